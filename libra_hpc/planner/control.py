"""Libra's control loop: the one decision-maker that the job and the simulator drive.

It takes observations and returns decisions; it never measures, waits or moves anything
itself (pure: no MPI, no torch, no clock):

| call | observation in | decision out |
|---|---|---|
| :meth:`ControlLoop.initial` | nothing (the length prior) or known lengths | the first :class:`LayoutChange` |
| :meth:`ControlLoop.start` | a pinned plan | the first :class:`LayoutChange` (its hybrid pool formed as for a planned one) |
| :meth:`ControlLoop.observe` | length samples of finished trajectories | (the window the next plans are made on) |
| :meth:`ControlLoop.after_rollout` | a batch's rollout makespan and the last training step time | a new layout (plan search → gate → reprice of the current plan → same-plan check), else hybrid-pool transitions |
| :meth:`ControlLoop.while_waiting` | a batch done while a change waits to be applied | nothing, or the change to wait for instead when the running training shape no longer holds the next batch (made for memory) |
| :meth:`ControlLoop.apply` | the driver applied a change (rollout drained, groups rebuilt) | (the current layout and pool) |
| :meth:`ControlLoop.progress` / :meth:`ControlLoop.after_training_step` | a hybrid replica finished a phase / a training step ended | pool transitions |

The current allocation is a :class:`~libra_hpc.cluster.layout.Layout` (who trains, which
rollout instances exist, which slots form the hybrid pool), with the plan it came from
(the predicted step times) and its :class:`~libra_hpc.planner.hybrid.HybridPool`.

The loop orchestrates what its parts decide: plan valuation (``planner/valuation.py``), a
plan's layout and pool (``allocation.py``), the pool's lending and lend trial
(``lending.py``), re-shards and memory checks (``reshard.py``), the replanning gate
(``gate.py``). :meth:`ControlLoop.state_dict` is its whole decision state as plain data.

With :attr:`ControlLoop.journal` set to a list, every call is recorded there (inputs and
decisions as plain data), so that a recorded stream of observations can be replayed into
a fresh loop: the same inputs give the same decisions, whoever drives it
(tests/test_control_golden.py).
"""

from __future__ import annotations

import logging
import statistics
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from libra_hpc.cluster.layout import Layout
from libra_hpc.planner import loop_state as S
from libra_hpc.planner.allocation import allocate
from libra_hpc.planner.allocation import resplit_hybrid as resplit_hybrid
from libra_hpc.planner.calibration import Calibration
from libra_hpc.planner.costs import LengthProfile, LengthSample, TrainingCost, TrainShape
from libra_hpc.planner.decisions import AfterRollout as AfterRollout
from libra_hpc.planner.decisions import LayoutChange as LayoutChange
from libra_hpc.planner.decisions import journal_form as journal_form
from libra_hpc.planner.gate import GateOptions, ReplanGate
from libra_hpc.planner.hybrid import HybridPool
from libra_hpc.planner.hybrid import PoolEvent as PoolEvent
from libra_hpc.planner.lending import HybridLending
from libra_hpc.planner.options import ControlOptions as ControlOptions
from libra_hpc.planner.options import feasible_tps as feasible_tps
from libra_hpc.planner.options import profiles as profiles
from libra_hpc.planner.pipeline import moved_times as moved_times
from libra_hpc.planner.pipeline import pipelined_step_s as pipelined_step_s
from libra_hpc.planner.pipeline import rollout_side_s, switch_drain_s
from libra_hpc.planner.profiles import HardwareProfile, ModelProfile
from libra_hpc.planner.reshard import TrainingResharder, memory_need, memory_short, resharded
from libra_hpc.planner.search import Plan, PlanError, PlannerOptions, PlanResult, RLBatch, reprice
from libra_hpc.planner.valuation import PlanValuation, measured_scale
from libra_hpc.planner.valuation import grown as grown
from libra_hpc.planner.valuation import length_profile as length_profile
from libra_hpc.planner.valuation import same_plan as same_plan

log = logging.getLogger(__name__)
STATE_FORMAT = 1
"""Version of :meth:`ControlLoop.state_dict`'s layout."""


class ControlLoop:
    """Libra's decisions for one run (see the module docstring)."""

    def __init__(self, model: ModelProfile, hw: HardwareProfile, options: ControlOptions,
                 calibration: Calibration | None = None):
        if not options.rollout_tps:
            raise PlanError(f"no rollout TP size fits {model.name} on {hw.name}")
        self.model, self.hw, self.o = model, hw, options
        self.cal = calibration or Calibration()
        self.window: deque[LengthSample] = deque(maxlen=options.window)
        self.gate = ReplanGate(GateOptions(every_steps=1, margin_s=0.0, confirm_checks=1, min_dwell_steps=0,
                                           horizon_steps=options.gate.every_steps)
                               if options.clairvoyant else options.gate)
        self.lending = HybridLending(options.hybrid_margin)
        """The hybrid pool's gate and the lend on trial."""
        self.resharder = TrainingResharder(model, hw, gpus_per_node=options.gpus_per_node, on_memory=options.on_memory,
                                           hysteresis=options.tp_hysteresis, confirm=options.tp_confirm,
                                           table=options.tp_table)
        self.scale = (1.0, 1.0)
        """Measured over predicted training and rollout time of the running plan at the
        last check (``PlanValuation.pooled_objective`` weighs a hybrid replica's move with it)."""
        self.scale_mean: float | None = None
        """The observed mean sequence tokens at the last check (:meth:`_rescale`)."""
        self.latest_mean: float | None = None
        """Mean sequence tokens of the last batch observed: what the memory check and new
        plans hold ``memory_headroom`` × at least, while the window (``planner.window``
        trajectories) still holds shorter batches before it (:meth:`observe`)."""
        self.search: PlannerOptions | None = None
        tps = (self.valuation().best_single_tp(self.prior()),) if options.single_tp else options.rollout_tps
        self.search = PlannerOptions(rollout_tps=tps, min_rollout_gpus=options.min_rollout_gpus,
                                     refine_top=options.refine_top, in_flight=options.max_staleness + 1,
                                     length_aware=options.length_aware_routing, migration=options.migration)
        self.min_gap = 1 if options.clairvoyant else max(1, self.gate.opt.every_steps // 5)
        self.last_check = -(10 ** 9)
        self.layout: Layout | None = None
        self.plan: Plan | None = None
        self.pool: HybridPool | None = None
        self.considered: list[dict] = []
        """Plans looked at and why each was (not) applied, for events.jsonl and reports."""
        self.measured: tuple[float, float | None] | None = None
        """The last batch's measured rollout makespan and training step (after_rollout)."""
        self.journal: list[dict] | None = None
        """Set to a list to record every call (inputs and decisions as plain data); off by
        default, since the samples of a long run add up."""

    @classmethod
    def from_config(cls, cfg: Any, *, rollout_tps: Sequence[int] | None = None,
                    calibration: Calibration | None = None, **setup: Any) -> ControlLoop:
        """The loop an experiment config (or a simulator scenario) gives: the profiles it
        names (:func:`profiles`), ``calibration`` (default: the cost models' defaults), the
        rollout TP sizes of ``rollout_tps`` (default: ``scheduler.bucket_token_limits``'
        sizes) that hold the model (:func:`feasible_tps`), and the options
        :meth:`ControlOptions.from_config` makes of the config and ``setup``."""
        model, hw = profiles(cfg)
        cal = Calibration() if calibration is None else calibration
        candidates = list(cfg.scheduler.bucket_token_limits) if rollout_tps is None else rollout_tps
        options = ControlOptions.from_config(cfg, feasible_tps(model, hw, candidates, cal), **setup)
        return cls(model, hw, options, cal)

    # ------------------------------------------------------------------ valuation
    def valuation(self) -> PlanValuation:
        """How plans are valued now (the current calibration, scale and lend trial)."""
        return PlanValuation(self.model, self.hw, self.o, self.cal, self.search, self.scale, self.lending.held,
                             self.latest_mean)

    def prior(self) -> LengthProfile:
        """The lengths assumed before any is observed (``ControlOptions.prior_profile``)."""
        return self.o.prior_profile()

    def prior_turns(self) -> list[tuple[int, ...]]:
        """Per-turn generated tokens of the prior (each trajectory cut into ``prior.turns``
        equal turns): what the first bucket limits are placed on."""
        prior, n = self.prior(), max(1, self.o.prior.turns)
        return [(max(1, round(g / n)),) * n for g, c in zip(prior.gen, prior.count) for _ in range(c)]

    def best_plan(self, lengths: LengthProfile, options: PlannerOptions | None = None) -> PlanResult:
        """:meth:`PlanValuation.best_plan <libra_hpc.planner.valuation.PlanValuation.best_plan>` now."""
        return self.valuation().best_plan(lengths, options)

    def pressure(self, makespan_s: float, t_train: float | None) -> dict:
        """The gate's pressure signal: rollout time weighed against training (the makespan
        over k; training is the bottleneck iff T_train > M / k)."""
        return {"rollout_train_ratio": self.rollout_side_s(makespan_s) / t_train} if t_train else {}

    def rollout_side_s(self, makespan_s: float) -> float:
        """:func:`~libra_hpc.planner.pipeline.rollout_side_s` at this run's staleness."""
        return rollout_side_s(makespan_s, self.o.max_staleness, self.o.stream_groups, self.cal.stream_tail_s)

    # ------------------------------------------------------------------ the hybrid pool's gate
    def hybrid_gain(self, direction: str, t_train: float, makespan_s: float) -> float | None:
        """Seconds per step that lending more hybrid replicas (``borrow``) or taking some
        back (``release``) is predicted to save, at the measured training step ``t_train``
        and rollout makespan ``makespan_s``: the pipelined step now less the step after the
        move (:meth:`PlanValuation.lent_times`: training at 1/DP, the rollout's makespan by
        the cost model on the window's lengths), the best over how many replicas move (a
        first lend that costs rollout more than it gives training may lead to a second that
        pays; the pool lends one at a time). None when no replica can move that way."""
        pool = self.pool
        if pool is None:
            return None
        lent = len(pool.training_replicas())
        valuation = self.valuation()
        if direction == "borrow":
            afters = [k for k in valuation.lendable(self.plan, pool) if k > lent] if pool.in_state("rollout") else []
        else:
            afters = list(range(lent))
        if not afters:
            return None
        lengths = length_profile(list(self.window), self.o.global_batch) if self.window else None
        now_s = valuation.step_objective(t_train, makespan_s)
        return max(now_s - valuation.step_objective(*valuation.lent_times(self.plan, pool, t_train, makespan_s,
                                                                          lent, k, lengths))
                   for k in afters)

    def hybrid_move(self, t_train: float, makespan_s: float) -> tuple[str | None, float | None]:
        """The move of the pool predicted to save the most and its gain (:meth:`hybrid_gain`),
        among those the pool's gate weighs (``HybridLending.moves``: the lend trial, its
        floor and training's memory as in :meth:`after_rollout`), before the margin; (None,
        None) when no move is predicted to save anything."""
        if self.pool is None:
            return None, None
        moves = self.lending.moves(t_train, self.rollout_side_s(makespan_s),
                                   lambda d: self.hybrid_gain(d, t_train, makespan_s), self._can_grow)
        moves = {d: g for d, g in moves.items() if g > 0}
        if not moves:
            return None, None
        best = max(moves, key=lambda d: moves[d])
        return best, moves[best]

    def lend_held(self, t_train: float, t_roll: float) -> bool:
        """True when a lend at this training/rollout balance is held: one at a balance no
        heavier on training made the step slower (the lend trial)."""
        return self.lending.held(t_train, t_roll)

    @property
    def lend_trial(self) -> dict | None:
        """The replica lent to training on trial (``HybridLending.trial``), or None."""
        return self.lending.trial

    @property
    def borrow_floor(self) -> float | None:
        """The ratio a borrow must exceed after a lend made the step slower (``HybridLending.floor``)."""
        return self.lending.floor

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
        """Finished trajectories (prompt + tool-output tokens, generated tokens, turns, tool s):
        a batch's (the simulator and the job give one batch per call)."""
        self.window.extend(samples)
        if samples:  # LengthProfile.mean_seq_tokens of the batch, without building its profile
            self.latest_mean = statistics.fmean(s.prompt_len + s.gen_len for s in samples)
        self._log("observe", {"samples": [tuple(s) for s in samples]}, None)

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

    def while_waiting(self, step: int, change: LayoutChange) -> LayoutChange | None:
        """Batch ``step`` is done while ``change`` waits for its moment (the pending-change
        rule, ``planner/window.py``): does the running training shape still hold what the
        window says the next batches may reach? None: it does, wait on. Else the change to
        wait for instead, one made for memory (the batches that wait are trained on it):
        ``change`` itself when its shape holds them, else the memory change the loop makes
        now (a re-shard, or a replan past the gate)."""
        observed = length_profile(list(self.window), self.o.global_batch) if self.window else None
        short = self._short(self.training_shape(), observed)
        out = None
        if short is not None:
            if self._short(change.plan.train, observed) is None:
                out = replace(change, reason=f"{short}; the waiting change holds them: {change.reason}")
                self.considered.append({"step": step, "kind": "replan_check", "trigger": "memory", "apply": True,
                                        "reason": out.reason, "candidate": change.plan.describe()})
            else:
                out = self._consider(step, {}, None) or replace(change, reason=f"{short}; {change.reason}")
        self._log("while_waiting", {"step": step, "waiting": change.step}, out)
        return out

    def apply(self, change: LayoutChange) -> None:
        """The driver runs ``change`` from now on (after draining what it had to)."""
        self.layout, self.plan, self.pool = change.layout, change.plan, change.pool
        self.resharder.applied(change.plan.train.tp)
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

    def drain_s(self) -> float:
        """What draining the pipeline for a layout change costs at the last measured times
        (:func:`~libra_hpc.planner.pipeline.switch_drain_s`; 0 before a training step is
        measured): the gate weighs a change's gain against it and ``reconfig_s``."""
        if not self.o.price_drain or self.measured is None or self.measured[1] is None:
            return 0.0
        makespan, t_train = self.measured
        return switch_drain_s(t_train, makespan, self.o.max_staleness, self.o.stream_groups, self.cal.stream_tail_s)

    # ------------------------------------------------------------------ internals
    def _consider(self, step: int, pressure: dict,
                  future: Callable[[], LengthProfile | None] | None) -> LayoutChange | None:
        if not self.window or self.plan is None:
            return None
        o = self.o
        observed = length_profile(list(self.window), o.global_batch)
        short = self._short(self.training_shape(), observed)  # checked after every batch: the next may not fit
        change = self._reshard(step, observed, short)  # a re-shard moves no GPU between roles
        if change is not None or not self.o.replan:
            return change
        # pressure checks at most every every_steps // 5 steps (each costs a plan search); with
        # planner.confirm_next_step a winning candidate's confirmation comes at the next step
        # (at most one extra search per winning candidate)
        gap = 1 if self.gate.confirming(step) else self.min_gap
        if short is None and (step - self.last_check < gap or not self.gate.due(step, pressure)):
            return None
        self.last_check = step
        if self.o.clairvoyant:
            lengths = future() if future is not None else None
            if lengths is None:
                return None
        else:
            lengths = observed
        now_plan = reprice(self.plan, self.model, self.hw, o.gpus_per_node, lengths, self.cal,
                           RLBatch.of(o.global_batch, lengths),  # as best_plan's
                           in_flight=o.max_staleness + 1, length_aware=o.length_aware_routing,
                           migration=o.migration, stream_groups=o.stream_groups)
        lent = len(self.pool.training_replicas()) if self.pool is not None else 0
        self._rescale(lengths, now_plan, lent)
        try:
            candidate = self.best_plan(lengths)
        except PlanError as exc:
            log.warning("replan at step %d found no plan: %s", step, exc)
            return None
        if short is not None:  # no gate: the alternative is running out of memory
            self.gate.last_apply, self.gate.moved = step, None
            self.considered.append({"step": step, "kind": "replan_check", "trigger": "memory", "apply": True,
                                    "reason": short, "candidate": candidate.plan.describe(),
                                    "candidate_objective_s": candidate.plan.objective})
            return self._change(step, candidate, f"{short}; apply {candidate.plan.describe()}", None)
        if same_plan(candidate.plan, self.plan):
            self.considered.append({"step": step, "kind": "replan_check", "apply": False,
                                    "reason": "the best plan is the current one", "candidate": candidate.plan.describe()})
            return None
        valuation = self.valuation()
        model_s = valuation.step_objective(now_plan.t_train, now_plan.t_rollout)  # the cost models' own prediction
        now_plan = replace(now_plan, objective=valuation.pooled_objective(now_plan, self.pool, lengths))
        decision = self.gate.consider(step, now_plan.objective, candidate, o.reconfig_s + self.drain_s(), pressure,
                                      current=self.plan, model_error=model_error(self.cal))
        self.considered.append({"step": step, "kind": "replan_check", "trigger": decision.trigger,
                                "apply": decision.apply, "reason": decision.reason,
                                "current_objective_s": now_plan.objective, "model_step_s": model_s,
                                "scale": [round(x, 4) for x in self.scale], "candidate": candidate.plan.describe(),
                                "candidate_objective_s": candidate.plan.objective})
        if not decision.apply:
            return None
        return self._change(step, candidate, decision.reason, now_plan.objective - candidate.plan.objective)

    def _rescale(self, lengths: LengthProfile, now_plan: Plan, lent: int) -> None:
        """Measure :attr:`scale` again, unless the lengths shifted since the last check by
        more than ``scale_shift`` (mean sequence tokens): the times measured then belong
        to batches of the old lengths while the prediction they are set against is made on
        the new ones, so the ratio says more about the shift than about the cost models
        (context-drift-tp: a training scale of 2.8 at a regime change that kept the old
        split 3 steps longer). Across a shift the scale goes back to (1, 1), the cost
        models' own prediction, until a steady check measures it again: the last steady
        scale was measured on the old regime (context-drift-tp: a rollout scale of 0.57,
        kept across the second regime change, valued the running plan's step at 716 s
        where the cost models said 1248 and the next steps took 3-4 thousand, and the
        change waited a check: 5992 tokens/s against 6134)."""
        mean, last = lengths.mean_seq_tokens, self.scale_mean
        self.scale_mean = mean
        if self.o.scale_shift is not None and last and abs(mean / last - 1) > self.o.scale_shift:
            self.scale = (1.0, 1.0)
            return
        self.scale = measured_scale(self.measured, now_plan, lent, self.pool.replica_size if lent else 0)

    def _short(self, shape: TrainShape, observed: LengthProfile | None) -> str | None:
        """Why training ``shape`` cannot run the sequences the window's profile ``observed``
        says the next batch may reach (:func:`~libra_hpc.planner.reshard.memory_short`), None
        when it can (or nothing was observed)."""
        if observed is None:
            return None
        o = self.o
        return memory_short(self.model, self.hw, shape, observed, o.seq_len, o.memory_headroom, self.cal,
                            self.latest_mean)

    def _reshard(self, step: int, lengths: LengthProfile, short: str | None) -> LayoutChange | None:
        """The re-shard ``TrainingResharder`` proposes, as a change that keeps every rollout
        instance. None while hybrid replicas are lent or in transit (theirs is the running shape)."""
        if self.pool is not None and len(self.pool.in_state("rollout")) != len(self.pool.all_replicas()):
            return None
        need = memory_need(lengths, self.o.seq_len, self.o.memory_headroom, self.latest_mean)
        proposal, note = self.resharder.propose(step, self.plan.train, lengths, need, short, self.window, self.cal)
        if note is not None:
            self.considered.append(note)
        if proposal is None:
            return None
        base = self.plan.train
        plan_, layout, pool = self._allocation(resharded(self.plan, proposal.shape, proposal.seconds), proposal.reason,
                                               resplit=False)
        if plan_.rollout != self.plan.rollout:
            return None  # the pool would move rollout instances: not a re-shard
        self.considered.append({"step": step, "kind": "reshard_check", "trigger": proposal.trigger, "apply": True,
                                "reason": proposal.reason, "from_tp": base.tp, "to_tp": proposal.shape.tp})
        change = LayoutChange(step, replace(layout, version=self.layout.version + 1), plan_, pool, proposal.reason,
                              None, PlanResult(plan_, (), 0, 0.0), reshard=True)
        self._log("reshard", {"step": step, "trigger": proposal.trigger}, change)
        return change

    def _hybrid_decide(self, step: int, now: float, t_train: float, t_roll: float) -> list[PoolEvent] | None:
        """The pool's transitions (``HybridLending.decide``); None when nothing was considered."""
        makespan = self.measured[0]
        events, notes = self.lending.decide(
            self.pool, step, now, t_train, t_roll, gain=lambda direction: self.hybrid_gain(direction, t_train, makespan),
            can_grow=self._can_grow)
        self.considered.extend(notes)
        return events

    def _can_grow(self) -> bool:
        """One more hybrid replica fits training's memory."""
        return not TrainingCost(self.model, self.hw, grown(self.training_shape(), 1), self.cal).infeasible

    def _change(self, step: int, result: PlanResult, reason: str, gain_s: float | None,
                searched: bool = True) -> LayoutChange:
        plan_, layout, pool = self._allocation(result.plan, reason, resplit=not searched)
        version = 0 if self.layout is None else self.layout.version + 1
        return LayoutChange(step, replace(layout, version=version), plan_, pool, reason, gain_s, result)

    def _allocation(self, plan_: Plan, reason: str, resplit: bool = True) -> tuple[Plan, Layout, HybridPool | None]:
        """The plan's layout and hybrid pool (:func:`~libra_hpc.planner.allocation.allocate`)."""
        return allocate(plan_, self.o, reason, resplit, self.cal.stream_tail_s)

    def _log(self, call: str, given: dict, out: Any) -> None:
        if self.journal is not None:
            self.journal.append({"call": call, "in": given, "out": journal_form(out)})

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """The loop's whole decision state as plain data (``json.dumps`` writes it; a JSON
        round trip leaves it equal): what a fresh loop built from the same config needs,
        through :meth:`load_state_dict`, to decide as this one would. The options are the
        config's, not state; the journal is a recording, left out."""
        return {
            "format": STATE_FORMAT,
            "cluster": [self.o.nodes, self.o.gpus_per_node],
            "calibration": S.calibration_state(self.cal),
            "window": S.samples_state(self.window),
            "layout": S.layout_state(self.layout),
            "plan": S.plan_state(self.plan),
            "pool": S.pool_state(self.pool),
            "search_rollout_tps": list(self.search.rollout_tps),
            "gate": S.gate_state(self.gate),
            "last_check": self.last_check,
            "measured": S.plain(self.measured),
            "scale": list(self.scale),
            "scale_mean": self.scale_mean,
            "latest_mean": self.latest_mean,
            "training_tp": self.resharder.state_dict(),
            "lending": self.lending.state_dict(),
            "considered": S.plain(self.considered),
        }

    def load_state_dict(self, state: dict) -> None:
        """Take on the decision state :meth:`state_dict` saved (possibly through JSON) from a
        loop built from the same config."""
        if state.get("format") != STATE_FORMAT:
            raise ValueError(f"control loop state: format {state.get('format')!r}, this loop reads {STATE_FORMAT}")
        if list(state["cluster"]) != [self.o.nodes, self.o.gpus_per_node]:
            raise ValueError(f"control loop state: saved for {state['cluster'][0]} nodes × {state['cluster'][1]} "
                             f"GPUs, this loop plans {self.o.nodes} × {self.o.gpus_per_node}")
        self.cal = S.calibration_from(state["calibration"])
        self.window.clear()
        self.window.extend(S.samples_from(state["window"]))
        self.layout, self.plan = S.layout_from(state["layout"]), S.plan_from(state["plan"])
        self.pool = S.pool_from(state["pool"])
        self.search = replace(self.search, rollout_tps=tuple(state["search_rollout_tps"]))
        S.load_gate(self.gate, state["gate"])
        self.last_check = state["last_check"]
        self.measured = None if state["measured"] is None else tuple(state["measured"])
        self.scale = tuple(state["scale"])
        self.scale_mean = state.get("scale_mean")  # absent from a checkpoint older than it
        self.latest_mean = state.get("latest_mean")  # as scale_mean
        self.resharder.load_state_dict(state["training_tp"])
        self.lending.load_state_dict(state["lending"])
        self.considered = S.plain(state["considered"])


def model_error(cal: Calibration) -> float:
    """How far this run's fitted cost models are from what it measured: the largest
    relative RMS error of the kinds its calibration was fitted on (the engines' decode
    steps, the trajectories' chains, the training passes; 0 on a calibration given, not
    fitted). The gate does not act on a predicted gain below it. The job fits chains and
    training, not decode steps: reading the decode error alone, its gate saw no error at all
    and applied a re-plan predicted to save 4.3 s a step (a 36% gain, where the chain fit
    was off by 40-80%) that made the steps 7 times longer on 2 shared cores. The streamed
    steps' tails are left out: a few seconds of a step (the slowest DP replica's last
    seconds, 33% off in a default run), their relative error is not the step's."""
    return max((err for kind, err in cal.fit_errors if kind != "tail"), default=0.0)
