"""Does the policy learn? GRPO on an agentic task, on the real engines, several seeds
against a learning-rate-0 control, on the same held-out prompts before and after.

    python benchmarks/bench_learning.py [--config configs/learning.yaml] [--seeds 3]
                                        [--eval-prompts 200] [--subset 64] [--eval-every 4]
                                        [--set rl.steps=8 ...] [--cache DIR]

Two MPI ranks (``mpiexec -n 2``, started by this script): rank 0 trains (Megatron-Core,
its own one-rank torch world), rank 1 rolls out (vLLM, the tool orchestrator and the
task's tools). The script only sequences the library's functions:

1. warm start (rank 0, cached): :func:`libra_hpc.rl.warmstart.build_warmstart`, the task's
   noisy solver's demonstrations and a supervised pass;
2. greedy evaluation of the warm start on ``--eval-prompts`` held-out prompts
   (:func:`libra_hpc.rl.rollout.evaluate`): ``success_warmstart``;
3. per run (``--seeds`` seeds with ``training.lr``, then the control with lr 0), from the
   warm start: ``rl.steps`` × [rank 1: :func:`~libra_hpc.rl.rollout.rollout` of
   ``rl.prompts_per_step`` training prompts × ``rl.group_size`` samples with tool turns →
   trajectories to rank 0; rank 0: :func:`~libra_hpc.rl.step.prepare_batch` +
   :func:`~libra_hpc.rl.step.grpo_step`, then the new weights to rank 1 in memory
   (:func:`~libra_hpc.engines.sync.push_weights` → ``update_weights``)]; every
   ``--eval-every`` steps a greedy evaluation on the first ``--subset`` held-out prompts;
   at the end the full held-out evaluation: ``success_rl`` of the run.

Greedy evaluation of the same weights on the same prompts is deterministic, so the warm
start is evaluated once and every run's gain is measured against that number.

Prints one table row per step and run (reward, held-out success on the subset of the
policy that sampled the step, every ``--eval-every`` steps, format-valid rate, share of
the step's episodes answered without a tool, turns, groups kept, rollout tokens/s, step
times), a per-kind breakdown after each held-out evaluation, a summary table,
and last one JSON line: ``success_warmstart``, ``success_rl`` (mean over seeds),
``success_rl_per_seed``, ``gains``, ``gain_min``, ``control_gain``, ``eval_prompts``,
``seeds``, ``steps``, ``wall_s`` (and the warm start's build time, 0 when cached), and the
held-out answers split by tool use: ``success_tool_{warmstart,rl}``,
``success_no_tool_{warmstart,rl}``, ``tool_share_{warmstart,rl}`` (the seeds pooled; the
job's ``summary.json`` carries the same keys). ``--seeds 0 --no-control`` builds and
scores the warm start only.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

TRAIN, ROLL = 0, 1
TAG_TRAJ, TAG_DONE, TAG_WARM = 41, 42, 43


def _settings(args):
    from libra_hpc.config import load_config

    return load_config(args.config, list(args.set))


def _task(cfg):
    from libra_hpc.envs.registry import task_from_config

    return task_from_config(cfg)


def _orchestrator(cfg, task):
    from libra_hpc.tools.orchestrator import orchestrator_from_config

    return orchestrator_from_config(cfg.tools, cfg.scheduler, extra=task.runners())


def _polite_barrier(comm) -> None:
    """A barrier that sleeps while it waits (MPICH's blocking calls poll a core, which the
    other rank needs: the machine has two)."""
    from libra_hpc.cluster.messages import wait_sent

    wait_sent([comm.Ibarrier()])


def _recv(comm, source: int, tag: int):
    from libra_hpc.cluster.messages import wait_message

    return wait_message(comm, source, tag)


# ---------------------------------------------------------------- rank 0: training

def worker_train(args, comm) -> dict:
    import torch

    from libra_hpc.engines.sync import push_weights
    from libra_hpc.engines.tiny import resolve_model
    from libra_hpc.engines.train.engine import MegatronTrainEngine
    from libra_hpc.engines.train.parallel import start_torch_world
    from libra_hpc.rl.rollout import TextCodec
    from libra_hpc.rl.step import grpo_step, prepare_batch
    from libra_hpc.rl.trajectory import Trajectory
    from libra_hpc.rl.warmstart import build_warmstart, fingerprint

    torch.set_num_threads(args.threads)
    cfg = _settings(args)
    task = _task(cfg)
    base = resolve_model(cfg.model, cache_dir=args.cache)
    options = cfg.warmstart
    spec = fingerprint(base, task, getattr(cfg.tasks, cfg.rl.task).model_dump(), options)
    warm = Path(args.cache) / f"warmstart-{spec['fingerprint']}"
    start_torch_world(comm.Split(0, 0))  # collective with rank 1's Split
    started = time.perf_counter()
    if not (warm / "build.json").is_file():
        orch = _orchestrator(cfg, task)
        try:
            build_warmstart(warm, base, task, spec, options, orch, progress=lambda line: print(line, flush=True))
        finally:
            orch.close()
    build_s = time.perf_counter() - started
    print(f"warm start: {warm} ({'built in %.0f s' % build_s if build_s > 1 else 'cached'})", flush=True)
    comm.send(str(warm), dest=ROLL, tag=TAG_WARM)
    codec = TextCodec(warm)
    mbs = cfg.training.micro_batch_size
    runs = [("seed", cfg.rl.seed + k, cfg.training.lr) for k in range(args.seeds)]
    runs += [("control", cfg.rl.seed, 0.0)] if args.control else []
    log_rows = []
    for kind, seed, lr in runs:
        engine = MegatronTrainEngine(warm, lr=lr, clip_grad=cfg.training.grad_clip, clip_eps=cfg.training.ppo_clip,
                                     micro_batch_size=mbs, seed=seed)
        _polite_barrier(comm)
        push_weights(comm, engine.iter_hf(), root=TRAIN)  # the rollout side starts from the warm start too
        for step in range(cfg.rl.steps):
            report = _recv(comm, ROLL, TAG_TRAJ)
            trajectories = [Trajectory.from_dict(t) for t in report.pop("trajectories")]
            tick = time.perf_counter()
            batch, kept = prepare_batch(trajectories, cfg.rl, train_version=step, pad_id=codec.pad_id,
                                        rows_multiple=mbs)
            stats = grpo_step(engine, batch) if batch is not None else None
            train_s = time.perf_counter() - tick
            tick = time.perf_counter()
            _polite_barrier(comm)
            push_weights(comm, engine.iter_hf(), root=TRAIN)
            row = {"run": kind, "seed": seed, "step": step + 1, **report, "train_s": train_s,
                   "sync_s": time.perf_counter() - tick, "groups_kept": kept.groups - kept.filtered_groups,
                   "groups": kept.groups, "loss": stats.loss if stats else 0.0,
                   "grad_norm": stats.grad_norm if stats else 0.0}
            row["step_s"] = row["rollout_s"] + train_s + row["sync_s"]
            log_rows.append(row)
            _print_row(row)
        engine.shutdown()
    final = _recv(comm, ROLL, TAG_DONE)
    return {"rows": log_rows, "final": final, "build_s": build_s, "warmstart": str(warm)}


# ----------------------------------------------------------------- rank 1: rollout

def worker_rollout(args, comm) -> None:
    from libra_hpc.engines.rollout.vllm_engine import VllmRolloutEngine
    from libra_hpc.engines.sync import pull_weights
    from libra_hpc.rl.rollout import PromptSampler, TextCodec, evaluate, rollout

    from mpi4py import MPI

    comm.Split(MPI.UNDEFINED, 1)  # collective: rank 0 splits off its one-rank torch world
    cfg = _settings(args)
    task = _task(cfg)
    warm = Path(_recv(comm, TRAIN, TAG_WARM))  # sleeps while rank 0 builds the warm start
    codec = TextCodec(warm)
    heldout = list(task.splits.heldout[:args.eval_prompts])
    if len(heldout) < args.eval_prompts:
        raise SystemExit(f"--eval-prompts {args.eval_prompts}: the held-out split has {len(heldout)} prompts "
                         f"(tasks.{cfg.rl.task}.heldout_prompts)")
    orch = _orchestrator(cfg, task)
    engine = VllmRolloutEngine(warm, max_model_len=min(cfg.training.seq_len, 2048), kv_cache_gib=cfg.rollout.kv_cache_gib,
                               cpu_threads=args.threads, seed=cfg.rl.seed)
    final: dict = {}
    try:
        base = evaluate(engine, task, heldout, orch, codec, tag="eval-warm", max_turn_tokens=cfg.rollout.max_new_tokens)
        final["warmstart"] = {**base.summary(), **_breakdown(base)}
        print(f"warm start held-out success {base.success:.3f} on {len(heldout)} prompts "
              f"(format-valid {base.format_valid:.2f}, {_describe(base)}; {base.wall_s:.0f} s)", flush=True)
        runs = [("seed", cfg.rl.seed + k) for k in range(args.seeds)] + ([("control", cfg.rl.seed)] if args.control else [])
        for kind, seed in runs:
            _polite_barrier(comm)
            engine.update_weights(pull_weights(comm, root=TRAIN))
            sampler = PromptSampler(task.splits, seed=seed)
            for step in range(cfg.rl.steps):
                subset = None
                if step and step % args.eval_every == 0:  # the policy this step samples with
                    subset = evaluate(engine, task, heldout[:args.subset], orch, codec, tag=f"eval-{kind}{seed}-{step}",
                                      max_turn_tokens=cfg.rollout.max_new_tokens).success
                prompts = sampler.next(cfg.rl.prompts_per_step, lambda: f"training batch {step + 1} of run {kind} {seed}")
                result = rollout(engine, task, prompts, orch, codec, group_size=cfg.rl.group_size, version=step,
                                 tag=f"{kind}{seed}-s{step}", temperature=cfg.rollout.temperature,
                                 max_turn_tokens=cfg.rollout.max_new_tokens)
                summary = result.summary()
                report = {"reward": summary["success"], "format_valid": summary["format_valid"],
                          "no_tool": _breakdown(result)["no_tool"],
                          "tokens_per_s": summary["tokens_per_s"], "rollout_s": summary["wall_s"],
                          "turns": summary["turns_per_episode"], "heldout_subset": subset,
                          "trajectories": [t.to_dict() for t in result.trajectories]}
                comm.send(report, dest=TRAIN, tag=TAG_TRAJ)
                _polite_barrier(comm)
                engine.update_weights(pull_weights(comm, root=TRAIN))
            after = evaluate(engine, task, heldout, orch, codec, tag=f"eval-{kind}{seed}",
                             max_turn_tokens=cfg.rollout.max_new_tokens)
            final.setdefault("runs", []).append({"run": kind, "seed": seed, **after.summary(), **_breakdown(after)})
            print(f"{kind} {seed}: held-out success {base.success:.3f} -> {after.success:.3f} "
                  f"(format-valid {after.format_valid:.2f}, {_describe(after)})", flush=True)
    finally:
        engine.shutdown()
        orch.close()
    comm.send(final, dest=TRAIN, tag=TAG_DONE)


def _breakdown(result) -> dict:
    """What a greedy evaluation did: the share of episodes answered without any tool call,
    and, per prompt kind (``meta["kind"]``, when the task records it), success and the
    share answered without a tool."""
    episodes = result.episodes
    no_tool = lambda e: not any(returns for _, returns in e.turns)  # noqa: E731
    out = {"no_tool": sum(map(no_tool, episodes)) / max(len(episodes), 1),
           "rewards": [e.reward or 0.0 for e in episodes],
           "calls": [sum(len(returns) for _, returns in e.turns) for e in episodes]}
    by: dict[str, list] = {}
    for e in episodes:
        kind = e.prompt.meta.get("kind")
        if kind is not None:
            by.setdefault(str(kind), []).append(e)
    out["by_kind"] = {k: {"prompts": len(v), "success": round(statistics.fmean(e.reward or 0.0 for e in v), 3),
                          "no_tool": round(statistics.fmean(map(no_tool, v)), 3)} for k, v in sorted(by.items())}
    return out


def _describe(result) -> str:
    b = _breakdown(result)
    kinds = "; ".join(f"{k} {v['success']:.2f} (no tool {v['no_tool']:.2f}, n={v['prompts']})"
                      for k, v in b["by_kind"].items())
    return f"answered without a tool {b['no_tool']:.2f}" + (f"; success by kind: {kinds}" if kinds else "")


def _print_row(row: dict) -> None:
    held = "" if row["heldout_subset"] is None else f"{row['heldout_subset']:.3f}"
    print(f"{row['run']:>7} {row['seed']:>4} {row['step']:>4} {row['reward']:>7.3f} {held:>7} {row['format_valid']:>7.2f} "
          f"{row['no_tool']:>7.2f} {row['turns']:>6.2f} {row['groups_kept']:>3}/{row['groups']:<3} {row['tokens_per_s']:>8.0f} "
          f"{row['rollout_s']:>7.1f} {row['train_s']:>6.1f} {row['step_s']:>6.1f}", flush=True)


def worker(args) -> None:
    from mpi4py import MPI

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s rank%(rank)s %(name)s: %(message)s")
    comm = MPI.COMM_WORLD
    old = logging.getLogRecordFactory()
    rank = comm.Get_rank()

    def factory(*a, **k):
        record = old(*a, **k)
        record.rank = rank
        return record

    logging.setLogRecordFactory(factory)
    if rank == TRAIN:
        result = worker_train(args, comm)
        Path(args.out).write_text(json.dumps(result))
    else:
        worker_rollout(args, comm)


# ------------------------------------------------------------------------- driver

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "learning.yaml"))
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config field, e.g. --set rl.steps=8 (repeatable)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--eval-prompts", type=int, default=200)
    parser.add_argument("--no-control", dest="control", action="store_false",
                        help="leave out the learning-rate-0 control run (a quick look; control_gain is then null)")
    parser.add_argument("--subset", type=int, default=64, help="held-out prompts of the in-run evaluations")
    parser.add_argument("--eval-every", type=int, default=4, help="steps between in-run evaluations")
    parser.add_argument("--cache", default=str(Path.home() / ".cache" / "libra_hpc"))
    parser.add_argument("--threads", type=int, default=max(1, len(os.sched_getaffinity(0))),
                        help="torch threads per rank (the ranks take turns)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return
    cfg = _settings(args)  # refuse a bad config before starting anything
    started = time.perf_counter()
    print(f"bench_learning: task {cfg.rl.task}, {args.seeds} seeds{' + lr-0 control' if args.control else ''}, {cfg.rl.steps} steps of "
          f"{cfg.rl.prompts_per_step} prompts x {cfg.rl.group_size} samples, lr {cfg.training.lr:g}, "
          f"{args.eval_prompts} held-out prompts", flush=True)
    print(f"{'run':>7} {'seed':>4} {'step':>4} {'reward':>7} {'held':>7} {'format':>7} {'no tool':>7} {'turns':>6} {'groups':>7} "
          f"{'tok/s':>8} {'roll s':>7} {'train':>6} {'step s':>6}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        cmd = ["mpiexec", "-n", "2", sys.executable, "-m", "mpi4py", __file__, "--worker", "--out", str(out),
               "--config", args.config, "--seeds", str(args.seeds), "--eval-prompts", str(args.eval_prompts),
               "--subset", str(args.subset), "--eval-every", str(args.eval_every), "--cache", args.cache,
               "--threads", str(args.threads)] + ([] if args.control else ["--no-control"]) + [f"--set={s}" for s in args.set]
        done = subprocess.run(cmd, cwd=ROOT)
        if done.returncode != 0 or not out.is_file():
            raise SystemExit(f"bench_learning: the MPI job failed (exit {done.returncode}); see its output above")
        result = json.loads(out.read_text())
    from libra_hpc.runtime.evaluation import tool_use

    final = result["final"]
    warm = final["warmstart"]["success"]
    final.setdefault("runs", [])
    seeds = [r for r in final["runs"] if r["run"] == "seed"]
    control = next((r for r in final["runs"] if r["run"] == "control"), None)
    gains = [r["success"] - warm for r in seeds]
    mean = lambda xs: round(statistics.fmean(xs), 4) if xs else None  # noqa: E731
    print(f"\nheld-out success on {args.eval_prompts} prompts (greedy), warm start {warm:.3f}")
    print(f"{'run':>8} {'seed':>4} {'after':>7} {'gain':>7} {'format':>7}")
    for r in final["runs"]:
        print(f"{r['run']:>8} {r['seed']:>4} {r['success']:>7.3f} {r['success'] - warm:>+7.3f} {r['format_valid']:>7.2f}")
    summary = {
        "task": cfg.rl.task, "success_warmstart": round(warm, 4),
        "success_rl": mean([r["success"] for r in seeds]),
        "success_rl_per_seed": [round(r["success"], 4) for r in seeds], "gains": [round(g, 4) for g in gains],
        "gain_mean": mean(gains), "gain_min": round(min(gains), 4) if gains else None,
        "control_gain": None if control is None else round(control["success"] - warm, 4), "format_valid_warmstart": round(final["warmstart"]["format_valid"], 4),
        "format_valid_rl": mean([r["format_valid"] for r in seeds]),
        # answers with and without a tool call: the warm start's, and the seeds' pooled
        **tool_use(final["warmstart"]["rewards"], final["warmstart"]["calls"], "warmstart"),
        **tool_use([x for r in seeds for x in r["rewards"]], [c for r in seeds for c in r["calls"]], "rl"),
        "tool_calls_rl_eval": sum(c for r in seeds for c in r["calls"]),
        "eval_prompts": args.eval_prompts, "heldout_entity_overlap": _task(cfg).splits.entity_overlap(),
        "seeds": args.seeds, "steps": cfg.rl.steps,
        "batch": cfg.rl.prompts_per_step * cfg.rl.group_size, "lr": cfg.training.lr,
        "warmstart_build_s": round(result["build_s"], 1), "wall_s": round(time.perf_counter() - started, 1),
        "cores": len(os.sched_getaffinity(0))}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
