"""Cross-field checks of an experiment config: what pydantic's per-field types cannot see
(the cluster shape against the training parallelism, the rollout patterns, the batch
split over DP replicas, the hybrid pool, the scheduler's buckets, the tool pool).

Each check returns one line per problem, naming the fields; :class:`ExperimentConfig`
(libra_hpc/config.py) raises them together as one ``ConfigError``. The simulator's
scenarios run :func:`check_common` only (their layouts come from the planner).
"""

from __future__ import annotations

import math
import re
from typing import Any

ExperimentConfig = Any
"""An experiment config (libra_hpc/config.py ``ExperimentConfig``); not imported, since
config.py imports this module."""

SLURM_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")
"""A Slurm time string: ``MM``, ``MM:SS``, ``HH:MM:SS``, ``D-HH``, ``D-HH:MM``, ``D-HH:MM:SS``."""


def slurm_time_s(text: str | int) -> int | None:
    """A Slurm time string (:data:`SLURM_TIME`, as ``sbatch --time`` takes it and ``squeue``
    prints it) in seconds; None when it is not one (``UNLIMITED``, ``INVALID``, ...)."""
    match = SLURM_TIME.match(str(text).strip())
    if match is None:
        return None
    days, first, second, third = match.groups()
    if days is not None:  # D-HH[:MM[:SS]]
        return int(days) * 86400 + int(first) * 3600 + int(second or 0) * 60 + int(third or 0)
    if third is not None:  # HH:MM:SS
        return int(first) * 3600 + int(second) * 60 + int(third)
    return int(first) * 60 + int(second or 0)  # MM[:SS]



def tp_table_problem(rows: list[tuple[int, int]]) -> str | None:
    """What is wrong with a measured TP table (``parallel.training_tp_by_context``, as
    ``(context_tokens, tp)`` rows sorted by context), or None. ``TpTable``
    (libra_hpc/parallel/selector.py) refuses the same tables with it."""
    if not rows or rows[0][0] != 0:
        return f"the first row must start at context 0 (got {rows})"
    for (c0, t0), (c1, t1) in zip(rows, rows[1:]):
        if c1 <= c0 or t1 < t0:
            return f"rows must have growing contexts and TP sizes that do not shrink; ({c0}: {t0}) then ({c1}: {t1})"
    if any(tp < 1 for _, tp in rows):
        return f"TP sizes must be >= 1 (got {rows})"
    return None


def check_common(cfg: ExperimentConfig) -> list[str]:
    """The checks every config of this schema passes, live experiment or simulator scenario."""
    return [*_check_cluster(cfg), *_check_scheduler(cfg), *_check_tools(cfg), *_check_tasks(cfg), *_check_epochs(cfg)]


def _check_epochs(cfg: ExperimentConfig) -> list[str]:
    bad = {k: v for k, v in cfg.rl.update_epochs.items() if k < 0 or v < 1}
    return [f"rl.update_epochs: {bad}: steps must be >= 0 and passes >= 1"] if bad else []


def check_layout(cfg: ExperimentConfig) -> list[str]:
    """The live job's checks of the initial layout it is given: training TP×PP×DP and
    ``rollout.tp_per_node`` on the nodes, the batch over every DP the hybrid pool reaches,
    the scripted borrow/return steps."""
    return [*_check_parallelism(cfg), *_check_rollout_buckets(cfg), *_check_planner(cfg)]


BUILTIN_TASKS = ("arithmetic", "search")
"""Task names ``rl.task`` accepts besides ``package.module:Factory`` (libra_hpc/envs/registry.py)."""


def _check_tasks(cfg: ExperimentConfig) -> list[str]:
    problems = []
    task = cfg.rl.task
    if task not in BUILTIN_TASKS and not re.fullmatch(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*", task):
        problems.append(f"rl.task: {task!r} is neither a built-in task ({', '.join(BUILTIN_TASKS)}) nor "
                        "'package.module:Factory'")
    a = cfg.tasks.arithmetic
    if a.min_steps > a.max_steps:
        problems.append(f"tasks.arithmetic.min_steps: {a.min_steps} exceeds tasks.arithmetic.max_steps={a.max_steps}")
    if cfg.tasks.plugin and ":" not in task:
        problems.append(f"tasks.plugin: set, but rl.task={task!r} is a built-in task (the section is for "
                        "'package.module:Factory' tasks)")
    return problems


def _check_cluster(cfg: ExperimentConfig) -> list[str]:
    limit = cfg.cluster.time_limit
    if (isinstance(limit, int) and limit < 1) or not SLURM_TIME.match(str(limit)):
        return [f"cluster.time_limit: {limit!r} is not a Slurm time; use MM, MM:SS, HH:MM:SS or D-HH:MM:SS"]
    job, warn = cfg.job, cfg.cluster.signal_before_limit_s
    if job.checkpoint_on_stop and job.stop_grace_s + job.checkpoint_save_s > warn:
        return [f"job.stop_grace_s: {job.stop_grace_s:g} s for the step in flight plus job.checkpoint_save_s="
                f"{job.checkpoint_save_s:g} s for its checkpoint do not fit in the "
                f"cluster.signal_before_limit_s={warn} s between Slurm's warning and the time limit; raise "
                "cluster.signal_before_limit_s or lower job.stop_grace_s"]
    return []


def _batch_text(cfg: ExperimentConfig) -> str:
    return f"the batch rl.prompts_per_step × rl.group_size = {cfg.batch_size}"


def _check_parallelism(cfg: ExperimentConfig) -> list[str]:
    """Training and rollout shapes against the nodes and GPUs."""
    c, t, r, p = cfg.cluster, cfg.training, cfg.rollout, cfg.planner
    g = c.gpus_per_node
    problems: list[str] = []
    if t.tensor_parallel > g or g % t.tensor_parallel:
        problems.append(
            f"training.tensor_parallel: {t.tensor_parallel} must divide cluster.gpus_per_node={g} "
            "(a TP group never crosses a node)"
        )
    per_step = t.micro_batch_size * t.data_parallel
    if cfg.batch_size % per_step:
        problems.append(
            f"rl.prompts_per_step: {_batch_text(cfg)} is not a multiple of "
            f"training.micro_batch_size × training.data_parallel = {per_step}"
        )
    for pattern in r.node_patterns or [[]]:
        bad_tp = [tp for tp in pattern if tp < 1 or tp & (tp - 1)]
        if bad_tp:
            problems.append(f"rollout.tp_per_node: sizes must be powers of two ≥ 1, got {bad_tp}")
        elif sum(pattern) != g:
            problems.append(
                f"rollout.tp_per_node: {pattern} sums to {sum(pattern)} GPUs, "
                f"but a node has cluster.gpus_per_node={g}"
            )
    rollout_slots = c.total_gpus - cfg.training_slots
    if rollout_slots < p.min_rollout_gpus:
        problems.append(
            f"training: TP×PP×DP = {cfg.training_slots} GPU slots leaves {rollout_slots} of the "
            f"{c.total_gpus} ({c.nodes} nodes × {g}) for rollout; planner.min_rollout_gpus is {p.min_rollout_gpus}"
        )
    return problems


def _check_scheduler(cfg: ExperimentConfig) -> list[str]:
    """Settings the C-MLFQ router could not use."""
    sc = cfg.scheduler
    problems: list[str] = []
    thresholds = sc.size_thresholds
    if sorted(set(thresholds)) != thresholds or len(thresholds) > 4 or any(t < 1 for t in thresholds):
        problems.append(f"scheduler.size_thresholds: {thresholds} must be at most 4 strictly increasing "
                        "positive character counts")
    if sc.min_samples > sc.tree_window:
        problems.append(f"scheduler.min_samples: {sc.min_samples} can never be reached with "
                        f"scheduler.tree_window={sc.tree_window} samples per node")
    limits = list(sc.bucket_token_limits.values())
    if len(set(limits)) != len(limits) or min(limits, default=1) < 1:
        problems.append(f"scheduler.bucket_token_limits: {sc.bucket_token_limits} must give each TP size its own "
                        "positive limit (the limits order the MLFQ levels)")
    return problems


def _check_rollout_buckets(cfg: ExperimentConfig) -> list[str]:
    """Every rollout TP of the initial layout has a bucket."""
    sc = cfg.scheduler
    missing = sorted({tp for pattern in cfg.rollout.node_patterns for tp in pattern} - set(sc.bucket_token_limits))
    if missing:
        return [f"scheduler.bucket_token_limits: no limit for rollout TP {missing} (used by rollout.tp_per_node); "
                f"given for {sorted(sc.bucket_token_limits)}"]
    return []


def _check_tools(cfg: ExperimentConfig) -> list[str]:
    """Pool bounds, quotas and duration priors the tool orchestrator could not use."""
    tc = cfg.tools
    problems = [f"tools.quotas.{tool}: {n} must be >= 1 concurrent actions" for tool, n in tc.quotas.items() if n < 1]
    problems += [f"tools.expected_s.{tool}: {s} must be >= 0 seconds" for tool, s in tc.expected_s.items() if s < 0]
    if tc.min_workers > tc.max_workers:
        problems.append(f"tools.min_workers: {tc.min_workers} exceeds tools.max_workers={tc.max_workers}")
    if tc.reward_endpoint and not tc.reward_endpoint.startswith(("http://", "https://")):
        problems.append(f"tools.reward_endpoint: {tc.reward_endpoint!r} must be an http:// or https:// URL")
    slurm_set = [name for name in ("slurm_partition", "slurm_time_limit", "slurm_args") if getattr(tc, name)]
    if tc.placement == "local" and slurm_set:
        problems.append(f"tools.{slurm_set[0]} is set but tools.placement is 'local': set placement: slurm to use it")
    if tc.slurm_time_limit and not tc.slurm_partition:
        problems.append("tools.slurm_time_limit needs tools.slurm_partition (a step of the current job ends with the job)")
    problems += [f"tools.slurm_args: {arg!r} must be an srun option starting with '-'"
                 for arg in tc.slurm_args if not arg.startswith("-")]
    return problems


def _lcm_all(values: list[int]) -> int:
    result = 1
    for value in values:
        result = result * value // math.gcd(result, value)
    return result


def _check_planner(cfg: ExperimentConfig) -> list[str]:
    """The hybrid pool and the scripted borrow/return steps."""
    c, t, p = cfg.cluster, cfg.training, cfg.planner
    g = c.gpus_per_node
    problems: list[str] = []
    rollout_slots = c.total_gpus - cfg.training_slots
    rollout_nodes = max(c.nodes - -(-cfg.training_slots // g), 0)
    if p.hybrid_nodes > rollout_nodes:
        problems.append(f"planner.hybrid_nodes: {p.hybrid_nodes} but only {rollout_nodes} node(s) are wholly rollout")
    elif p.hybrid_nodes:
        replica = t.tensor_parallel * t.pipeline_parallel
        if (p.hybrid_nodes * g) % replica:
            problems.append(
                f"planner.hybrid_nodes: {p.hybrid_nodes} node(s) × {g} GPUs do not form whole training "
                f"replicas of TP×PP = {replica} GPUs"
            )
        else:
            # The pool lends one replica at a time: DP can be any of dp+1 .. dp+K.
            pool = p.hybrid_nodes * g // replica
            bad = [t.data_parallel + k for k in range(1, pool + 1)
                   if cfg.batch_size % (t.micro_batch_size * (t.data_parallel + k))]
            if bad:
                problems.append(
                    f"rl.prompts_per_step: {_batch_text(cfg)} does not split over DP {bad}, which "
                    f"lending the hybrid pool reaches (training.micro_batch_size {t.micro_batch_size}); make it a "
                    f"multiple of {_lcm_all([t.micro_batch_size * (t.data_parallel + k) for k in range(pool + 1)])}"
                )
        left = rollout_slots - p.hybrid_nodes * g
        if left < p.min_rollout_gpus:
            problems.append(
                f"planner.hybrid_nodes: lending {p.hybrid_nodes} node(s) leaves {left} rollout GPU slots, "
                f"below planner.min_rollout_gpus={p.min_rollout_gpus}"
            )
    for name in ("borrow_at_step", "return_at_step"):
        step = getattr(p, name)
        if step is not None and not 0 <= step < cfg.rl.steps:
            problems.append(f"planner.{name}: {step} is outside the run's steps 0..{cfg.rl.steps - 1} (rl.steps={cfg.rl.steps})")
    if p.return_at_step is not None and (p.borrow_at_step is None or p.return_at_step <= p.borrow_at_step):
        problems.append(f"planner.return_at_step: {p.return_at_step} must come after planner.borrow_at_step={p.borrow_at_step}")
    return problems
