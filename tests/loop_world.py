"""MPI worlds for tests/test_runtime_loop.py (and benchmarks/bench_runtime.py, which times
them): ``mpiexec -n N python tests/loop_world.py SCENARIO OUT [--seconds S]``.

``mixed`` (6 ranks): rank 0 runs the event loop with a queue handler (a stand-in service
that works :data:`SERVICE_S` per request, so the queue keeps the loop busy), a control
handler (REPORT → an ack sent back with tag COMMAND) and a tool-completion handler
(TOOL_DONE, no reply), and a timer every :data:`TICK_S`. Ranks 1-3 ask the queue
:data:`ROUNDS` times each, rank 4 sends as many reports and waits for each ack; both kinds
of client wait for replies the same way (probe, yield the core). Rank 5 sends a queue
request that does not unpickle, a tool completion whose handler raises, one that does not
unpickle, a message with a tag no handler serves, then :data:`COMPLETIONS` completions.
Each client ends with a ``done`` report carrying what it measured; the loop stops
:data:`IDLE_TAIL_S` after the last one (an idle stretch for the timer).
``control-when-idle``: the same clients against a loop that reads other messages only
when the queue is idle (what the event loop must not do: the control client starves).

``busy-worker`` (2 ranks): rank 1 reports, then takes no command until rank 0 tells it to
go (tag TOOL_RESULT): a worker busy in a long step. Rank 0, in the report's handler, sends
it :data:`BURST` small commands and one of :data:`BIG` bytes through its
:class:`~libra_hpc.cluster.messages.Outbox`, then the go; rank 1 then takes the commands
and reports what came. A blocking send would wait in the handler for a receiver that waits
for the go: the world would hang.

``idle`` (2 ranks): rank 0 runs the loop (the same handlers and a timer); rank 1 sleeps
:data:`IDLE_S`, then sends one report; rank 0 measures its own CPU time over the idle
stretch and how late it saw the report.

Counted, not timed: the tests assert on counts and on the order rank 0 served messages
in (``order``; each timer tick notes how many messages had been served), which hold
however the cores are shared. ``--seconds S`` makes the mixed clients go on for S seconds
instead of :data:`ROUNDS` round trips, and the idle client sleep S seconds: the benchmark's
rates, latencies and CPU shares (wall-clock figures, which a test must not bound).

Rank 0 writes a JSON summary to OUT (the ranks' stdout is not a channel to parse).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from pathlib import Path

from mpi4py import MPI

from libra_hpc.cluster.messages import COMMAND, QUEUE_REPLY, QUEUE_REQUEST, REPORT, TOOL_DONE, TOOL_RESULT, Outbox
from libra_hpc.runtime.loop import EventLoop
from libra_hpc.scheduler.mpi_service import QueueClient, QueueError, QueueHandler

ROUNDS = 30
"""Round trips of each queue client and of the control client (counted mode)."""
COMPLETIONS = 20
"""Tool completions the error client sends after its errors."""
SERVICE_S = 0.01
TICK_S = 0.05
IDLE_TAIL_S = 0.5
IDLE_S = 0.5
"""The idle client's sleep in counted mode (the benchmark passes --seconds)."""
IDLE_MARK_S = 0.3
"""When rank 0 starts measuring its idle CPU time, after the loop starts."""
WINDOW_S = 0.5
BURST = 200
"""Small commands of the busy-worker world: more than MPICH queues for one receiver (64 fit, 100 did not)."""
BIG = 100_000
"""Bytes of its large command: beyond MPICH's eager limit (16 KB here)."""
QUEUE_CLIENTS = (1, 2, 3)
CONTROL_CLIENT, ERROR_CLIENT = 4, 5


class SlowService:
    """Stands in for QueueService: answers every request ``SERVICE_S`` later (asleep, so
    that the clients have the cores: the loop, not the CPU, is what they wait for, and
    three clients keep a request waiting at all times). Notes each request in ``order``."""

    def __init__(self, order: list):
        self.handled, self.order = 0, order

    def handle(self, request, now):
        time.sleep(SERVICE_S)
        self.handled += 1
        self.order.append(["queue", request["instance"]])
        return {"ok": True, "n": self.handled}

    def maintain(self, now, *, busy=False):
        return False


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def server(comm, scenario: str, out: Path) -> None:
    records = Records()
    logging.getLogger("libra_hpc.runtime.loop").addHandler(records)
    loop = EventLoop(comm)
    order: list[list] = []  # what was served, in order: [kind, source rank]
    service = SlowService(order)
    QueueHandler(comm, service).attach(loop)
    ticks: list[float] = []
    ticks_after: list[int] = []  # per tick: the messages served before it
    loop.every(TICK_S, lambda: (ticks.append(time.monotonic()), ticks_after.append(len(order))), name="tick")
    done: dict[int, dict] = {}
    tools: list[int] = []
    idle: dict[str, float] = {}

    outbox, busy = Outbox(comm), {}

    def control(report, source):
        order.append(["control", source])
        if scenario == "busy-worker":
            if report.get("busy"):
                for n in range(BURST + 1):
                    outbox.send({"n": n, "blob": bytes(BIG) if n == BURST else b""}, source, COMMAND)
                busy["untaken_at_go"] = outbox.waiting().get(source, 0)
                outbox.send({"go": True}, source, TOOL_RESULT)
            else:
                busy.update(report)
                loop.stop("the worker took its commands")
            return
        comm.send({"ack": report.get("seq")}, dest=source, tag=COMMAND)
        if scenario == "idle":
            idle.update(seen_late_s=time.monotonic() - report["sent"], wall=time.monotonic(), cpu=time.process_time())
            loop.stop("the report came")
        elif report.get("done"):
            done[source] = report
            if len(done) == comm.Get_size() - 1:
                loop.after(IDLE_TAIL_S, lambda: loop.stop("every client is done"), name="stop")

    def tool_done(completion, source):
        order.append(["tool", source])
        if completion.get("boom"):
            raise ValueError(f"tool completion {completion} makes this handler fail")
        tools.append(completion["n"])

    loop.on(REPORT, control)
    loop.on(TOOL_DONE, tool_done)
    if scenario == "idle":
        loop.after(IDLE_MARK_S, lambda: idle.update(wall0=time.monotonic(), cpu0=time.process_time()), name="mark")
    comm.Barrier()  # every client starts with the loop: no client runs alone for a while
    started = time.monotonic()
    # The 60 s stop only ends a world whose clients never finish (the test then fails on `stopped`).
    counters = (run_control_when_idle(comm, loop, service, control, tool_done) if scenario == "control-when-idle"
                else loop.run(stop_when=lambda: time.monotonic() - started > 60))
    out.write_text(json.dumps({"counters": counters, "stopped": loop.stopped, "ticks": [t - started for t in ticks],
                               "ticks_after": ticks_after, "order": order, "started": started,
                               "clients": {str(k): v for k, v in done.items()}, "tools": tools,
                               "log": records.lines, "idle": idle, "queue_handled": service.handled,
                               "busy": busy, "outbox": {"sent": outbox.sent, "left": outbox.flush(timeout_s=10.0)}}))


def run_control_when_idle(comm, loop, service, control, tool_done) -> dict:
    """The wrong rule, for the tests to show they can tell: a loop that serves the queue and
    reads other messages only when no queue request came for ``loop.spin`` probes (as
    serve() ran its saves). It stops when ``loop.stop`` is called (by a handler or by
    ``comm``)."""
    queue = QueueHandler(comm, service)
    status, idle = MPI.Status(), 0
    handlers = {QUEUE_REQUEST: queue.handle, REPORT: control, TOOL_DONE: tool_done}
    while loop.stopped is None:
        message = comm.improbe(source=MPI.ANY_SOURCE, tag=QUEUE_REQUEST, status=status)
        if message is None and idle >= loop.spin:
            message = comm.improbe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status)
        if message is None:
            idle += 1
            loop._run_timers(loop.clock(), idle=True)
            continue
        idle = 0
        try:
            payload = message.recv()
            handlers.get(status.Get_tag(), lambda payload, source: None)(payload, status.Get_source())
        except Exception:  # the error client's messages: not what this loop is here to show
            if status.Get_tag() == QUEUE_REQUEST:
                queue.malformed(status.Get_source(), ValueError("garbage"))
    return {}


def wait_reply(comm, tag: int):
    """The reply from rank 0 with ``tag``, probing and yielding the core (as QueueClient(poll_s=0))."""
    while True:
        message = comm.improbe(source=0, tag=tag)
        if message is not None:
            return message.recv()
        os.sched_yield()


def round_trips(once, seconds: float | None) -> dict:
    """``once(sent)`` (a request and its reply) :data:`ROUNDS` times, or again and again
    for ``seconds``: the count, and (for the benchmark) round trips per :data:`WINDOW_S`
    window and latency quantiles (s)."""
    ends, latencies = [], []
    start = time.monotonic()
    while (len(ends) < ROUNDS) if seconds is None else (time.monotonic() - start < seconds):
        sent = time.monotonic()
        once(sent)
        ends.append(time.monotonic())
        latencies.append(ends[-1] - sent)
    windows = [0] * max(1, round((ends[-1] - start if seconds is None else seconds) / WINDOW_S))
    for end in ends:
        windows[min(int((end - start) / WINDOW_S), len(windows) - 1)] += 1
    ordered = sorted(latencies)
    return {"windows": windows, "count": len(ordered), "p50_s": ordered[len(ordered) // 2],
            "p99_s": ordered[int(len(ordered) * 0.99)], "max_s": ordered[-1]}


def queue_client(comm, seconds: float | None) -> dict:
    queue = QueueClient(comm, poll_s=0.0)
    ask = {"op": "ask", "instance": comm.Get_rank(), "max": 1}
    return round_trips(lambda sent: queue.request(ask), seconds)


def control_client(comm, seconds: float | None) -> dict:
    def report(sent):
        comm.send({"seq": 0, "sent": sent}, dest=0, tag=REPORT)
        wait_reply(comm, COMMAND)

    return round_trips(report, seconds)


def error_client(comm, seconds: float | None) -> dict:
    comm.Send(bytearray(b"\x80\x05garbage"), dest=0, tag=QUEUE_REQUEST)
    reply = wait_reply(comm, QUEUE_REPLY)
    comm.send({"boom": True}, dest=0, tag=TOOL_DONE)
    comm.Send(bytearray(b"\x80\x05garbage"), dest=0, tag=TOOL_DONE)
    comm.send({"stray": True}, dest=0, tag=0x7777)
    try:  # the loop goes on: the queue still answers this rank
        QueueClient(comm, poll_s=0.0).request({"op": "ask", "instance": ERROR_CLIENT, "max": 1})
        after_errors = "answered"
    except QueueError as exc:
        after_errors = str(exc)
    sent, start = 0, time.monotonic()
    while (sent < COMPLETIONS) if seconds is None else (time.monotonic() - start < seconds):
        comm.send({"n": sent}, dest=0, tag=TOOL_DONE)
        sent += 1
        time.sleep(0.01)
    return {"malformed_reply": reply, "after_errors": after_errors, "completions_sent": sent}


def client(comm, scenario: str, seconds: float | None) -> None:
    rank = comm.Get_rank()
    # With the loop and the others (CI saw a control client that started, or went on, alone
    # while the queue clients were still starting: 2885 round trips against their 94).
    comm.Barrier()
    if scenario == "busy-worker":
        comm.send({"busy": True}, dest=0, tag=REPORT)
        wait_reply(comm, TOOL_RESULT)
        got = [comm.recv(source=0, tag=COMMAND) for _ in range(BURST + 1)]
        comm.send({"received": [m["n"] for m in got], "big": len(got[-1]["blob"])}, dest=0, tag=REPORT)
        return
    if scenario == "idle":
        time.sleep(IDLE_S if seconds is None else seconds)
        comm.send({"seq": 0, "sent": time.monotonic()}, dest=0, tag=REPORT)
        wait_reply(comm, COMMAND)
        return
    measured = (queue_client(comm, seconds) if rank in QUEUE_CLIENTS
                else control_client(comm, seconds) if rank == CONTROL_CLIENT else error_client(comm, seconds))
    comm.send({"done": True, "seq": -1, **measured}, dest=0, tag=REPORT)
    wait_reply(comm, COMMAND)


def main() -> None:
    parser = argparse.ArgumentParser(description="an MPI world of tests/test_runtime_loop.py")
    parser.add_argument("scenario", choices=["mixed", "control-when-idle", "idle", "busy-worker"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--seconds", type=float, default=None,
                        help="timed mode (benchmarks/bench_runtime.py): the clients go on this long, "
                             "or the idle one sleeps")
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    if comm.Get_rank() == 0:
        server(comm, args.scenario, args.out)
    else:
        client(comm, args.scenario, args.seconds)


if __name__ == "__main__":
    main()
