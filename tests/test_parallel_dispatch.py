"""The layout-aware dispatcher's pure parts: where a unit goes (token balance) and by which
path (direct, or the gather-then-scatter baseline), and the bytes each rank moves."""

import itertools
import random

import pytest

from libra_hpc.parallel.dispatch import (DirectDispatch, GatherScatterDispatch, Hop, balance, least_loaded, loads_of,
                                         make_dispatcher, max_rank_bytes, traffic)


def _optimum(units: dict[str, int], replicas: int) -> int:
    """The smallest possible largest replica (every assignment tried)."""
    names = sorted(units)
    best = None
    for assign in itertools.product(range(replicas), repeat=len(names)):
        loads = [0] * replicas
        for n, d in zip(names, assign):
            loads[d] += units[n]
        best = max(loads) if best is None else min(best, max(loads))
    return best


@pytest.mark.parametrize("seed", range(40))
def test_balance_is_within_one_sequence_of_the_optimum(seed):
    rng = random.Random(seed)
    replicas = rng.choice([2, 3])
    units = {f"t{i}": rng.choice([rng.randint(10, 200), rng.randint(500, 4000)]) for i in range(rng.randint(4, 9))}
    assignment = balance(units, replicas)
    assert sorted(assignment) == sorted(units)  # every sequence placed, once
    loads = loads_of(assignment, units, replicas)
    assert sum(loads) == sum(units.values())
    assert max(loads) - _optimum(units, replicas) <= max(units.values())
    assert max(loads) <= 4 / 3 * _optimum(units, replicas) + 1e-9  # longest first: Graham's bound


def test_online_least_loaded_keeps_every_replica_within_one_unit_of_the_mean():
    """Units routed in arrival order (as the controller routes finished groups): the
    largest replica never exceeds the mean by more than the largest unit."""
    rng = random.Random(3)
    loads: dict[int, int] = {}
    sizes = [rng.randint(1, 3000) for _ in range(200)]
    for size in sizes:
        d = least_loaded(loads, range(4))
        loads[d] = loads.get(d, 0) + size
    assert max(loads.values()) - sum(sizes) / 4 <= max(sizes)
    assert least_loaded({0: 5, 1: 5}, [1, 0]) == 0  # ties go to the lowest index
    assert least_loaded({0: 5, 1: 9}, [1]) == 1  # only open replicas count
    with pytest.raises(ValueError, match="no replica"):
        least_loaded({}, [])


def test_direct_sends_from_the_leader_to_every_rank_of_the_replica():
    assert DirectDispatch().path(6, [2, 3]) == [Hop(6, (2, 3))]
    hub = GatherScatterDispatch(hub=1)
    assert hub.path(6, [2, 3]) == [Hop(6, (1,)), Hop(1, (2, 3))]
    assert hub.path(6, [1, 2]) == [Hop(6, (1,)), Hop(1, (2,))]  # the hub keeps its own copy
    assert hub.path(1, [1]) == []
    assert make_dispatcher("gather_scatter", 4) == GatherScatterDispatch(4)
    with pytest.raises(ValueError, match="valid: direct, gather_scatter"):
        make_dispatcher("scatter", 0)
    with pytest.raises(ValueError, match="no ranks"):
        DirectDispatch().path(6, [])


def test_traffic_counts_every_byte_once_per_receiver_and_the_hub_carries_everything():
    """4 leaders (ranks 4-7) → 2 DP replicas × TP 2 (ranks 0-3), 16 units of 1 MB: the
    direct path puts at most a replica's share through a rank; the baseline's hub takes
    the whole batch in and sends every unit to both TP ranks of its replica."""
    replicas = [[0, 1], [2, 3]]
    mb = 1 << 20
    sends = [(4 + i % 4, replicas[i % 2], mb) for i in range(16)]
    direct, gathered = traffic(DirectDispatch(), sends), traffic(GatherScatterDispatch(hub=0), sends)
    for per in (direct, gathered):  # every TP rank of the destination replica gets every unit of it
        assert [per[r]["in"] for r in range(4)] in ([8 * mb] * 4, [16 * mb, 8 * mb, 8 * mb, 8 * mb])
    assert max_rank_bytes(direct) == 8 * mb
    assert gathered[0] == {"in": 16 * mb, "out": 24 * mb}  # its own replica's partner, and both of the other
    assert max_rank_bytes(gathered) / max_rank_bytes(direct) == 5
