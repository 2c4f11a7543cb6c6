"""The fixed splits the baselines run, found by the planner's search and by simulation
(not strawmen).

Colocated (:func:`search_colocated`): training on (nearly) all GPUs, one rollout TP on all.
A candidate is scored by simulating the rollout of a few RL steps spread over the run
(``search.sample_steps``: the drift is seen), each step alone, plus training and the
switch; two stages keep it cheap at 4096 GPUs: every candidate is screened with the
planner's cost model on the middle sample step, then the best four (two above 512 GPUs)
are simulated on every sample step and the best simulated wins.

Disaggregated fixed splits search the same decision space as Libra's planner (part-node
training, mixed rollout TP instances; libra_hpc/planner/search.py) and choose by
simulation (libra_hpc/sim/baselines.py runs them):

- :func:`top_plans`: the plan search's best plans, one per training GPU count, valued as
  the control loop values them (the plan search's ``pipelined`` objective), on the
  lengths of the given batches, training sized for the longest batch's packed length;
- :func:`pilot_plan`: the planner's choice on the first batches, training sized for
  ``training.seq_len``;
- :func:`best_simulated`: each candidate simulated on the batches it is for (from a cold
  start), the most tokens/s wins (a candidate that ran out of memory loses to any that did not).
"""

from __future__ import annotations

import logging
import math
import statistics

from dataclasses import replace

from libra_hpc.cluster.layout import Layout
from libra_hpc.envs.synthetic import Trajectory
from libra_hpc.planner.control import length_profile, pipelined_step_s
from libra_hpc.planner.costs import TrainShape
from libra_hpc.planner.costs import rollout_makespan as rollout_cost_makespan
from libra_hpc.planner.search import Plan, PlanError, plan_to_layout
from libra_hpc.planner.valuation import PlanValuation
from libra_hpc.sim.context import Context, instances_of, samples_of, trained_of
from libra_hpc.sim.controller import PolicyRun
from libra_hpc.sim.engine import SimClock
from libra_hpc.sim.policies import PolicySetup, SETUPS, control_loop
from libra_hpc.sim.recorder import Recorder
from libra_hpc.sim.rollout import RolloutSide
from libra_hpc.sim.training import best_shape, for_batch, step_s

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
        roll = rollout_makespan(ctx, layout, s)
        train = _train_s(ctx, train_shape, ctx.batch(s))
        values.append(roll + train + ctx.cfg.costs.colocate_switch_s if sync
                      else pipelined_step_s(train, roll + ctx.weight_sync_s, ctx.cfg.rl.max_staleness, ctx.cfg.rl.stream_groups))
    return statistics.fmean(values)


def _packed(batch: list) -> float:
    """The mean length ``batch``'s training step packs to: its trained trajectories' (all
    of them when none is)."""
    return statistics.fmean(t.total_tokens for t in trained_of(batch) or batch)


def _train_s(ctx: Context, shape: TrainShape, batch: list) -> float:
    """The training step of ``batch`` on ``shape``: its trained trajectories (``trained_of``)."""
    kept = trained_of(batch)
    if not kept:
        return 0.0
    return step_s(ctx.model, ctx.hw, for_batch(shape, len(kept), len(batch)),
                  sum(t.total_tokens for t in kept) / len(kept), ctx.cal)


def _screen(ctx: Context, layout: Layout, train_shape: TrainShape, step: int, sync: bool) -> float:
    """Stage 1: the planner's cost model (rollout makespan of the batch's length profile
    over the allocation's instances) in place of a simulation."""
    batch = ctx.batch(step)
    pools: dict[int, int] = {}
    for inst in layout.rollout_instances:
        pools[inst.tp] = pools.get(inst.tp, 0) + 1
    roll = rollout_cost_makespan([(ctx.rollout_costs[tp], n) for tp, n in pools.items()],
                                 length_profile(samples_of(batch), len(batch))).makespan_s
    train = _train_s(ctx, train_shape, batch)
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
    return max(math.ceil(_packed(ctx.batch(s))) for s in sample_steps(ctx))


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


class StepsFrom:
    """``ctx`` seen from step ``first`` on: ``batch(j)`` is step ``first + j``'s batch
    (renumbered, so that a window simulates like a run of its own); everything else is
    ``ctx``'s."""

    def __init__(self, ctx: Context, first: int):
        self._ctx, self.first = ctx, first
        self._batches: dict[int, list[Trajectory]] = {}

    def __getattr__(self, name: str):
        return getattr(self._ctx, name)

    def batch(self, step: int) -> list[Trajectory]:
        if step not in self._batches:
            self._batches[step] = [replace(t, step=step) for t in self._ctx.batch(self.first + step)]
        return self._batches[step]


def _valuation(ctx: Context, steps: range, need: int | None) -> tuple[PlanValuation, object]:
    """How a fixed policy's plans are valued (the control loop's valuation, without hybrid
    pool or replanning), training sized for ``need`` tokens per packed sequence (None:
    ``training.seq_len``), and the lengths of batches ``steps``."""
    control = control_loop(ctx, SETUPS["static_hindsight"])
    lengths = length_profile(samples_of([t for j in steps for t in ctx.batch(j)]), ctx.cfg.batch_size)
    need = ctx.cfg.training.seq_len if need is None else need
    # the valuation fits shapes to memory_headroom × the profile's mean (planner/reshard.py memory_need)
    headroom = need / max(1.0, lengths.mean_seq_tokens)
    valuation = replace(control.valuation(), o=replace(control.o, memory_headroom=headroom))
    return valuation, lengths


def train_counts(ctx: Context, limit: int = 64) -> list[int]:
    """Training GPU counts the fixed-split search tries one by one: every count that leaves
    ``planner.min_rollout_gpus`` to rollout, at most ``limit`` of them spread evenly (whole
    nodes first past that)."""
    top = ctx.gpus - max(1, ctx.cfg.planner.min_rollout_gpus)
    counts = list(range(1, top + 1))
    if len(counts) > limit:
        g = ctx.cfg.cluster.gpus_per_node
        counts = [n for n in counts if n % g == 0] or counts
    if len(counts) > limit:
        counts = sorted({counts[round(i * (len(counts) - 1) / (limit - 1))] for i in range(limit)})
    return counts


def top_plans(ctx: Context, steps: range, top: int) -> list[Plan]:
    """The plan search's ``top`` best plans on the lengths of batches ``steps`` (hindsight),
    one per training GPU count, valued as the control loop values plans (the pipelined step
    objective: the plan search's ``pipelined`` mode), training sized for the
    longest packed batch of ``steps`` (5% over its mean length, at most ``training.seq_len``).
    Two stages, as the search's own: every count of :func:`train_counts` is screened with
    one rollout TP size at a time, and the best ``2 × top`` counts, with the search's own
    pick, get the full search over mixed rollout instances."""
    peak = max(_packed(ctx.batch(j)) for j in steps)
    valuation, lengths = _valuation(ctx, steps, min(ctx.cfg.training.seq_len, math.ceil(1.05 * peak)))
    best: dict[int, Plan] = {}
    try:
        own = valuation.best_plan(lengths).plan
        best[own.train_gpus] = own
    except PlanError as exc:
        log.warning("hindsight plan search over steps %d..%d found no plan: %s", steps[0], steps[-1], exc)
    search = valuation.search
    screened = []
    for n in train_counts(ctx):
        only = replace(search, min_train_gpus=n, min_rollout_gpus=ctx.gpus - n)
        scores = [_objective(valuation, lengths, replace(only, rollout_tps=(tp,))) for tp in search.rollout_tps]
        if min(scores) < math.inf:
            screened.append((min(scores), n))
    for _, n in sorted(screened)[:2 * top]:
        if n not in best:
            best[n] = valuation.best_plan(lengths, replace(search, min_train_gpus=n, min_rollout_gpus=ctx.gpus - n)).plan
    return sorted(best.values(), key=lambda p: (p.objective, p.train_gpus))[:top]


def _objective(valuation: PlanValuation, lengths, options) -> float:
    try:
        return valuation.best_plan(lengths, options).plan.objective
    except PlanError:
        return math.inf


def pilot_plan(ctx: Context, pilot_steps: int) -> Plan:
    """The planner's plan on the lengths of the first ``pilot_steps`` batches, training
    sized for ``training.seq_len`` (what a user fixes after a pilot run)."""
    valuation, lengths = _valuation(ctx, range(min(pilot_steps, ctx.cfg.rl.steps)), None)
    return valuation.best_plan(lengths).plan


def as_candidate(ctx: Context, plan: Plan, origin: str) -> Candidate:
    layout = plan_to_layout(plan, ctx.cfg.cluster.nodes, ctx.cfg.cluster.gpus_per_node, 0, reason=origin)
    return (f"{origin}: {plan.describe()}", layout, plan.train)


def split_key(layout: Layout, train: TrainShape) -> tuple:
    """What a fixed split's simulation depends on: the training shape and the rollout
    instances per TP size."""
    return (replace(train, seq_len=1), tuple(sorted(g.tp for g in layout.rollout_instances)))


def simulate_all(ctx: Context, setup: PolicySetup, candidates: list[Candidate], steps: int,
                 turns: list[tuple[int, ...]] | None) -> list[tuple[Candidate, Recorder]]:
    """Each distinct candidate (:func:`split_key`; the first of a kind keeps its name) run
    as ``setup`` over ``steps`` batches of ``ctx``, from a cold start."""
    seen: set[tuple] = set()
    out = []
    for cand in candidates:
        key = split_key(cand[1], cand[2])
        if key not in seen:
            seen.add(key)
            out.append((cand, PolicyRun(ctx, setup, cand[1], cand[2], steps, initial_turns=turns).run()))
    if not out:
        raise ValueError(f"{setup.name}: no candidate split to simulate")
    return out


def rank(rec: Recorder) -> tuple:
    """Order of simulated runs, best last: one that ran out of memory ranks by the steps it
    completed, below every one that did not; then tokens/s."""
    s = rec.summary
    return (s.get("out_of_memory") is None, s["steps"], s["tokens_per_s"])


def best_simulated(ctx: Context, setup: PolicySetup, candidates: list[Candidate], steps: int,
                   turns: list[tuple[int, ...]] | None) -> tuple[Candidate, Recorder, list[dict]]:
    """The candidate with the most simulated tokens/s (:func:`simulate_all`, :func:`rank`),
    its run, and a row per candidate for the report."""
    runs = simulate_all(ctx, setup, candidates, steps, turns)
    best, rec = max(runs, key=lambda r: rank(r[1]))
    log.info("%s: %s wins among %d simulated splits", setup.name, best[0], len(runs))
    return best, rec, [candidate_row(c, r, c is best) for c, r in runs]


def candidate_row(cand: Candidate, rec: Recorder, chosen: bool) -> dict:
    s = rec.summary
    oom = s.get("out_of_memory")
    return {"candidate": cand[0], "tokens_per_s": round(s["tokens_per_s"], 1), "sim_time_s": round(s["sim_time_s"], 1),
            "out_of_memory_step": oom["step"] if oom else None, "chosen": chosen}
