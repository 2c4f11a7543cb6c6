"""The control plane's message tags and the one way a rank waits for a message.

Every control-plane message is a pickled object sent point to point with one of the tags
below (never a world-wide collective after start: a rank waiting in MPICH's blocking
receive or ``bcast`` busy-polls a core, and on a host with more ranks than cores that
starves the ranks doing work). Data-plane traffic (weights, trajectories) uses its own
communicators and is not listed here.

| tag | from → to | what |
|---|---|---|
| ``QUEUE_REQUEST`` | rollout leader → controller | C-MLFQ queue request (scheduler/mpi_service.py) |
| ``QUEUE_REPLY`` | controller → rollout leader | its reply |
| ``COMMAND`` | controller → any rank | a command (layout change, step, stop) |
| ``REPORT`` | any rank → controller | the answer to a command, a step report, a heartbeat |
| ``TOOL_DONE`` | tool worker → controller | a tool action's completion |
| ``TOOL_REQUEST`` | rollout leader → controller | a tool action for the shared pool (runtime/tools.py) |
| ``TOOL_RESULT`` | controller → rollout leader | its result |

Data-plane tags (on the job's own communicator, ``COMM_WORLD.Dup()``, never rank 0):

| tag | from → to | what |
|---|---|---|
| ``TRAJECTORY`` | rollout leader → training ranks | a finished trajectory, to the DP replica the controller chose |
| ``WEIGHTS`` / ``WEIGHTS_BYTES`` | export holder → rollout leaders | a policy version: manifest, then bytes |
| ``EPISODE_ASK`` / ``EPISODE`` | rollout leader ↔ rollout leader | a migrating trajectory's state, pulled by its next instance |
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

QUEUE_REQUEST = 0x1F01
QUEUE_REPLY = 0x1F02
COMMAND = 0x2001
REPORT = 0x2002
TOOL_DONE = 0x2003
TOOL_REQUEST = 0x2004
TOOL_RESULT = 0x2005
TRAJECTORY = 0x4001
WEIGHTS = 0x4002
WEIGHTS_BYTES = 0x4003
EPISODE_ASK = 0x4004
EPISODE = 0x4005

TAG_NAMES = {QUEUE_REQUEST: "queue_request", QUEUE_REPLY: "queue_reply", COMMAND: "command", REPORT: "report",
             TOOL_DONE: "tool_done", TOOL_REQUEST: "tool_request", TOOL_RESULT: "tool_result",
             TRAJECTORY: "trajectory", WEIGHTS: "weights", WEIGHTS_BYTES: "weights_bytes", EPISODE_ASK: "episode_ask",
             EPISODE: "episode"}


class Backoff:
    """Sleeps between probes that found nothing: ``first_s`` after the first empty probe,
    doubling up to ``max_s``; :meth:`reset` after a message. A rank idle for long wakes
    every ``max_s`` (its reaction time), one that just got a message reacts within
    microseconds."""

    def __init__(self, first_s: float = 5e-5, max_s: float = 0.02):
        if not 0 < first_s <= max_s:
            raise ValueError(f"Backoff: need 0 < first_s ({first_s}) <= max_s ({max_s})")
        self.first_s, self.max_s = first_s, max_s
        self.next_s = first_s

    def reset(self) -> None:
        self.next_s = self.first_s

    def sleep(self) -> None:
        time.sleep(self.next_s)
        self.next_s = min(self.max_s, self.next_s * 2)


def wait_message(comm: Any, source: int, tag: int, *, backoff: Backoff | None = None,
                 timeout_s: float | None = None, status: Any = None) -> Any:
    """Receive the next message from ``source`` (MPI.ANY_SOURCE allowed) with ``tag``,
    probing without blocking and sleeping in between (:class:`Backoff`): an idle rank
    costs almost no CPU. Raises TimeoutError naming the tag and source after
    ``timeout_s``. ``status`` (an MPI.Status) receives the sender and tag."""
    found: list[Any] = []

    def arrived() -> bool:
        message = comm.improbe(source=source, tag=tag, status=status)
        if message is not None:
            found.append(message)
        return message is not None

    _poll(arrived, backoff, timeout_s, lambda: f"no {TAG_NAMES.get(tag, hex(tag))} message from rank {source}")
    return found[0].recv()


def wait_sent(requests: list[Any], *, backoff: Backoff | None = None, timeout_s: float | None = None) -> None:
    """Wait until the non-blocking sends ``requests`` (``comm.isend``) have left this
    rank, sleeping between tests as :func:`wait_message` does (``Waitall``, like a blocking
    send of a message too big for MPICH's eager protocol, polls a core until the receiver
    takes it). Raises TimeoutError after ``timeout_s`` (the sends stay posted)."""
    from mpi4py import MPI

    _poll(lambda: MPI.Request.Testall(requests), backoff, timeout_s,
          lambda: f"{len(requests)} message(s) not taken by their receivers")


class Outbox:
    """Rank 0's sends, none of which waits for its receiver: each message is posted
    (``comm.isend``) and the posted sends are tested, and forgotten once taken, at each
    later :meth:`send` and whenever the event loop idles (:meth:`progress`). A blocking
    send waits, polling a core, until the receiver takes the message once it is larger
    than MPICH's eager limit (16 KB on this host) or once about 100 smaller ones are
    queued for it, and a trainer inside a step of several passes takes nothing for tens
    of seconds. Rank 0 blocked in a send routes no turn and answers no tool call: every
    default run stalled 12-37 s beside its last four-pass step (py-spy: rank 0 in a queue
    reply's send, two leaders in the sends of their requests to it, their own cells full
    of trajectories for the busy trainers: ``JobController._route`` now holds those), and
    the batch rolling out took 2.5-4× its usual time. Messages to one rank with one tag
    still arrive in the order they were sent (MPI's non-overtaking rule)."""

    def __init__(self, comm: Any):
        self.comm = comm
        self.posted: list[tuple[Any, int]] = []  # (request, dest), not yet taken
        self.sent = 0

    def send(self, message: Any, dest: int, tag: int) -> None:
        self.posted.append((self.comm.isend(message, dest=dest, tag=tag), dest))
        self.sent += 1
        self.progress()

    def progress(self) -> bool:
        """Forget the sends their receivers took; whether any are still waiting."""
        self.posted = [p for p in self.posted if not p[0].Test()]
        return bool(self.posted)

    def waiting(self) -> dict[int, int]:
        """Rank → messages posted to it and not taken yet."""
        out: dict[int, int] = {}
        for _, dest in self.posted:
            out[dest] = out.get(dest, 0) + 1
        return out

    def flush(self, timeout_s: float, backoff: Backoff | None = None) -> dict[int, int]:
        """Wait up to ``timeout_s`` for every posted send to be taken (:func:`wait_sent`);
        what is still waiting after it (:meth:`waiting`; empty when all left)."""
        try:
            wait_sent([request for request, _ in self.posted], backoff=backoff, timeout_s=timeout_s)
        except TimeoutError:
            pass
        self.progress()
        return self.waiting()


def _poll(ready: Callable[[], bool], backoff: Backoff | None, timeout_s: float | None, what: Callable[[], str]) -> None:
    """Call ``ready()`` until it is true, sleeping with ``backoff`` in between; TimeoutError
    saying ``what()`` after ``timeout_s``."""
    wait = backoff or Backoff()
    wait.reset()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not ready():
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"{what()} within {timeout_s} s")
        wait.sleep()
