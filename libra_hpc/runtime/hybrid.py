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
from dataclasses import replace
from typing import Any

from libra_hpc.cluster.layout import lend_hybrid_to_training, return_hybrid_to_rollout
from libra_hpc.runtime.roles import roles_from_layout

log = logging.getLogger(__name__)
GAIN_STEPS = 3
"""Steps before and after a switch whose mean step time gives its measured gain."""
MEASURED_STEPS = 2
"""Steps measured on the current layout (batches that did not overlap a switch) before
the control loop decides again; it decides on their mean times (up to GAIN_STEPS of them),
since one batch's rollout time on two shared cores varies by 2-3×."""


class HybridDriver:
    """Carries out the control loop's layout decisions (:class:`~.planning.PlannerDriver`
    owns the loop): hybrid-pool transitions, and the relayouts of those and of a replan."""

    def __init__(self, controller: Any):
        self.c = controller
        self.t0 = time.monotonic()
        self.instances: dict[int, list[int]] = {}
        self._map_pool()
        self.leaving: set[int] = set()  # instances out of rollout for a relayout (draining, then drained)
        self.drained: set[int] = set()
        self.no_route: set[int] = set()  # DP replicas that get no new group (releasing)
        self.pending: tuple[str, Any] | None = None  # ("join" | "leave", replica) or ("replan", layout)
        self.relaying: set[int] = set()
        self.switch: dict = {}
        self.applied = 0
        self.pauses: list[dict] = []
        self.step_times: list[tuple[int, float]] = []
        self.gain_checks: list[tuple[int, dict]] = []
        self.measure_from = 0  # the first step whose batch did not overlap the last switch
        self.on_replaced = None

    @property
    def pool(self):
        return self.c.planner.pool

    def _map_pool(self) -> None:
        """Hybrid replica → the rollout instances on its slots (in the current layout)."""
        c, pool = self.c, self.pool
        self.instances = {} if pool is None else {
            r.rid: [c.ids[g.slots] for g in c.layout.rollout_instances if g.hybrid and set(g.slots) <= set(r.slots)]
            for r in pool.all_replicas()}

    def now(self) -> float:
        return self.c.planner.now()

    def busy(self) -> bool:
        """No new training step starts: a relayout waits for the step boundary, or its
        training ranks have not all re-formed yet (a rollout instance coming back may
        still be starting its engine: training does not wait for it)."""
        if self.relaying:
            return bool(self.relaying & set(self.c.roles.trainers))
        return self.pending is not None and self._ready()

    def settled(self, b: int) -> bool:
        """The control loop may decide after step ``b``: no switch under way, the last one's
        batches are measured, and a switch now would be measured before the run ends."""
        pool = self.pool
        moving = pool is not None and bool(pool.joining() or pool.in_state("releasing"))
        measured = b - self.measure_from + 1 >= MEASURED_STEPS
        return not (moving or self.pending or self.relaying) and measured and b + 2 < self.c.cfg.rl.steps

    # ------------------------------------------------------------------ decisions

    def after_step(self, b: int) -> None:
        c = self.c
        self.step_times.append((b, c.last_step_s))
        self._check_gains(b)
        self._zero_grad_done()
        self._maybe_relayout()

    def assess(self, t_train: float, t_rollout: float) -> dict:
        """Which way the pool's gate points, and the step time a move is predicted to save
        (taken before the control loop decides: its answer changes the pool)."""
        control = self.c.planner.control
        direction = control.hybrid_direction(t_train, t_rollout)
        gain = control.hybrid_gain(direction, t_train, t_rollout) if direction else None
        out = {"direction": direction, "t_train": round(t_train, 3), "t_rollout": round(t_rollout, 3),
               "predicted_gain_s": None if gain is None else round(gain, 3)}
        if direction == "borrow" and control.lend_held(t_train, t_rollout):
            floor = control.borrow_floor
            out["held_by"] = f"a lend at this balance made the step slower (training/rollout ≤ {floor:.3g})"
        return out

    def carry_out(self, events: list, assessment: dict) -> None:
        """The pool's answer to one ``after_rollout``: borrow, release, or hold (logged)."""
        c = self.c
        direction, gain = assessment["direction"], assessment["predicted_gain_s"]
        moved = [e for e in events if e.changed and e.to_state in ("requested", "releasing")]
        if moved:  # the gate's move, or a lend judged by what it did (ControlLoop._judge_lend)
            what = "borrow" if moved[0].to_state == "requested" else "release"
            reason = ("predicted to shorten the step by more than the margin" if what == direction
                      else moved[0].reason)
        else:
            what = direction or "hold"
            reason = ("within the margin" if direction is None else assessment["held_by"] if "held_by" in assessment
                      else "nothing to move that way" if gain is None
                      else "predicted to shorten the step by less than the margin")
        c.runlog.event("plan_considered", step=c.version - 1, what=f"hybrid pool: {what}", **assessment,
                       decision="applied" if moved else "hold" if direction is None or gain is None else "kept",
                       reason=reason)
        for event in events:
            c.runlog.event("hybrid", replica=event.replica, state=event.to_state, from_state=event.from_state,
                           reason=event.reason, refused=event.refused, **assessment)
            if event.refused or not event.changed:
                continue
            if event.to_state in ("requested", "releasing"):
                self.switch = {"replica": event.replica, "predicted_gain_s": gain, "decided": time.perf_counter(),
                               "direction": "join" if event.to_state == "requested" else "leave", "step": c.version}
            if event.to_state == "requested":
                self._borrow(event.replica)
            elif event.to_state == "releasing":
                self._release(event.replica)

    def _borrow(self, rid: int) -> None:
        c = self.c
        until = c.version + (1 if c.training else 0)
        for instance in self.instances[rid]:
            self._leave(instance, until)
        self._tokens_mark("before")

    def _leave(self, instance: int, until: int) -> None:
        c = self.c
        c.service.retire(instance, time.monotonic())
        self.leaving.add(instance)
        c._send(c.roles.leaders[instance], {"op": "leave", "until_version": until})

    def left(self, message: dict, source: int) -> None:
        instance = message["instance"]
        self.drained.add(instance)
        self.c.runlog.event("hybrid_drained" if self.pending is None or self.pending[0] != "replan" else "instance_drained",
                            instance=instance, rank=source, drain_s=message["drain_s"])
        if self.pending is not None and self.pending[0] == "replan":
            self._maybe_relayout()
            return
        rid = next(r for r, insts in self.instances.items() if instance in insts)
        if all(i in self.drained for i in self.instances[rid]):
            events = self.c.planner.control.progress(rid, self.now())
            for event in events:
                self._event(event)
            if self.pool.replica(rid).state != "fetching_state":  # rolled back (a timeout) after its engine stopped
                raise RuntimeError(f"hybrid replica {rid} was rolled back to rollout while its instances drained "
                                   f"({events[-1].reason if events else 'no event'}); restarting their engines is not "
                                   "supported")
            self.pending = ("join", rid)
            self._maybe_relayout()

    def _release(self, rid: int) -> None:
        c = self.c
        train = c.layout.training
        core = len([s for s in train.slots if s not in c.layout.hybrid]) // (train.tp * train.pp)
        self.no_route.update(range(core, train.dp))
        self.pending = ("leave", rid)
        self._tokens_mark("before")
        self._maybe_relayout()  # ready at once when no untrained batch has a group there

    def replace(self, change: Any, on_done: Any) -> None:
        """Run ``change.layout`` (a replan) from now on; nothing is in flight. The instances
        it drops drain and leave, then the ranks whose role changes re-form;
        ``on_done(record)`` when every rank reported."""
        c = self.c
        layout = replace(change.layout, version=c.layout.version + 1)
        ids = dict(c.ids)
        for g in layout.rollout_instances:
            ids.setdefault(g.slots, max(ids.values(), default=-1) + 1)
        keep = {g.slots for g in layout.rollout_instances}
        dropped = [i for i in c.roles.leaders if c.roles.groups[i].slots not in keep]
        self.pending = ("replan", (layout, ids, dropped))
        self.on_replaced = on_done
        self.switch = {"direction": "replan", "decided": time.perf_counter(), "step": c.version}
        self._tokens_mark("before")
        for instance in dropped:
            self._leave(instance, c.version)
        self._maybe_relayout()

    # ------------------------------------------------------------------ relayout

    def _ready(self) -> bool:
        """The pending relayout may start: no training step runs, and (release) no
        untrained batch has a group on a replica that leaves, (replan) every instance it
        drops has left."""
        c = self.c
        if c.training:
            return False
        if self.pending and self.pending[0] == "leave":
            return not any(c.untrained_on(d) for d in self.no_route)
        if self.pending and self.pending[0] == "replan":
            return all(i in self.drained for i in self.pending[1][2])
        return True

    def _maybe_relayout(self) -> None:
        if self.pending is None or self.relaying or not self._ready():
            return
        c = self.c
        kind, what = self.pending
        old = c.roles
        if kind == "join":
            layout = lend_hybrid_to_training(c.layout, reason=f"hybrid replica {what} joins training (planner's gate)",
                                             only=frozenset(self.pool.replica(what).slots))
            changed = self.instances[what]
        elif kind == "leave":
            layout = return_hybrid_to_rollout(c.layout, c.initial, reason=f"hybrid replica {what} back to rollout "
                                                                            "(planner's gate)",
                                              only=frozenset(self.pool.replica(what).slots))
            changed = self.instances[what]
        else:
            layout, ids, changed = what
            c.ids = ids
        roles = roles_from_layout(layout, c.world.topology.rank_of, c.ids)
        moved = set(old.trainers) | set(roles.trainers)
        if kind == "replan":
            changed = list(changed) + [i for i in roles.leaders if i not in old.leaders]
        for instance in changed:
            moved.update((old.members.get(instance) or ()) + (roles.members.get(instance) or ()))
        fresh = sorted(r for r in roles.leaders.values() if r in moved)  # a new engine here: it needs the policy
        for rank in fresh:
            c.leader_version.pop(rank, None)
        command = {"op": "relayout", "roles": roles, "checkpoint": str(c.runlog.folder / f"relayout-v{layout.version}"),
                   "version": c.version, "fresh_leaders": fresh, "reason": layout.reason}
        self.switch.update(started=time.perf_counter(), version=layout.version, kind=kind)
        for rank in sorted(moved):
            c._send(rank, command)
        for instance, rank in roles.leaders.items():  # the others learn the new instance map
            if rank not in moved:
                c._send(rank, {"op": "roles", "roles": roles})
        self.relaying = set(moved)
        c.layout, c.roles = layout, roles
        if kind == "replan":  # nothing is in flight: the queue starts over now, so that it knows the new
            c.rebuild_queue()  # instances as soon as their leaders ask (else it refuses them until all re-form)
        c.runlog.event("progress", line=f"relayout v{layout.version}: {layout.reason}")

    def relaid(self, message: dict, source: int) -> None:
        c = self.c
        self.relaying.discard(source)
        if "trainers_back" not in self.switch and not self.relaying & set(c.roles.trainers):
            self.switch["trainers_back"] = time.perf_counter()  # the core training group's pause ends
            if self.relaying:
                c._maybe_train()
        if self.relaying:
            return
        kind, what = self.pending
        self.pending = None
        pause = self.switch.pop("trainers_back") - self.switch["started"]
        shutil.rmtree(c.runlog.folder / f"relayout-v{c.layout.version}", ignore_errors=True)  # loaded: not needed again
        others = self._tokens_mark("during")
        record = {"direction": self.switch["direction"], "pause_s": round(pause, 3),
                  "all_ranks_back_s": round(time.perf_counter() - self.switch["started"], 3),
                  "decided_to_applied_s": round(time.perf_counter() - self.switch["decided"], 3),
                  "predicted_gain_s": self.switch.get("predicted_gain_s"), **others}
        if kind == "replan":
            self._replaced(what, record)
            return
        self.applied += 1
        self.pauses.append(record)
        c.runlog.event("layout_applied", step=c.version, by="planner (hybrid pool)", **c.layout.summary(), **record)
        if kind == "join":
            self.leaving.difference_update(self.instances[what])
            self.drained.difference_update(self.instances[what])
            for event in c.planner.control.progress(what, self.now()):  # fetched: the zero-gradient step is next
                self._event(event)
            self.zero_grad_at = c.version
        else:
            self.no_route.clear()
            for instance in self.instances[what]:
                c.service.restore(instance)
            for event in c.planner.control.progress(what, self.now()):  # releasing -> rollout
                self._event(event)
        self.gain_checks.append((c.version, record))
        # The batches in flight across the switch carry its pause: judge it on the ones after.
        self.measure_from = c.version + 1 + c.cfg.rl.max_staleness
        c._maybe_train()

    def _replaced(self, what: tuple, record: dict) -> None:
        """A replan's ranks re-formed (the queue started over on the new buckets when the
        relayout began): the pool maps onto the new layout."""
        c = self.c
        layout, _, dropped = what
        self.leaving.difference_update(dropped)
        self.drained.difference_update(dropped)
        for instance in dropped:
            c.leader_load.pop(instance, None)
        c.initial = layout
        done, self.on_replaced = self.on_replaced, None
        done(record)  # the planner adopts the change: its pool is the new layout's
        self._map_pool()
        self.gain_checks.append((c.version, record))
        self.measure_from = c.version + 1 + c.cfg.rl.max_staleness

    def _zero_grad_done(self) -> None:
        """The first step after a join was the new replica's zero-gradient step."""
        at = getattr(self, "zero_grad_at", None)
        if at is not None and self.c.version > at:
            for r in self.pool.in_state("zero_grad_sync"):
                for event in self.c.planner.control.progress(r.rid, self.now()):
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
