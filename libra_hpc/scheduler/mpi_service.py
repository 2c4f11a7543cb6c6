"""The queue service over MPI: a handler of rank 0's event loop, a client for rollout
instance leaders.

Thin transport: every decision is :meth:`QueueService.handle`'s (scheduler/service.py;
the protocol is documented in scheduler/protocol.py). Requests are pickled dicts sent to the server rank
with tag :data:`~libra_hpc.cluster.messages.QUEUE_REQUEST`; each gets exactly one reply,
to the sender, with tag :data:`~libra_hpc.cluster.messages.QUEUE_REPLY`. A client has at
most one request outstanding (one thread per rank talks to the queue).

:class:`QueueHandler` is the server side as a handler of the controller's loop
(``libra_hpc/runtime/loop.py``), which serves it beside control messages and tool
completions; ``libra_hpc.runtime.loop.serve_queue`` is that loop with the queue alone, for
a rank that serves nothing else (the benchmark, the tests). This module knows the loop
only by the two methods :meth:`QueueHandler.attach` calls (``on``, ``when_idle``): the
scheduler does not import the runtime.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from libra_hpc.cluster.messages import QUEUE_REPLY, QUEUE_REQUEST, Outbox
from libra_hpc.scheduler.service import QueueService
from libra_hpc.scheduler.types import ToolState

log = logging.getLogger(__name__)

BUSY_MAINTAIN_EVERY = 1024
"""Requests between two runs of the service's overdue maintenance when the loop never idles."""


class QueueError(RuntimeError):
    """The queue service refused a request; ``reason`` is its counter (``late_report``,
    ``duplicate_report``, ``malformed``, ...), the message is the server's."""

    def __init__(self, op: str, reason: str, error: str):
        super().__init__(f"queue service refused {op}: {error} [{reason}]")
        self.op = op
        self.reason = reason
        self.error = error


class QueueHandler:
    """The queue protocol as a handler of rank 0's loop: :meth:`handle` answers one
    request with one reply to its sender.

    ``on_shutdown(source)`` is called for a ``shutdown`` request (answered ``ok``); without
    it a client cannot stop the server and the request is refused. A request whose
    payload did not unpickle is answered by :meth:`malformed` (reason ``malformed``). If
    the service itself raises (a router bug), the asker gets a ``server_error`` reply and
    the exception propagates: :meth:`attach` registers the handler ``fatal``, so the loop
    ends rather than serve from a state the failed request may have left half changed.
    Replies go out through ``outbox`` (default: one of its own; rank 0's in the job), never
    waiting for their receiver (in the default job, before: rank 0 sat 20 s in a reply's
    send while two leaders sat in the sends of their next requests to it, beside a
    four-pass training step on the same two cores).
    Under constant load the service's overdue maintenance runs every
    :data:`BUSY_MAINTAIN_EVERY` requests; when idle the loop calls ``service.maintain``.
    ``requests`` and ``bad_payloads`` count what was received."""

    def __init__(self, comm: Any, service: QueueService, *, clock: Callable[[], float] = time.monotonic,
                 on_shutdown: Callable[[int], None] | None = None, outbox: Outbox | None = None):
        self.comm, self.service, self.clock, self.on_shutdown = comm, service, clock, on_shutdown
        self.outbox = Outbox(comm) if outbox is None else outbox
        self.requests = 0
        self.bad_payloads = 0

    def attach(self, loop: Any, *, fatal: bool = True) -> None:
        """Register with ``loop`` (a :class:`libra_hpc.runtime.loop.EventLoop`): this
        handler for the queue's requests, the service's maintenance for idle moments."""
        loop.on(QUEUE_REQUEST, self.handle, malformed=self.malformed, fatal=fatal, name="queue request")
        loop.when_idle(self.service.maintain)
        loop.when_idle(lambda now: self.outbox.progress() and False)

    def handle(self, request: Any, source: int) -> None:
        """Answer ``request`` from rank ``source``."""
        self.requests += 1
        if type(request) is dict and request.get("op") == "shutdown":
            self._shutdown(source)
            return
        try:
            reply = self.service.handle(request, self.clock())
        except Exception as exc:  # a router bug: tell the asker before the loop ends
            self.outbox.send({"ok": False, "reason": "server_error", "error": f"queue service failed: {exc!r}"},
                             source, QUEUE_REPLY)
            raise
        self.outbox.send(reply, source, QUEUE_REPLY)
        if not self.requests % BUSY_MAINTAIN_EVERY:  # never idle: overdue maintenance runs anyway
            self.service.maintain(self.clock(), busy=True)

    def malformed(self, source: int, exc: Exception) -> None:
        """Answer a request whose payload did not unpickle."""
        self.bad_payloads += 1
        self.outbox.send({"ok": False, "reason": "malformed",
                          "error": f"request from rank {source} is not a pickled dict: {exc!r}"}, source, QUEUE_REPLY)

    def _shutdown(self, source: int) -> None:
        if self.on_shutdown is None:
            self.outbox.send({"ok": False, "reason": "refused", "error": "this queue service is not stopped by its "
                              "clients: the controller ends it"}, source, QUEUE_REPLY)
            return
        self.outbox.send({"ok": True}, source, QUEUE_REPLY)
        log.info("queue service: shutdown requested by rank %d", source)
        self.on_shutdown(source)


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
        self.comm.send(message, dest=self.server_rank, tag=QUEUE_REQUEST)
        reply = self._receive()
        if not reply.get("ok"):
            op = message.get("op", "?") if isinstance(message, dict) else type(message).__name__
            raise QueueError(str(op), reply.get("reason", "?"), reply.get("error", repr(reply)))
        return reply

    def _receive(self) -> dict:
        if self.poll_s is None:
            return self.comm.recv(source=self.server_rank, tag=QUEUE_REPLY)
        spin_until = time.perf_counter() + self.spin_s
        while True:
            message = self.comm.improbe(source=self.server_rank, tag=QUEUE_REPLY)
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
