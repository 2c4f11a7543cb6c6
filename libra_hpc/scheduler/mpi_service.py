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

import logging
import time
from collections.abc import Callable
from typing import Any

from mpi4py import MPI

from libra_hpc.scheduler.service import QueueService

log = logging.getLogger(__name__)

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
          spin: int = 200) -> dict:
    """Answer requests from any rank of ``comm`` until a shutdown request or ``stop_when()``.

    ``save`` (e.g. write ``router.state_dict()`` to the log folder) runs off the request
    path: when ``save_every_s`` has passed and no request is waiting; if requests never
    stop for another ``save_every_s``, it runs anyway between two requests. It also runs
    once on the way out. A failing save is logged and retried at the next period.

    When idle, the loop probes ``spin`` times, then runs the service's maintenance (lease
    expiry, the router's tree rebuild when due) or sleeps ``idle_sleep_s`` between probes
    (so a waiting controller leaves the core to ranks on the same node). Under constant
    load, overdue maintenance runs every 1024 requests. ``stop_when`` is polled between requests and while idle.
    Returns transport counters: requests, bad_payloads, saves, save_failures."""
    status = MPI.Status()
    counters = {"requests": 0, "bad_payloads": 0, "saves": 0, "save_failures": 0}
    last_save = clock()
    idle = 0
    while not stop_when():
        message = comm.improbe(source=MPI.ANY_SOURCE, tag=REQUEST_TAG, status=status)
        if message is None:
            idle += 1
            if save is not None and clock() - last_save >= save_every_s:
                last_save = _save(save, counters, clock)
            if idle > spin:
                if not service.maintain(clock()):  # lease expiry, tree rebuild when due
                    time.sleep(idle_sleep_s)
            continue
        idle = 0
        source = status.Get_source()
        try:
            request = message.recv()
        except Exception as exc:  # noqa: BLE001 - any undecodable payload; answered and counted
            counters["bad_payloads"] += 1
            log.warning("queue request from rank %d could not be unpickled: %r", source, exc)
            comm.send({"ok": False, "reason": "malformed",
                       "error": f"request from rank {source} is not a pickled dict: {exc!r}"}, dest=source, tag=REPLY_TAG)
            continue
        counters["requests"] += 1
        if type(request) is dict and request.get("op") == "shutdown":
            comm.send({"ok": True}, dest=source, tag=REPLY_TAG)
            log.info("queue service: shutdown requested by rank %d", source)
            break
        try:
            reply = service.handle(request, clock())
        except Exception as exc:  # a router bug: tell the asker before the job fails
            comm.send({"ok": False, "reason": "server_error", "error": f"queue service failed: {exc!r}"},
                      dest=source, tag=REPLY_TAG)
            raise
        comm.send(reply, dest=source, tag=REPLY_TAG)
        if counters["requests"] % 1024 == 0:  # never idle: overdue maintenance runs anyway
            service.maintain(clock(), busy=True)
        if save is not None and clock() - last_save >= 2 * save_every_s:  # never idle: save anyway
            last_save = _save(save, counters, clock)
    if save is not None:
        _save(save, counters, clock)
    return counters


def _save(save: Callable[[], None], counters: dict, clock: Callable[[], float]) -> float:
    try:
        save()
        counters["saves"] += 1
    except Exception:  # noqa: BLE001 - a failed save must not stop serving; logged with its traceback, retried
        counters["save_failures"] += 1
        log.exception("queue service: saving the routing state failed; retrying in the next period")
    return clock()


class QueueClient:
    """The worker side: one rank (a rollout instance leader) talking to the server rank.
    Every method raises :class:`QueueError` with the server's message when refused.

    ``poll_s``: None waits for a reply in MPI's blocking receive, which busy-polls (the
    lowest latency when every rank has its own core). On a host with more ranks than
    cores (the local executor) give a few microseconds: the rank then probes and sleeps
    ``poll_s`` between probes, leaving the core to the server (on 2 cores with 4 clients
    that doubled the service's throughput with the batch op)."""

    def __init__(self, comm: Any, server_rank: int = 0, *, poll_s: float | None = None):
        self.comm = comm
        self.server_rank = server_rank
        self.poll_s = poll_s

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
        while True:
            message = self.comm.improbe(source=self.server_rank, tag=REPLY_TAG)
            if message is not None:
                return message.recv()
            time.sleep(self.poll_s)

    def ask(self, instance: int, max: int) -> list[dict]:
        """Up to ``max`` turns for ``instance`` (each with its ``lease``)."""
        return self.request({"op": "ask", "instance": instance, "max": max})["turns"]

    def tool_return(self, lease: int, *, tool: str, output: str, tokens: int, exit_code: int | None = 0,
                    timed_out: bool = False) -> dict:
        """Report that the leased turn generated ``tokens`` and called ``tool``, which
        returned ``output``; returns the placement of the next turn."""
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
