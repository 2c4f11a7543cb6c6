"""What ``launch.py`` does once the config is valid: pick the executor, describe the job,
submit or start it, and follow it."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TextIO

from libra_hpc.cluster import follow as follow_mod
from libra_hpc.cluster import local, slurm
from libra_hpc.cluster.layout import layout_from_config
from libra_hpc.config import ConfigError, ExperimentConfig, dump_config
from libra_hpc.metrics.runlog import run_folder


def choose_executor(requested: str, strict: bool = True) -> tuple[str, str]:
    """``(executor, why)``: Slurm when asked or reachable, else local. Asking for Slurm
    when none answers is an error, unless ``strict`` is off (dry runs describe anyway)."""
    if requested == "local":
        return "local", "asked for"
    ok, why = slurm.slurm_reachable()
    if requested == "slurm":
        if not ok and strict:
            raise RuntimeError(f"executor slurm, but {why}")
        return "slurm", "asked for" if ok else f"asked for, but {why}"
    return ("slurm", f"auto: {why}") if ok else ("local", f"auto: {why}")


def with_absolute_log_dir(cfg: ExperimentConfig) -> ExperimentConfig:
    """Pin logging.dir to an absolute path, so every rank writes where the user looks."""
    folder = str(Path(cfg.logging.dir).expanduser().resolve())
    return cfg.model_copy(update={"logging": cfg.logging.model_copy(update={"dir": folder})})


def describe(cfg: ExperimentConfig, executor: str, why: str) -> str:
    """The dry-run report: Slurm request, MPI step, initial layout."""
    request = slurm.SlurmRequest.from_config(cfg)
    layout = layout_from_config(cfg)
    train = layout.training
    rollout = layout.rollout_instances
    hybrid = sorted({s.node for s in layout.hybrid})
    lines = [
        f"executor: {executor} ({why})",
        f"Slurm request: {cfg.cluster.nodes} nodes × {cfg.cluster.gpus_per_node} GPUs = {cfg.cluster.total_gpus} GPUs, "
        f"{request.world_size} MPI ranks (one per GPU + the controller), time limit {request.time_minutes} min",
        *request.sbatch_directives(),
        "job step: " + " ".join(request.srun_command(Path("<config.yaml>"), python="python")),
        "job step's MPI transport: " + " ".join(f"{k}={v}" for k, v in slurm.world_step_transport(os.environ).items())
        + " (set either before launching to change it; docs/resilience.md)",
        "",
        f"initial layout (model {cfg.model.name}):",
        f"  training: TP{train.tp} × PP{train.pp} × DP{train.dp} = {len(train.slots)} GPUs",
        f"  rollout:  {len(layout.slots_of('rollout'))} GPUs in {len(rollout)} instances of TP {[g.tp for g in rollout]}",
        f"  hybrid pool (*): nodes {hybrid or 'none'}"
        + (f", lent to training at step {cfg.planner.borrow_at_step}"
           if hybrid and cfg.job.mode == "check" and cfg.planner.borrow_at_step is not None else ""),
        "",
        layout.table(),
    ]
    return "\n".join(lines)


def first_decision(cfg: ExperimentConfig):
    """``(model profile, hardware profile, LayoutChange)``: the control loop's first decision
    for ``cfg``, on the planner's default calibration."""
    from libra_hpc.planner.control import ControlLoop

    try:
        control = ControlLoop.from_config(cfg)
    except ConfigError as exc:  # the profile files: name the fields that chose them
        raise ConfigError("model.name / cluster.hardware", [f"model.name={cfg.model.name!r}, cluster.hardware="
                                                             f"{cfg.cluster.hardware!r}: {p}" for p in exc.problems]) from None
    return control.model, control.hw, control.initial()


def describe_plan(cfg: ExperimentConfig) -> str:
    """The first layout Libra's control loop (libra_hpc/planner/control.py) chooses for this
    config (``launch.py --plan``): training shape, rollout instance mix, predicted times, the
    per-node grid with the hybrid pool and the runners-up. Lengths come from
    ``planner.prior`` (nothing has been observed before a run). The simulator's first
    planning round on the same config makes the same decision (tests/test_control_plan.py)."""
    c, prior = cfg.cluster, cfg.planner.prior
    model, hardware, first = first_decision(cfg)
    chosen, result = first.plan, first.result
    k = cfg.rl.max_staleness
    pool = (f"hybrid pool: {len(first.pool.all_replicas())} replica(s) of {first.pool.replica_size} GPUs on the last "
            f"{cfg.planner.hybrid_nodes} node(s) (*)" if first.pool else
            f"hybrid pool: none (planner.hybrid_nodes={cfg.planner.hybrid_nodes}: this plan leaves no whole rollout "
            "nodes that split into training replicas, or training is not predicted to become the bottleneck)")
    lines = [
        f"plan for {model.name} on {c.nodes} nodes × {c.gpus_per_node} {hardware.name} "
        f"(rl.max_staleness={k}; objective: the pipelined step max(T_train, (T_rollout + T_train) / {k + 1}))",
        f"  {chosen.describe()}",
        f"  predicted per RL step: T_train {chosen.t_train:.1f} s, T_rollout {chosen.t_rollout:.1f} s, "
        f"step {chosen.objective:.1f} s ({chosen.mode} search)",
        f"  batch {cfg.batch_size} trajectories (rl.prompts_per_step × rl.group_size), packed to the prior's mean "
        f"length; lengths from planner.prior (median {prior.gen_tokens_median} generated tokens, Pareto tail "
        f"{prior.tail_shape}, {prior.turns} turns)",
        f"  searched in {result.elapsed_s * 1e3:.0f} ms ({result.evaluated} rollout makespans)",
        f"  {pool}",
        "",
        first.layout.table(),
        "",
        f"runners-up in the {chosen.mode} search (objective {'T_train + T_rollout' if chosen.mode == 'sync' else 'max(T_train, T_rollout)'}):",
        *(f"  {r.description}: {r.reason}" for r in result.runners_up),
    ]
    return "\n".join(lines)


def launch_local(cfg: ExperimentConfig, wait: bool, out: TextIO, log_dir: Path | None = None) -> int:
    """Start the world under mpiexec in a new log folder, or in ``log_dir`` (a stopped
    run's: the job resumes from its newest checkpoint)."""
    job_id = "local-" + time.strftime("%Y%m%d-%H%M%S") if log_dir is None else log_dir.name
    log_dir = log_dir or run_folder(cfg.logging.dir, cfg.cluster.job_name, job_id)
    log_dir.mkdir(parents=True, exist_ok=True)
    config_path = log_dir / "config.yaml"
    config_path.write_text(dump_config(cfg))
    started = time.time()
    process = local.start(local.mpiexec_command(cfg, config_path, log_dir), log_dir, detach=not wait)
    print(f"job {job_id} (local, pid {process.pid}): {cfg.cluster.total_gpus + 1} ranks under mpiexec", file=out)
    print(f"log folder: {log_dir}", file=out, flush=True)
    if not wait:
        return 0
    try:
        events = follow_mod.follow(log_dir / "events.jsonl", lambda: process.poll() is not None, out)
    except KeyboardInterrupt:
        process.terminate()
        process.wait()
        print("interrupted: the local job was stopped", file=out)
        return 130
    if process.returncode != 0:
        local.remove_stale_shm(since=started - 1)  # a killed world cannot clean up after itself
        _explain_failure(cfg, log_dir, (log_dir / "job.out").read_text(errors="replace"), out)
    return _verdict(process.returncode == 0, f"exit status {process.returncode}", events, log_dir / "job.out", out)


def _explain_failure(cfg: ExperimentConfig, log_dir: Path, output: str, out: TextIO) -> None:
    """After a world that ended badly: which rank's death ended it (the post-mortem of
    :mod:`libra_hpc.runtime.heartbeat`), and how to resume."""
    import os

    from libra_hpc.runtime.heartbeat import post_mortem
    from libra_hpc.runtime.resume import CheckpointStore

    line = post_mortem(log_dir, output, dict(os.environ), cfg.cluster.requeue, cfg.cluster.max_requeues)
    if line:
        print(f"lost: {line}", file=out)
    versions = CheckpointStore(log_dir).versions()
    if versions:
        print(f"checkpoints at versions {versions}; resume with: python launch.py --resume {log_dir}", file=out)


def launch_slurm(cfg: ExperimentConfig, wait: bool, out: TextIO) -> int:
    from libra_hpc.runtime.heartbeat import post_mortem_of  # the batch step names a dead rank with it

    request = slurm.SlurmRequest.from_config(cfg)
    staging = Path(cfg.logging.dir) / "submitit"
    staging.mkdir(parents=True, exist_ok=True)
    config_path = staging / f"{cfg.cluster.job_name}-{time.strftime('%Y%m%d-%H%M%S')}-{time.monotonic_ns() % 10**6}.yaml"
    config_path.write_text(dump_config(cfg))
    job_id = slurm.submit(request, config_path, staging, logs_root=str(cfg.logging.dir), post_mortem=post_mortem_of)
    log_dir = run_folder(cfg.logging.dir, cfg.cluster.job_name, job_id)
    print(f"job {job_id} submitted to Slurm: {request.nodes} nodes × {request.gpus_per_node} GPUs", file=out)
    print(f"log folder: {log_dir} (batch output: {staging}/{job_id}_0_log.out)", file=out, flush=True)
    if not wait:
        return 0
    last = {"state": None}

    def finished() -> bool:
        state = slurm.job_state(job_id)
        if state != last["state"]:
            print(f"job {job_id}: {state or 'gone from Slurm'}", file=out, flush=True)
            last["state"] = state
        return state is None or state in slurm.TERMINAL_STATES

    try:
        events = follow_mod.follow(log_dir / "events.jsonl", finished, out, poll_s=1.0)
    except KeyboardInterrupt:
        print(f"stopped following; job {job_id} keeps running (scancel {job_id} to stop it)", file=out)
        return 130
    state = last["state"]
    return _verdict(state == "COMPLETED", f"Slurm state {state}", events, staging / f"{job_id}_0_log.out", out)


def _verdict(ok: bool, status: str, events: list[dict], output: Path, out: TextIO) -> int:
    finished = any(e["kind"] == "shutdown" for e in events)
    if ok and finished:
        print(f"done: {status}", file=out)
        return 0
    print(f"FAILED: {status}; {'no shutdown event' if not finished else 'shut down with errors'}; see {output}", file=out)
    if output.exists():
        tail = output.read_text(errors="replace").splitlines()[-15:]
        print("\n".join("  | " + line for line in tail), file=out)
    return 1
