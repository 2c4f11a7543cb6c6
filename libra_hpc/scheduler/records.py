"""The queue service's books: one record per rollout instance and per active trajectory
(:class:`~libra_hpc.scheduler.service.QueueService` keeps them; nothing else does).

Plain classes with slots, compiled with the service (libra_hpc/_compiled.py): every
request reads and writes their attributes.
"""

from __future__ import annotations

from collections import deque

from libra_hpc.scheduler.types import ToolState

QUEUED, LEASED = "queued", "leased"
"""A trajectory's phase: its one turn waits in an instance's queue, or is leased to one."""


class InstanceRecord:
    """One rollout instance as the service keeps it: its bucket, the turns queued on it, the
    leases it holds, when it last asked or sent a heartbeat (None: never), and the queues
    its asks drain (its own first, then its bucket's other instances)."""

    __slots__ = ("bucket", "held", "id", "queue", "renewed", "sources")

    def __init__(self, instance_id: int, bucket: str):
        self.id = instance_id
        self.bucket = bucket
        self.queue: deque[TrajectoryRecord] = deque()
        self.held = 0
        self.renewed: float | None = None
        self.sources: list[InstanceRecord] = []


class TrajectoryRecord:
    """One active trajectory. While its turn is leased, ``lease`` is the lease id (0: none)
    and ``deadline`` when it lapses unless renewed; ``at`` is the instance its turn is
    queued on or leased to and ``expected`` the tokens it is charged there: a trajectory
    holds at most one lease, so the lease needs no object of its own."""

    __slots__ = ("at", "bucket", "deadline", "expected", "generated", "keys", "lease", "migrated", "migrations",
                 "phase", "prev_instance", "prompt_id", "requeues", "states", "tid", "true_remaining", "turn_tokens")

    def __init__(self, tid: str, prompt_id: str, true_remaining: int | None):
        self.tid = tid
        self.prompt_id = prompt_id
        self.true_remaining = true_remaining  # output tokens in all, if known (oracle)
        self.states: tuple[ToolState, ...] = ()  # tuples: handed to the router as they are
        self.keys: tuple[str, ...] = ()  # the states' tree keys (TrajectoryView.keys)
        self.turn_tokens: tuple[int, ...] = ()
        self.generated = 0
        self.bucket: str | None = None  # of the current turn
        self.at = NOWHERE  # queued on / leased to (set when its first turn is placed)
        self.expected = 0  # tokens its current turn is charged to that instance (load accounting)
        self.prev_instance: int | None = None  # where the previous turn ran
        self.migrated = False
        self.phase = QUEUED
        self.lease = 0
        self.deadline = 0.0
        self.migrations = 0
        self.requeues = 0


NOWHERE = InstanceRecord(-1, "")
"""Where a trajectory is before its first turn is placed."""
