"""The C-MLFQ queue service: trajectories, their turns, and the leases on them.

Pure: no MPI, no torch, no clock of its own (every call that needs the time takes
``now``, seconds on one monotonic clock). The protocol, its requests, replies and
refusals, is scheduler/protocol.py's; scheduler/mpi_service.py carries it over MPI; the
simulator may call :meth:`QueueService.handle` directly. The service's record of each
instance and each active trajectory is in scheduler/records.py.

A trajectory alternates generated turns and tool calls. Its turns run one at a time: a
turn is *queued* on a rollout instance, *leased* to the instance that asked for it, and
ends with a tool return (the router places the next turn, which may migrate to another
bucket) or with the finish of the trajectory (the router learns from it). At any moment
an active trajectory has exactly one turn, queued or leased; a finished one has none.

Leases. A lease lasts ``lease_s`` from when it was handed out or from the holder's last
``ask``/``heartbeat``, whichever is later. :meth:`QueueService.expire` (run at the start
of every request) re-places expired turns with the router (the instance may be dead) and
queues them at the front. Expiry uses a heap of deadlines; renewing an instance only
stamps the instance, and a popped deadline that a renewal pushed back is pushed again.
Entries of leases ended by a report stay in the heap until popped; when they outnumber
live leases 3 to 1 (plus 4096) the heap is rebuilt, which is amortised O(1).

Silent instances. An instance is *silent* (maybe dead) when one of its leases expires,
or when turns are queued on it and it has not asked or sent a heartbeat for ``lease_s``
(checked by :meth:`QueueService.maintain`): the turns queued on it are placed again
(with the expired ones), and the router (``set_down``, when it has one) places nothing
there while another instance can take the turn — otherwise a bucket whose only instance
died would hold its work forever. Its next ``ask`` or ``heartbeat`` brings it back, and
turns that had to be queued on silent instances meanwhile are placed again.

Load accounting. ``router.turn_started(instance, e)`` when a turn is placed (queued on
``instance``) and ``router.turn_ended(instance, e)`` when its lease ends (report or
expiry) or it leaves the queue otherwise (a sibling instance asked for it first: ended
here, started there; its instance fell silent), with the same ``e``: the mean turn
length (output tokens) reported so far when it was placed, ``default_turn_tokens``
before the first report. So an instance's outstanding work counts its queue, not only
the turns it is generating: least-load choices see a long queue.

Cost per request: O(1) for heartbeat; O(batch · log leases + bucket instances) for ask;
O(depth + log leases) plus the router's cost for tool_return and finish. Nothing scans
all trajectories or all leases per request (the heap compaction is amortised;
:meth:`QueueService.audit` scans, for tests only).
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Callable, Sequence
from typing import Any

from libra_hpc.scheduler.protocol import (
    MAX_BATCH_REQUESTS,
    MAX_TURN_TOKENS,
    OPS,
    REASONS,
    Reject,
    check_tool_return,
    int_field,
)
from libra_hpc.scheduler.records import LEASED, NOWHERE, QUEUED, InstanceRecord, TrajectoryRecord
from libra_hpc.scheduler.routers import RouterBase
from libra_hpc.scheduler.state import Classifier
from libra_hpc.scheduler.types import (
    BucketSpec,
    CompletedTrajectory,
    FinishedTrajectory,
    Placement,
    Router,
    RouterError,
    ServiceInvariantError,
    ToolState,
    TrajectoryView,
    new_tuple,
)

log = logging.getLogger(__name__)

class _Delegate(RouterBase):
    """A router that is not a :class:`RouterBase` (a test's stub, a user's own object),
    called through RouterBase's methods, so that the service calls one class's methods:
    compiled, a call to a RouterBase is a direct call, one to any object a generic one
    (4% of a decision). Only the methods the service calls on every decision delegate."""

    def __init__(self, router: Router):  # no RouterBase state: every method used is delegated
        self.router = router

    def place(self, view: TrajectoryView) -> Placement:
        return self.router.place(view)

    def turn_started(self, instance: int, expected_tokens: int) -> None:
        self.router.turn_started(instance, expected_tokens)

    def turn_ended(self, instance: int, expected_tokens: int) -> None:
        self.router.turn_ended(instance, expected_tokens)

    def observe(self, finished: FinishedTrajectory) -> None:
        self.router.observe(finished)


class QueueService:
    """Owns trajectories, per-instance turn queues and leases; asks ``router`` where turns
    run. ``buckets`` defaults to ``router.buckets``; the instances of the buckets are the
    only ones that may ask. ``remember_leases``: over how many of the latest lease ids
    *issued* a late report is told from a duplicate one (a report for an older lease is
    refused as late, ended too long ago). ``classify``: replaces
    :func:`~libra_hpc.scheduler.state.classify` (same arguments)."""

    def __init__(self, router: Router, *, lease_s: float, max_batch: int, size_thresholds: Sequence[int],
                 error_markers: Sequence[str], buckets: Sequence[BucketSpec] | None = None,
                 default_turn_tokens: int = 256, remember_leases: int = 1 << 16,
                 classify: Callable[..., ToolState] | None = None):
        if lease_s <= 0 or max_batch < 1 or default_turn_tokens < 1:
            raise ValueError(f"QueueService: lease_s={lease_s} must be > 0, max_batch={max_batch} >= 1, "
                             f"default_turn_tokens={default_turn_tokens} >= 1")
        fast = Classifier(size_thresholds, error_markers)  # refuses bad thresholds now, not at the first tool return
        buckets = buckets if buckets is not None else getattr(router, "buckets", None)
        if not buckets:
            raise ValueError(f"QueueService: router {getattr(router, 'name', router)!r} has no .buckets; pass buckets=")
        self._router = router
        self._calls = router if isinstance(router, RouterBase) else _Delegate(router)  # the hot-path calls
        self._lease_s = float(lease_s)
        self._max_batch = int(max_batch)
        self._fast_classify = fast
        self._classify: Callable[[str, str, int | None, bool], ToolState]
        if classify is None:
            self._classify = fast
        else:
            thresholds, markers = tuple(size_thresholds), tuple(error_markers)
            self._classify = lambda tool, output, code, timed_out: classify(tool, output, code, timed_out,
                                                                            thresholds, markers)
        self._default_turn_tokens = int(default_turn_tokens)
        self._remember = int(remember_leases)
        self._instances: dict[int, InstanceRecord] = {}
        for bucket in buckets:
            for instance in bucket.instances:
                if instance in self._instances:
                    raise ValueError(f"QueueService: instance {instance} is in buckets "
                                     f"{self._instances[instance].bucket!r} and {bucket.name!r}")
                self._instances[instance] = InstanceRecord(instance, bucket.name)
            for i, instance in enumerate(bucket.instances):
                self._instances[instance].sources = [self._instances[source]
                                                     for source in bucket.instances[i:] + bucket.instances[:i]]
        self._depth: dict[str, int] = {b.name: 0 for b in buckets}
        self._trajs: dict[str, TrajectoryRecord] = {}
        self._leases: dict[int, TrajectoryRecord] = {}  # lease id → the trajectory whose turn it holds
        self._down: set[int] = set()  # silent instances (see _silent)
        self._retired: set[int] = set()  # instances out of rollout until restore() (the hybrid pool lent)
        self._first_seen: float | None = None  # time of the first maintenance
        self._next_liveness = float("-inf")
        self._expired: set[int] = set()  # lease ids that expired, within the remembered window
        self._prune_expired_at = 1024
        self._expiry: list[tuple[float, int]] = []
        self._next_lease = 1
        self._finished: list[TrajectoryRecord] = []  # completed, not drained yet (drain_finished builds the records)
        self._turn_tokens_total = 0
        self._turns_total = 0
        # Counters (stats()): attributes, not a dict, since several change per decision.
        self._submitted = self._placements = self._decisions = self._migrations = self._handed_out = 0
        self._completed = self._requeued_on_expiry = self._instances_silent = 0
        self._rejected = dict.fromkeys(REASONS, 0)
        self._ops = {"ask": self._ask, "tool_return": self._tool_return, "finish": self._finish,
                     "heartbeat": self._heartbeat, "stats": lambda message, now: {"ok": True, "stats": self.stats()}}
        self._batched_ops = dict(self._ops)
        self._ops["batch"] = self._batch

    # ------------------------------------------------------------------ entry points

    def submit(self, tid: str, prompt_id: str, true_remaining: int | None = None) -> Placement:
        """A new trajectory; the router places its first turn (``view.bucket is None``).
        ``true_remaining``: its total output tokens, known only in simulations (oracle)."""
        if not isinstance(tid, str) or not isinstance(prompt_id, str):
            raise TypeError(f"submit: tid and prompt_id must be str, got {tid!r}, {prompt_id!r}")
        if tid in self._trajs:
            raise ValueError(f"submit: trajectory {tid!r} is already active ({self._trajs[tid].phase})")
        traj = TrajectoryRecord(tid, prompt_id, true_remaining)
        self._trajs[tid] = traj
        self._submitted += 1
        return self._place(traj, front=False)

    def retire(self, instance: int, now: float) -> int:
        """``instance`` leaves rollout (its GPUs are lent to training): nothing is placed
        there any more and the turns queued on it are placed again; turns it holds leases
        on still end there (their reports are taken). Returns the turns placed again. It
        takes work again after :meth:`restore` (an ask alone does not bring it back)."""
        if instance not in self._instances:
            raise ValueError(f"retire: unknown rollout instance {instance}")
        self._retired.add(instance)
        if instance in self._down:
            return 0
        lost = self._silent(instance, now, "left rollout", planned=True)
        self._requeue(lost)
        return len(lost)

    def restore(self, instance: int) -> None:
        """A retired instance serves rollout again (the hybrid pool came back)."""
        self._retired.discard(instance)
        if instance in self._down:
            self._back(instance)

    def handle(self, message: Any, now: float) -> dict:
        """Answer one protocol request (scheduler/protocol.py). Never raises for a bad request;
        raises :class:`RouterError` only when the router misbehaves."""
        if self._expiry and self._expiry[0][0] <= now:
            self.expire(now)
        return self._dispatch(message, now, self._ops)

    def _dispatch(self, message: Any, now: float, ops: dict) -> dict:
        if type(message) is not dict:
            return self._refuse("malformed", f"request must be a dict with an 'op' field, got {type(message).__name__}")
        op = message.get("op")
        handler = ops.get(op) if type(op) is str else None
        if handler is None:
            valid = ", ".join(o for o in OPS if o in ops)
            return self._refuse("malformed", f"request op {op!r} is unknown here; valid ops: {valid}")
        try:
            return handler(message, now)
        except Reject as refused:
            return self._refuse(refused.reason, refused.error)

    def expire(self, now: float) -> int:
        """Re-place and re-queue every turn whose lease expired by ``now`` (and the turns
        queued on instances that fell silent); returns how many leases expired."""
        heap, lost, expired = self._expiry, [], 0
        while heap and heap[0][0] <= now:
            _, lid = heapq.heappop(heap)
            traj = self._leases.get(lid)
            if traj is None:
                continue  # ended by a report
            instance = traj.at.id
            renewed = traj.at.renewed
            deadline = traj.deadline if renewed is None else max(traj.deadline, renewed + self._lease_s)
            if deadline > now:  # renewed since: look again then
                traj.deadline = deadline
                heapq.heappush(heap, (deadline, lid))
                continue
            self._end_lease(traj, expired=True)
            traj.requeues += 1
            self._requeued_on_expiry += 1
            log.info("lease %d of trajectory %s on instance %d expired at t=%.3f: turn re-queued", lid, traj.tid,
                     instance, now)
            lost.append(traj)
            expired += 1
            if instance not in self._down:
                lost.extend(self._silent(instance, now, "let a lease expire"))
        self._requeue(lost)  # oldest lease first
        return expired

    def _requeue(self, trajs: list[TrajectoryRecord]) -> None:
        """Place turns again, at the queue fronts, the first of ``trajs`` ahead."""
        for traj in reversed(trajs):
            moved = traj.migrated  # its KV cache was never built where the turn now goes
            self._place(traj, front=True)
            traj.migrated = traj.migrated or moved

    def _check_liveness(self, now: float) -> None:
        """An instance with queued turns that has not asked or sent a heartbeat for
        ``lease_s`` (since the service's first maintenance, if ever) falls silent too:
        one that died holding no lease never lets one expire. Runs from :meth:`maintain`
        at most every ``lease_s / 4``; O(instances)."""
        if self._first_seen is None:
            self._first_seen = now
        if now < self._next_liveness:
            return
        self._next_liveness = now + self._lease_s / 4
        lost: list[TrajectoryRecord] = []
        for instance, at in self._instances.items():
            renewed = at.renewed if at.renewed is not None else self._first_seen
            if at.queue and instance not in self._down and now - renewed >= self._lease_s:
                lost.extend(self._silent(instance, now, f"held {len(at.queue)} queued turns without asking"))
        self._requeue(lost)

    def _take_queue(self, instance: int) -> list[TrajectoryRecord]:
        """Empty ``instance``'s queue (oldest first), its load accounting included."""
        at = self._instances[instance]
        taken = list(at.queue)
        at.queue.clear()
        if taken:
            self._depth[at.bucket] -= len(taken)
        for traj in taken:
            self._calls.turn_ended(instance, traj.expected)
        return taken

    def _silent(self, instance: int, now: float, why: str, planned: bool = False) -> list[TrajectoryRecord]:
        """``instance`` did not ask or send a heartbeat in time: tell the router to place
        nothing there while another instance can take it, and take back the turns queued
        on it (returned, oldest first, to be placed again): a bucket of one dead instance
        would keep them forever. It is back at its next ask or heartbeat (:meth:`_back`).
        ``planned`` (:meth:`retire`: the hybrid pool lends it): the same, but not a fault:
        logged at info and not counted in ``instances_silent``."""
        self._down.add(instance)
        set_down = getattr(self._router, "set_down", None)
        if set_down is not None:
            set_down(instance, True)
        taken = self._take_queue(instance)
        if planned:
            log.info("rollout instance %d %s (t=%.3f): %d queued turns placed again", instance, why, now, len(taken))
            return taken
        self._instances_silent += 1
        log.warning("rollout instance %d is silent (it %s; t=%.3f): %d queued turns placed again, no new work for "
                    "it until it asks or sends a heartbeat", instance, why, now, len(taken))
        return taken

    def _back(self, instance: int) -> None:
        """``instance`` asked or sent a heartbeat after falling silent. Turns that had to
        be queued on silent instances (every instance was silent then) are placed again,
        now that there is a live one."""
        self._down.discard(instance)
        set_down = getattr(self._router, "set_down", None)
        if set_down is not None:
            set_down(instance, False)
        stranded = [traj for down in sorted(self._down) for traj in self._take_queue(down)]
        self._requeue(stranded)
        log.info("rollout instance %d is back; %d turns stranded on silent instances placed again", instance,
                 len(stranded))

    def maintain(self, now: float, *, busy: bool = False) -> bool:
        """Work kept off the request path: expire leases, and let the router run its
        periodic maintenance (C-MLFQ's tree rebuild) if it has any. The transport calls
        this when no request is waiting (``busy=False``) and, under constant load,
        between requests (``busy=True``: the router only does overdue work)."""
        self.expire(now)
        self._check_liveness(now)
        maintain = getattr(self._router, "maintain", None)
        return bool(maintain(busy=busy)) if maintain is not None else False

    def drain_finished(self) -> list[CompletedTrajectory]:
        """Completed trajectories since the last call, in completion order."""
        done, self._finished = self._finished, []
        return [CompletedTrajectory(traj.tid, traj.prompt_id, traj.states, traj.turn_tokens, traj.migrations,
                                    traj.requeues) for traj in done]

    def stats(self) -> dict:
        """Counters since start: ``submitted``, ``placements`` (all router decisions),
        ``decisions`` (placements after a tool return), ``migrations``, ``handed_out``,
        ``completed``, ``requeued_on_expiry``, ``instances_silent`` (times an instance let
        a lease expire), ``late_reports``, ``duplicate_reports``, ``rejected`` (by
        reason); and now: ``active`` trajectories, ``leased`` turns, ``queued`` turns per
        bucket, ``silent`` instances, ``undrained`` completed trajectories,
        ``router_falling_back`` (cmlfq's self-check sends every turn to the top level)."""
        return {"submitted": self._submitted, "placements": self._placements, "decisions": self._decisions,
                "migrations": self._migrations, "handed_out": self._handed_out, "completed": self._completed,
                "requeued_on_expiry": self._requeued_on_expiry, "instances_silent": self._instances_silent,
                "late_reports": self._rejected["late_report"],
                "duplicate_reports": self._rejected["duplicate_report"], "rejected": dict(self._rejected),
                "active": len(self._trajs), "leased": len(self._leases), "queued": dict(self._depth),
                "silent": sorted(self._down), "undrained": len(self._finished),
                "router_falling_back": bool(getattr(self._router, "falling_back", False))}

    def audit(self) -> dict[str, str]:
        """Tid → ``queued``/``leased`` for every active trajectory, checked against the
        queues and leases. A full scan, for tests: raises ServiceInvariantError when a
        trajectory is lost, in two places, or its phase disagrees with where it is."""
        seen: dict[str, str] = {}
        for instance, at in self._instances.items():
            for traj in at.queue:
                self._audit_one(seen, traj, QUEUED, instance)
        for lid, traj in self._leases.items():
            if traj.lease != lid:
                raise ServiceInvariantError(f"trajectory {traj.tid} is filed under lease {lid} but holds {traj.lease}")
            self._audit_one(seen, traj, LEASED, traj.at.id)
        if seen.keys() != self._trajs.keys():
            raise ServiceInvariantError(f"lost: {sorted(self._trajs.keys() - seen.keys())}, "
                                        f"unknown: {sorted(seen.keys() - self._trajs.keys())}")
        depth = {b: 0 for b in self._depth}
        for at in self._instances.values():
            depth[at.bucket] += len(at.queue)
        held = {i: 0 for i in self._instances}
        for traj in self._leases.values():
            held[traj.at.id] += 1
        counted = {i: at.held for i, at in self._instances.items()}
        if depth != self._depth or held != counted:
            raise ServiceInvariantError(f"counters drifted: depth {self._depth} vs {depth}, held {counted} vs {held}")
        return seen

    def _audit_one(self, seen: dict[str, str], traj: TrajectoryRecord, phase: str, instance: int) -> None:
        if traj.tid in seen:
            raise ServiceInvariantError(f"trajectory {traj.tid} is both {seen[traj.tid]} and {phase}")
        if traj.phase != phase or traj.at.id != instance or self._trajs.get(traj.tid) is not traj:
            raise ServiceInvariantError(f"trajectory {traj.tid}: phase {traj.phase} on {traj.at.id}, "
                                        f"found {phase} on {instance}")
        seen[traj.tid] = phase

    # ------------------------------------------------------------------- operations

    def _ask(self, message: dict, now: float) -> dict:
        at = self._instance(message, "ask")
        want = int_field(message, "max", "ask", minimum=1)
        at.renewed = now
        if at.id in self._retired:
            return {"ok": True, "turns": [], "active": len(self._trajs)}
        if at.id in self._down:
            self._back(at.id)
        room = min(want, self._max_batch)
        turns: list[dict] = []
        for source in at.sources:
            queue = source.queue
            while queue and room:
                turns.append(self._hand_out(queue.popleft(), at, now))
                room -= 1
            if not room:
                break
        return {"ok": True, "turns": turns, "active": len(self._trajs)}

    def _tool_return(self, message: dict, now: float) -> dict:
        # message.get(...) each time, not a bound method kept in a local: compiled, that is a native lookup
        tool, output = message.get("tool"), message.get("output")
        tokens, lid = message.get("tokens"), message.get("lease")
        size = message.get("size") if output is None else None
        if (type(tool) is not str or type(tokens) is not int or not 0 <= tokens <= MAX_TURN_TOKENS
                or type(lid) is not int):  # one test on the hot path; the slow path names the field
            check_tool_return(message)
        try:
            if size is not None:  # classified by the worker
                status = message.get("status")
                if type(size) is not str or type(status) is not str:
                    check_tool_return(message)
                state = self._fast_classify.state(tool, size, status)
            else:
                exit_code, timed_out = message.get("exit_code"), message.get("timed_out", False)
                if type(output) is not str or (exit_code is not None and type(exit_code) is not int) \
                        or type(timed_out) is not bool:
                    check_tool_return(message)
                state = self._classify(tool, output, exit_code, timed_out)
        except ValueError as exc:
            raise Reject("malformed", f"tool_return (lease {lid}): {exc}") from None
        traj = self._claim(lid, "tool_return")
        traj.states += (state,)
        traj.keys += (state.key(),)
        traj.turn_tokens += (tokens,)  # as _record_turn(), inlined on the hot path
        traj.generated += tokens
        self._turn_tokens_total += tokens
        self._turns_total += 1
        self._decisions += 1
        bucket, instance, migrated, reason = self._place(traj, front=False)
        return {"ok": True, "tid": traj.tid, "bucket": bucket, "instance": instance, "migrated": migrated,
                "reason": reason}

    def _finish(self, message: dict, now: float) -> dict:
        tokens = int_field(message, "tokens", "finish", minimum=0, maximum=MAX_TURN_TOKENS)
        traj = self._claim(int_field(message, "lease", "finish"), "finish")
        self._record_turn(traj, tokens)
        turns = traj.turn_tokens
        total, remaining = traj.generated, []
        for tokens in turns:  # what remained after each tool return: a suffix sum
            remaining.append(total)
            total -= tokens
        self._calls.observe(new_tuple(FinishedTrajectory, (traj.prompt_id, traj.states, tuple(remaining), traj.keys)))
        del self._trajs[traj.tid]
        self._finished.append(traj)
        self._completed += 1
        return {"ok": True, "tid": traj.tid, "turns": len(remaining)}

    def _batch(self, message: dict, now: float) -> dict:
        requests = message.get("requests")
        if type(requests) is not list or len(requests) > MAX_BATCH_REQUESTS:
            raise Reject("malformed", f"batch: field 'requests' must be a list of at most {MAX_BATCH_REQUESTS} "
                                       f"requests, got {type(requests).__name__}"
                                       f"{f' of {len(requests)}' if type(requests) is list else ''}")
        replies: list[dict] = []
        for request in requests:  # as _dispatch(request, now, self._batched_ops), direct calls for the hot ops
            op = request.get("op") if type(request) is dict else None
            try:
                if op == "tool_return":
                    replies.append(self._tool_return(request, now))
                elif op == "finish":
                    replies.append(self._finish(request, now))
                elif op == "ask":
                    replies.append(self._ask(request, now))
                else:
                    replies.append(self._dispatch(request, now, self._batched_ops))  # the rest, or what is wrong
            except Reject as refused:
                replies.append(self._refuse(refused.reason, refused.error))
        return {"ok": True, "replies": replies}

    def _heartbeat(self, message: dict, now: float) -> dict:
        at = self._instance(message, "heartbeat")
        at.renewed = now
        if at.id in self._down and at.id not in self._retired:
            self._back(at.id)
        return {"ok": True, "leases": at.held}

    # ---------------------------------------------------------------------- helpers

    def _place(self, traj: TrajectoryRecord, front: bool) -> Placement:
        remaining = None if traj.true_remaining is None else max(0, traj.true_remaining - traj.generated)
        view = new_tuple(TrajectoryView, (traj.tid, traj.prompt_id, traj.states, traj.generated, traj.bucket,
                                           remaining, traj.turn_tokens, traj.prev_instance, traj.keys))
        placement = self._calls.place(view)
        bucket, instance, migrated, _ = placement
        at = self._instances.get(instance)
        if at is None or at.bucket != bucket:
            raise RouterError(f"router {getattr(self._router, 'name', '?')!r} placed trajectory {traj.tid} on "
                              f"instance {instance} of bucket {bucket!r}; instances by bucket: "
                              f"{ {i: known.bucket for i, known in self._instances.items()} }")
        self._placements += 1
        traj.expected = self._turn_tokens_total // self._turns_total if self._turns_total else self._default_turn_tokens
        self._calls.turn_started(instance, traj.expected)
        if migrated:
            self._migrations += 1
            traj.migrations += 1
        traj.bucket = bucket
        traj.migrated = migrated
        traj.phase = QUEUED
        traj.at = at
        at.queue.appendleft(traj) if front else at.queue.append(traj)
        self._depth[bucket] += 1
        return placement

    def _hand_out(self, traj: TrajectoryRecord, at: InstanceRecord, now: float) -> dict:
        bucket = traj.bucket
        assert bucket is not None, "a queued turn has a bucket"
        self._depth[bucket] -= 1
        lid = self._next_lease
        self._next_lease += 1
        if traj.at is not at:  # a sibling's queue: the turn's load moves here
            self._calls.turn_ended(traj.at.id, traj.expected)
            self._calls.turn_started(at.id, traj.expected)
        deadline = traj.deadline = now + self._lease_s
        traj.lease = lid
        self._leases[lid] = traj
        heapq.heappush(self._expiry, (deadline, lid))
        if len(self._expiry) > 4 * len(self._leases) + 4096:  # mostly ended leases: compact (amortised O(1))
            self._expiry = [(held.deadline, held.lease) for held in self._leases.values()]
            heapq.heapify(self._expiry)
        at.held += 1
        traj.phase = LEASED
        traj.at = at
        self._handed_out += 1
        return {"lease": lid, "tid": traj.tid, "prompt_id": traj.prompt_id, "turn": len(traj.states),
                "bucket": traj.bucket, "migrated": traj.migrated, "prev_instance": traj.prev_instance,
                "lease_s": self._lease_s}

    def _claim(self, lid: int, op: str) -> TrajectoryRecord:
        """End the lease ``lid`` for a report (returns its trajectory), or refuse the report."""
        traj = self._leases.get(lid)
        if traj is None:
            if not 0 < lid < self._next_lease:
                raise Reject("unknown_lease", f"{op}: lease {lid} was never handed out")
            if lid in self._expired:
                raise Reject("late_report", f"{op}: lease {lid} expired and its turn was re-queued; "
                                             "this report is dropped")
            if lid >= self._next_lease - self._remember:  # neither live nor expired: reported
                raise Reject("duplicate_report", f"{op}: lease {lid} was already reported; this report is dropped")
            raise Reject("late_report", f"{op}: lease {lid} ended too long ago to remember; this report is dropped")
        del self._leases[lid]  # as _end_lease(traj), inlined on the hot path
        traj.lease = 0
        at = traj.at
        at.held -= 1
        self._calls.turn_ended(at.id, traj.expected)
        traj.prev_instance = at.id
        return traj

    def _end_lease(self, traj: TrajectoryRecord, expired: bool) -> None:
        lid = traj.lease
        del self._leases[lid]
        traj.lease = 0
        if expired:
            self._expired.add(lid)
            if len(self._expired) > self._prune_expired_at:  # forget ids that left the window (amortised O(1))
                oldest = self._next_lease - self._remember
                self._expired = {old for old in self._expired if old >= oldest}
                self._prune_expired_at = max(1024, 2 * len(self._expired))
        traj.at.held -= 1
        self._calls.turn_ended(traj.at.id, traj.expected)

    def _record_turn(self, traj: TrajectoryRecord, tokens: int) -> None:
        traj.turn_tokens += (tokens,)
        traj.generated += tokens
        self._turn_tokens_total += tokens
        self._turns_total += 1

    def _instance(self, message: dict, op: str) -> InstanceRecord:
        instance = int_field(message, "instance", op)
        at = self._instances.get(instance)
        if at is None:
            raise Reject("unknown_instance", f"{op}: instance {instance} is in no bucket; known instances: "
                                              f"{sorted(self._instances)}")
        return at

    def _refuse(self, reason: str, error: str) -> dict:
        self._rejected[reason] += 1
        log.warning("queue request refused (%s): %s", reason, error)
        return {"ok": False, "reason": reason, "error": error}
