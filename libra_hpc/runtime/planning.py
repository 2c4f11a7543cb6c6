"""The planner, live: the controller feeds Libra's control loop (:mod:`libra_hpc.planner.control`,
the decision code the simulator drives too) what the job measures, and turns what it
decides into layout changes for :class:`~.relayout.Relayouts` (:class:`PlannerDriver`).

What the loop is given after each RL step ``b``:

- the lengths of batch ``b``'s trajectories (``observe``: prompt and tool-output tokens,
  generated tokens, turns, tool seconds);
- timing records for the cost models' calibration, refitted every step
  (``fit_calibration``), each tagged with the step whose work it measured: the training
  step per optimizer pass against the training cost model's components for the shape
  that ran; each trajectory's wall time from its batch's submission to its report
  against its chain's parts (decode steps at its instance's running batch, prefill, tool
  seconds, turns). The rollout side is fitted on trajectories, not on the engines' busy
  seconds: a trajectory waits for its engine's steps, the leader's loop between them,
  the queue and the tools, and only its wall time says what a makespan is made of (an
  engine's busy seconds per step, fitted alone, put a CPU engine's fixed per-step cost
  into the memory bandwidth efficiency, bandwidth_eff 0.7 -> 0.058, and left the rest of
  the wall time out: steps predicted at ~1 s against 10-20 s measured). The fit after
  step ``b`` takes the records of steps ``<= b`` only, so step ``b + 1`` is predicted
  (:meth:`PlannerDriver.predict`) by a calibration that never saw it;
- the rollout makespan and the training step time (``after_rollout``): their means over
  the window of :class:`~libra_hpc.planner.window.StepWindow` (the steps measured on the
  current layout; batches that overlapped a switch are left out), once it is settled.

What it decides, and how it is carried out:

- a hybrid-pool transition: **borrow** (the replica's instances leave rollout, then it joins
  training at a step boundary; its first step is the zero-gradient one), **release** (it
  leaves training once nothing untrained is routed to it, and serves rollout again);
- a **replan** (the plan search on the observed lengths and the fitted calibration beat
  the current plan by the gate's margin) or a **re-shard** (EARL's selector: training to
  another TP size on the same GPUs): the change waits (:class:`~libra_hpc.planner.window.PendingChange`:
  no new batch is submitted; once every batch in flight is trained) and is then carried
  out by a relayout; the held batches go in after it.

Every decision is an event: ``plan_considered`` (each check, with the current and the
candidate plan's predicted step and why it was kept or applied), ``hybrid`` (each pool
transition), ``replan`` / ``tp_reshard``, ``layout_applied`` (the pause and the predicted
gain), ``hybrid_gain`` (the gain measured three steps later; ``layout_gains`` in
``summary.json``). Every step, ``planner_prediction``: the step time the planner predicts
for the layout that ran it, per term (rollout makespan, training), against what the step
measured (the step's metrics row carries ``planner_predicted_s`` and ``measured_step_s``).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

from libra_hpc.config_learning import epochs_at
from libra_hpc.planner import loop_state as S
from libra_hpc.planner.control import ControlLoop
from libra_hpc.planner.costs import (LengthProfile, LengthSample, RolloutCost, TimingRecord, TrainingCost, TrainShape,
                                     fit_calibration)
from libra_hpc.planner.hybrid import PhaseTimeouts
from libra_hpc.planner.options import migration_pricing
from libra_hpc.planner.pipeline import pipelined_step_s, streamed_tail_s
from libra_hpc.planner.search import Plan, RLBatch, reprice
from libra_hpc.planner.search import RolloutInstance as PlanInstance
from libra_hpc.planner.window import PendingChange, StepWindow, layout_gain, moves_training
from libra_hpc.rl.grpo import compute_advantages
from libra_hpc.runtime.episodes import group_of
from libra_hpc.runtime.relayout import Applied, Relayouts
from libra_hpc.runtime.state import JobState, Sends

log = logging.getLogger(__name__)
RECORDS = {"train": 64, "tail": 64, "chain": 1024}
"""Timing records of each kind the calibration is fitted on (the most recent)."""
FIT_HALF_LIFE = 1.0
"""Steps over which a timing record's weight in the calibration fit halves. What a step
costs moves during a job: the layout changes, fewer GRPO groups train, more epochs, and on
a shared host whatever else runs beside it. Replayed on a default run's own records
(issue 30), all records weighing the same predicted its rollouts 0.77x and its steps 1.8x;
half-lives of 0.5-3 steps gave rollouts 0.83-0.99x, and 1 the steps' mean closest to 1."""
JOB_TIMEOUTS = PhaseTimeouts(requested=600, fetching_state=900, zero_grad_sync=900, releasing=900)
"""The hybrid pool's phase timeouts in the job: a drain on CPU takes tens of seconds."""


def resumed_layout(state: dict | None, config_layout: Any) -> tuple[Any, Any, dict]:
    """The layout a job resumed from a checkpoint's ``state`` starts in (the one in force
    when it was saved: a replan's, a re-shard's, a hybrid replica lent), the layout its
    lent replicas return to, and its rollout instance ids (slots → id, the lent replica's
    too); the config's layout without one."""
    saved = (state or {}).get("planner")
    if saved is None:
        return config_layout, config_layout, {g.slots: g.gid for g in config_layout.rollout_instances}
    return (S.layout_from(saved["layout"]), S.layout_from(saved["initial"]),
            {S.slots_from(slots): gid for slots, gid in saved["ids"]})


def config_plan(layout: Any, cfg: Any) -> Plan:
    """The plan of the config's layout (training shape, rollout instances in layout order);
    its times are priced when the loop starts on it."""
    t = layout.training
    shape = TrainShape(t.tp, t.pp, t.dp, cfg.training.micro_batch_size, cfg.batch_size, cfg.training.seq_len)
    rollout = tuple(PlanInstance(g.tp, g.slots) for g in layout.rollout_instances)
    return Plan(shape, t.slots, rollout, 0.0, 0.0, 0.0, "async")


class PlannerDriver:
    def __init__(self, state: JobState, relayout: Relayouts):
        self.s, self.relayout = state, relayout
        cfg = state.cfg
        tps = sorted({g.tp for g in state.layout.rollout_instances} | set(cfg.scheduler.bucket_token_limits))
        self.control = ControlLoop.from_config(cfg, rollout_tps=tps, reconfig_s=cfg.planner.reconfig_s,
                                               hybrid_timeouts=JOB_TIMEOUTS, replan=cfg.planner.replan,
                                               # the job's router uses the fixed limits
                                               migration=migration_pricing(cfg, cfg.scheduler.policy, share=False))
        self.model, self.hw, self.base, options = self.control.model, self.control.hw, self.control.cal, self.control.o
        plan = config_plan(state.layout, cfg)
        prior = self.control.prior()
        plan = reprice(plan, self.model, self.hw, cfg.cluster.gpus_per_node, prior, self.base,
                       RLBatch(cfg.batch_size, int(prior.mean_seq_tokens)), in_flight=cfg.rl.max_staleness + 1,
                       length_aware=options.length_aware_routing, migration=options.migration)
        self.control.start(plan, "the config's layout")
        self.window = StepWindow(cfg.rl.max_staleness, cfg.rl.steps)
        self.records: dict[str, list[TimingRecord]] = {kind: [] for kind in RECORDS}
        self.running: dict[int, list[int]] = {}
        self.pending: PendingChange | None = None
        self.replans = self.reshards = self.hybrid_applied = 0
        self.pauses: list[dict] = []
        self.layout_gains: list[dict] = []
        self.zero_grad_at: int | None = None
        self.t0 = time.monotonic()
        self._map_pool()

    def now(self) -> float:
        return time.monotonic() - self.t0

    @property
    def pool(self):
        return self.control.pool

    def _map_pool(self) -> None:
        """Hybrid replica → the rollout instances on its slots (in the current layout)."""
        s, pool = self.s, self.control.pool
        self.instances = {} if pool is None else {
            r.rid: [s.ids[g.slots] for g in s.layout.rollout_instances if g.hybrid and set(g.slots) <= set(r.slots)]
            for r in pool.all_replicas()}

    def pool_instances(self) -> set[int]:
        return {i for insts in self.instances.values() for i in insts}

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict:
        """What decides, for the job's checkpoint (plain data): the control loop's state
        (calibration, length window, gate, hybrid pool, lend trial, TP selector), the timing
        records the calibration is refitted on, the step window the gate weighs, the pool's
        clock, the layout in force and its instance ids, the summary's counters."""
        return {"control": self.control.state_dict(), "now": self.now(), "layout": S.layout_state(self.s.layout),
                "initial": S.layout_state(self.s.initial),
                "ids": [[S.slots_state(slots), gid] for slots, gid in self.s.ids.items()],
                "records": {kind: [[r.kind, dict(r.components), r.measured_s, r.step] for r in rows]
                            for kind, rows in self.records.items()},
                "window": self.window.state_dict(),
                "counts": [self.replans, self.reshards, self.hybrid_applied]}

    def load_state_dict(self, state: dict, version: int) -> None:
        """Take on what :meth:`state_dict` saved at ``version`` (the world runs the layout it
        was saved in, :func:`resumed_layout`): a hybrid lend or return under way is finished
        or undone to match that layout (:func:`~libra_hpc.planner.loop_state.settled`); the
        steps from ``version`` on, trained again, are dropped from the window."""
        self.control.load_state_dict(S.settled(state["control"], state["layout"]))
        self.t0 = time.monotonic() - state["now"]
        self.records = {kind: [] for kind in RECORDS} | {  # a checkpoint from before the tail records has none
            kind: [TimingRecord(k, c, m, step) for k, c, m, step in rows] for kind, rows in state["records"].items()}
        self.window.load_state_dict(state["window"], before=version)
        self.replans, self.reshards, self.hybrid_applied = state["counts"]
        self._map_pool()

    # ------------------------------------------------------------------ observations

    def load(self, message: dict) -> None:
        """A leader's load report: its running batch is sampled for the decode records."""
        self.running.setdefault(message["instance"], []).append(message["running"])

    @staticmethod
    def samples(rows: list[dict]) -> list[LengthSample]:
        """The lengths of a batch's trajectory reports (rows of a checkpoint before
        ``prompt_tokens``: tool tokens 0). All marked trained: the job's loop still prices
        training on the whole batch (its per-step prediction does not, :meth:`trained_batch`)."""
        return [LengthSample(r["tokens"] - r["gen_tokens"], r["gen_tokens"], r["turns"], r["tool_s"],
                             r["tokens"] - r["gen_tokens"] - r.get("prompt_tokens", r["tokens"] - r["gen_tokens"]))
                for r in rows]

    def kept(self, rows: list[dict]) -> set[str]:
        """The ids of the trajectories a batch's training step trains: all but the GRPO
        groups the trainer leaves out (``rl.filter_zero_variance``: every reward equal,
        nothing to learn; the same rule, :func:`~libra_hpc.rl.grpo.compute_advantages`)."""
        members = [SimpleNamespace(group_id=group_of(r["tid"]), reward=r["reward"], tid=r["tid"]) for r in rows]
        out = compute_advantages(members, filter_zero_variance=self.s.cfg.rl.filter_zero_variance).trajectories
        return {m.tid for m in out}

    def predict(self, b: int, record: dict, reports: list[dict], step_s: float, ended: float | None = None) -> dict:
        """Step ``b`` ended (at ``ended``, the caller's clock; it took ``step_s`` since the
        step before), before it is observed: the step time the planner predicts for the
        layout that ran it, from the calibration fitted on steps before ``b`` and the
        batch's own lengths and turns, against the measured one, per term; the fields of
        the step's metrics row. Also keeps the batch's trajectories as chain records for
        the fit after this step.

        The step is priced as the pipeline runs it: training ``b`` ends at the later of
        the previous step's end plus its whole training (``T``: every pass, streamed
        groups included) and the batch's completion (its submission plus the predicted
        rollout makespan) plus training's tail (the last group's share of the pass and the
        fixed seconds fitted on the steps' measured tails, ``Calibration.stream_tail_s``:
        the optimizer step, the all-reduce, the wait for the last replica; all of ``T``
        when the step trains several passes, which do not stream). ``planner_steady_s`` is the
        steady-state step the gate weighs (:func:`~libra_hpc.planner.pipeline.pipelined_step_s`).
        A layout change's pause is not predicted (it is the change's, not the layout's)."""
        s, cfg = self.s, self.s.cfg
        rows = record["rows"]
        self._chain_records(b, rows, record["submitted"])
        epochs = epochs_at(cfg.rl.update_epochs, b)
        lengths = LengthProfile.from_samples(self.samples(rows), len(rows))
        o, cal = self.control.o, self.control.cal
        batch = self.trained_batch(rows, reports)
        plan = config_plan(s.layout, cfg)
        plan = replace(plan, train=replace(plan.train, uneven=True))  # whole groups per replica (runtime/batches.py)
        priced = reprice(plan, self.model, self.hw, cfg.cluster.gpus_per_node, lengths, cal, batch,
                         in_flight=o.max_staleness + 1, length_aware=o.length_aware_routing,
                         migration=o.migration)
        t_train, rollout = priced.t_train * epochs, priced.t_rollout
        groups = self.streamed_groups(epochs)
        tail = streamed_tail_s(t_train, groups, cal.stream_tail_s)
        steady = pipelined_step_s(t_train, rollout, o.max_staleness, groups, cal.stream_tail_s)
        predicted = steady
        if ended is not None:
            previous_end = ended - step_s
            predicted = max(t_train, record["submitted"] + rollout - previous_end + tail)
        terms = {"rollout_s": [_r(rollout), _r(record["complete"] - record["submitted"])],
                 "train_s": [_r(t_train), _r(max(r["train_s"] + r.get("stream_s", 0.0) for r in reports))],
                 "train_tail_s": [_r(tail), _r(max(r["train_s"] for r in reports))],
                 "step_s": [_r(predicted), _r(step_s)], "steady_step_s": [_r(steady), _r(step_s)]}
        s.runlog.event("planner_prediction", step=b, layout_version=s.layout.version, epochs=epochs, **terms,
                       calibration=cal.note, work={r["replica"]: r["work"] for r in reports if "work" in r})
        log.info("planner prediction, step %d: %s", b,
                 ", ".join(f"{k} predicted {p} measured {m}" for k, (p, m) in terms.items()))
        if not math.isfinite(predicted) or step_s <= 0:
            return {}
        return {"planner_predicted_s": _r(predicted), "planner_steady_s": _r(steady), "measured_step_s": _r(step_s),
                "planner_terms": terms}

    def _chain_records(self, b: int, rows: list[dict], submitted: float) -> None:
        """Each trajectory of batch ``b``: the wall seconds it ran, from its first turn's
        start to its report (``active_s``, measured by the leaders; rows without it: since
        the batch was submitted, which also counts the wait for a first turn behind the
        previous batch), against its chain's parts, at the running batch its instance
        reported (rows without a report time after the submission, from before a resume,
        give none)."""
        cal = self.control.cal
        if self.s.cfg.rl.partial_rollout:  # a trajectory may span batches: no start to measure from
            return
        for r, x in zip(rows, self.samples(rows)):
            if r.get("finished_at", 0.0) <= submitted:
                continue
            batch = max(1.0, statistics.fmean(self.running.get(r.get("instance"), []) or [1]))
            tp = self.s.roles.tps.get(r.get("instance"), 1)
            parts = RolloutCost(self.model, self.hw, tp, cal).chain_components(
                x.prompt_len, x.gen_len, x.tool_time_s, x.turns, batch, batch * x.decode_context)
            ran = r.get("active_s")
            measured = r["finished_at"] - submitted if ran is None else min(ran, r["finished_at"] - submitted)
            self.records["chain"].append(TimingRecord("chain", parts, measured, b))

    def streamed_groups(self, epochs: int) -> int:
        """GRPO groups a step of ``epochs`` passes streams (``rl.stream_training``), 0 when it
        trains whole: steps of several passes do not stream (runtime/batches.py)."""
        return self.control.o.stream_groups if epochs == 1 else 0

    def trained_batch(self, rows: list[dict], reports: list[dict]) -> RLBatch:
        """The sequences a batch's training step works on (:meth:`kept`), their mean length
        and where they were trained (each DP replica's first trainer reports the ids it
        received). In a default run a step training 2 of its 12 groups took 2.1 s and one
        training 10 took 9; priced on the whole batch, both cost the same. And the step
        waits for the replica with the most work: placed at a group's first finish, that
        one carried 1.0-2.1× an even share, attention quadratic in each length."""
        ids = self.kept(rows)
        kept = [r for r in rows if r["tid"] in ids]
        tokens = {r["tid"]: r["tokens"] for r in kept}
        by_replica = {r["replica"]: tuple(tokens[t] for t in r["tids"] if t in tokens) for r in reports if "tids" in r}
        shares = tuple(by_replica[d] for d in sorted(by_replica)) if sorted(by_replica) == list(
            range(len(by_replica))) else ()
        return RLBatch(max(1, len(kept)), max(1, math.ceil(statistics.fmean(r["tokens"] for r in kept or rows))),
                       shares=shares)

    def observe(self, b: int, rows: list[dict], reports: list[dict], epochs: int) -> None:
        """Batch ``b`` was trained: its lengths, and the timing records it gives."""
        self.control.observe(self.samples(rows))
        batch, t = self.trained_batch(rows, reports), self.s.layout.training
        shape = batch.shape(TrainShape(t.tp, t.pp, t.dp, self.s.cfg.training.micro_batch_size, batch.global_batch,
                                       batch.seq_len, uneven=True))
        cal = self.control.cal
        per_pass = max(r["train_s"] + r.get("stream_s", 0.0) for r in reports) / max(1, epochs)  # streamed parts too
        parts = TrainingCost(self.model, self.hw, shape, cal).components()
        self.records["train"].append(TimingRecord("train", parts, per_pass, b))
        groups = self.streamed_groups(epochs)
        if groups:  # what the step trained after its last group arrived (the slowest replica's)
            share = {k: v / groups for k, v in parts.items()}
            self.records["tail"].append(TimingRecord("tail", {**share, "tail_steps": 1.0},
                                                     max(r["train_s"] for r in reports), b))
        self.running.clear()  # the running batches the chain records of the next batch are taken at
        for kind, most in RECORDS.items():
            del self.records[kind][:-most]
        self.control.cal = fit_calibration([r for rs in self.records.values() for r in rs], self.base, before=b + 1,
                                           half_life=FIT_HALF_LIFE)

    # ------------------------------------------------------------------ decisions

    def after_step(self, b: int, reports: list[dict]) -> Sends:
        """Step ``b`` ended: the loop decides on the window's batch makespan and step time."""
        s = self.s
        # training's whole work, streamed parts included: what the pipelined step weighs (control.rollout_side_s)
        self.window.record(b, s.last_rollout_s, max(r["train_s"] + r.get("stream_s", 0.0) for r in reports),
                           s.last_step_s)
        self._gains(self.window.realised_gains())
        self._zero_grad_done()
        self._while_waiting(b)
        pool = self.pool
        moving = self.pending is not None or self.relayout.moving() or (
            pool is not None and bool(pool.joining() or pool.in_state("releasing")))
        if not self.window.settled(b, moving):
            return []
        steps, rollout_s, t_train = self.window.means()
        before = len(self.control.considered)
        assessment = None if pool is None else self.assess(t_train, rollout_s)
        if assessment is not None:
            assessment["steps"] = steps
        out = self.control.after_rollout(b, self.now(), rollout_s, t_train)
        for considered in self.control.considered[before:]:
            details = {k: v for k, v in considered.items() if k not in ("step", "kind")}
            s.runlog.event("plan_considered", step=b, what="replan", check=considered.get("kind"),
                           decision="applied" if details.get("apply") else "kept", **details)
        if out.change is not None:
            self._hold(out.change)
            return []
        if pool is not None and out.pool_decided:
            return self.carry_out(out.pool_events, assessment)
        return []

    def _gains(self, gains: list[dict]) -> None:
        for gain in gains:
            self.s.runlog.event("hybrid_gain" if gain["direction"] in ("join", "leave") else "layout_gain", **gain)
            self.layout_gains.append(layout_gain(gain))

    def finish(self) -> list[dict]:
        """The run ended: ``layout_gains`` of ``summary.json``, every applied layout change's
        predicted and realised step-time gain (s per step; those applied near the end over
        the steps that followed them)."""
        self._gains(self.window.realised_gains(final=True))
        return self.layout_gains

    def assess(self, t_train: float, makespan_s: float) -> dict:
        """Which way the pool's gate points (the move predicted to save the most), and that
        saving (taken before the control loop decides: its answer changes the pool).
        ``t_rollout`` in the record: the rollout side the margin and the lend trial weigh."""
        control = self.control
        direction, gain = control.hybrid_move(t_train, makespan_s)
        t_rollout = control.rollout_side_s(makespan_s)
        held = control.hybrid_gain("borrow", t_train, makespan_s) if control.lend_held(t_train, t_rollout) else None
        if held is not None and held > 0 and (gain is None or held > gain):  # the move the lend trial holds
            direction, gain = "borrow", held
        out = {"direction": direction, "t_train": round(t_train, 3), "t_rollout": round(t_rollout, 3),
               "predicted_gain_s": None if gain is None else round(gain, 3)}
        if direction == "borrow" and held is not None:
            out["held_by"] = f"a lend at this balance made the step slower (training/rollout ≤ {control.borrow_floor:.3g})"
        return out

    def carry_out(self, events: list, assessment: dict) -> Sends:
        """The pool's answer to one ``after_rollout``: borrow, release, or hold (logged)."""
        s = self.s
        direction, gain = assessment["direction"], assessment["predicted_gain_s"]
        moved = [e for e in events if e.changed and e.to_state in ("requested", "releasing")]
        if moved:  # the gate's move, or a lend judged by what it did (the control loop's lend trial)
            what = "borrow" if moved[0].to_state == "requested" else "release"
            reason = "predicted to shorten the step by more than the margin" if what == direction else moved[0].reason
        else:
            what = direction or "hold"
            reason = ("no move predicted to shorten the step" if direction is None else assessment["held_by"] if "held_by" in assessment
                      else "nothing to move that way" if gain is None
                      else "predicted to shorten the step by less than the margin")
        s.runlog.event("plan_considered", step=s.version - 1, what=f"hybrid pool: {what}", **assessment,
                       decision="applied" if moved else "hold" if direction is None or gain is None else "kept",
                       reason=reason)
        sends: Sends = []
        for event in events:
            s.runlog.event("hybrid", replica=event.replica, state=event.to_state, from_state=event.from_state,
                           reason=event.reason, refused=event.refused, **assessment)
            if event.refused or not event.changed:
                continue
            rid = event.replica
            switch = {"replica": rid, "predicted_gain_s": gain,
                      "direction": "join" if event.to_state == "requested" else "leave"}
            if event.to_state == "requested":
                sends += self.relayout.lend(self.instances[rid], self.pool_instances(), switch)
            elif event.to_state == "releasing":
                sends += self.relayout.give_back(rid, frozenset(self.pool.replica(rid).slots), self.instances[rid],
                                                 self.pool_instances(), switch)
        return sends

    def left(self, instance: int) -> Sends:
        """A lent replica's instance left rollout; once all have, the replica joins."""
        rid = next(r for r, insts in self.instances.items() if instance in insts)
        if not all(i in self.relayout.drained for i in self.instances[rid]):
            return []
        events = self._progress(rid)
        if self.pool.replica(rid).state != "fetching_state":  # rolled back (a timeout) after its engine stopped
            raise RuntimeError(f"hybrid replica {rid} was rolled back to rollout while its instances drained "
                               f"({events[-1].reason if events else 'no event'}); restarting their engines is not "
                               "supported")
        return self.relayout.join(rid, frozenset(self.pool.replica(rid).slots), self.instances[rid])

    def _progress(self, rid: int) -> list:
        events = self.control.progress(rid, self.now())
        for event in events:
            self.s.runlog.event("hybrid", replica=event.replica, state=event.to_state, from_state=event.from_state,
                                reason=event.reason, refused=event.refused)
        return events

    def _zero_grad_done(self) -> None:
        """The first step after a join was the new replica's zero-gradient step."""
        if self.zero_grad_at is not None and self.s.version > self.zero_grad_at:
            for r in self.pool.in_state("zero_grad_sync"):
                self._progress(r.rid)
            self.zero_grad_at = None

    # ------------------------------------------------------------------ replans and re-shards

    def _hold(self, change: Any) -> None:
        s = self.s
        self.pending = PendingChange(change, time.perf_counter(), moves_training(s.layout, change.layout))
        what = "re-shard" if change.reshard else "replan"
        if change.reshard:  # EARL's selector: training to another TP size, the same GPUs
            s.runlog.event("tp_reshard", step=s.version, from_tp=s.layout.training.tp, to_tp=change.plan.train.tp,
                           plan=change.plan.describe(), reason=change.reason)
        else:
            s.runlog.event("replan", step=s.version, plan=change.plan.describe(), reason=change.reason,
                           predicted_gain_s=None if change.gain_s is None else round(change.gain_s, 3),
                           calibration=self.control.cal.note)
        s.runlog.event("progress", line=f"{what} decided at step {s.version}: {change.plan.describe()} "
                                        f"({change.reason}); draining the batches in flight")

    def _while_waiting(self, b: int) -> None:
        """A change waits: if the running training shape no longer holds the next batch, the
        control loop names the change to wait for instead, made for memory (training waits
        for it: :meth:`holds_training`), as in the simulator."""
        p = self.pending
        if p is None or p.for_memory or self.relayout.moving():
            return
        instead = self.control.while_waiting(b, p.change)
        if instead is not None:
            self.pending = PendingChange(instead, p.decided_at, moves_training(self.s.layout, instead.layout), p.held)
            self.s.runlog.event("progress", line=f"the waiting change is now for memory at step {self.s.version}: "
                                                 f"{instead.plan.describe()} ({instead.reason})")

    def holds_training(self) -> bool:
        """Training waits: a change made for memory waits for its moment (the running shape
        cannot hold the batches that wait; they are trained on the new one)."""
        return self.pending is not None and self.pending.for_memory

    def hold_batch(self, b: int) -> bool:
        """Batch ``b`` waits (a change waits for the pipeline to drain): True if held."""
        if self.pending is None:
            return False
        self.pending.held.append(b)
        return True

    def maybe_apply(self, rolling: bool, untrained: bool) -> Sends:
        """Start the waiting change once the pending-change rule says it is due
        (``rolling``, ``untrained``: the batch tracker's answers)."""
        p = self.pending
        if p is None or not p.due(
                rolling=rolling, untrained=untrained, training=self.s.training, moving=self.relayout.moving()):
            return []
        return self.relayout.replace(p.change, self.pool_instances())

    def applied(self, done: Applied) -> list[int]:
        """A layout change every rank carried out: the pool and the loop follow, the
        window starts over; the batches held for a replan, to submit now."""
        s = self.s
        held: list[int] = []
        if done.kind == "replan":
            change, pending = done.what, self.pending
            self.pending = None
            self.control.apply(change)
            if change.reshard:
                self.reshards += 1
            else:
                self.replans += 1
            done.record.update(predicted_gain_s=None if change.gain_s is None else round(change.gain_s, 3),
                               decided_to_applied_s=round(time.perf_counter() - pending.decided_at, 3))
            s.runlog.event("layout_applied", step=s.version,
                           by="planner (re-shard)" if change.reshard else "planner (replan)",
                           plan=change.plan.describe(), **s.layout.summary(), **done.record)
            self._map_pool()
            held = pending.held
        else:
            self.hybrid_applied += 1
            self.pauses.append(done.record)
            s.runlog.event("layout_applied", step=s.version, by="planner (hybrid pool)", **s.layout.summary(),
                           **done.record)
            self._progress(done.what)  # join: fetched, the zero-gradient step is next; leave: back to rollout
            if done.kind == "join":
                self.zero_grad_at = s.version
        self.window.switched(s.version, done.record)
        return held


def _r(x: float) -> float | None:
    return round(x, 3) if math.isfinite(x) else None
