"""Rank 0's one event loop: every message the controller serves, its timers, its idle work.

The controller rank answers several kinds of messages (tags from
:mod:`libra_hpc.cluster.messages`), each by the handler registered for its tag:

| tag | handler (registered by) |
|---|---|
| ``QUEUE_REQUEST`` | the C-MLFQ queue: one request, one reply (scheduler/mpi_service.py ``QueueHandler``) |
| ``REPORT`` | control: command answers, step reports, heartbeats (the controller) |
| ``TOOL_REQUEST`` | a tool action for the shared Tangram pool; its result goes back as ``TOOL_RESULT`` (runtime/tools.py ``ToolService``) |

and runs timers (planner checks, checkpoints, saving the routing tree) and idle hooks
(lease expiry, the router's maintenance) between messages.

**Why nothing blocks.** The loop only probes (``comm.improbe``, which returns at once),
receives the message a probe matched, and calls its handler; handlers answer with a
send and return (a send to a rank that posted its receive, or a small message MPICH
sends eagerly, does not wait for the peer). No handler waits for another rank, so a slow
or dead peer delays only its own requests. MPICH's blocking receive busy-polls a core;
an idle loop sleeps instead (below).

**Order and fairness.** With one handler the loop probes that tag alone (other traffic on
the communicator is left alone: :func:`serve_queue` relies on it); with several it
probes any tag and serves messages in the order MPI matches them, the oldest arrived
first (MPICH keeps one queue of arrived, unmatched messages, polling its senders in
turn). So a control message waits behind at most the messages that arrived before it:
with queue clients that each have one request outstanding, at most one request per
client, whatever the queue's load. A message with a tag no handler serves is received,
logged with its tag and source and counted (``unexpected``): it cannot be left waiting
without hiding every later message from an any-tag probe. Give other traffic to rank 0
its own communicator (``comm.Dup()``).

**Errors.** A payload that does not unpickle is counted (``bad_payloads``), logged with
its tag and source, and passed to the handler's ``malformed`` hook (the queue answers
it with an error reply). A handler that raises is logged with the tag and source rank and
counted (``handler_errors``); the loop goes on unless the handler was registered
``fatal=True`` (then the error propagates out of :meth:`EventLoop.run`). A timer that
raises is logged with its name and rescheduled.

**Idle.** After ``spin`` empty probes in a row (a real idle moment, not the gap between
two requests of one client) the loop runs due timers, the idle hooks and a due garbage
collection; when none had work it sleeps. Within ``short_idle_s`` of the last message it
naps ``idle_sleep_s`` and spins again (clients that send one small request after another
find it awake: growing sleeps here cost 20% of the benchmark's one-request-per-report
rate); after that the sleeps double up to ``max_sleep_s``
(:class:`~libra_hpc.cluster.messages.Backoff`), with one probe and the idle work between
two (and after idle work that did something, one probe and the idle work again before
the next sleep). An idle controller thus wakes every ``max_sleep_s`` (its reaction time:
10 ms by default; about 2% of a core here in sleeps and wake-ups, where napping and
spinning took 22%) and leaves the core to the ranks that share it.
Under constant load the loop checks the clock after each message and runs, between two
messages, the timers overdue by their ``busy_after_s`` and an overdue collection
(:class:`Collector`).
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Self

from mpi4py import MPI

from libra_hpc.cluster.messages import TAG_NAMES, Backoff
from libra_hpc.scheduler.mpi_service import QueueHandler

log = logging.getLogger(__name__)

YOUNG_THRESHOLD = 20_000
"""Net allocations between young-generation collections while the loop runs (Python's default: 700)."""

Handler = Callable[[Any, int], None]
"""``handler(payload, source_rank)``: a received message's object and its sender."""


@dataclass
class _Route:
    name: str
    handle: Handler
    malformed: Callable[[int, Exception], None] | None
    fatal: bool


@dataclass
class Timer:
    """A callback due at ``due`` (seconds on the loop's clock): it runs at the first idle
    moment after ``due``, or between two messages once ``late`` has passed. Periodic
    timers (``period_s``) are due again ``period_s`` after each run."""

    name: str
    callback: Callable[[], Any]
    due: float
    late: float
    period_s: float | None = None
    busy_after_s: float = 0.0
    cancelled: bool = False

    def cancel(self) -> None:
        self.cancelled = True


class EventLoop:
    """Rank 0's event loop over ``comm`` (see the module docstring). Register handlers
    (:meth:`on`), timers (:meth:`every`, :meth:`after`) and idle hooks
    (:meth:`when_idle`), then :meth:`run` until :meth:`stop` or ``stop_when()``.

    ``clock``: monotonic seconds for timers (and what handlers may share). ``spin``: empty
    probes before the loop counts as idle. ``idle_sleep_s``: the naps while idle up to
    ``short_idle_s`` after the last message, and the first sleep after; ``max_sleep_s``:
    the longest sleep (``idle_sleep_s`` 0: never sleep, for a controller with a core of
    its own). ``collect_every_s``: full garbage collections when idle this often
    (:class:`Collector`; None: the loop leaves the collector alone)."""

    def __init__(self, comm: Any, *, clock: Callable[[], float] = time.monotonic, spin: int = 200,
                 idle_sleep_s: float = 2e-4, short_idle_s: float = 5e-3, max_sleep_s: float = 0.01,
                 collect_every_s: float | None = 10.0):
        if spin < 1 or idle_sleep_s < 0 or short_idle_s < 0 or (idle_sleep_s > 0 and max_sleep_s < idle_sleep_s):
            raise ValueError(f"EventLoop: need spin >= 1 (got {spin}), idle_sleep_s >= 0 (got {idle_sleep_s}), "
                             f"short_idle_s >= 0 (got {short_idle_s}) and max_sleep_s >= idle_sleep_s "
                             f"(got {max_sleep_s})")
        self.idle_sleep_s, self.short_idle_s = idle_sleep_s, short_idle_s
        self.comm, self.clock, self.spin = comm, clock, spin
        self.backoff = Backoff(idle_sleep_s, max_sleep_s) if idle_sleep_s > 0 else None
        self.collect_every_s = collect_every_s
        self.counters = {"messages": 0, "bad_payloads": 0, "handler_errors": 0, "unexpected": 0, "timer_runs": 0,
                         "timer_errors": 0, "sleeps": 0, "full_collections": 0}
        self._routes: dict[int, _Route] = {}
        self._timers: list[Timer] = []
        self._idle_hooks: list[Callable[[float], bool]] = []
        self._collector: Collector | None = None
        self.next_late = float("inf")  # when the next timer or collection is overdue even under load
        self.stopped: str | None = None

    # ------------------------------------------------------------------ registration

    def on(self, tag: int, handle: Handler, *, malformed: Callable[[int, Exception], None] | None = None,
           fatal: bool = False, name: str | None = None) -> None:
        """Serve messages with ``tag`` by ``handle(payload, source)``; ``malformed(source,
        exc)`` is told of a payload that did not unpickle; ``fatal``: an exception of
        ``handle`` ends the loop (raised out of :meth:`run`) instead of being logged."""
        if tag in self._routes:
            raise ValueError(f"EventLoop.on: tag {TAG_NAMES.get(tag, hex(tag))} already has a handler")
        self._routes[tag] = _Route(name or TAG_NAMES.get(tag, hex(tag)), handle, malformed, fatal)

    def every(self, period_s: float, callback: Callable[[], Any], *, name: str,
              busy_after_s: float | None = None) -> Timer:
        """Run ``callback()`` every ``period_s`` seconds, in an idle moment; when the loop
        never idles, between two messages once ``busy_after_s`` (default: another period)
        has passed too."""
        if period_s <= 0:
            raise ValueError(f"EventLoop.every({name}): period_s must be > 0, got {period_s}")
        busy = period_s if busy_after_s is None else busy_after_s
        return self._add(Timer(name, callback, 0.0, 0.0, period_s, busy), self.clock() + period_s)

    def after(self, delay_s: float, callback: Callable[[], Any], *, name: str, busy_after_s: float = 0.0) -> Timer:
        """Run ``callback()`` once, ``delay_s`` seconds from now (see :meth:`every`)."""
        return self._add(Timer(name, callback, 0.0, 0.0, None, busy_after_s), self.clock() + delay_s)

    def _add(self, timer: Timer, due: float) -> Timer:
        timer.due, timer.late = due, due + timer.busy_after_s
        self._timers.append(timer)
        self.next_late = min(self.next_late, timer.late)
        return timer

    def when_idle(self, hook: Callable[[float], bool]) -> None:
        """Call ``hook(now)`` in idle moments (and before each sleep); it returns whether it
        did work (then the loop probes again before sleeping)."""
        self._idle_hooks.append(hook)

    def stop(self, reason: str = "stop requested") -> None:
        """End :meth:`run` after the current message (a handler's or a timer's request)."""
        self.stopped = reason

    # ------------------------------------------------------------------ the loop

    def run(self, stop_when: Callable[[], bool] = lambda: False) -> dict:
        """Serve until :meth:`stop` or ``stop_when()`` (polled between messages and while
        idle). Returns the counters: messages, bad_payloads, handler_errors, unexpected,
        timer_runs, timer_errors, sleeps, full_collections."""
        if not self._routes:
            raise ValueError("EventLoop.run: no handler registered (EventLoop.on)")
        status, probe, any_source = MPI.Status(), self.comm.improbe, MPI.ANY_SOURCE
        tag = next(iter(self._routes)) if len(self._routes) == 1 else MPI.ANY_TAG
        dispatch, spin, clock = self._dispatch, self.spin, self.clock
        self.stopped, idle, handled, last = None, 0, 0, clock()
        with Collector(self.collect_every_s, self.clock, self.counters) as self._collector:
            self._reschedule()
            while self.stopped is None and not stop_when():
                message = probe(source=any_source, tag=tag, status=status)
                if message is None:
                    idle += 1
                    if idle >= spin:  # a real idle moment
                        idle = self._rest(last)
                    continue
                idle = 0
                dispatch(message, status.Get_source(), status.Get_tag())
                handled += 1
                last = clock()
                if last >= self.next_late:  # never idle for long: what is overdue runs anyway
                    self._busy_tick()
        self.counters["messages"] += handled
        return dict(self.counters)

    def _dispatch(self, message: Any, source: int, tag: int) -> None:
        route = self._routes.get(tag)
        try:
            payload = message.recv()
        except Exception as exc:  # noqa: BLE001 - an undecodable payload: counted, logged, told
            self._malformed(route, tag, source, exc)
            return
        if route is None:
            self.counters["unexpected"] += 1
            log.error("message with tag %s from rank %d: no handler serves this tag (dropped: %.200r)",
                      TAG_NAMES.get(tag, hex(tag)), source, payload)
            return
        try:
            route.handle(payload, source)
        except Exception:
            if self._failed(route, source):
                raise

    def _malformed(self, route: _Route | None, tag: int, source: int, exc: Exception) -> None:
        self.counters["bad_payloads"] += 1
        log.warning("%s message from rank %d could not be unpickled: %r",
                    route.name if route else TAG_NAMES.get(tag, hex(tag)), source, exc)
        if route is not None and route.malformed is not None:
            try:
                route.malformed(source, exc)
            except Exception:
                if self._failed(route, source):
                    raise

    def _failed(self, route: _Route, source: int) -> bool:
        """Log and count the exception being handled; whether it ends the loop."""
        self.counters["handler_errors"] += 1
        log.exception("%s handler failed on a message from rank %d%s", route.name, source,
                      " (fatal: the loop stops)" if route.fatal else "; the loop goes on")
        return route.fatal

    def _rest(self, last: float) -> int:
        """Idle work, then a nap or a sleep if it had none (``last``: when the last message
        was handled); returns the count of empty probes to go on from."""
        if self._idle_work():
            return self.spin  # one probe, then idle work again
        if self.backoff is None:
            return 0  # never sleeping: idle work every spin probes
        self.counters["sleeps"] += 1
        if self.clock() - last < self.short_idle_s:  # a short gap: nap, then spin again
            self.backoff.reset()
            time.sleep(self.idle_sleep_s)
            return 0
        self.backoff.sleep()  # idle for a while: longer each time, one probe between
        return self.spin

    def _idle_work(self) -> bool:
        """Due timers, idle hooks, a due collection; whether any of them worked."""
        now = self.clock()
        worked = self._run_timers(now, idle=True)
        for hook in self._idle_hooks:
            worked = bool(hook(now)) or worked
        worked = self._collector.due(idle=True) or worked
        self._reschedule()
        return worked

    def _busy_tick(self) -> None:
        self._run_timers(self.clock(), idle=False)
        self._collector.due(idle=False)
        self._reschedule()

    def _reschedule(self) -> None:
        self.next_late = min([t.late for t in self._timers], default=float("inf"))
        self.next_late = min(self.next_late, self._collector.overdue_at())

    def _run_timers(self, now: float, *, idle: bool) -> bool:
        due = [t for t in self._timers if (now >= t.due if idle else now >= t.late) or t.cancelled]
        ran = False
        for timer in due:
            self._timers.remove(timer)
            if timer.cancelled:
                continue
            ran = True
            try:
                timer.callback()
                self.counters["timer_runs"] += 1
            except Exception:
                self.counters["timer_errors"] += 1
                log.exception("timer %s failed%s", timer.name, "; it runs again in its next period"
                              if timer.period_s else "")
            if timer.period_s is not None and not timer.cancelled:
                self._add(timer, self.clock() + timer.period_s)
        return ran


def serve_queue(comm: Any, service: Any, *, clock: Callable[[], float] = time.monotonic,
                save: Callable[[], None] | None = None, save_every_s: float = 30.0,
                stop_when: Callable[[], bool] = lambda: False, idle_sleep_s: float = 2e-4, short_idle_s: float = 5e-3,
                max_sleep_s: float = 0.01, spin: int = 200, collect_every_s: float = 10.0) -> dict:
    """Answer queue requests from any rank of ``comm`` (``service``: a
    :class:`~libra_hpc.scheduler.service.QueueService`) until a client's ``shutdown``
    request (answered ``{"ok": True}``) or ``stop_when()``: this loop with the queue's
    handler alone, for a rank that serves nothing else (the benchmark, the tests).

    ``save`` (e.g. write ``router.state_dict()`` to the log folder) is a timer of the loop,
    off the request path: it runs when ``save_every_s`` has passed and no request is
    waiting; if requests never stop for another ``save_every_s``, it runs anyway between
    two requests. It also runs once on the way out. A failing save is logged and retried
    at the next period. Returns transport counters: requests, bad_payloads, saves,
    save_failures, full_collections."""
    loop = EventLoop(comm, clock=clock, spin=spin, idle_sleep_s=idle_sleep_s, short_idle_s=short_idle_s,
                     max_sleep_s=max(max_sleep_s, idle_sleep_s), collect_every_s=collect_every_s)
    queue = QueueHandler(comm, service, clock=clock,
                         on_shutdown=lambda source: loop.stop(f"queue shutdown requested by rank {source}"))
    queue.attach(loop)
    saves = {"saves": 0, "save_failures": 0}
    if save is not None:
        loop.every(save_every_s, lambda: _save(save, saves), name="queue state save")
    counters = loop.run(stop_when)
    if save is not None:
        _save(save, saves)
    return {"requests": queue.requests, "bad_payloads": queue.bad_payloads, **saves,
            "full_collections": counters["full_collections"]}


def _save(save: Callable[[], None], counters: dict) -> None:
    try:
        save()
        counters["saves"] += 1
    except Exception:
        counters["save_failures"] += 1
        log.exception("queue service: saving the routing state failed; retrying in the next period")


class Collector:
    """Full garbage collections at moments the loop chooses, not in the middle of a request.

    CPython's automatic full collection walks every tracked object; with a trained causal
    index, thousands of active trajectories and the caller's own data that was 125 ms per
    collection, a quarter of the queue service's time in a benchmark run (and each one a
    latency spike). On entry: one collection, then ``gc.freeze()`` (what exists now — the
    trained trees, the submitted trajectories — is no longer walked; it is still freed
    by reference counting), automatic full collections deferred, and young collections
    made rarer (every :data:`YOUNG_THRESHOLD` net allocations instead of 700: a request's
    objects die by reference counting long before; at 700 the young collections cost 5%
    of a decision's instructions, measured with callgrind). :meth:`due` runs a full
    collection every ``every_s`` when idle, or after ``2 * every_s`` when the loop never
    idles. On exit the settings are restored and the frozen objects handed back to the
    collector. When something was frozen before (the caller, or an outer loop), freezing
    is left to its owner. ``every_s`` None: the collector is left alone."""

    def __init__(self, every_s: float | None, clock: Callable[[], float], counters: dict):
        self.every_s, self.clock, self.counters = every_s, clock, counters

    def __enter__(self) -> Self:
        if self.every_s is None:
            return self
        self.thresholds = gc.get_threshold()
        self.froze = gc.get_freeze_count() == 0  # the caller (or an outer loop) may manage it already
        if self.froze:
            gc.collect()
            gc.freeze()
        gc.set_threshold(max(self.thresholds[0], YOUNG_THRESHOLD), max(self.thresholds[1], 50), 1 << 30)
        self.last = self.clock()
        return self

    def overdue_at(self) -> float:
        """When a collection is due even between two requests (inf: never)."""
        return float("inf") if self.every_s is None else self.last + 2 * self.every_s

    def due(self, *, idle: bool) -> bool:
        """Collect now if the period has passed (twice over when not ``idle``)."""
        if self.every_s is None or self.clock() - self.last < (1 if idle else 2) * self.every_s:
            return False
        gc.collect()
        self.counters["full_collections"] += 1
        self.last = self.clock()
        return True

    def __exit__(self, *exc: object) -> None:
        if self.every_s is None:
            return
        gc.set_threshold(*self.thresholds)
        if self.froze:
            gc.unfreeze()
