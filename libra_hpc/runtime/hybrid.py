"""The elastic hybrid pool, live: the controller's side of lending a rollout replica to
training and taking it back (:class:`HybridDriver`).

The decisions are the planner's (:class:`~libra_hpc.planner.hybrid.HybridPool`: its state
machine and its gate, ``decide``, on the measured training step time and batch rollout
time with ``planner.hybrid_margin``; never a step number). What the driver does for each:

- **borrow** (``requested``): the replica's rollout instances are retired from the queue
  (no new turns; their queued turns go elsewhere) and told to ``leave``: each finishes
  the turns it holds, waits until every trajectory it holds was pulled by the instance
  that runs its next turn, takes the last policy posted to it and shuts its engine down
  (``left``). Then (``fetching_state``), between two training steps, the training ranks
  save their state and every rank of the new training group (the core ranks and the
  replica's) forms it and loads that state, resharded to DP + 1 (``relayout`` →
  ``relaid``): the core training group's pause. The replica's first step is the
  zero-gradient one (``zero_grad_sync``: no group of a batch routed before it joined is
  its own), then it is ``active``;
- **release** (``releasing``): no new group is routed to the replica; once no untrained
  batch has a group on it, the training ranks save, the core group re-forms at DP and
  the replica's ranks become a rollout instance again, get the current policy from the
  holder and are restored to the queue (``rollout``).

Every transition is an event (``hybrid``) with the gate's reason and the predicted gain;
every applied layout one ``layout_applied`` event with the measured pause and the
tokens/s of the rollout instances outside the pool before and during the switch; three
steps later the measured gain (``hybrid_gain``).
"""

from __future__ import annotations

import logging
import shutil
import statistics
import time
from typing import Any

from libra_hpc.cluster.layout import lend_hybrid_to_training, return_hybrid_to_rollout
from libra_hpc.planner.hybrid import HybridPool, PhaseTimeouts
from libra_hpc.runtime.roles import roles_from_layout

log = logging.getLogger(__name__)
GAIN_STEPS = 3
"""Steps before and after a switch whose mean step time gives its measured gain."""


class HybridDriver:
    def __init__(self, controller: Any):
        self.c = controller
        cfg = controller.cfg
        layout = controller.layout
        self.t0 = time.monotonic()
        self.pool = HybridPool.from_layout(layout, min_rollout_gpus=cfg.planner.min_rollout_gpus,
                                           timeouts=PhaseTimeouts(requested=600, fetching_state=900,
                                                                  zero_grad_sync=900, releasing=900))
        members = {r.rid: set(r.slots) for r in self.pool.all_replicas()}
        self.instances = {rid: [controller.ids[g.slots] for g in layout.rollout_instances
                                if g.hybrid and set(g.slots) <= slots] for rid, slots in members.items()}
        self.leaving: set[int] = set()  # instances out of rollout for a join (draining, then drained)
        self.drained: set[int] = set()
        self.no_route: set[int] = set()  # DP replicas that get no new group (releasing)
        self.pending: tuple[str, int] | None = None  # ("join" | "leave", replica) waiting for a step boundary
        self.relaying: set[int] = set()
        self.switch: dict = {}
        self.applied = 0
        self.pauses: list[dict] = []
        self.step_times: list[tuple[int, float]] = []
        self.gain_checks: list[tuple[int, dict]] = []
        self.quiet_until = 0  # no decision on steps whose batches overlapped the last switch

    def now(self) -> float:
        return time.monotonic() - self.t0

    def busy(self) -> bool:
        """A relayout waits for the step boundary (no new training step starts) or runs."""
        return bool(self.relaying) or (self.pending is not None and self._ready())

    # ------------------------------------------------------------------ decisions

    def after_step(self, b: int, reports: list[dict]) -> None:
        c = self.c
        t_train = max(r["train_s"] for r in reports)
        t_rollout = c.last_rollout_s
        self.step_times.append((b, c.last_step_s))
        self._check_gains(b)
        self._zero_grad_done()
        settled = not (self.pool.joining() or self.pool.in_state("releasing") or self.pending or self.relaying)
        if settled and self.quiet_until <= b and b + 2 < c.cfg.rl.steps:  # a switch is judged once it is measured
            margin = c.cfg.planner.hybrid_margin
            direction = "borrow" if t_train > t_rollout * (1 + margin) else "release" if t_rollout > t_train * (1 + margin) else None
            if (direction == "borrow" and not self.pool.in_state("rollout")) or \
                    (direction == "release" and not self.pool.training_replicas()):
                direction = None  # nothing to lend, or nothing lent
            gain = self._predicted(direction, t_train, t_rollout) if direction else None
            c.runlog.event("plan_considered", step=b, what=f"hybrid pool: {direction or 'hold'}", t_train=round(t_train, 3),
                           t_rollout=round(t_rollout, 3), predicted_gain_s=None if gain is None else round(gain, 3),
                           decision="hold" if direction is None else "to the pool's gate" if gain > 0 else "kept",
                           reason="within the margin" if direction is None else
                           "predicted to shorten the step" if gain > 0 else "predicted not to shorten the step")
            events = self.pool.decide(self.now(), t_train, t_rollout, margin=margin) if gain and gain > 0 else []
            for event in events:
                self._record(event, t_train, t_rollout)
                if event.refused:
                    continue
                if event.to_state == "requested":
                    self._borrow(event.replica)
                elif event.to_state == "releasing":
                    self._release(event.replica)
        self._maybe_relayout()

    def _predicted(self, direction: str | None, t_train: float, t_rollout: float) -> float | None:
        """Step time saved by lending one replica (``borrow``) or taking one back
        (``release``): training time scales with 1/DP, rollout time with 1/rollout GPUs,
        and the step is the slower of the two (the pipelined, asynchronous step)."""
        d = len(self.c.roles.replicas)
        rollout = len(self.c.layout.slots_of("rollout"))
        size = self.pool.replica_size
        now_s = max(t_train, t_rollout)
        if direction == "borrow":
            return now_s - max(t_train * d / (d + 1), t_rollout * rollout / max(rollout - size, 1))
        if direction == "release":
            return now_s - max(t_train * d / max(d - 1, 1), t_rollout * rollout / (rollout + size))
        return None

    def _record(self, event: Any, t_train: float, t_rollout: float) -> None:
        direction = {"requested": "borrow", "releasing": "release"}.get(event.to_state)
        predicted = self._predicted(direction, t_train, t_rollout)
        self.c.runlog.event("hybrid", replica=event.replica, state=event.to_state, from_state=event.from_state,
                            reason=event.reason, refused=event.refused, t_train=round(t_train, 3),
                            t_rollout=round(t_rollout, 3),
                            predicted_gain_s=None if predicted is None else round(predicted, 3))
        if predicted is not None:
            self.switch = {"replica": event.replica, "predicted_gain_s": round(predicted, 3),
                           "direction": "join" if event.to_state == "requested" else "leave",
                           "decided": time.perf_counter(), "step": self.c.version}

    def _borrow(self, rid: int) -> None:
        c = self.c
        until = c.version + (1 if c.training else 0)
        for instance in self.instances[rid]:
            c.service.retire(instance, time.monotonic())
            self.leaving.add(instance)
            c._send(c.roles.leaders[instance], {"op": "leave", "until_version": until})
        self._tokens_mark("before")

    def left(self, message: dict, source: int) -> None:
        instance = message["instance"]
        self.drained.add(instance)
        self.c.runlog.event("hybrid_drained", instance=instance, rank=source, drain_s=message["drain_s"])
        rid = next(r for r, insts in self.instances.items() if instance in insts)
        if all(i in self.drained for i in self.instances[rid]):
            events = self.pool.progress(rid, self.now())
            for event in events:
                self._event(event)
            if self.pool.replica(rid).state != "fetching_state":  # rolled back (a timeout) after its engine stopped
                raise RuntimeError(f"hybrid replica {rid} was rolled back to rollout while its instances drained "
                                   f"({events[-1].reason}); restarting their engines is not supported")
            self.pending = ("join", rid)
            self._maybe_relayout()

    def _release(self, rid: int) -> None:
        c = self.c
        train = c.layout.training
        core = len([s for s in train.slots if s not in c.layout.hybrid]) // (train.tp * train.pp)
        self.no_route.update(range(core, train.dp))
        self.pending = ("leave", rid)
        self._tokens_mark("before")

    # ------------------------------------------------------------------ relayout

    def _ready(self) -> bool:
        """The pending relayout may start: no training step runs, and (release) no
        untrained batch has a group on a replica that leaves."""
        c = self.c
        if c.training:
            return False
        if self.pending and self.pending[0] == "leave":
            return not any(batch["count"].get(d, 0) for b, batch in c.batches.items() if b >= c.version
                           for d in self.no_route)
        return True

    def _maybe_relayout(self) -> None:
        if self.pending is None or self.relaying or not self._ready():
            return
        c = self.c
        kind, rid = self.pending
        old = c.roles
        if kind == "join":
            layout = lend_hybrid_to_training(c.layout, reason=f"hybrid replica {rid} joins training (planner's gate)")
        else:
            layout = return_hybrid_to_rollout(c.layout, c.initial, reason=f"hybrid replica {rid} back to rollout "
                                                                           "(planner's gate)")
        roles = roles_from_layout(layout, c.world.topology.rank_of, c.ids)
        moved = set(old.trainers) | set(roles.trainers)
        for instance in self.instances[rid]:
            moved.update((old.members.get(instance) or ()) + (roles.members.get(instance) or ()))
        command = {"op": "relayout", "roles": roles, "checkpoint": str(c.runlog.folder / f"relayout-v{layout.version}"),
                   "version": c.version, "old_leaders": sorted(old.leaders.values()), "reason": layout.reason}
        self.switch.update(started=time.perf_counter(), version=layout.version, kind=kind)
        for rank in sorted(moved):
            c._send(rank, command)
        for instance, rank in roles.leaders.items():  # the others learn the new instance map
            if rank not in moved:
                c._send(rank, {"op": "roles", "roles": roles})
        self.relaying = set(moved)
        c.layout, c.roles = layout, roles
        c.runlog.event("progress", line=f"relayout v{layout.version}: {layout.reason}")

    def relaid(self, message: dict, source: int) -> None:
        c = self.c
        self.relaying.discard(source)
        if self.relaying:
            return
        kind, rid = self.pending
        self.pending = None
        pause = time.perf_counter() - self.switch["started"]
        shutil.rmtree(c.runlog.folder / f"relayout-v{c.layout.version}", ignore_errors=True)  # loaded: not needed again
        others = self._tokens_mark("during")
        self.applied += 1
        record = {"direction": "join" if kind == "join" else "leave", "pause_s": round(pause, 3),
                  "decided_to_applied_s": round(time.perf_counter() - self.switch["decided"], 3),
                  "predicted_gain_s": self.switch.get("predicted_gain_s"), **others}
        self.pauses.append(record)
        c.runlog.event("layout_applied", step=c.version, by="planner (hybrid pool)", **c.layout.summary(), **record)
        if kind == "join":
            self.leaving.difference_update(self.instances[rid])
            self.drained.difference_update(self.instances[rid])
            for event in self.pool.progress(rid, self.now()):  # fetched: the zero-gradient step is next
                self._event(event)
            self.zero_grad_at = c.version
        else:
            self.no_route.clear()
            for instance in self.instances[rid]:
                c.service.restore(instance)
            for event in self.pool.progress(rid, self.now()):
                self._event(event)
        self.gain_checks.append((c.version, record))
        # The batches in flight across the switch carry its pause: judge it on the ones after.
        self.quiet_until = c.version + 1 + c.cfg.rl.max_staleness
        c._maybe_train()

    def _zero_grad_done(self) -> None:
        """The first step after a join was the new replica's zero-gradient step."""
        at = getattr(self, "zero_grad_at", None)
        if at is not None and self.c.version > at:
            for r in self.pool.in_state("zero_grad_sync"):
                for event in self.pool.progress(r.rid, self.now()):
                    self._event(event)
            self.zero_grad_at = None

    def _event(self, event: Any) -> None:
        self.c.runlog.event("hybrid", replica=event.replica, state=event.to_state, from_state=event.from_state,
                            reason=event.reason, refused=event.refused)

    # ------------------------------------------------------------------ measurements

    def _tokens_mark(self, phase: str) -> dict:
        """Tokens/s of the rollout instances outside the pool: ``before`` marks the
        switch's start; ``during`` returns their rates over the switch and over as long
        a window before it (from the leaders' load reports)."""
        c = self.c
        pool_instances = {i for insts in self.instances.values() for i in insts}
        now = time.perf_counter()
        totals = {i: m["tokens"] for i, m in c.leader_load.items() if i not in pool_instances}
        history = c.load_history
        if phase == "before":
            self.mark = (now, totals)
            return {}
        start, at_start = self.mark
        span = now - start
        earlier = [h for h in history if h[0] <= start - span]
        base_t, base = earlier[-1] if earlier else history[0] if history else (start, at_start)
        before = sum(at_start.get(i, 0) - base.get(i, 0) for i in at_start) / max(start - base_t, 1e-9)
        during = sum(totals.get(i, 0) - at_start.get(i, 0) for i in at_start) / max(span, 1e-9)
        return {"others_tokens_per_s_before": round(before, 1), "others_tokens_per_s_during": round(during, 1),
                "others_kept": round(during / before, 3) if before > 0 else None}

    def _check_gains(self, b: int) -> None:
        for applied_at, record in list(self.gain_checks):
            after = [s for step, s in self.step_times if step >= applied_at]
            if len(after) < GAIN_STEPS:
                continue
            before = [s for step, s in self.step_times if step < applied_at][-GAIN_STEPS:]
            self.gain_checks.remove((applied_at, record))
            if before:
                measured = statistics.fmean(before) - statistics.fmean(after[:GAIN_STEPS])
                self.c.runlog.event("hybrid_gain", direction=record["direction"], at_step=applied_at,
                                    predicted_gain_s=record["predicted_gain_s"], measured_gain_s=round(measured, 3),
                                    step_s_before=round(statistics.fmean(before), 3),
                                    step_s_after=round(statistics.fmean(after[:GAIN_STEPS]), 3))
