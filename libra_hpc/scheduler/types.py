"""The contract between the C-MLFQ routing core and the queue service that drives it.

Pure data, no MPI, no torch. The service (scheduler/service.py) owns trajectories, turns
and leases; a :class:`Router` (scheduler/routers.py) only decides *where* the next turn of
a trajectory is generated, and learns from finished trajectories.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal, NamedTuple, Protocol

Status = Literal["success", "failure", "timeout"]

new_tuple = tuple.__new__
"""``new_tuple(NamedTupleClass, (field, ...))`` builds a named tuple without calling its
Python-level ``__new__``, which costs more than the rest of a routing decision when called
from the compiled scheduler (libra_hpc/_compiled.py). For the few built per decision; every
field must be given, in order."""


# The scheduler's errors that subclass a builtin error live here, in a module that stays
# interpreted: a compiled (native) class may subclass Exception only (libra_hpc/_compiled.py).
class RouterError(RuntimeError):
    """The router returned a placement that does not exist (a bug in the router, not in
    the request): raised out of :meth:`QueueService.handle`."""


class ServiceInvariantError(AssertionError):
    """:meth:`QueueService.audit` found a trajectory lost or in two places at once."""


class CausalTreeFormatError(ValueError):
    """A saved causal index (JSON) does not have the expected shape."""


@dataclass(frozen=True, order=True)
class ToolState:
    """The causal signal of one tool return: which tool, how big its output, how it ended."""

    tool: str
    size: str  # a size class name, e.g. "S", "M", "L" (thresholds in SchedulerConfig)
    status: Status
    _key: ClassVar[str]  # set per instance in __post_init__; not a field (asdict() and the tool worker's JSON leave it out)

    def __post_init__(self) -> None:
        # The tree key, computed once: the same states are looked up at every later
        # decision of their trajectory (a plain attribute read on the hot path).
        object.__setattr__(self, "_key", f"{self.tool}|{self.size}|{self.status}")

    def key(self) -> str:
        """Compact, JSON-safe key used in the prefix tree: ``tool|size|status``."""
        return self._key


@dataclass(frozen=True)
class BucketSpec:
    """Rollout instances of one TP size. Buckets form the MLFQ levels, ordered by
    ``token_limit`` ascending: level 0 (top) is for the shortest remaining work."""

    name: str
    tp: int
    token_limit: int  # remaining output tokens this bucket is meant for (upper bound)
    instances: tuple[int, ...]  # instance ids (rollout group ids of the layout)
    max_outstanding_tokens: int = 1 << 30  # an instance above this is saturated


class TrajectoryView(NamedTuple):
    """What a router may know about a trajectory when placing its next turn. (A named
    tuple: the service builds one per decision.)"""

    tid: str
    prompt_id: str
    states: tuple[ToolState, ...] = ()  # tool returns so far, oldest first
    generated_tokens: int = 0
    bucket: str | None = None  # where its previous turn ran (None: new)
    true_remaining: int | None = None  # known only to the oracle (simulations, benchmarks)
    turn_tokens: tuple[int, ...] = ()
    """Output tokens of each turn so far: ``turn_tokens[d]`` was generated after the d-th
    tool return. Lets C-MLFQ condition a shallower node's statistics on what the
    trajectory has generated since that node."""
    instance: int | None = None
    """The instance its previous turn ran on: its KV prefix is cached there (None: new)."""
    keys: tuple[str, ...] = ()
    """``states``' tree keys (:meth:`ToolState.key`), when the caller keeps them (the queue
    service does); otherwise empty, and a router that needs them computes them."""


class Placement(NamedTuple):
    """A router's decision. (A named tuple: one is built per decision on the hot path.)"""

    bucket: str
    instance: int
    migrated: bool = False  # the bucket changed: the KV cache is recomputed at the destination
    reason: str = ""


class FinishedTrajectory(NamedTuple):
    """Input for learning: ``remaining_after[d]`` is the output tokens generated after the
    d-th tool return (``remaining_after[0]``: after the start, i.e. the whole output), so
    ``len(remaining_after) == len(states) + 1``. (A named tuple: one per finish.)"""

    prompt_id: str
    states: tuple[ToolState, ...]
    remaining_after: tuple[int, ...]
    keys: tuple[str, ...] = ()
    """``states``' tree keys, when the caller keeps them (see :attr:`TrajectoryView.keys`)."""


class CompletedTrajectory(NamedTuple):
    """A finished trajectory, for the trainer side (what ``QueueService.drain_finished``
    returns). ``turn_tokens[d]``: output tokens of the turn generated after ``d`` tool
    returns (``len(states) + 1`` turns)."""

    tid: str
    prompt_id: str
    states: tuple[ToolState, ...]
    turn_tokens: tuple[int, ...]
    migrations: int  # placements that changed bucket
    requeues: int  # leases that expired under it


class Router(Protocol):
    """Where turns run. Implementations: CmlfqRouter and the baselines, by registered name."""

    @property
    def name(self) -> str:
        """The policy's registered name."""

    def place(self, view: TrajectoryView) -> Placement:
        """Choose bucket and instance for the trajectory's next turn (first turn when
        ``view.bucket`` is None). Must return an instance of ``buckets``."""

    def turn_started(self, instance: int, expected_tokens: int) -> None:
        """A turn now waits on or runs on ``instance`` (load accounting: queued or leased
        there; the service moves it when a sibling instance takes it)."""

    def turn_ended(self, instance: int, expected_tokens: int) -> None:
        """That turn left ``instance``: done, its lease expired, a sibling took it from the
        queue, or the instance fell silent."""

    def observe(self, finished: FinishedTrajectory) -> None:
        """Learn from a finished trajectory. O(depth): called on the service's hot path."""
