"""A pending layout change, live: drain, re-form, resume (:class:`Relayouts`).

Every layout change the control loop decides goes through here, the same way:

- **join** (a hybrid replica lent to training): its rollout instances are retired from the
  queue and told to ``leave`` (:meth:`Relayouts.lend`); each finishes the turns it holds,
  waits until every trajectory it holds was pulled by the instance that runs its next turn,
  takes the last policy posted to it and shuts its engine down (``left``). Once all have
  left (:meth:`Relayouts.join`) and no training step runs, the relayout starts;
- **leave** (the replica back to rollout, :meth:`Relayouts.give_back`): no new group is
  routed to it; the relayout starts once no untrained batch has a group there;
- **replan** and **re-shard** (:meth:`Relayouts.replace`, once the pipeline has drained:
  :class:`~libra_hpc.planner.window.PendingChange` says when): the instances the new layout drops leave,
  then the relayout starts.

The relayout itself (:meth:`Relayouts.advance`): the training ranks save their state and
every rank whose role changes re-forms (``relayout``: the training ranks load that state,
resharded to the new shape), the others learn the new instance map (``roles``); each
re-formed rank says ``relaid``. Training resumes as soon as its ranks are back (a rollout
instance coming back may still be starting its engine); the change is applied when every
rank is (:meth:`Relayouts.relaid` returns an :class:`Applied`).

Nothing here sends: every method returns the commands to send (:data:`~.state.Sends`).
"""

from __future__ import annotations

import shutil
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from libra_hpc.cluster.layout import lend_hybrid_to_training, return_hybrid_to_rollout
from libra_hpc.runtime.resume import RELAYOUT_PREFIX
from libra_hpc.runtime.roles import roles_from_layout
from libra_hpc.runtime.state import JobState, Sends


@dataclass
class Applied:
    """A layout change every rank carried out: ``kind`` (join, leave, replan), what it was
    about (the replica's id, or the replan's change), the pause record for the log."""

    kind: str
    what: Any
    record: dict = field(default_factory=dict)
    instances: list[int] = field(default_factory=list)
    """The rollout instances the change moved (a replica's, or those a replan dropped)."""


class Relayouts:
    def __init__(self, state: JobState, untrained_on: Callable[[int], bool], rebuild_queue: Callable[[], None]):
        """``untrained_on(replica)``: the batch tracker's answer; ``rebuild_queue()``: a
        fresh queue service on the current layout's buckets (a replan's relayout starts)."""
        self.s = state
        self.untrained_on = untrained_on
        self.rebuild_queue = rebuild_queue
        self.leaving: set[int] = set()  # instances out of rollout for a relayout (draining, then drained)
        self.drained: set[int] = set()
        self.no_route: set[int] = set()  # DP replicas that get no new group (releasing)
        self.pending: tuple[str, Any, list[int]] | None = None  # (kind, what, instances)
        self.relaying: set[int] = set()  # ranks not re-formed yet
        self.switch: dict = {}
        self.mark: tuple[float, dict] = (0.0, {})

    # ------------------------------------------------------------------ queries

    def busy(self) -> bool:
        """No new training step starts: a relayout waits for the step boundary, or its
        training ranks have not all re-formed yet."""
        if self.relaying:
            return bool(self.relaying & set(self.s.roles.trainers))
        return self.pending is not None and self._ready()

    def moving(self) -> bool:
        """A layout change is under way (decided, draining or re-forming)."""
        return bool(self.pending or self.relaying)

    def open_replicas(self) -> list[int]:
        """The DP replicas a new group may go to (not one about to return to rollout)."""
        return [d for d in range(len(self.s.roles.replicas)) if d not in self.no_route]

    def serving(self) -> dict[int, int]:
        """Instance → leader rank of the leaders that run their loop (a drained one left
        it for a relayout)."""
        return {i: r for i, r in self.s.roles.leaders.items() if i not in self.drained}

    def training_leaders(self) -> list[int]:
        """The leaders a new policy goes to (not one leaving rollout)."""
        return [r for i, r in self.s.roles.leaders.items() if i not in self.leaving]

    # ------------------------------------------------------------------ starting a change

    def lend(self, instances: list[int], pool_instances: set[int], direction: dict) -> Sends:
        """A borrow: ``instances`` (the replica's) stop taking turns and leave once they
        hold none. ``direction``: the switch's record so far (replica, predicted gain)."""
        self._begin(direction, pool_instances)
        return self._leave(instances, self.s.next_step())

    def _leave(self, instances: list[int], until: int) -> Sends:
        sends = []
        for instance in instances:
            self.s.service.retire(instance, time.monotonic())
            self.leaving.add(instance)
            sends.append((self.s.roles.leaders[instance], {"op": "leave", "until_version": until}))
        return sends

    def left(self, instance: int) -> bool:
        """Instance ``instance``'s leader left its loop; True when it was one a replan drops
        (the replan goes on by itself), False when it belongs to a lent replica."""
        self.drained.add(instance)
        return self.pending is not None and self.pending[0] == "replan"

    def join(self, rid: int, slots: frozenset, instances: list[int]) -> Sends:
        """Every instance of lent replica ``rid`` left: it joins training at the next step
        boundary."""
        self.pending = ("join", (rid, slots), list(instances))
        return self.advance()

    def give_back(self, rid: int, slots: frozenset, instances: list[int], pool_instances: set[int],
                  direction: dict) -> Sends:
        """A release: no new group goes to the replica's DP ranks; it leaves training once
        no untrained batch has a group there."""
        self._begin(direction, pool_instances)
        train, layout = self.s.layout.training, self.s.layout
        core = len([s for s in train.slots if s not in layout.hybrid]) // (train.tp * train.pp)
        self.no_route.update(range(core, train.dp))
        self.pending = ("leave", (rid, slots), list(instances))
        return self.advance()

    def replace(self, change: Any, pool_instances: set[int]) -> Sends:
        """Run ``change.layout`` (a replan or re-shard) from now on; nothing is in flight.
        The instances it drops drain and leave, then the ranks whose role changes re-form."""
        s = self.s
        layout = replace(change.layout, version=s.layout.version + 1)
        ids = dict(s.ids)
        for g in layout.rollout_instances:
            ids.setdefault(g.slots, max(ids.values(), default=-1) + 1)
        keep = {g.slots for g in layout.rollout_instances}
        dropped = [i for i in s.roles.leaders if s.roles.groups[i].slots not in keep]
        self.pending = ("replan", (change, layout, ids), dropped)
        self._begin({"direction": "replan"}, pool_instances)
        return self._leave(dropped, s.version) + self.advance()

    # ------------------------------------------------------------------ the relayout

    def _ready(self) -> bool:
        """The pending relayout may start: no training step runs, and (leave) no untrained
        batch has a group on a replica that leaves, (replan) every instance it drops has left."""
        if self.s.training or self.pending is None:
            return False
        kind, _, instances = self.pending
        if kind == "leave":
            return not any(self.untrained_on(d) for d in self.no_route)
        if kind == "replan":
            return all(i in self.drained for i in instances)
        return True

    def advance(self) -> Sends:
        """Start the pending relayout if its moment came: the commands that start it. Once
        the last step is trained nothing re-forms: what waits is abandoned (the held-out
        evaluation runs on the leaders that serve)."""
        if self.pending is None or self.relaying or not self._ready() or self.s.version >= self.s.cfg.rl.steps:
            return []
        s = self.s
        kind, what, changed = self.pending
        old = s.roles
        if kind == "join":
            rid, slots = what
            layout = lend_hybrid_to_training(s.layout, reason=f"hybrid replica {rid} joins training (planner's gate)",
                                             only=slots)
        elif kind == "leave":
            rid, slots = what
            layout = return_hybrid_to_rollout(s.layout, s.initial, reason=f"hybrid replica {rid} back to rollout "
                                                                           "(planner's gate)", only=slots)
        else:
            _, layout, s.ids = what
        roles = roles_from_layout(layout, s.rank_of, s.ids)
        moved = set(old.trainers) | set(roles.trainers)
        if kind == "replan":
            changed = list(changed) + [i for i in roles.leaders if i not in old.leaders]
        for instance in changed:
            moved.update((old.members.get(instance) or ()) + (roles.members.get(instance) or ()))
        fresh = sorted(r for r in roles.leaders.values() if r in moved)  # a new engine here: it needs the policy
        for rank in fresh:
            s.leader_version.pop(rank, None)
        command = {"op": "relayout", "roles": roles, "checkpoint": str(s.runlog.folder / f"{RELAYOUT_PREFIX}{layout.version}"),
                   "version": s.version, "fresh_leaders": fresh, "reason": layout.reason}
        self.switch["started"] = time.perf_counter()
        sends: Sends = [(rank, command) for rank in sorted(moved)]
        sends += [(rank, {"op": "roles", "roles": roles}) for rank in roles.leaders.values() if rank not in moved]
        self.relaying = set(moved)
        s.layout, s.roles = layout, roles
        if kind == "replan":  # nothing is in flight: the queue starts over now, so that it knows the new
            self.rebuild_queue()  # instances as soon as their leaders ask (else it refuses them until all re-form)
        s.runlog.event("progress", line=f"relayout v{layout.version}: {layout.reason}")
        return sends

    def relaid(self, source: int, pool_instances: set[int]) -> tuple[bool, Applied | None]:
        """Rank ``source`` re-formed. Returns whether the training ranks are all back now
        (training may go on) and, once every rank is, the change :class:`Applied`."""
        self.relaying.discard(source)
        trainers_back = "trainers_back" not in self.switch and not self.relaying & set(self.s.roles.trainers)
        if trainers_back:
            self.switch["trainers_back"] = time.perf_counter()  # the core training group's pause ends
        if self.relaying:
            return trainers_back, None
        kind, what, instances = self.pending
        self.pending = None
        pause = self.switch.pop("trainers_back") - self.switch["started"]
        shutil.rmtree(self.s.runlog.folder / f"{RELAYOUT_PREFIX}{self.s.layout.version}", ignore_errors=True)  # loaded
        others = self._tokens_rates(pool_instances)
        record = {"direction": self.switch["direction"], "pause_s": round(pause, 3),
                  "all_ranks_back_s": round(time.perf_counter() - self.switch["started"], 3),
                  "decided_to_applied_s": round(time.perf_counter() - self.switch["decided"], 3),
                  "predicted_gain_s": self.switch.get("predicted_gain_s"), **others}
        if kind == "join":
            self.leaving.difference_update(instances)
            self.drained.difference_update(instances)
        elif kind == "leave":
            self.no_route.clear()
            for instance in instances:
                self.s.service.restore(instance)
        else:
            self.leaving.difference_update(instances)
            self.drained.difference_update(instances)
            for instance in instances:
                self.s.leader_load.pop(instance, None)
            self.s.initial = self.s.layout
        return trainers_back, Applied(kind, what[0], record, instances)

    # ------------------------------------------------------------------ measurements

    def _begin(self, direction: dict, pool_instances: set[int]) -> None:
        """A switch is decided (``direction``: its kind and predicted gain): its clock starts,
        and the tokens the rollout instances outside the pool made so far are marked."""
        self.switch = {**direction, "decided": time.perf_counter()}
        self.mark = (time.perf_counter(), {i: m["tokens"] for i, m in self.s.leader_load.items()
                                           if i not in pool_instances})

    def _tokens_rates(self, pool_instances: set[int]) -> dict:
        """Tokens/s of the rollout instances outside the pool over the switch, and over as
        long a window before it (from the leaders' load reports)."""
        now = time.perf_counter()
        totals = {i: m["tokens"] for i, m in self.s.leader_load.items() if i not in pool_instances}
        history = self.s.load_history
        start, at_start = self.mark
        span = now - start
        earlier = [h for h in history if h[0] <= start - span]
        base_t, base = earlier[-1] if earlier else history[0] if history else (start, at_start)
        before = sum(at_start.get(i, 0) - base.get(i, 0) for i in at_start) / max(start - base_t, 1e-9)
        during = sum(totals.get(i, 0) - at_start.get(i, 0) for i in at_start) / max(span, 1e-9)
        return {"others_tokens_per_s_before": round(before, 1), "others_tokens_per_s_during": round(during, 1),
                "others_kept": round(during / before, 3) if before > 0 else None}
