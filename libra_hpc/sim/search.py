"""Best static configuration of a baseline, found by simulation (not a strawman).

A candidate (training GPUs, homogeneous rollout TP) is scored by simulating the rollout of
a few RL steps spread over the run (``search.sample_steps``: the drift is seen) on its
instances, each step alone, and costing training on its training GPUs:

- colocated (sync): mean of rollout + training + switch;
- asynchronous: mean of max(training, (rollout + weight sync + training) / (k + 1)), the
  steady-state step of the bounded-staleness pipeline (libra_hpc/sim/controller.py).

Two stages keep it cheap at 4096 GPUs: every candidate is screened with the planner's cost
model on the middle sample step (``rollout_makespan`` of the batch's lengths), then the best
four (two above 512 GPUs) are simulated on every sample step and the best simulated wins. The training shape per GPU count is the fastest that fits
(libra_hpc/sim/training.py). Returns the chosen layout, its training shape and every candidate's score.
"""

from __future__ import annotations

import logging
import math
import statistics

from libra_hpc.cluster.layout import Layout
from libra_hpc.planner.costs import TrainShape
from libra_hpc.planner.costs import rollout_makespan as rollout_cost_makespan
from libra_hpc.planner.control import length_profile, pipelined_step_s
from libra_hpc.sim.context import Context, instances_of, samples_of
from libra_hpc.sim.engine import SimClock
from libra_hpc.sim.rollout import RolloutSide
from libra_hpc.sim.training import best_shape, step_s

log = logging.getLogger(__name__)
KEEP = 4


Candidate = tuple[str, Layout, TrainShape]
"""(description, layout, training shape)."""


def rollout_makespan(ctx: Context, layout: Layout, step: int, router: str = "least_load") -> float:
    """Seconds to roll out batch ``step`` alone on ``layout``'s instances, from idle."""
    done: dict[int, float] = {}

    def finished(batch: int, now: float):
        done[batch] = now

    clock = SimClock()
    side = RolloutSide(ctx.step_models, ctx.cfg.scheduler, ctx.cfg.costs, router, ctx.cfg.rl.seed, finished)
    side.configure(instances_of(layout), 0.0)
    clock.schedule_all(side.submit(step, ctx.batch(step), 0.0))
    clock.run()
    return done[step]


def sample_steps(ctx: Context) -> list[int]:
    n, last = ctx.cfg.search.sample_steps, ctx.cfg.rl.steps - 1
    if n == 1 or last == 0:
        return [last // 2]
    return sorted({round(i * last / (n - 1)) for i in range(n)})


def _score(ctx: Context, layout: Layout, train_shape: TrainShape, steps: list[int], sync: bool) -> float:
    values = []
    for s in steps:
        batch = ctx.batch(s)
        mean_tokens = sum(t.total_tokens for t in batch) / len(batch)
        roll = rollout_makespan(ctx, layout, s)
        train = step_s(ctx.model, ctx.hw, train_shape, mean_tokens, ctx.cal)
        values.append(roll + train + ctx.cfg.costs.colocate_switch_s if sync
                      else pipelined_step_s(train, roll + ctx.weight_sync_s, ctx.cfg.rl.max_staleness, ctx.cfg.rl.stream_groups))
    return statistics.fmean(values)


def _screen(ctx: Context, layout: Layout, train_shape: TrainShape, step: int, sync: bool) -> float:
    """Stage 1: the planner's cost model (rollout makespan of the batch's length profile
    over the allocation's instances) in place of a simulation."""
    batch = ctx.batch(step)
    pools: dict[int, int] = {}
    for inst in layout.rollout_instances:
        pools[inst.tp] = pools.get(inst.tp, 0) + 1
    roll = rollout_cost_makespan([(ctx.rollout_costs[tp], n) for tp, n in pools.items()],
                                 length_profile(samples_of(batch), len(batch))).makespan_s
    train = step_s(ctx.model, ctx.hw, train_shape, statistics.fmean(t.total_tokens for t in batch), ctx.cal)
    return (roll + train + ctx.cfg.costs.colocate_switch_s if sync
            else pipelined_step_s(train, roll, ctx.cfg.rl.max_staleness, ctx.cfg.rl.stream_groups))


def _two_stage(ctx: Context, candidates: list[Candidate], sync: bool) -> tuple[Layout, TrainShape, list[dict]]:
    steps = sample_steps(ctx)
    middle = steps[len(steps) // 2]
    first = sorted(((_screen(ctx, lay, shape, middle, sync), name, (lay, shape)) for name, lay, shape in candidates),
                   key=lambda x: x[0])
    table = [{"candidate": name, "stage1_s": round(score, 3)} for score, name, _ in first]
    keep = KEEP if ctx.gpus <= 512 else 2
    second = sorted(((_score(ctx, *a, steps, sync), name, a) for _, name, a in first[:keep]), key=lambda x: x[0])
    scores = {name: score for score, name, _ in second}
    for row in table:
        if row["candidate"] in scores:
            row["score_s"] = round(scores[row["candidate"]], 3)
    best = second[0]
    log.info("search (%s): best %s, %.1f s per step over steps %s", "sync" if sync else "async", best[1], best[0], steps)
    return best[2][0], best[2][1], table


def packed_seq_len(ctx: Context) -> int:
    """Training sequence length the shapes are chosen for: the longest mean (packed)
    trajectory length over the sample steps."""
    return max(math.ceil(statistics.fmean(t.total_tokens for t in ctx.batch(s))) for s in sample_steps(ctx))


def search_colocated(ctx: Context) -> tuple[Layout, TrainShape, list[dict]]:
    """Colocated: training on (nearly) all GPUs, homogeneous rollout TP on all, chosen by simulation."""
    seq = packed_seq_len(ctx)
    shapes = [s for n in range(ctx.gpus, ctx.gpus // 2, -1)
              if (s := best_shape(ctx.model, ctx.hw, n, ctx.cfg.batch_size, seq, ctx.cal)) is not None]
    if not shapes:
        raise ValueError(f"no training shape of {ctx.model.name} fits {ctx.gpus // 2}..{ctx.gpus} GPUs with "
                         f"batch {ctx.cfg.batch_size} (the global batch must split over DP × micro-batch)")
    # The fastest shape on at most all GPUs (48 GPUs cannot split a batch of 320 over DP: 40 train, 8 wait).
    shape = min(shapes, key=lambda s: step_s(ctx.model, ctx.hw, s, seq, ctx.cal))
    candidates = [(f"rollout TP{tp} on all {ctx.gpus} GPUs", ctx.static_layout(shape, tp, colocated=True), shape)
                  for tp in ctx.tps]
    return _two_stage(ctx, candidates, sync=True)


def train_sizes(ctx: Context, seq_len: int, limit: int = 15) -> list[int]:
    """Training GPU counts tried: whole nodes on which some training shape splits the
    batch, at most ``limit`` of them spread evenly."""
    g, nodes = ctx.cfg.cluster.gpus_per_node, ctx.cfg.cluster.nodes
    top = ctx.gpus - max(ctx.cfg.planner.min_rollout_gpus, 1)
    whole = [n * g for n in range(1, nodes) if n * g <= top
             and best_shape(ctx.model, ctx.hw, n * g, ctx.cfg.batch_size, seq_len, ctx.cal) is not None]
    if len(whole) <= limit:
        return whole
    return sorted({whole[round(i * (len(whole) - 1) / (limit - 1))] for i in range(limit)})


def search_async_static(ctx: Context) -> tuple[Layout, TrainShape, list[dict]]:
    """Disaggregated async: training GPU count × homogeneous rollout TP, by simulation."""
    candidates = []
    seq = packed_seq_len(ctx)
    for n in train_sizes(ctx, seq):
        shape = best_shape(ctx.model, ctx.hw, n, ctx.cfg.batch_size, seq, ctx.cal)
        if shape is None:
            continue
        for tp in ctx.tps:
            candidates.append((f"train {n} GPUs (TP{shape.tp} PP{shape.pp} DP{shape.dp}) + rollout TP{tp}",
                               ctx.static_layout(shape, tp), shape))
    if not candidates:
        raise ValueError(f"no training shape fits any whole-node split of {ctx.gpus} GPUs")
    return _two_stage(ctx, candidates, sync=False)
