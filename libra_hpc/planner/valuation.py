"""Plan valuation: what a plan's step is worth to this run (pure: no MPI, no torch).

The plan search (:mod:`libra_hpc.planner.search`) prices training and rollout with the
cost models and knows nothing of the pipeline or the hybrid pool. A :class:`PlanValuation`
weighs its plans as the run will see them: the pipelined step at this run's staleness
(:func:`~libra_hpc.planner.pipeline.pipelined_step_s`, the objective the search itself
minimises in its ``pipelined`` mode), the hybrid pool's worth (a replica lent where that
shortens the step), and the cost models' error measured on the running plan.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from libra_hpc.planner.allocation import pool_of, resplit_hybrid, resplit_sizes
from libra_hpc.planner.calibration import Calibration
from libra_hpc.planner.costs import LengthProfile, LengthSample, RolloutCost, TrainingCost, TrainShape, rollout_makespan
from libra_hpc.planner.hybrid import HybridPool
from libra_hpc.planner.options import ControlOptions
from libra_hpc.planner.pipeline import moved_times, pipelined_step_s, rollout_side_s
from libra_hpc.planner.profiles import HardwareProfile, ModelProfile
from libra_hpc.planner.reshard import memory_need
from libra_hpc.planner.search import Plan, PlanError, PlannerOptions, PlanResult, RLBatch, plan, reprice


def grown(shape: TrainShape, extra_replicas: int) -> TrainShape:
    """``shape`` with ``extra_replicas`` more DP replicas (hybrid replicas lent to training);
    the replicas may then hold unequal shares of the batch (``TrainShape.uneven``)."""
    return replace(shape, dp=shape.dp + extra_replicas, uneven=shape.uneven or extra_replicas > 0)


def same_plan(a: Plan, b: Plan) -> bool:
    """Same training shape and the same rollout instances per TP size: applying one over the
    other would only permute slots (a drain and a reconfiguration for nothing)."""
    return a.train == b.train and a.train_gpus == b.train_gpus and a.rollout_counts == b.rollout_counts


def length_profile(samples: Sequence[LengthSample], batch_size: int) -> LengthProfile:
    """The planner's view of finished trajectories, for a batch of ``batch_size``."""
    return LengthProfile.from_samples(list(samples), batch_size)


def measured_scale(measured: tuple[float, float | None] | None, now: Plan, lent: int = 0,
                   replica_size: int = 0) -> tuple[float, float]:
    """Measured over predicted (training, rollout) time of the running plan (``now``:
    repriced on the lengths of this check; ``measured``: the last batch's rollout makespan
    and training step); (1, 1) before a measurement. While ``lent`` hybrid replicas of
    ``replica_size`` GPUs train, the measured step is that of the moved layout, so the
    prediction it is set against is ``now``'s times moved as the pool moved them
    (:func:`~libra_hpc.planner.pipeline.moved_times`). (It used to stay at (1, 1) while a
    replica was lent, which is most of a run that lends: on a800-swe-drift the running plan
    was then valued unscaled while rollout ran at 0.55-0.6 of its prediction, and the loop
    applied a plan predicted 6 s a step better that was 200 s a step worse.)"""
    if measured is None or measured[1] is None:
        return (1.0, 1.0)
    makespan, t_train = measured
    if not (now.t_train > 0 and now.t_rollout > 0 and math.isfinite(now.t_rollout)):
        return (1.0, 1.0)
    p_train, p_roll = now.t_train, now.t_rollout
    if lent:
        if now.rollout_gpus - lent * replica_size <= 0:
            return (1.0, 1.0)
        p_train, p_roll = moved_times(p_train, p_roll, now.train.dp, now.rollout_gpus, replica_size, lent)
    return (t_train / p_train, makespan / p_roll)


def rollout_left(plan_: Plan, pool: HybridPool, lent: int) -> dict[int, int]:
    """Rollout instances per TP size of ``plan_`` once the pool's first ``lent`` replicas
    (by id) train: the plan's instances less those inside their slots."""
    gone = {s for r in pool.all_replicas()[:lent] for s in r.slots}
    out: dict[int, int] = {}
    for inst in plan_.rollout:
        if not set(inst.slots) <= gone:
            out[inst.tp] = out.get(inst.tp, 0) + 1
    return out


@dataclass(frozen=True)
class PlanValuation:
    """How the control loop values plans at one moment: its profiles, options and current
    calibration, the plan search's options, the measured/predicted scale of the running
    plan, and whether a lend at a given training/rollout balance is held (the lend trial's
    verdict, :meth:`~libra_hpc.planner.lending.HybridLending.held`)."""

    model: ModelProfile
    hw: HardwareProfile
    o: ControlOptions
    cal: Calibration
    search: PlannerOptions | None = None
    """The plan search's options (None only while the loop picks its single TP size)."""
    scale: tuple[float, float] = (1.0, 1.0)
    """Measured over predicted training and rollout time of the running plan at the last
    check (:func:`measured_scale`)."""
    held: Callable[[float, float], bool] = lambda t_train, t_roll: False
    """``held(t_train, t_rollout_side)``: a lend at this balance made the step slower."""
    latest_mean: float | None = None
    """Mean sequence tokens of the last batch observed: new plans fit ``memory_headroom`` ×
    at least that (:func:`~libra_hpc.planner.reshard.memory_need`'s floor)."""

    def makespan_s(self, counts: dict[int, int], lengths: LengthProfile) -> float:
        """The rollout cost model's makespan of ``lengths`` on instances ``counts`` (TP → n)."""
        hw = self.hw.model_copy(update={"gpus_per_node": self.o.gpus_per_node})
        pools = [(RolloutCost(self.model, hw, tp, self.cal), n) for tp, n in counts.items() if n]
        if not pools:
            return math.inf
        return rollout_makespan(pools, lengths, in_flight=self.o.max_staleness + 1,
                                length_aware=self.o.length_aware_routing, migration=self.o.migration).makespan_s

    def lent_times(self, plan_: Plan, pool: HybridPool, t_train: float, t_rollout: float, before: int, after: int,
                   lengths: LengthProfile | None) -> tuple[float, float]:
        """Training and rollout time once ``after`` of the pool's replicas train instead of
        ``before`` (lowest ids first), from ``t_train`` and ``t_rollout`` with ``before``
        lent: training with 1/DP; rollout by the rollout cost model's makespan of
        ``lengths`` on the instances left (their tails included), or with 1/GPUs without
        ``lengths``. (1/GPUs alone says a node of a tool-bound rollout taken away costs
        a third more; on cmlfq-premise half the rollout GPUs cost 7%.)"""
        size = pool.replica_size
        t_train, by_gpus = moved_times(t_train, t_rollout, plan_.train.dp + before, plan_.rollout_gpus - before * size,
                                       size, after - before)
        if lengths is None:
            return t_train, by_gpus
        old = self.makespan_s(rollout_left(plan_, pool, before), lengths)
        new = self.makespan_s(rollout_left(plan_, pool, after), lengths)
        return t_train, (t_rollout * new / old if 0 < old < math.inf else math.inf)

    def lendable(self, plan_: Plan, pool: HybridPool) -> list[int]:
        """How many of the pool's replicas ``plan_`` can have lent at once: 1, 2, ... up to
        the first count that would leave rollout under ``min_rollout_gpus`` or training's
        grown shape out of memory (the pool lends one replica at a time)."""
        out = []
        for k in range(1, len(pool.all_replicas()) + 1):
            if plan_.rollout_gpus - k * pool.replica_size < max(1, self.o.min_rollout_gpus) or \
                    TrainingCost(self.model, self.hw, grown(plan_.train, k), self.cal).infeasible:
                break
            out.append(k)
        return out

    def step_objective(self, t_train: float, t_rollout: float) -> float:
        """:func:`~libra_hpc.planner.pipeline.pipelined_step_s` at this run's staleness."""
        return pipelined_step_s(t_train, t_rollout, self.o.max_staleness, self.o.stream_groups, self.cal.stream_tail_s)

    def best_plan(self, lengths: LengthProfile, options: PlannerOptions | None = None) -> PlanResult:
        """plan()'s ``pipelined`` search on ``lengths``: the plan whose :meth:`step_objective`
        is least. (It used to take the better of the ``async`` search, max(T_train,
        T_rollout), and the ``sync`` one, T_train + T_rollout, under the step objective; a plan
        best under neither was never looked at: on a800-swe-drift the loop saw the plan it
        needed, 20 training GPUs and 7×TP4, at one check in three, and never applied it.)
        Its ``plan.objective`` is the step objective. Training sequences are packed to the
        profile's mean length. ``options`` None: the loop's search, valued as the control
        loop values the running plan (:meth:`pooled_objective`: scaled by the running plan's
        measured/predicted times, the hybrid pool's worth counted where there is one, with
        :meth:`_with_pool`): the gate compares the two. (Without a pool the candidate was
        left unscaled while the running plan was scaled, and a job faster than the cost
        model never replanned.)"""
        o = self.o
        batch = RLBatch.of(o.global_batch, lengths)
        fit = memory_need(lengths, o.seq_len, o.memory_headroom, self.latest_mean)
        opts = replace(options or self.search, fit_seq_len=fit,
                       in_flight=o.max_staleness + 1, stream_groups=o.stream_groups)
        result = plan(self.model, self.hw, o.nodes, o.gpus_per_node, lengths, batch, mode="pipelined",
                      options=opts, calibration=self.cal)
        if options is None and o.hybrid and o.hybrid_nodes:
            result = replace(result, plan=self._with_pool(result.plan, lengths, batch))
        elif options is None:  # valued as the running plan is (scaled by what it measured), to compare with it
            result = replace(result, plan=replace(result.plan, objective=self.pooled_objective(result.plan, None)))
        return result

    def _with_pool(self, plan_: Plan, lengths: LengthProfile, batch: RLBatch) -> Plan:
        """``plan_`` or, when its hybrid node's instances must be re-split for the pool to
        form, the re-split plan, whichever is worth more counting what the pool can do:
        each is valued at :meth:`pooled_objective` (its step with a replica lent, where
        that is shorter). The search itself knows nothing of the pool; without this a plan
        whose training would bind once a replica is lent never forms it, as a tie of the
        step objectives leaves the pool out."""
        o = self.o
        best = replace(plan_, objective=self.pooled_objective(plan_, pool_of(plan_, o), lengths))
        for tp in resplit_sizes(o):
            candidate = resplit_hybrid(plan_, tp, o.nodes - o.hybrid_nodes)
            pool = None if candidate is None else pool_of(candidate, o)
            if pool is None:
                continue
            candidate = reprice(candidate, self.model, self.hw, o.gpus_per_node, lengths, self.cal, batch,
                                in_flight=o.max_staleness + 1, length_aware=o.length_aware_routing,
                                migration=o.migration, stream_groups=o.stream_groups)
            candidate = replace(candidate, objective=self.pooled_objective(candidate, pool, lengths))
            if candidate.objective < best.objective:
                best = candidate
            break  # the widest split that forms the pool
        return best

    def pooled_objective(self, plan_: Plan, pool: HybridPool | None, lengths: LengthProfile | None = None) -> float:
        """``plan_``'s step objective, or its step with hybrid replicas lent to training if
        that is shorter (every count the pool and training's memory allow; the times as
        :meth:`lent_times` moves them, on ``lengths``), when ``pool`` can lend one. Whether
        lending pays, and which of two plans is faster, turns on the balance of the two
        times, so they are first scaled by what the running plan measured against its
        prediction (:attr:`scale`: the cost models' error there, taken to hold for every
        candidate; (1, 1) for the initial plan). Lent replicas are counted together: the
        first of two may slow rollout more than it speeds training (its instance ends the
        rollout's tail) where both pay (cmlfq-premise)."""
        plan_ = replace(plan_, t_train=plan_.t_train * self.scale[0], t_rollout=plan_.t_rollout * self.scale[1])
        now = self.step_objective(plan_.t_train, plan_.t_rollout)
        if pool is None:
            return now
        if self.held(plan_.t_train, rollout_side_s(plan_.t_rollout, self.o.max_staleness, self.o.stream_groups,
                                                  self.cal.stream_tail_s)):
            return now  # lending at this balance was tried and made the step slower (the lend trial)
        return min([now] + [self.step_objective(*self.lent_times(plan_, pool, plan_.t_train, plan_.t_rollout, 0, k,
                                                                 lengths))
                            for k in self.lendable(plan_, pool)])

    def best_single_tp(self, prior: LengthProfile) -> int:
        """The one rollout TP size whose plan for ``prior`` is best (``single_tp``)."""
        best = None
        for tp in self.o.rollout_tps:
            try:
                r = self.best_plan(prior, PlannerOptions(rollout_tps=(tp,), min_rollout_gpus=self.o.min_rollout_gpus))
            except PlanError:
                continue
            if best is None or r.plan.objective < best[0]:
                best = (r.plan.objective, tp)
        if best is None:
            raise PlanError("no single rollout TP size gives a plan for the prior")
        return best[1]
