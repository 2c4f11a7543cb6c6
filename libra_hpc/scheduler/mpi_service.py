"""The queue service over MPI: a serve loop on the controller rank, a client for rollout
instance leaders.

Thin transport: every decision is :meth:`QueueService.handle`'s (scheduler/service.py,
where the protocol is documented). Requests are pickled dicts sent to the server rank
with tag :data:`REQUEST_TAG`; each gets exactly one reply, to the sender, with tag
:data:`REPLY_TAG`. A client has at most one request outstanding (one thread per rank
talks to the queue). ``{"op": "shutdown"}`` is answered ``{"ok": True}`` and ends
:func:`serve`.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Callable
from typing import Any, Self

from mpi4py import MPI

from libra_hpc.scheduler.service import QueueService
from libra_hpc.scheduler.types import ToolState

log = logging.getLogger(__name__)

YOUNG_THRESHOLD = 20_000
"""Net allocations between young-generation collections while serving (Python's default: 700)."""

REQUEST_TAG = 0x1F01
REPLY_TAG = 0x1F02


class QueueError(RuntimeError):
    """The queue service refused a request; ``reason`` is its counter (``late_report``,
    ``duplicate_report``, ``malformed``, ...), the message is the server's."""

    def __init__(self, op: str, reason: str, error: str):
        super().__init__(f"queue service refused {op}: {error} [{reason}]")
        self.op = op
        self.reason = reason
        self.error = error


def serve(comm: Any, service: QueueService, *, clock: Callable[[], float] = time.monotonic,
          save: Callable[[], None] | None = None, save_every_s: float = 30.0,
          stop_when: Callable[[], bool] = lambda: False, idle_sleep_s: float = 2e-4,
          spin: int = 200, collect_every_s: float = 10.0) -> dict:
    """Answer requests from any rank of ``comm`` until a shutdown request or ``stop_when()``.

    ``save`` (e.g. write ``router.state_dict()`` to the log folder) runs off the request
    path: when ``save_every_s`` has passed and no request is waiting; if requests never
    stop for another ``save_every_s``, it runs anyway between two requests. It also runs
    once on the way out. A failing save is logged and retried at the next period.

    When idle, the loop runs the service's maintenance (lease expiry, the router's tree
    rebuild when due) every ``spin`` probes and, when there was none to do, sleeps
    ``idle_sleep_s`` (so a waiting controller leaves the core to ranks on the same node;
    0: never sleep, for a controller with a core of its own). Under constant load,
    overdue maintenance runs every 1024 requests. ``stop_when`` is polled between
    requests and while idle.

    Garbage collection is kept off the request path too (:class:`_Collector`): what
    exists when serving starts is frozen out of the collector's reach, and full
    collections run every ``collect_every_s`` in an idle moment (between requests after
    twice that). Returns transport counters: requests, bad_payloads, saves,
    save_failures, full_collections."""
    status = MPI.Status()
    counters = {"requests": 0, "bad_payloads": 0, "saves": 0, "save_failures": 0, "full_collections": 0}
    last_save = clock()
    idle = 0
    with _Collector(collect_every_s, clock, counters) as collector:
        while not stop_when():
            message = comm.improbe(source=MPI.ANY_SOURCE, tag=REQUEST_TAG, status=status)
            if message is None:
                idle += 1
                if save is not None and clock() - last_save >= save_every_s:
                    last_save = _save(save, counters, clock)
                if idle % spin == 0 and not service.maintain(clock()) and not collector.due(idle=True) \
                        and idle_sleep_s > 0:
                    time.sleep(idle_sleep_s)  # lease expiry, a due tree rebuild or collection ran first
                continue
            idle = 0
            if not _answer(comm, service, message, status.Get_source(), clock, counters):
                break
            if counters["requests"] % 1024 == 0:  # never idle: overdue maintenance runs anyway
                service.maintain(clock(), busy=True)
                collector.due(idle=False)
            if save is not None and clock() - last_save >= 2 * save_every_s:  # never idle: save anyway
                last_save = _save(save, counters, clock)
    if save is not None:
        _save(save, counters, clock)
    return counters


def _answer(comm: Any, service: QueueService, message: Any, source: int, clock: Callable[[], float],
            counters: dict) -> bool:
    """Receive one request and send its reply; False when it was a shutdown request."""
    try:
        request = message.recv()
    except Exception as exc:  # noqa: BLE001 - any undecodable payload; answered and counted
        counters["bad_payloads"] += 1
        log.warning("queue request from rank %d could not be unpickled: %r", source, exc)
        comm.send({"ok": False, "reason": "malformed",
                   "error": f"request from rank {source} is not a pickled dict: {exc!r}"}, dest=source, tag=REPLY_TAG)
        return True
    counters["requests"] += 1
    if type(request) is dict and request.get("op") == "shutdown":
        comm.send({"ok": True}, dest=source, tag=REPLY_TAG)
        log.info("queue service: shutdown requested by rank %d", source)
        return False
    try:
        reply = service.handle(request, clock())
    except Exception as exc:  # a router bug: tell the asker before the job fails
        comm.send({"ok": False, "reason": "server_error", "error": f"queue service failed: {exc!r}"},
                  dest=source, tag=REPLY_TAG)
        raise
    comm.send(reply, dest=source, tag=REPLY_TAG)
    return True


class _Collector:
    """Full garbage collections at moments serve() chooses, not in the middle of a request.

    CPython's automatic full collection walks every tracked object; with a trained causal
    index, thousands of active trajectories and the caller's own data that was 125 ms per
    collection, a quarter of the service's time in a benchmark run (and each one a
    latency spike). On entry: one collection, then ``gc.freeze()`` (what exists now — the
    trained trees, the submitted trajectories — is no longer walked; it is still freed
    by reference counting), automatic full collections deferred, and young collections
    made rarer (every :data:`YOUNG_THRESHOLD` net allocations instead of 700: a request's
    objects die by reference counting long before; at 700 the young collections cost 5%
    of a decision's instructions, measured with callgrind). :meth:`due` runs a full
    collection every ``every_s`` when idle, or after ``2 * every_s`` when the loop never
    idles. On exit the settings are restored
    and the frozen objects handed back to the collector. When something was frozen
    before (the caller, or an outer serve), freezing is left to its owner."""

    def __init__(self, every_s: float, clock: Callable[[], float], counters: dict):
        self.every_s, self.clock, self.counters = every_s, clock, counters

    def __enter__(self) -> Self:
        self.thresholds = gc.get_threshold()
        self.froze = gc.get_freeze_count() == 0  # the caller (or an outer serve) may manage it already
        if self.froze:
            gc.collect()
            gc.freeze()
        gc.set_threshold(max(self.thresholds[0], YOUNG_THRESHOLD), max(self.thresholds[1], 50), 1 << 30)
        self.last = self.clock()
        return self

    def due(self, *, idle: bool) -> bool:
        """Collect now if the period has passed (twice over when not ``idle``)."""
        if self.clock() - self.last < (1 if idle else 2) * self.every_s:
            return False
        gc.collect()
        self.counters["full_collections"] += 1
        self.last = self.clock()
        return True

    def __exit__(self, *exc) -> None:
        gc.set_threshold(*self.thresholds)
        if self.froze:
            gc.unfreeze()


def _save(save: Callable[[], None], counters: dict, clock: Callable[[], float]) -> float:
    try:
        save()
        counters["saves"] += 1
    except Exception:
        counters["save_failures"] += 1
        log.exception("queue service: saving the routing state failed; retrying in the next period")
    return clock()


class QueueClient:
    """The worker side: one rank (a rollout instance leader) talking to the server rank.
    Every method raises :class:`QueueError` with the server's message when refused.

    ``poll_s``: None waits for a reply in MPI's blocking receive, which busy-polls (the
    lowest latency when every rank has its own core). On a host with more ranks than
    cores (the local executor), 0 probes and yields the core between probes
    (``sched_yield``: no sleep is added to the round trip, but a yielding rank still
    takes its fair share of the core), and a positive value sleeps that long between
    probes (at least the kernel's timer slack, about 50 µs) once ``spin_s`` has passed
    since the request went out: a quick reply is caught while probing, a slow one (a
    batch the server is working through) leaves the cores to the server. On 2 cores with
    4 clients, spinning or yielding clients left the server a third of a core."""

    def __init__(self, comm: Any, server_rank: int = 0, *, poll_s: float | None = None, spin_s: float = 0.0):
        if (poll_s is not None and poll_s < 0) or spin_s < 0:
            raise ValueError(f"QueueClient: poll_s={poll_s} and spin_s={spin_s} must be >= 0 (poll_s None: MPI's "
                             "blocking receive)")
        self.comm = comm
        self.server_rank = server_rank
        self.poll_s = poll_s
        self.spin_s = spin_s

    def request(self, message: Any) -> dict:
        """Send any request and wait for its reply (raw protocol access)."""
        self.comm.send(message, dest=self.server_rank, tag=REQUEST_TAG)
        reply = self._receive()
        if not reply.get("ok"):
            op = message.get("op", "?") if isinstance(message, dict) else type(message).__name__
            raise QueueError(str(op), reply.get("reason", "?"), reply.get("error", repr(reply)))
        return reply

    def _receive(self) -> dict:
        if self.poll_s is None:
            return self.comm.recv(source=self.server_rank, tag=REPLY_TAG)
        spin_until = time.perf_counter() + self.spin_s
        while True:
            message = self.comm.improbe(source=self.server_rank, tag=REPLY_TAG)
            if message is not None:
                return message.recv()
            if self.poll_s and time.perf_counter() >= spin_until:
                time.sleep(self.poll_s)
            else:
                os.sched_yield()

    def ask(self, instance: int, max: int) -> list[dict]:
        """Up to ``max`` turns for ``instance`` (each with its ``lease``)."""
        return self.request({"op": "ask", "instance": instance, "max": max})["turns"]

    def tool_return(self, lease: int, *, tool: str, tokens: int, output: str | None = None,
                    exit_code: int | None = 0, timed_out: bool = False, state: ToolState | None = None) -> dict:
        """Report that the leased turn generated ``tokens`` and called ``tool``, which
        returned ``output`` (the server classifies it), or whose outcome was classified
        here as ``state`` (the output stays on this node; the sandbox's result carries
        it); returns the placement of the next turn."""
        if (output is None) == (state is None):
            raise ValueError(f"tool_return(lease {lease}): give exactly one of output and state")
        if state is not None:
            return self.request({"op": "tool_return", "lease": lease, "tool": tool, "size": state.size,
                                 "status": state.status, "tokens": tokens})
        return self.request({"op": "tool_return", "lease": lease, "tool": tool, "output": output,
                             "exit_code": exit_code, "timed_out": timed_out, "tokens": tokens})

    def finish(self, lease: int, tokens: int) -> dict:
        """Report the last turn (``tokens`` generated): the trajectory is complete."""
        return self.request({"op": "finish", "lease": lease, "tokens": tokens})

    def batch(self, requests: list[dict]) -> list[dict]:
        """Several requests in one message (e.g. the reports of one engine step and the
        next ask); returns their replies in order, refusals included (not raised)."""
        return self.request({"op": "batch", "requests": requests})["replies"]

    def heartbeat(self, instance: int) -> int:
        """Renew every lease ``instance`` holds; returns how many it holds."""
        return self.request({"op": "heartbeat", "instance": instance})["leases"]

    def stats(self) -> dict:
        return self.request({"op": "stats"})["stats"]

    def shutdown(self) -> None:
        """Stop the server's loop."""
        self.request({"op": "shutdown"})
