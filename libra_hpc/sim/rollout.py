"""The rollout side: instances, the C-MLFQ queue service, the router and the tool pool.

It drives the very objects the live controller runs: :class:`~libra_hpc.scheduler.QueueService`
over a router from :func:`~libra_hpc.scheduler.make_router`, speaking the service's request
protocol (``ask``, ``tool_return``, ``finish``) exactly as an instance leader would. What a
live instance leader does, the simulator does here:

- a new trajectory is ``submit``-ted; the instance its first turn is queued on is poked;
- an instance with room and nothing waiting asks for at most what fits (free seats, and the
  KV tokens left over the mean need of a turn); when the instance the router chose is full,
  an idle sibling of its bucket asks instead (the service lets siblings drain a queue);
- a finished turn either starts its tool call (the lease is held during the call, as live)
  or reports ``finish``; a tool's return is reported with an output whose length and
  markers the service classifies into (tool, size class, status), the router places the
  next turn, and the chosen instance is poked.

A hybrid replica is lent as the job lends it (runtime/relayout.py ``Relayouts.lend``):
the service retires its instances (``QueueService.retire``: nothing is placed there any
more, and the turns queued on them are placed again at once), they finish what they run
and, once they run nothing, the ``on_drained`` callback fires; ``QueueService.restore``
brings them back when the replica returns. (Until 2026-12-08 the simulator kept them
routable as saturated and let them take their bucket's queue before leaving: a lend on
a800-swe-drift took effect six steps after it was decided.)

Adaptation to the scheduler's API:

- a new plan's instances need a new router and service: they are built only when nothing
  is in flight (the controller drains rollout for a plan change), and the causal index is
  carried over with the router's ``state_dict``/``load_state_dict``.

Events: :class:`Wake` (an instance's step boundary), :class:`ToolDone`.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from libra_hpc.config import SchedulerConfig
from libra_hpc.scheduler import (
    BucketSpec,
    QueueService,
    buckets_from_instances,
    make_router,
)
from libra_hpc.planner.migration import share_limits as planner_share_limits
from libra_hpc.scheduler.routers import outward_order
from libra_hpc.sim.config import CostSpec
from libra_hpc.sim.engine import Event
from libra_hpc.sim.instance import RolloutInstance, Run, StepModel
from libra_hpc.envs.synthetic import ToolCall, Trajectory

log = logging.getLogger(__name__)
ERROR_MARKER = "Traceback (most recent call last)"


@dataclass(frozen=True)
class InstanceSpec:
    """One rollout instance of a layout: id, TP size, hybrid replica it belongs to (or None)."""

    iid: int
    tp: int
    replica: int | None = None


class _Active:
    __slots__ = ("batch", "context", "lease", "ran_on", "traj", "turn")

    def __init__(self, traj: Trajectory, batch: int):
        self.traj = traj
        self.batch = batch
        self.turn = 0
        self.context = traj.prompt_tokens
        self.lease = 0
        self.ran_on: int | None = None  # instance holding its KV prefix (where its last turn ran)


class Wake(Event):
    KIND = 30
    __slots__ = ("iid", "side", "target", "version")

    def __init__(self, time: float, side: RolloutSide, iid: int, version: int, target: int):
        super().__init__(time)
        self.side, self.iid, self.version, self.target = side, iid, version, target

    def fire(self):
        return self.side.on_wake(self)


class ToolDone(Event):
    KIND = 20
    __slots__ = ("active", "call", "side")

    def __init__(self, time: float, side: RolloutSide, active: _Active, call: ToolCall):
        super().__init__(time)
        self.side, self.active, self.call = side, active, call

    def fire(self):
        return self.side.on_tool_done(self)


class RolloutSide:
    """Rollout instances of the current layout plus the queue service routing turns to them.

    ``step_models``: TP → engine timing; ``policy``: a registered router name;
    ``on_batch_done(batch_id, now)`` is called when a batch's last trajectory finishes and
    returns the events it causes."""

    def __init__(self, step_models: dict[int, StepModel], sched: SchedulerConfig, costs: CostSpec, policy: str,
                 seed: int, on_batch_done: Callable[[int, float], list[Event] | None],
                 on_drained: Callable[[int, float], list[Event] | None] | None = None,
                 on_finished: Callable[[Trajectory, int, float], list[Event] | None] | None = None,
                 on_aborted: Callable[[Trajectory, int, int, float], list[Event] | None] | None = None):
        """``on_finished(trajectory, batch, now)``: one trajectory finished (before its
        batch's ``on_batch_done``); ``on_aborted(trajectory, batch, wasted_tokens, now)``:
        one that :meth:`abort` named stopped at a turn boundary (partial rollout)."""
        self.models, self.sched, self.costs, self.policy, self.seed = step_models, sched, costs, policy, seed
        self.on_batch_done = on_batch_done
        self.on_drained = on_drained
        self.on_finished, self.on_aborted = on_finished, on_aborted
        self.aborting: set[str] = set()
        self.mode: dict[int, str] = {}  # instance → "serve" | "drain" | "lent"
        self.instances: dict[int, RolloutInstance] = {}
        self.bucket_of: dict[int, tuple[int, ...]] = {}  # instance → its bucket's instances
        self.service: QueueService | None = None
        self.router = None
        self.layout: tuple[InstanceSpec, ...] = ()
        self.limits: dict[int, int] = {}
        self.active: dict[str, _Active] = {}
        self.left: dict[int, int] = {}  # batch → trajectories not finished
        self._scheduled: dict[int, int] = {}  # instance → version of its scheduled Wake
        self._tool_busy: dict[str, int] = {}
        self._tool_queue: dict[str, deque] = {}
        self._need_sum, self._need_n = 0.0, 0  # KV need of handed-out turns (for ask sizes)
        self.turn_tokens_mean = 512.0  # updated from finished turns; saturation thresholds use it
        self.counts = {"migrations": 0, "turns": 0, "tool_calls": 0, "asks": 0, "fallbacks": 0, "steals": 0,
                       "cache_hits": 0, "later_turns": 0}
        self.gen_tokens = 0
        self._busy_retired = 0.0
        self._prefill_retired = 0.0

    # ------------------------------------------------------------------ layout
    def configure(self, layout: list[InstanceSpec] | tuple[InstanceSpec, ...], now: float,
                  lengths: list[int] | None = None) -> None:
        """Use these instances from now on. Only between batches (nothing in flight); the
        causal index survives. ``lengths``: per-turn generated tokens of recent finished
        trajectories (``bucket_limits: share`` places the bucket limits on them)."""
        if self.active:
            raise RuntimeError(f"rollout reconfigured with {len(self.active)} trajectories in flight")
        layout = tuple(layout)
        limits = self._limits(layout, lengths)
        if (layout == self.layout and self.service is not None and not _moved(self.limits, limits)
                and not _moved(self.saturation, self._saturation_turns(layout))):
            return
        old_router = self.router
        self._busy_retired = self.busy_gpu_s()
        self._prefill_retired = self.prefill_gpu_s()
        self.layout, self.limits = layout, limits
        self.instances = {s.iid: RolloutInstance(s.iid, s.tp, self.models[s.tp], seats=self.costs.max_num_seqs,
                                                 resync_steps=self.costs.resync_steps) for s in layout}
        for inst in self.instances.values():
            inst.t_sync = now
        buckets = self._buckets(layout, limits)
        self.router = make_router(self.policy, buckets, window=self.sched.tree_window,
                                  min_samples=self.sched.min_samples, rebuild_every=self.sched.rebuild_every,
                                  predictor_noise=self.sched.predictor_noise, seed=self.seed,
                                  affinity_tokens=self.sched.affinity_tokens, self_check=self.sched.self_check)
        if old_router is not None and hasattr(old_router, "state_dict") and hasattr(self.router, "load_state_dict"):
            self.router.load_state_dict(old_router.state_dict())
        if old_router is not None:
            self.counts["fallbacks"] += old_router.fallbacks
        self.service = QueueService(self.router, lease_s=1e12, max_batch=self.costs.max_num_seqs,
                                    size_thresholds=self.sched.size_thresholds, error_markers=(ERROR_MARKER,),
                                    default_turn_tokens=max(1, int(self.turn_tokens_mean)))
        self.bucket_of = {i: b.instances for b in buckets for i in b.instances}
        self.bucket_name = {i: b.name for b in buckets for i in b.instances}
        self._scheduled = {}
        self.mode = dict.fromkeys(self.instances, "serve")
        self.queued = {b.name: 0 for b in buckets}  # turns waiting in the service, per bucket
        self.room = {b.name: set(b.instances) for b in buckets}  # serving instances that could take a turn
        self.idle = {b.name: set(b.instances) for b in buckets}  # serving instances with nothing running or waiting
        self.level = {b.name: k for k, b in enumerate(self.router.buckets)}  # MLFQ level, 0 = shortest work
        self.levels = [b.name for b in self.router.buckets]
        self.first_of = {b.name: b.instances[0] for b in buckets}

    def _limits(self, layout: tuple[InstanceSpec, ...], lengths: list[tuple[int, ...]] | None) -> dict[int, int]:
        fixed = self.sched.bucket_token_limits
        missing = sorted({s.tp for s in layout} - set(fixed))
        if missing:
            raise ValueError(f"scheduler.bucket_token_limits has no limit for rollout TP {missing} "
                             f"(configured: {sorted(fixed)})")
        if self.sched.bucket_limits == "fixed" or not lengths:
            return dict(fixed)
        return share_limits(layout, lengths)

    def _saturation_turns(self, layout: tuple[InstanceSpec, ...]) -> dict[int, int]:
        """Turns per instance at which an instance of each TP counts as saturated for
        routing: ``scheduler.saturation`` × the *decode knee*, the smallest batch whose
        step takes twice the step of one sequence alone (each sequence holding the mean KV
        need of the turns handed out so far: context + turn), capped by the seats the KV
        capacity and ``max_num_seqs`` allow. Past the knee each added sequence slows every
        running one (the KV reads dominate the weight read), so a turn waiting for a faster
        idle instance elsewhere is better placed there; at ~256 turns (the seats) the
        threshold never triggered and the largest instances sat idle."""
        need = max(1.0, self._need_sum / self._need_n if self._need_n else 4 * self.turn_tokens_mean)
        out = {}
        for tp in sorted({s.tp for s in layout}):
            model = self.models[tp]
            seats = max(1, min(self.costs.max_num_seqs, int(model.kv_capacity // need)))
            alone, knee = model.step_s(1, need), seats
            for b in range(2, seats + 1):
                if model.step_s(b, b * need) >= 2 * alone:
                    knee = b
                    break
            out[tp] = max(1, round(self.sched.saturation * knee))
        return out

    def _buckets(self, layout: tuple[InstanceSpec, ...], limits: dict[int, int]) -> list[BucketSpec]:
        buckets = buckets_from_instances([(s.iid, s.tp) for s in layout], limits)
        self.saturation = self._saturation_turns(layout)
        return [replace(b, max_outstanding_tokens=max(1, int(self.saturation[b.tp] * self.turn_tokens_mean)))
                for b in buckets]

    def block(self, iids: list[int], now: float) -> tuple[list[int], list[Event]]:
        """Take ``iids`` (a hybrid replica being lent) out of rollout as the job does: the
        service retires them (nothing is placed there any more; the turns queued on them are
        placed again, and the instances given them ask), and they drain what they run.
        Returns the ones already empty (lent at once), the others report through
        ``on_drained``; and the events of the instances that took the turns placed again."""
        empty: list[int] = []
        events: list[Event] = []
        moved = 0
        for iid in iids:
            if self.mode[iid] == "serve":
                moved += self.service.retire(iid, now)
            self.mode[iid] = "drain"
            self._note(self.instances[iid])
        if moved:
            self.queued.update(self.service.stats()["queued"])
            for inst in self.instances.values():
                if self.mode[inst.iid] == "serve" and self._fill(inst, now):
                    self._schedule(inst, events)
        for iid in iids:
            if self._drained(iid):
                self.mode[iid] = "lent"
                empty.append(iid)
        return empty, events

    def unblock(self, iids: list[int], now: float) -> list[Event]:
        """``iids`` serve again (the replica came back): the service restores them; they ask
        for queued work."""
        events: list[Event] = []
        for iid in iids:
            if self.mode[iid] != "serve":
                self.service.restore(iid)
                self.mode[iid] = "serve"
                self._fill(self.instances[iid], now)
                self._note(self.instances[iid])
                self._schedule(self.instances[iid], events)
        return events

    def serving_gpus(self) -> int:
        return sum(i.tp for iid, i in self.instances.items() if self.mode[iid] != "lent")

    def _drained(self, iid: int) -> bool:
        """A retired instance holds nothing queued (the service placed it elsewhere): it is
        drained once it runs nothing."""
        return self.instances[iid].load == 0

    def _bucket_queued(self, iid: int) -> int:
        """Turns queued in ``iid``'s bucket, from the service's replies (placements add, asks
        take; leases never expire here)."""
        return self.queued[self.bucket_name[iid]]

    def _note(self, inst: RolloutInstance) -> None:
        """Keep ``room`` (instances a poke may ask) and ``idle`` in step with ``inst``."""
        name = self.bucket_name[inst.iid]
        room, idle = self.room[name], self.idle[name]
        if self.mode[inst.iid] == "serve" and inst.free_seats > 0 and not inst.waiting:
            room.add(inst.iid)
        else:
            room.discard(inst.iid)
        if self.mode[inst.iid] == "serve" and not inst.load:
            idle.add(inst.iid)
        else:
            idle.discard(inst.iid)

    # ------------------------------------------------------------------ batches
    def submit(self, batch_id: int, trajectories: list[Trajectory], now: float) -> list[Event]:
        """Start a batch at ``now``: every trajectory's first turn is placed and queued."""
        if not trajectories:
            raise ValueError(f"batch {batch_id} is empty")
        self.left[batch_id] = self.left.get(batch_id, 0) + len(trajectories)  # a restart joins its batch
        events: list[Event] = []
        for t in trajectories:
            a = _Active(t, batch_id)
            self.active[t.tid] = a
            placement = self.service.submit(t.tid, t.prompt_id, true_remaining=t.gen_tokens)
            self.queued[placement.bucket] += 1
            self._poke(placement.instance, now, events)
        return events

    def abort(self, tid: str) -> None:
        """Stop trajectory ``tid`` at the end of its current turn (or of the next one, when
        it is in a tool call or queued); ``on_aborted`` then reports it."""
        if tid not in self.active:
            raise KeyError(f"trajectory {tid} is not in flight")
        self.aborting.add(tid)

    def tokens_by_turn_end(self, tid: str) -> int:
        """Tokens trajectory ``tid`` will have generated when its current turn ends."""
        a = self.active[tid]
        return sum(a.traj.turns[: a.turn + 1])

    def maintain(self, now: float) -> None:
        """Between batches: C-MLFQ rebuilds its trees when due."""
        self.service.maintain(now)

    def stats(self) -> dict:
        """Turns waiting now (queued in the service, plus leased ones waiting inside an
        instance for seats or KV), sequences running, busy instances."""
        s = self.service.stats() if self.service is not None else {"queued": {}}
        running = sum(len(i.running) for i in self.instances.values())
        waiting = sum(len(i.waiting) for i in self.instances.values())
        return {"queued": sum(s["queued"].values()) + waiting, "running": running,
                "busy_instances": sum(1 for i in self.instances.values() if i.running)}

    def busy_gpu_s(self) -> float:
        """GPU-seconds instances have been busy (decoding or prefilling) since the start."""
        return self._busy_retired + sum(i.busy_s * i.tp for i in self.instances.values())

    def prefill_gpu_s(self) -> float:
        """GPU-seconds of :meth:`busy_gpu_s` spent prefilling (joining sequences)."""
        return self._prefill_retired + sum(i.prefill_busy_s * i.tp for i in self.instances.values())

    # ------------------------------------------------------------------ events
    def on_wake(self, ev: Wake) -> list[Event] | None:
        inst = self.instances.get(ev.iid)
        if inst is None or inst.version != ev.version:
            return None  # outdated: the instance re-planned, or left the layout
        self._scheduled.pop(ev.iid, None)
        now = ev.time
        finished = inst.wake(now, ev.target)
        events: list[Event] = []
        for run in finished:
            self._turn_end(run, now, events)
        if self.instances.get(ev.iid) is not inst:  # the last batch ended and its callback re-planned
            return events
        if not self._fill(inst, now) and not inst.load:
            self._steal(inst, now)
        self._note(inst)
        self._schedule(inst, events)
        if self.mode[ev.iid] == "drain" and self._drained(ev.iid):
            self.mode[ev.iid] = "lent"
            if self.on_drained is not None:
                events.extend(self.on_drained(ev.iid, now) or ())
        return events

    def on_tool_done(self, ev: ToolDone) -> list[Event]:
        now, a, call = ev.time, ev.active, ev.call
        events: list[Event] = []
        self._tool_release(call.tool, now, events)
        output, exit_code, timed_out = call.output(self.sched.size_thresholds, ERROR_MARKER)
        reply = self.service.handle({"op": "tool_return", "lease": a.lease, "tool": call.tool, "output": output,
                                     "exit_code": exit_code, "timed_out": timed_out,
                                     "tokens": a.traj.turns[a.turn]}, now)
        if not reply["ok"]:
            raise RuntimeError(f"queue service refused the tool return of {a.traj.tid}: {reply}")
        self.counts["migrations"] += reply["migrated"]
        self.queued[reply["bucket"]] += 1
        a.context += a.traj.turns[a.turn] + call.output_tokens
        a.turn += 1
        self._poke(reply["instance"], now, events)
        return events

    # ---------------------------------------------------------------- internals
    def _turn_end(self, run: Run, now: float, events: list[Event]) -> None:
        a: _Active = run.payload
        self.counts["turns"] += 1
        self.gen_tokens += run.tokens
        self.turn_tokens_mean += (run.tokens - self.turn_tokens_mean) / min(self.counts["turns"], 4096)
        aborted = a.traj.tid in self.aborting
        if a.turn < len(a.traj.calls) and not aborted:
            call = a.traj.calls[a.turn]
            self.counts["tool_calls"] += 1
            start = self._tool_acquire(call, a, now)
            if start is not None:
                events.append(ToolDone(start + call.latency_s, self, a, call))
            return
        reply = self.service.handle({"op": "finish", "lease": a.lease, "tokens": run.tokens}, now)
        if not reply["ok"]:
            raise RuntimeError(f"queue service refused the finish of {a.traj.tid}: {reply}")
        del self.active[a.traj.tid]
        self.left[a.batch] -= 1
        if aborted:
            self.aborting.discard(a.traj.tid)
            events.extend(self.on_aborted(a.traj, a.batch, sum(a.traj.turns[: a.turn + 1]), now) or ())
        elif self.on_finished is not None:
            events.extend(self.on_finished(a.traj, a.batch, now) or ())
        if not self.left[a.batch]:
            del self.left[a.batch]
            events.extend(self.on_batch_done(a.batch, now) or ())

    def _tool_acquire(self, call: ToolCall, a: _Active, now: float) -> float | None:
        slots = self.costs.tool_slots
        if slots is None:
            return now
        busy = self._tool_busy.get(call.tool, 0)
        if busy < slots:
            self._tool_busy[call.tool] = busy + 1
            return now
        self._tool_queue.setdefault(call.tool, deque()).append((a, call))
        return None

    def _tool_release(self, tool: str, now: float, events: list[Event]) -> None:
        if self.costs.tool_slots is None:
            return
        queue = self._tool_queue.get(tool)
        if queue:
            a, call = queue.popleft()
            events.append(ToolDone(now + call.latency_s, self, a, call))
        else:
            self._tool_busy[tool] -= 1

    def _poke(self, iid: int, now: float, events: list[Event]) -> None:
        """A turn was queued on ``iid``: let it (or, when it is full, an idle sibling; when
        the whole bucket is full, an idle instance of a neighbouring bucket) ask."""
        inst = self.instances[iid]
        if self._fill(inst, now):
            self._schedule(inst, events)
            return
        name = self.bucket_name[iid]
        for sibling in sorted(self.room[name]):
            other = self.instances[sibling]
            if other is not inst and self._fill(other, now):
                self._schedule(other, events)
                return
        for level in outward_order(self.level[name], len(self.levels))[1:]:
            idle = self.idle[self.levels[level]]
            if idle:
                other = self.instances[min(idle)]
                if self._steal(other, now, only=name):
                    self._note(other)
                    self._schedule(other, events)
                return

    def _steal(self, inst: RolloutInstance, now: float, only: str | None = None) -> int:
        """An idle serving instance whose own bucket has nothing queued takes queued turns of
        a neighbouring bucket (the longer level first; ``only``: that bucket), asking as
        that bucket's first instance. Each stolen turn counts as a migration (its KV moves
        here). Adaptation: the live service only lets siblings of one bucket drain each
        other's queues; the router keeps accounting the turn's load on the bucket it chose."""
        name = self.bucket_name[inst.iid]
        if self.mode[inst.iid] != "serve" or inst.load or self.queued[name] or len(self.levels) < 2:
            return 0
        for level in outward_order(self.level[name], len(self.levels))[1:]:
            other = self.levels[level]
            if only is not None and other != only:
                continue
            if self.queued[other]:
                got = self._fill(inst, now, self.first_of[other])
                self.counts["steals"] += got
                self.counts["migrations"] += got
                return got
        return 0

    def _fill(self, inst: RolloutInstance, now: float, as_iid: int | None = None) -> int:
        """Ask the service for as many turns as ``inst`` can take; returns how many came.
        ``as_iid``: ask as that instance (of another bucket: :meth:`_steal`)."""
        asker = inst.iid if as_iid is None else as_iid
        if inst.waiting or inst.free_seats <= 0 or self.mode[inst.iid] != "serve" or not self._bucket_queued(asker):
            return 0
        need = self._need_sum / self._need_n if self._need_n else 1.0
        room = inst.model.kv_capacity - inst.reserved
        want = max(1, min(inst.free_seats, int(room // max(need, 1.0))))
        self.counts["asks"] += 1
        reply = self.service.handle({"op": "ask", "instance": asker, "max": want}, now)
        turns = reply["turns"]
        if not turns:
            return 0
        runs = []
        for turn in turns:
            self.queued[turn["bucket"]] -= 1
            a = self.active[turn["tid"]]
            a.lease = turn["lease"]
            tokens = a.traj.turns[a.turn]
            cached = a.turn > 0 and a.ran_on == inst.iid  # its KV prefix is here (prefix cache)
            if a.turn > 0:
                self.counts["later_turns"] += 1
                self.counts["cache_hits"] += cached
            a.ran_on = inst.iid
            prefill = a.traj.calls[a.turn - 1].output_tokens if cached else a.context
            runs.append(Run(turn["lease"], a.traj.tid, a.context, tokens, prefill, payload=a))
            self._need_sum += a.context + tokens
            self._need_n += 1
        inst.offer(runs, now)
        self._note(inst)
        return len(runs)

    def _schedule(self, inst: RolloutInstance, events: list[Event]) -> None:
        if inst.wake_at is not None and self._scheduled.get(inst.iid) != inst.version:
            self._scheduled[inst.iid] = inst.version
            time, target = inst.wake_at
            events.append(Wake(time, self, inst.iid, inst.version, target))


def _moved(old: dict[int, int], new: dict[int, int], factor: float = 1.5) -> bool:
    """Limits changed enough to rebuild the router (a rebuild reloads the causal index)."""
    if old.keys() != new.keys():
        return True
    return any(max(a, b) > factor * min(a, b) for a, b in ((old[k], new[k]) for k in old))


def share_limits(layout: tuple[InstanceSpec, ...], trajectories: list[tuple[int, ...]]) -> dict[int, int]:
    """Bucket token limits from the layout's GPU shares (``bucket_limits: share``), on the
    quantity C-MLFQ compares: the *remaining* output tokens after a tool return.

    ``trajectories``: per-turn generated tokens of recent finished trajectories. Every turn
    ``d >= 1`` is a sample (remaining tokens ``sum(turns[d:])``, weight ``turns[d]``: the
    tokens it decodes on the level its remaining length maps to); first turns always run on
    the top level and count there. TP sizes ascending, bucket ``i``'s limit is the smallest
    remaining length at which the decoded tokens routed to buckets ``0..i`` reach their
    cumulative GPU share; the last bucket is unbounded. Limits are strictly increasing.
    The arithmetic is the planner's (:func:`libra_hpc.planner.migration.share_limits`),
    which prices C-MLFQ's migrations on the limits a plan would get."""
    gpus: dict[int, int] = {}
    for s in layout:
        gpus[s.tp] = gpus.get(s.tp, 0) + s.tp
    first = sum(t[0] for t in trajectories if t)
    samples = [(sum(t[d:]), t[d]) for t in trajectories for d in range(1, len(t))]
    return planner_share_limits(gpus, first, samples)
