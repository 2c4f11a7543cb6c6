"""Layout-aware data dispatch (EARL): which training ranks a finished trajectory goes to,
and by which path. Pure: plans, no transport (the job's rollout leaders and
``benchmarks/bench_dispatch.py`` carry the plans out over MPI).

Two decisions:

- **Where** (:func:`least_loaded`, :func:`balance`): a unit of work (a trajectory, or a
  whole GRPO group, whose advantages need all its members on one replica) goes to the DP
  replica with the fewest tokens so far. Greedy list scheduling: every replica ends at
  most one unit above the optimum's largest replica, online (units in arrival order) or
  offline (:func:`balance`, longest first, which is also within 4/3 of the optimum).
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

from collections.abc import Mapping, Sequence
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


def least_loaded(loads: Mapping[int, int], replicas: Sequence[int]) -> int:
    """Of ``replicas``, the one with the fewest tokens in ``loads`` (absent: 0); ties go to
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


def loads_of(assignment: Mapping[str, int], units: Mapping[str, int], replicas: int) -> list[int]:
    """Tokens per replica under ``assignment``."""
    loads = [0] * replicas
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
