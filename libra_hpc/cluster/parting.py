"""The world's last exchange before ``MPI_Finalize``: every rank's posted sends taken,
whatever is still in flight to it received and dropped, then all ranks leave together.

Why: a rank that stops may still have non-blocking sends posted (a rollout leader's
finished trajectories to trainers that stopped first, an export holder's policy to
leaders that left). A large message goes by MPICH's rendezvous protocol: it stays pending
until the receiver matches it, and ``MPI_Finalize`` waits for it, so the world never
exits. Here every rank, after its role loop:

1. keeps receiving (and discarding) every message addressed to it on the given
   communicators, so that every other rank's sends can complete;
2. once its own ``pending`` sends have completed, enters a non-blocking barrier;
3. goes on draining until the barrier completes: then every rank's sends are done and
   nothing can be left for ``MPI_Finalize`` to wait on.

A rank that never arrives (stuck in a role loop) makes the barrier time out after
``timeout_s``; :func:`part` then returns what it saw and the caller ends the world.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from libra_hpc.cluster.messages import Backoff


@dataclass
class Parting:
    """What a rank saw on its way out: messages dropped (by tag), seconds it waited, and
    whether everyone arrived (``complete``) or the wait timed out."""

    dropped: dict[int, int] = field(default_factory=dict)
    waited_s: float = 0.0
    complete: bool = True
    unsent: int = 0

    def line(self) -> str:
        dropped = sum(self.dropped.values())
        if self.complete:
            return f"parted in {self.waited_s:.2f} s, {dropped} late message(s) dropped"
        return (f"parting timed out after {self.waited_s:.1f} s ({self.unsent} own send(s) not taken, "
                f"{dropped} late message(s) dropped): a rank did not reach the end of its loop")


def drop_incoming(comm: Any, seen: dict[int, int]) -> bool:
    """Receive every message now waiting on ``comm`` (any source, any tag) into a scratch
    buffer and drop it; counts by tag into ``seen``. True if there was one."""
    from mpi4py import MPI

    got = False
    status = MPI.Status()
    while (message := comm.improbe(source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG, status=status)) is not None:
        message.Recv([bytearray(max(status.Get_count(MPI.BYTE), 1)), MPI.BYTE])
        seen[status.Get_tag()] = seen.get(status.Get_tag(), 0) + 1
        got = True
    return got


def part(world_comm: Any, comms: Iterable[Any], pending: list[Any], *, timeout_s: float = 60.0,
         backoff: Backoff | None = None) -> Parting:
    """Run the parting (module docstring) on this rank. ``world_comm`` carries the barrier
    (every rank of the world must call this); ``comms`` are drained (``world_comm``
    included if given); ``pending`` are this rank's posted send requests (their buffers
    kept alive by the caller). Never raises on a timeout: returns ``complete=False``."""
    from mpi4py import MPI

    comms = list(comms)
    wait = backoff or Backoff(1e-4, 0.01)
    result = Parting()
    started = time.monotonic()
    barrier = None
    while True:
        worked = False
        for comm in comms:
            worked |= drop_incoming(comm, result.dropped)
        if barrier is None and (not pending or MPI.Request.Testall(pending)):
            barrier = world_comm.Ibarrier()
            worked = True
        if barrier is not None and barrier.Test():
            break
        result.waited_s = time.monotonic() - started
        if result.waited_s >= timeout_s:
            result.complete = False
            result.unsent = 0 if barrier is not None else sum(1 for r in pending if not r.Test())
            return result
        if worked:
            wait.reset()
        else:
            wait.sleep()
    result.waited_s = time.monotonic() - started
    return result
