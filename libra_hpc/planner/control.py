"""Libra's control loop: the one decision-maker that the job and the simulator drive.

It takes observations and returns decisions; it never measures, waits or moves anything
itself (pure: no MPI, no torch, no clock):

| call | observation in | decision out |
|---|---|---|
| :meth:`ControlLoop.initial` | nothing (the length prior) or known lengths | the first :class:`LayoutChange` |
| :meth:`ControlLoop.start` | a pinned plan | the first :class:`LayoutChange` (its hybrid pool formed as for a planned one) |
| :meth:`ControlLoop.observe` | length samples of finished trajectories | (the window the next plans are made on) |
| :meth:`ControlLoop.after_rollout` | a batch's rollout makespan and the last training step time | a new layout (plan search → gate → reprice of the current plan → same-plan check), else hybrid-pool transitions |
| :meth:`ControlLoop.apply` | the driver applied a change (rollout drained, groups rebuilt) | (the current layout and pool) |
| :meth:`ControlLoop.progress` / :meth:`ControlLoop.after_training_step` | a hybrid replica finished a phase / a training step ended | pool transitions |

The current allocation is a :class:`~libra_hpc.cluster.layout.Layout` (who trains, which
rollout instances exist, which slots form the hybrid pool), with the plan it came from
(the predicted step times) and its :class:`~libra_hpc.planner.hybrid.HybridPool`.

With :attr:`ControlLoop.journal` set to a list, every call is recorded there (inputs and
decisions as plain data), so that a recorded stream of observations can be replayed into
a fresh loop: the same inputs give the same decisions, whoever drives it
(tests/test_control_golden.py).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from libra_hpc.cluster.layout import Layout, LayoutError
from libra_hpc.config import LengthPrior
from libra_hpc.planner.costs import Calibration, LengthProfile, LengthSample, RolloutCost, TrainingCost, TrainShape
from libra_hpc.planner.gate import GateOptions, ReplanGate
from libra_hpc.planner.hybrid import HybridPool, HybridPoolError, PhaseTimeouts, PoolEvent
from libra_hpc.planner.prior import prior_lengths
from libra_hpc.planner.profiles import HardwareProfile, ModelProfile, load_hardware, load_model
from libra_hpc.planner.search import (
    Plan,
    PlanError,
    PlannerOptions,
    PlanResult,
    RLBatch,
    fitting_training_cost,
    plan,
    plan_to_layout,
    reprice,
)
from libra_hpc.planner.search import RolloutInstance as PlanInstance
from libra_hpc.parallel.selector import TpSelector, TpTable, choose_by_cost, context_percentile
from libra_hpc.planner.reshard import resharded, tp_options

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ControlOptions:
    """What the loop plans for and may do. Units: GPUs, sequences, tokens, seconds, steps."""

    nodes: int
    gpus_per_node: int
    global_batch: int
    """Trajectories per RL step (prompts × group size)."""
    seq_len: int
    """Longest trajectory in tokens: the prior's cap."""
    max_staleness: int
    """Policy versions rollout may run ahead of training (k); 0 is synchronous."""
    rollout_tps: tuple[int, ...]
    """Rollout instance TP sizes that fit the model (descending)."""
    prior: LengthPrior = LengthPrior()
    """Lengths assumed before any is observed (``planner.prior``)."""
    seed: int = 0
    hybrid_nodes: int = 1
    """Last nodes that form the hybrid pool when the plan leaves them to rollout."""
    min_rollout_gpus: int = 1
    window: int = 512
    """Finished trajectories the length profile of a replan is built from."""
    gate: GateOptions = GateOptions()
    hybrid_margin: float = 0.1
    """Borrow when T_train > T_rollout × (1 + margin), release in reverse."""
    memory_headroom: float = 1.25
    """Training shapes must fit sequences this many times the observed mean (packed)
    length, up to ``seq_len``; a running shape that no longer does is replaced at once."""
    reconfig_s: float = 30.0
    """Seconds a layout change costs (the gate weighs the gain against it)."""
    hybrid_timeouts: PhaseTimeouts = PhaseTimeouts()
    replan: bool = True
    hybrid: bool = True
    clairvoyant: bool = False
    """Plan on the true lengths the driver passes (an oracle for comparisons)."""
    single_tp: bool = False
    """Restrict the search to the one rollout TP size that is best for the prior."""
    refine_top: int = 6
    length_aware_routing: bool = False
    """The router places turns by (true or predicted) length, so plans may count on the
    long trajectories reaching the fast instances (``PlannerOptions.length_aware``)."""
    on_memory: str = "reshard"
    """Contexts outgrew the training shape: ``reshard`` (training to another TP size on the
    same GPUs, :mod:`libra_hpc.parallel.selector`) before ``replan`` (the whole split)."""
    tp_table: tuple[tuple[int, int], ...] | None = None
    """A measured training TP table (context tokens from which → TP size); None: by cost."""
    tp_hysteresis: float = 0.1
    tp_confirm: int = 2
    stream_groups: int = 0
    """``rl.stream_training``: the GRPO groups of a step, trained as they finish (0: off);
    the step objective counts only the last one's share of training after the rollout."""

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    @classmethod
    def from_config(cls, cfg: Any, rollout_tps: Sequence[int], **setup: Any) -> ControlOptions:
        """The options an experiment config gives (a simulator scenario is one too): the
        cluster shape, the batch (``rl.prompts_per_step × rl.group_size``), ``rl`` and the
        ``planner`` section. ``setup``: what the caller adds (``reconfig_s``,
        ``hybrid_timeouts``) or what a policy may do (``replan``, ``hybrid``, ...).
        ``launch.py --plan`` and the simulator both come through here, so they plan on
        the same inputs."""
        c, p = cfg.cluster, cfg.planner
        return cls(
            nodes=c.nodes, gpus_per_node=c.gpus_per_node, global_batch=cfg.batch_size, seq_len=cfg.training.seq_len,
            max_staleness=cfg.rl.max_staleness, rollout_tps=tuple(rollout_tps),
            prior=p.prior,
            seed=cfg.rl.seed, hybrid_nodes=p.hybrid_nodes, min_rollout_gpus=p.min_rollout_gpus, window=p.window,
            gate=GateOptions(every_steps=p.every_steps, margin_s=p.margin_s, confirm_checks=p.confirm_checks,
                             min_dwell_steps=p.min_dwell_steps, min_gain=p.min_gain),
            hybrid_margin=p.hybrid_margin, memory_headroom=p.memory_headroom,
            on_memory=cfg.parallel.on_memory, tp_hysteresis=cfg.parallel.hysteresis,
            tp_confirm=cfg.parallel.confirm_checks,
            stream_groups=cfg.rl.stream_groups,
            tp_table=tuple(sorted(cfg.parallel.training_tp_by_context.items()))
            if cfg.parallel.training_tp_by_context else None,
            **{"length_aware_routing": cfg.scheduler.policy in ("oracle", "length_aware"), **setup})


@dataclass(frozen=True)
class LayoutChange:
    """A decision to run on ``layout`` (its plan's predictions, its hybrid pool)."""

    step: int
    layout: Layout
    plan: Plan
    pool: HybridPool | None
    reason: str
    gain_s: float | None = None
    """Predicted step-time saving against the current plan (None for the first layout)."""
    result: PlanResult | None = None
    """The search behind it (runners-up, time spent)."""
    reshard: bool = False
    """Only the training TP size changes (same GPUs, same rollout instances): rollout
    need not drain; training reloads its checkpoint at the new shape."""

    def describe(self) -> str:
        pool = f", hybrid pool {len(self.pool.all_replicas())} replica(s)" if self.pool else ""
        return self.plan.describe() + pool


@dataclass
class AfterRollout:
    """What :meth:`ControlLoop.after_rollout` decided: a layout change, or pool transitions."""

    change: LayoutChange | None = None
    pool_events: list[PoolEvent] = field(default_factory=list)
    pool_decided: bool = False
    """The hybrid pool's policy ran (a pool exists, no layout change, a training time is
    known, and a borrow would fit): ``pool_events`` is its answer, possibly empty."""


def feasible_tps(model: ModelProfile, hw: HardwareProfile, tps: Sequence[int], cal: Calibration) -> tuple[int, ...]:
    """The rollout TP sizes of ``tps`` whose instances can hold the model (descending)."""
    out = []
    for tp in sorted(set(tps)):
        why = RolloutCost(model, hw, tp, cal).infeasible
        if why:
            log.info("rollout TP%d left out: %s", tp, why)
        else:
            out.append(tp)
    return tuple(sorted(out, reverse=True))


def pipelined_step_s(t_train: float, t_rollout: float, k: int, stream_groups: int = 0) -> float:
    """Steady-state step time of the rollout/training pipeline with staleness ``k``:
    training step ``s`` ends at max(end(s - k - 1) + T_rollout, end(s - 1)) + T_train, so
    a step takes max(T_train, (T_rollout + T_train) / (k + 1)) (k = 0: their sum).

    ``stream_groups`` > 0 (``rl.stream_training``, that many GRPO groups a step): the
    trainers work through a batch's groups as they finish, so only the last group's share
    of the step, T_train / groups, follows the batch's slowest trajectory:
    max(T_train, (T_rollout + T_train / groups) / (k + 1))."""
    tail = t_train / stream_groups if stream_groups > 0 else t_train
    return max(t_train, (t_rollout + tail) / (k + 1))


def profiles(cfg: Any) -> tuple[ModelProfile, HardwareProfile]:
    """The planner's profiles an experiment config names (``model.name``,
    ``cluster.hardware``), the hardware's node size set to ``cluster.gpus_per_node``."""
    hw = load_hardware(cfg.cluster.hardware)
    return load_model(cfg.model.name), hw.model_copy(update={"gpus_per_node": cfg.cluster.gpus_per_node})


def moved_times(t_train: float, t_roll: float, dp: int, rollout_gpus: int, size: int,
                replicas: int) -> tuple[float, float]:
    """Training and rollout time once ``replicas`` hybrid replicas of ``size`` GPUs move
    to training (negative: back to rollout): training time scales with 1/DP, rollout time
    with 1/rollout GPUs."""
    return t_train * dp / (dp + replicas), t_roll * rollout_gpus / (rollout_gpus - replicas * size)


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


class ControlLoop:
    """Libra's decisions for one run (see the module docstring)."""

    def __init__(self, model: ModelProfile, hw: HardwareProfile, options: ControlOptions,
                 calibration: Calibration | None = None):
        if not options.rollout_tps:
            raise PlanError(f"no rollout TP size fits {model.name} on {hw.name}")
        self.model, self.hw, self.o = model, hw, options
        self.cal = calibration or Calibration()
        self.window: deque[LengthSample] = deque(maxlen=options.window)
        self.gate = ReplanGate(GateOptions(every_steps=1, margin_s=0.0, confirm_checks=1, min_dwell_steps=0)
                               if options.clairvoyant else options.gate)
        tps = (self._best_single_tp(),) if options.single_tp else options.rollout_tps
        self.search = PlannerOptions(rollout_tps=tps, min_rollout_gpus=options.min_rollout_gpus,
                                     refine_top=options.refine_top, in_flight=options.max_staleness + 1,
                                     length_aware=options.length_aware_routing)
        self.min_gap = 1 if options.clairvoyant else max(1, self.gate.opt.every_steps // 5)
        self.last_check = -(10 ** 9)
        self.layout: Layout | None = None
        self.plan: Plan | None = None
        self.pool: HybridPool | None = None
        self.considered: list[dict] = []
        """Plans looked at and why each was (not) applied, for events.jsonl and reports."""
        self.measured: tuple[float, float | None] | None = None
        """The last batch's measured rollout makespan and training step (after_rollout)."""
        self.scale = (1.0, 1.0)
        """Measured over predicted training and rollout time of the running plan at the
        last check (:meth:`pooled_objective` weighs a hybrid replica's move with it)."""
        self.tp = TpSelector(current=0, confirm=options.tp_confirm)
        """Training's TP size over time (EARL's selector; set by :meth:`apply`)."""
        self.lend_trial: dict | None = None
        """The last replica lent to training, on trial until two rollouts with it active
        are measured (:meth:`_judge_lend`)."""
        self.borrow_floor: float | None = None
        """After a lend that made the step slower: the training/rollout ratio a borrow must
        now exceed (:meth:`_judge_lend`)."""
        self.tp_table = TpTable(options.tp_table) if options.tp_table else None
        self.journal: list[dict] | None = None
        """Set to a list to record every call (inputs and decisions as plain data); off by
        default, since the samples of a long run add up."""

    # ------------------------------------------------------------------ planning
    def prior(self) -> LengthProfile:
        p, o = self.o.prior, self.o
        return prior_lengths(prompt_tokens=p.prompt_tokens, gen_tokens_median=p.gen_tokens_median,
                             tail_shape=p.tail_shape, turns=p.turns, tool_s_per_turn=p.tool_s_per_turn,
                             seq_len=o.seq_len, batch_size=o.global_batch, seed=o.seed)

    def prior_turns(self) -> list[tuple[int, ...]]:
        """Per-turn generated tokens of the prior (each trajectory cut into ``prior.turns``
        equal turns): what the first bucket limits are placed on."""
        prior, n = self.prior(), max(1, self.o.prior.turns)
        return [(max(1, round(g / n)),) * n for g, c in zip(prior.gen, prior.count) for _ in range(c)]

    def step_objective(self, t_train: float, t_rollout: float) -> float:
        """:func:`pipelined_step_s` at this run's staleness."""
        return pipelined_step_s(t_train, t_rollout, self.o.max_staleness, self.o.stream_groups)

    def best_plan(self, lengths: LengthProfile, options: PlannerOptions | None = None) -> PlanResult:
        """The better of plan()'s asynchronous and synchronous searches on ``lengths`` under
        :meth:`step_objective` (plan()'s async objective max(T_train, T_rollout) assumes one
        batch in flight; with overlapping batches the step mixes both objectives, and the
        sync search minimises T_train + T_rollout, the rollout-bound case). Its
        ``plan.objective`` is the step objective. Training sequences are packed to the
        profile's mean length."""
        o = self.o
        batch = RLBatch(o.global_batch, math.ceil(lengths.mean_seq_tokens))
        opts = replace(options or self.search, fit_seq_len=self.memory_need(lengths))
        best = None
        for mode in ("async", "sync"):
            r = plan(self.model, self.hw, o.nodes, o.gpus_per_node, lengths, batch, mode=mode,
                     options=opts, calibration=self.cal)
            obj = self.step_objective(r.plan.t_train, r.plan.t_rollout)
            if best is None or obj < best[0]:
                best = (obj, replace(r, plan=replace(r.plan, objective=obj)))
        result = best[1]
        if options is None and self.o.hybrid and self.o.hybrid_nodes:
            result = replace(result, plan=self._with_pool(result.plan, lengths, batch))
        return result

    def _with_pool(self, plan_: Plan, lengths: LengthProfile, batch: RLBatch) -> Plan:
        """``plan_`` or, when its hybrid node's instances must be re-split for the pool to
        form, the re-split plan, whichever is worth more counting what the pool can do:
        each is valued at :meth:`pooled_objective` (its step with a replica lent, where
        that is shorter). The search itself knows nothing of the pool; without this a plan
        whose training would bind once a replica is lent never forms it, as a tie of the
        step objectives leaves the pool out."""
        o = self.o
        best = replace(plan_, objective=self.pooled_objective(plan_, self._pool_of(plan_)))
        for tp in sorted((t for t in o.rollout_tps if t < o.gpus_per_node), reverse=True):
            candidate = resplit_hybrid(plan_, tp, o.nodes - o.hybrid_nodes)
            pool = None if candidate is None else self._pool_of(candidate)
            if pool is None:
                continue
            candidate = reprice(candidate, self.model, self.hw, o.gpus_per_node, lengths, self.cal, batch,
                                in_flight=o.max_staleness + 1, length_aware=o.length_aware_routing)
            candidate = replace(candidate, objective=self.pooled_objective(candidate, pool))
            if candidate.objective < best.objective:
                best = candidate
            break  # the widest split that forms the pool
        return best

    def _measured_scale(self, now: Plan) -> tuple[float, float]:
        """Measured over predicted (training, rollout) time of the running plan (``now``:
        it repriced on the lengths of this check); (1, 1) before a measurement or while
        hybrid replicas train (the measured step is then another shape's)."""
        if self.measured is None or self.measured[1] is None or \
                (self.pool is not None and self.pool.training_replicas()):
            return (1.0, 1.0)
        makespan, t_train = self.measured
        if not (now.t_train > 0 and now.t_rollout > 0 and math.isfinite(now.t_rollout)):
            return (1.0, 1.0)
        return (t_train / now.t_train, makespan / now.t_rollout)

    def _pool_of(self, plan_: Plan) -> HybridPool | None:
        """The hybrid pool ``plan_``'s layout forms as it is, or None."""
        o = self.o
        try:
            layout = plan_to_layout(plan_, o.nodes, o.gpus_per_node, o.hybrid_nodes, reason="valuation")
            return HybridPool.from_layout(layout, min_rollout_gpus=o.min_rollout_gpus, timeouts=o.hybrid_timeouts)
        except (LayoutError, HybridPoolError):
            return None

    def pooled_objective(self, plan_: Plan, pool: HybridPool | None) -> float:
        """``plan_``'s step objective, or its step with one hybrid replica lent to training
        if that is shorter (:func:`moved_times`, as :meth:`hybrid_gain` scales them), when
        ``pool`` can lend one. Whether lending
        pays, and which of two plans is faster, turns on the balance of the two times, so
        they are first scaled by what the running plan measured against its prediction
        (:attr:`scale`: the cost models' error there, taken to hold for every candidate;
        (1, 1) for the initial plan)."""
        plan_ = replace(plan_, t_train=plan_.t_train * self.scale[0], t_rollout=plan_.t_rollout * self.scale[1])
        now = self.step_objective(plan_.t_train, plan_.t_rollout)
        if pool is None:
            return now
        if self.lend_held(plan_.t_train, self.rollout_side_s(plan_.t_rollout)):
            return now  # lending at this balance was tried and made the step slower (_judge_lend)
        dp, gpus, size = plan_.train.dp, plan_.rollout_gpus, pool.replica_size
        if gpus - size < max(1, self.o.min_rollout_gpus) or \
                TrainingCost(self.model, self.hw, grown(plan_.train, 1), self.cal).infeasible:
            return now
        return min(now, self.step_objective(*moved_times(plan_.t_train, plan_.t_rollout, dp, gpus, size, 1)))

    def memory_need(self, lengths: LengthProfile) -> int:
        """Tokens per (packed) training sequence a plan must fit: ``memory_headroom`` ×
        the observed mean, at most ``seq_len`` (what the batch can still reach)."""
        return min(self.o.seq_len, math.ceil(self.o.memory_headroom * lengths.mean_seq_tokens))

    def memory_short(self, lengths: LengthProfile) -> str | None:
        """Why the running training shape (hybrid replicas included) cannot run the
        sequences ``lengths`` may reach next (``memory_need``), or None when it can."""
        shape = replace(self.training_shape(), seq_len=self.memory_need(lengths))
        cost = fitting_training_cost(self.model, self.hw, replace(shape, recompute=False), self.cal)
        if not cost.infeasible:
            return None
        return (f"memory: training TP{shape.tp} PP{shape.pp} DP{shape.dp} cannot run sequences of {shape.seq_len} "
                f"tokens ({self.o.memory_headroom:g} × the observed mean {lengths.mean_seq_tokens:.0f}): "
                f"{cost.infeasible.split(': ', 1)[-1]}")

    def _best_single_tp(self) -> int:
        best = None
        for tp in self.o.rollout_tps:
            try:
                r = self.best_plan(self.prior(), PlannerOptions(rollout_tps=(tp,), min_rollout_gpus=self.o.min_rollout_gpus,
                                                                in_flight=self.o.max_staleness + 1))
            except PlanError:
                continue
            if best is None or r.plan.objective < best[0]:
                best = (r.plan.objective, tp)
        if best is None:
            raise PlanError("no single rollout TP size gives a plan for the prior")
        return best[1]

    # ------------------------------------------------------------------ decisions
    def initial(self, lengths: LengthProfile | None = None) -> LayoutChange:
        """The first layout: planned on the prior (clairvoyant: on ``lengths``). Applied at once."""
        result = self.best_plan(lengths if lengths is not None else self.prior())
        self.considered.append({"step": 0, "kind": "initial_plan", "plan": result.plan.describe(),
                                "objective_s": result.plan.objective})
        change = self._change(0, result, "initial plan", None)
        self.apply(change)
        self._log("initial", {"lengths": lengths}, change)
        return change

    def start(self, plan_: Plan, reason: str) -> LayoutChange:
        """Start from a given plan (a pinned layout) instead of searching one; its hybrid pool
        forms as for a planned one. Applied at once."""
        change = self._change(0, PlanResult(plan_, (), 0, 0.0), reason, None, searched=False)
        self.apply(change)
        self._log("start", {"plan": plan_.describe(), "reason": reason}, change)
        return change

    def observe(self, samples: Sequence[LengthSample]) -> None:
        """Finished trajectories (prompt + tool-output tokens, generated tokens, turns, tool s)."""
        self.window.extend(samples)
        self._log("observe", {"samples": [tuple(s) for s in samples]}, None)

    def pressure(self, makespan_s: float, t_train: float | None) -> dict:
        """The gate's pressure signal: rollout time weighed against training (the makespan
        over k; training is the bottleneck iff T_train > M / k)."""
        return {"rollout_train_ratio": self.rollout_side_s(makespan_s) / t_train} if t_train else {}

    def rollout_side_s(self, makespan_s: float) -> float:
        """The rollout time to weigh against the training time: in steady state a step
        takes max(T, (M + T) / (k + 1)), which is T exactly when T >= M / k; training
        streamed over G groups, max(T, (M + T / G) / (k + 1)): T when T >= M / (k + 1 - 1 / G)."""
        k, g = self.o.max_staleness, self.o.stream_groups
        return makespan_s / (k + 1 - 1 / g) if g > 0 else makespan_s / max(1, k)

    def after_rollout(self, step: int, now: float, makespan_s: float, t_train: float | None,
                      future: Callable[[], LengthProfile | None] | None = None) -> AfterRollout:
        """Batch ``step``'s rollout is complete (it took ``makespan_s``; the last training
        step took ``t_train``, None before the first): a new layout when the gate applies a
        better plan, else the hybrid pool's transitions. ``future``: the next batch's true
        lengths (clairvoyant loops only; None past the last step)."""
        self.measured = (makespan_s, t_train)
        change = self._consider(step, self.pressure(makespan_s, t_train), future)
        out = AfterRollout(change)
        if change is None and self.pool is not None and t_train is not None:
            events = self._hybrid_decide(step, now, t_train, self.rollout_side_s(makespan_s))
            out.pool_events, out.pool_decided = events or [], events is not None
        self._log("after_rollout", {"step": step, "now": now, "makespan_s": makespan_s, "t_train": t_train}, out)
        return out

    def apply(self, change: LayoutChange) -> None:
        """The driver runs ``change`` from now on (after draining what it had to)."""
        self.layout, self.plan, self.pool = change.layout, change.plan, change.pool
        self.tp.applied(change.plan.train.tp)
        if change.step:
            self._log("apply", {"step": change.step}, None)

    def progress(self, rid: int, now: float) -> list[PoolEvent]:
        """Hybrid replica ``rid`` finished its current phase (drained, fetched its state)."""
        events = self.pool.progress(rid, now) if self.pool is not None else []
        self._log("progress", {"rid": rid, "now": now}, events)
        return events

    def after_training_step(self, now: float) -> list[PoolEvent]:
        """A training step ended: a replica in its zero-gradient step becomes active, a
        releasing one goes back to rollout."""
        events: list[PoolEvent] = []
        if self.pool is not None:
            for r in self.pool.in_state("zero_grad_sync", "releasing"):
                events += self.pool.progress(r.rid, now)
        self._log("after_training_step", {"now": now}, events)
        return events

    def training_shape(self) -> TrainShape:
        """The current training shape, hybrid replicas in training included."""
        lent = len(self.pool.training_replicas()) if self.pool is not None else 0
        return grown(self.plan.train, lent)

    # ------------------------------------------------------------------ internals
    def _consider(self, step: int, pressure: dict,
                  future: Callable[[], LengthProfile | None] | None) -> LayoutChange | None:
        if not self.window or self.plan is None:
            return None
        observed = length_profile(list(self.window), self.o.global_batch)
        short = self.memory_short(observed)  # checked after every batch: the next may not fit
        change = self._reshard(step, observed, short)  # a re-shard moves no GPU between roles
        if change is not None or not self.o.replan:
            return change
        if short is None and (step - self.last_check < self.min_gap or not self.gate.due(step, pressure)):
            return None  # pressure checks at most every every_steps // 5 steps (each costs a plan search)
        self.last_check = step
        if self.o.clairvoyant:
            lengths = future() if future is not None else None
            if lengths is None:
                return None
        else:
            lengths = observed
        o = self.o
        now_plan = reprice(self.plan, self.model, self.hw, o.gpus_per_node, lengths, self.cal,
                           RLBatch(o.global_batch, math.ceil(lengths.mean_seq_tokens)),  # as best_plan's
                           in_flight=o.max_staleness + 1, length_aware=o.length_aware_routing)
        self.scale = self._measured_scale(now_plan)
        try:
            candidate = self.best_plan(lengths)
        except PlanError as exc:
            log.warning("replan at step %d found no plan: %s", step, exc)
            return None
        if short is not None:  # no gate: the alternative is running out of memory
            self.gate.last_apply = step
            self.considered.append({"step": step, "kind": "replan_check", "trigger": "memory", "apply": True,
                                    "reason": short, "candidate": candidate.plan.describe(),
                                    "candidate_objective_s": candidate.plan.objective})
            return self._change(step, candidate, f"{short}; apply {candidate.plan.describe()}", None)
        if same_plan(candidate.plan, self.plan):
            self.considered.append({"step": step, "kind": "replan_check", "apply": False,
                                    "reason": "the best plan is the current one", "candidate": candidate.plan.describe()})
            return None
        model_s = self.step_objective(now_plan.t_train, now_plan.t_rollout)  # the cost models' own prediction
        now_plan = replace(now_plan, objective=self.pooled_objective(now_plan, self.pool))
        decision = self.gate.consider(step, now_plan.objective, candidate, o.reconfig_s, pressure, current=self.plan,
                                      model_error=dict(self.cal.fit_errors).get("decode", 0.0))
        self.considered.append({"step": step, "kind": "replan_check", "trigger": decision.trigger,
                                "apply": decision.apply, "reason": decision.reason,
                                "current_objective_s": now_plan.objective, "model_step_s": model_s,
                                "scale": [round(x, 4) for x in self.scale], "candidate": candidate.plan.describe(),
                                "candidate_objective_s": candidate.plan.objective})
        if not decision.apply:
            return None
        return self._change(step, candidate, decision.reason, now_plan.objective - candidate.plan.objective)

    def _reshard(self, step: int, lengths: LengthProfile, short: str | None) -> LayoutChange | None:
        """EARL's selector on training: a move to another TP size on the same GPUs, when
        the running one cannot hold the sequences the batch may reach (``short``, with
        ``on_memory: reshard``), or when the measured table says so (two checks in a row
        agreeing). None while hybrid replicas are lent or in transit (their shape is the
        running one's), or when no TP size fits (a re-plan's turn)."""
        if self.pool is not None and len(self.pool.in_state("rollout")) != len(self.pool.all_replicas()):
            return None
        if short is not None and self.o.on_memory != "reshard":
            return None
        if short is None and self.tp_table is None:
            return None
        base = self.plan.train
        if short is None:  # the table's answer first: most checks keep the running size, with nothing to price
            context = context_percentile([s.prompt_len + s.gen_len for s in self.window])
            choice = self.tp_table.choose(context, base.tp, self.o.tp_hysteresis)
            if choice.tp == base.tp:
                self.tp.consider(choice)
                return None
        options = tp_options(self.model, self.hw, base, self.memory_need(lengths), math.ceil(lengths.mean_seq_tokens),
                             self.cal)
        if short is not None:
            choice = choose_by_cost({tp: s for tp, (s, _) in options.items()}, base.tp, self.o.tp_hysteresis)
            trigger = "memory"
        else:
            trigger = "table"
            if choice.tp not in options or options[choice.tp][1] is None:
                self.considered.append({"step": step, "kind": "reshard_check", "trigger": trigger, "apply": False,
                                        "reason": f"{choice.reason}, but TP{choice.tp} cannot run here "
                                                  f"({self.o.gpus_per_node} GPUs per node, {base.gpus} training GPUs)"})
                return None
        if not choice.fits or self.tp.consider(choice, must=short is not None) is None:
            return None
        seconds, shape = options[choice.tp]
        reason = f"{short or choice.reason}; re-shard training TP{base.tp} → TP{choice.tp} (DP{shape.dp}, same GPUs)"
        plan_, layout, pool = self._allocation(resharded(self.plan, shape, seconds), reason, resplit=False)
        if plan_.rollout != self.plan.rollout:
            return None  # the pool would move rollout instances: not a re-shard
        self.considered.append({"step": step, "kind": "reshard_check", "trigger": trigger, "apply": True,
                                "reason": reason, "from_tp": base.tp, "to_tp": choice.tp})
        change = LayoutChange(step, replace(layout, version=self.layout.version + 1), plan_, pool, reason, None,
                              PlanResult(plan_, (), 0, 0.0), reshard=True)
        self._log("reshard", {"step": step, "trigger": trigger}, change)
        return change

    def _hybrid_decide(self, step: int, now: float, t_train: float, t_roll: float) -> list[PoolEvent] | None:
        """Borrow or release a hybrid replica; None (nothing considered) when training is
        the bottleneck but one more replica would not fit its memory. A move that
        :meth:`hybrid_gain` predicts to shorten the step by less than the margin's share of
        it holds (the margin alone would lend a replica whose rollout GPUs are worth more
        than its training, or switch, with the pause that costs, for a sliver). A lend is
        judged by what it did (:meth:`_judge_lend`)."""
        judged = self._judge_lend(step, now, t_train, t_roll)
        if judged is not None:
            return judged
        margin = self.o.hybrid_margin
        direction = self.hybrid_direction(t_train, t_roll)
        if direction == "borrow" and not self._can_grow():
            return None
        if direction == "borrow" and self.lend_held(t_train, t_roll):
            return self.pool.tick(now)  # the balance at which lending made the step slower
        gain = None if direction is None else self.hybrid_gain(direction, t_train, t_roll)
        if gain is not None and gain <= margin * max(t_train, t_roll):  # None: nothing to move (the pool says so)
            return self.pool.tick(now)
        events = self.pool.decide(now, t_train, t_roll, margin)
        lent = [e.replica for e in events if e.changed and e.to_state == "requested"]
        if lent:
            self.lend_trial = {"rid": lent[-1], "step": step, "before_s": max(t_train, t_roll),
                               "ratio": t_train / t_roll if t_roll > 0 else math.inf, "measured": 0}
        return events

    def lend_held(self, t_train: float, t_roll: float) -> bool:
        """True when a lend at this training/rollout balance is held: one at a balance no
        heavier on training made the step slower (:meth:`_judge_lend`)."""
        return self.borrow_floor is not None and t_train <= t_roll * self.borrow_floor

    def _judge_lend(self, step: int, now: float, t_train: float, t_roll: float) -> list[PoolEvent] | None:
        """The cost models price a lent replica as 1/DP faster training and 1/GPUs slower
        rollout. Where the rollout's tail binds (its makespan set by a few long trajectories,
        and streamed training overlapping it), taking GPUs from it can cost far more: the
        pool then lent and released on alternate checks. So a lend is on trial: once the
        replica has trained through two measured rollouts, a step (the slower of training
        and the rollout side) longer than before the lend by more than ``hybrid_margin``
        sends it back, and later borrows need a training/rollout ratio above the one it
        was lent at by that margin. The release (events), or None to decide as usual."""
        trial, pool = self.lend_trial, self.pool
        if trial is None:
            return None
        if all(r.rid != trial["rid"] for r in pool.training_replicas()):
            if all(r.rid != trial["rid"] for r in pool.joining()):
                self.lend_trial = None  # rolled back or released meanwhile: no verdict
            return None
        trial["measured"] += 1
        if trial["measured"] < 2:
            return None
        self.lend_trial = None
        margin, after = self.o.hybrid_margin, max(t_train, t_roll)
        worse = after > trial["before_s"] * (1 + margin)
        reason = (f"replica {trial['rid']} lent at step {trial['step']}: the step's slower side took "
                  f"{after:.3g} s against {trial['before_s']:.3g} s before the lend")
        self.considered.append({"step": step, "kind": "hybrid_trial", "apply": worse, "reason": reason,
                                "replica": trial["rid"], "before_s": trial["before_s"], "after_s": after})
        if not worse:
            return None
        self.borrow_floor = trial["ratio"] * (1 + margin)
        return pool.release(now, f"lending made the step slower ({reason})")

    def hybrid_direction(self, t_train: float, t_roll: float) -> str | None:
        """Which way the pool's gate points: ``borrow`` (training slower than rollout by
        more than ``hybrid_margin``), ``release`` (the reverse) or None."""
        margin = self.o.hybrid_margin
        return "borrow" if t_train > t_roll * (1 + margin) else "release" if t_roll > t_train * (1 + margin) else None

    def hybrid_gain(self, direction: str, t_train: float, t_roll: float) -> float | None:
        """Seconds per step that lending one more replica (``borrow``) or taking one back
        (``release``) is predicted to save: training time scales with 1/DP, rollout time
        with 1/rollout GPUs, the step is the slower of the two. None when there is no
        replica to move that way."""
        pool = self.pool
        if pool is None:
            return None
        dp = self.training_shape().dp
        lent = len(pool.training_replicas())
        rollout = self.plan.rollout_gpus - lent * pool.replica_size
        size = pool.replica_size
        now_s = max(t_train, t_roll)
        if direction == "borrow" and pool.in_state("rollout") and rollout > size:
            return now_s - max(moved_times(t_train, t_roll, dp, rollout, size, 1))
        if direction == "release" and lent and dp > 1:
            return now_s - max(moved_times(t_train, t_roll, dp, rollout, size, -1))
        return None

    def _can_grow(self) -> bool:
        return not TrainingCost(self.model, self.hw, grown(self.training_shape(), 1), self.cal).infeasible

    def _change(self, step: int, result: PlanResult, reason: str, gain_s: float | None,
                searched: bool = True) -> LayoutChange:
        plan_, layout, pool = self._allocation(result.plan, reason, resplit=not searched)
        version = 0 if self.layout is None else self.layout.version + 1
        return LayoutChange(step, replace(layout, version=version), plan_, pool, reason, gain_s, result)

    def _allocation(self, plan_: Plan, reason: str, resplit: bool = True) -> tuple[Plan, Layout, HybridPool | None]:
        """The plan's layout; with the hybrid pool on, its last ``hybrid_nodes`` nodes form
        the pool when they hold rollout instances only and split into whole replicas.

        The pool's rule: no rollout instance on a hybrid node may span more than one
        training replica (lending a replica must stop no other instance). The replica's
        slots on a node come in Megatron order (TP chunks, interleaved over PP and DP), so a
        plan whose hybrid-node instances are wider than a replica's chunk cannot form it
        (TP2 PP1 DP10 or TP1 DP20 fail with TP4 rollout on the node). When that happens and
        the plan predicts that training may become the bottleneck (``t_train × (1 +
        hybrid_margin) >= t_rollout / k``, when the pool lends replicas), the hybrid node's
        instances are re-split into the largest smaller TP size that forms the pool
        (:func:`resplit_hybrid`): narrower instances decode slower, a price worth paying
        only for a pool that may be used. Otherwise, or when no split forms it, the plan
        runs without a pool (logged). ``resplit`` False: the plan comes from
        :meth:`best_plan`, which weighed the re-split already (:meth:`_with_pool`)."""
        o = self.o
        layout = plan_to_layout(plan_, o.nodes, o.gpus_per_node, 0, reason=reason)
        pool = None
        if o.hybrid and o.hybrid_nodes:
            first = None
            useful = resplit and plan_.t_train * (1 + o.hybrid_margin) >= self.rollout_side_s(plan_.t_rollout)
            splits = sorted((t for t in o.rollout_tps if t < o.gpus_per_node), reverse=True) if useful else []
            for tp in [None, *splits]:
                candidate = plan_ if tp is None else resplit_hybrid(plan_, tp, o.nodes - o.hybrid_nodes)
                if candidate is None:
                    continue
                try:
                    hl = plan_to_layout(candidate, o.nodes, o.gpus_per_node, o.hybrid_nodes, reason=reason)
                    pool = HybridPool.from_layout(hl, min_rollout_gpus=o.min_rollout_gpus, timeouts=o.hybrid_timeouts)
                except (LayoutError, HybridPoolError) as exc:
                    first = first or str(exc)
                    continue
                if tp is not None:
                    log.info("plan %s: hybrid-node rollout re-split to TP%d so the hybrid pool forms (%s)",
                             plan_.describe(), tp, first)
                plan_, layout = candidate, hl
                break
            if pool is None:
                log.info("plan %s runs without a hybrid pool: %s%s", plan_.describe(), first,
                         "" if useful else " (not re-split: the plan predicts training will not be the bottleneck)" if resplit
                         else " (the plan search weighed the re-split: not worth it)")
        return plan_, layout, pool

    def _log(self, call: str, given: dict, out: Any) -> None:
        if self.journal is not None:
            self.journal.append({"call": call, "in": given, "out": journal_form(out)})


def resplit_hybrid(plan_: Plan, tp: int, first_hybrid_node: int) -> Plan | None:
    """``plan_`` with every rollout instance wider than ``tp`` on nodes from
    ``first_hybrid_node`` on cut into instances of ``tp`` GPUs (slots in order); None when
    no instance there is wider (nothing would change)."""
    out, changed = [], False
    for inst in plan_.rollout:
        if inst.tp > tp and inst.slots[0].node >= first_hybrid_node:
            out.extend(PlanInstance(tp, inst.slots[i:i + tp]) for i in range(0, inst.tp, tp))
            changed = True
        else:
            out.append(inst)
    return replace(plan_, rollout=tuple(out)) if changed else None


def journal_form(out: Any) -> Any:
    """A decision as plain data (what the golden test compares)."""
    if out is None:
        return None
    if isinstance(out, LayoutChange):
        return {"step": out.step, "layout": out.layout.summary(), "plan": out.plan.describe(),
                "t_train": out.plan.t_train, "t_rollout": out.plan.t_rollout, "objective": out.plan.objective,
                "reason": out.reason, "gain_s": out.gain_s,
                "pool": None if out.pool is None else [[str(s) for s in r.slots] for r in out.pool.all_replicas()]}
    if isinstance(out, AfterRollout):
        return {"change": journal_form(out.change), "pool_events": journal_form(out.pool_events),
                "pool_decided": out.pool_decided}
    if isinstance(out, list):
        return [e.to_dict() for e in out]
    raise TypeError(f"no journal form for {type(out).__name__}")
