"""Layout-aware data dispatch (EARL): which training ranks a finished trajectory goes to,
and by which path. Pure: plans, no transport (the job's rollout leaders and
``benchmarks/bench_dispatch.py`` carry the plans out over MPI).

Two decisions:

- **Where** (:func:`least_loaded`, :func:`balance`, :class:`GroupDispatch`): a unit of
  work (a trajectory, or a whole GRPO group, whose advantages need all its members on one
  replica) goes to the DP replica with the least work so far. Greedy list scheduling: every
  replica ends at most one unit above the optimum's largest replica, online (units in
  arrival order) or offline (:func:`balance`, longest first, which is also within 4/3 of
  the optimum). The bound needs each unit's size when it is placed: the job places a
  group when its last member finishes (:class:`GroupDispatch`), with its training work
  (0 for a group the trainer leaves out) known.
- **How** (:class:`Dispatcher`): every rank of the replica (each TP rank and pipeline
  stage) needs the unit. :class:`DirectDispatch` sends it from the rollout leader that
  produced it straight to each of those ranks. :class:`GatherScatterDispatch` is the
  single-controller baseline EARL measures against: every unit goes to one hub rank first,
  which sends it on to the replica's ranks, so the hub moves every byte of the batch in
  and again out, once per rank of the destination replica.

:func:`traffic` counts the bytes each rank sends and receives under a dispatcher: the
"largest number of bytes through any single rank" of the benchmark.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol


class Hop(NamedTuple):
    """One message of a unit's path: ``source`` sends it to each of ``dests`` (the source
    holds the unit by the time it sends: the previous hop delivered it there)."""

    source: int
    dests: tuple[int, ...]


class Dispatcher(Protocol):
    """How a unit produced on rank ``source`` reaches every rank of its replica."""

    name: str

    def path(self, source: int, replica_ranks: Sequence[int]) -> list[Hop]:
        ...


@dataclass(frozen=True)
class DirectDispatch:
    """Leader to each rank of the replica, in the training layout: no rank relays."""

    name: str = "direct"

    def path(self, source: int, replica_ranks: Sequence[int]) -> list[Hop]:
        if not replica_ranks:
            raise ValueError(f"dispatch from rank {source}: the destination replica has no ranks")
        return [Hop(source, tuple(r for r in replica_ranks if r != source))]


@dataclass(frozen=True)
class GatherScatterDispatch:
    """The baseline: gather on ``hub``, then scatter from it to the replica's ranks."""

    hub: int
    name: str = "gather_scatter"

    def path(self, source: int, replica_ranks: Sequence[int]) -> list[Hop]:
        if not replica_ranks:
            raise ValueError(f"dispatch from rank {source}: the destination replica has no ranks")
        hops = [] if source == self.hub else [Hop(source, (self.hub,))]
        rest = tuple(r for r in replica_ranks if r != self.hub)
        return hops + ([Hop(self.hub, rest)] if rest else [])


DISPATCHERS = ("direct", "gather_scatter")
"""The registered names (``job.dispatch``)."""


def make_dispatcher(name: str, hub: int) -> Dispatcher:
    """The dispatcher registered as ``name``; ``hub``: the gather rank of the baseline."""
    if name == "direct":
        return DirectDispatch()
    if name == "gather_scatter":
        return GatherScatterDispatch(hub)
    raise ValueError(f"unknown dispatcher {name!r}; valid: {', '.join(DISPATCHERS)}")


def least_loaded(loads: Mapping[int, float], replicas: Sequence[int]) -> int:
    """Of ``replicas``, the one with the least work in ``loads`` (absent: 0); ties go to
    the lowest index, so the choice is deterministic."""
    if not replicas:
        raise ValueError("least_loaded: no replica to choose from")
    return min(replicas, key=lambda d: (loads.get(d, 0), d))


def balance(units: Mapping[str, int], replicas: int) -> dict[str, int]:
    """Offline assignment of ``units`` (id → tokens) to ``replicas`` DP replicas: longest
    first, each to the least-loaded replica (ties by id, for determinism)."""
    if replicas < 1:
        raise ValueError(f"balance: need at least one replica, got {replicas}")
    loads: dict[int, int] = {}
    out: dict[str, int] = {}
    for uid, tokens in sorted(units.items(), key=lambda kv: (-kv[1], kv[0])):
        d = least_loaded(loads, range(replicas))
        out[uid] = d
        loads[d] = loads.get(d, 0) + tokens
    return out


def loads_of(assignment: Mapping[str, int], units: Mapping[str, float], replicas: int) -> list[float]:
    """Work (tokens, FLOPs) per replica under ``assignment``."""
    loads: list[float] = [0] * replicas
    for uid, d in assignment.items():
        loads[d] += units[uid]
    return loads


def traffic(dispatcher: Dispatcher, sends: Sequence[tuple[int, Sequence[int], int]]) -> dict[int, dict[str, int]]:
    """Bytes each rank sends (``out``) and receives (``in``) when ``dispatcher`` carries
    ``sends``: (source rank, the destination replica's ranks, bytes of the unit)."""
    per: dict[int, dict[str, int]] = {}
    for source, ranks, nbytes in sends:
        for hop in dispatcher.path(source, ranks):
            per.setdefault(hop.source, {"in": 0, "out": 0})["out"] += nbytes * len(hop.dests)
            for d in hop.dests:
                per.setdefault(d, {"in": 0, "out": 0})["in"] += nbytes
    return per


def max_rank_bytes(per: Mapping[int, Mapping[str, int]]) -> int:
    """The most bytes through one rank (in + out)."""
    return max((v["in"] + v["out"] for v in per.values()), default=0)


Route = tuple[int, str, int]
"""(the leader that holds a finished trajectory, its id, the DP replica it goes to)."""


class GroupDispatch:
    """Where whole GRPO groups train, each placed when its last member finishes.

    A group's members finish at different leaders over a whole rollout; the trainer leaves
    out a group whose rewards are all equal (``keep``), and a group's training work grows
    faster than its tokens (``weigh``: a sequence's tokens → its work; attention is
    quadratic in the length). Placed at its first member's finish, as the job did until
    2026-12, a group's size was unknown: the heaviest of a default run's replicas carried
    1.0-2.1× an even share (median 1.45). Placed when whole, with its work known, greedy
    list scheduling keeps every replica within one group of the optimum's largest.

    Until then its finished members wait at their leaders (:meth:`finished` returns no
    route for them), which costs nothing: no trainer trains part of a group. A member held
    at a leader that must empty itself (a rollout instance leaving for training or a
    replan) is placed at once (:meth:`place`, from the members so far, the group assumed
    kept). ``loads`` (replica → work booked) belong to the caller: one per batch when a
    step trains a batch, one for all untrained work when steps take groups of several."""

    def __init__(self, size: int, weigh: Callable[[int], float] = float,
                 keep: Callable[[Sequence[float]], bool] = lambda rewards: True):
        if size < 1:
            raise ValueError(f"GroupDispatch: a group has at least one member, got {size}")
        self.size, self.weigh, self.keep = size, weigh, keep
        self.dest: dict[str, int] = {}  # group → its replica, once placed
        self.work: dict[str, float] = {}  # group → the work booked for it on its replica
        self.held: dict[str, list[tuple[int, str]]] = {}  # group → (leader, tid) finished, not routed
        self.members: dict[str, list[tuple[int, float]]] = {}  # group → (tokens, reward) of its finished members
        self.left_out = 0  # groups placed that the trainer leaves out (they go round the replicas)

    def finished(self, group: str, leader: int, tid: str, tokens: int, reward: float,
                 loads: MutableMapping[int, float], replicas: Sequence[int], place: bool = True) -> list[Route]:
        """Member ``tid`` of ``group`` finished at ``leader``: the routes to send now (its
        own once the group is placed; all of the group's when this member completes it,
        unless ``place`` is False: the caller places whole groups later, :meth:`place_all`)."""
        if group in self.dest:
            return [(leader, tid, self.dest[group])]
        self.members.setdefault(group, []).append((tokens, reward))
        self.held.setdefault(group, []).append((leader, tid))
        return self.place(group, loads, replicas) if place and len(self.members[group]) >= self.size else []

    def place_all(self, groups: Iterable[str], loads: MutableMapping[int, float],
                  replicas: Sequence[int]) -> list[Route]:
        """Place every group of ``groups`` not placed yet, the one of most work first, each
        on the replica of least work (:func:`balance`'s rule, offline: within 4/3 of the
        optimum and one group of it). For a step that takes a whole batch and trains
        nothing ahead: every group's work is known when the batch is complete."""
        work = {g: self._work(self.members[g]) for g in groups if g not in self.dest and g in self.members}
        return [r for g in sorted(work, key=lambda g: (-work[g], g)) for r in self.place(g, loads, replicas)]

    def _work(self, members: Sequence[tuple[int, float]]) -> float:
        """A group's work from its finished members: 0 when whole and left out by ``keep``,
        else their mean work times the group's size (all of it once whole)."""
        if len(members) >= self.size and not self.keep([r for _, r in members]):
            return 0.0
        return sum(self.weigh(t) for t, _ in members) * self.size / len(members)

    def place(self, group: str, loads: MutableMapping[int, float], replicas: Sequence[int]) -> list[Route]:
        """Place ``group`` now on the replica of least work in ``loads`` (which books its
        work): its held members' routes. A group placed before it is whole is booked at
        its members' mean work times the group's size, as if kept."""
        members = self.members.pop(group, [])
        if not members:
            raise ValueError(f"GroupDispatch: group {group} has no finished member to place")
        work = self._work(members)
        if work:
            dest = least_loaded(loads, replicas)
        else:  # left out: it weighs nothing, and its bytes go round the replicas (not all to the least loaded)
            dest = replicas[self.left_out % len(replicas)]
            self.left_out += 1
        self.dest[group] = dest
        loads[dest] = loads.get(dest, 0.0) + work
        self.work[group] = work
        return [(leader, tid, dest) for leader, tid in self.held.pop(group)]

    def held_at(self, leaders: Iterable[int]) -> list[str]:
        """The groups not placed yet with a member held at one of ``leaders``."""
        at = set(leaders)
        return [g for g, held in self.held.items() if any(leader in at for leader, _ in held)]

    def forget(self, group: str) -> tuple[int | None, float, list[tuple[int, str]]]:
        """``group`` trained or will never train (regenerated): its replica (None: never
        placed), the work booked there, and its members still held (to be routed nowhere)."""
        self.members.pop(group, None)
        return self.dest.pop(group, None), self.work.pop(group, 0.0), self.held.pop(group, [])
