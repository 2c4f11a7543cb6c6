"""The layout-aware dispatcher's pure parts: where a unit goes (token balance) and by which
path (direct, or the gather-then-scatter baseline), and the bytes each rank moves."""

import itertools
import random

import pytest

from libra_hpc.parallel.dispatch import (DirectDispatch, GatherScatterDispatch, GroupDispatch, Hop, balance, least_loaded,
                                         loads_of, make_dispatcher, max_rank_bytes, traffic)
from libra_hpc.rl.grpo import group_trains


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


def _batch(rng: random.Random, groups: int, size: int) -> list[tuple[str, int, float]]:
    """A batch's finished members in a shuffled finishing order: (group, tokens, reward).
    About a third of the groups solve every sample or none (the trainer leaves them out)."""
    members = []
    for g in range(groups):
        kind = rng.choice(["none", "all", "mixed", "mixed"])
        for k in range(size):
            reward = {"none": 0.0, "all": 1.0}.get(kind, float(k == 0))
            members.append((f"g{g}", rng.choice([rng.randint(50, 300), rng.randint(600, 2000)]), reward))
    rng.shuffle(members)
    return members


def _work(tokens: int) -> float:
    return tokens * (1 + tokens / 500)  # a sequence's work grows faster than its tokens (attention)


@pytest.mark.parametrize("seed", range(30))
def test_groups_placed_whole_keep_every_replica_within_one_group_of_the_optimum(seed):
    """What the trainers wait for is the replica with the most work of the groups they
    keep. Placed when whole, with that work known, greedy list scheduling ends within one
    group of the optimum; placed at a group's first finish (the job before), it was not."""
    rng = random.Random(seed)
    replicas, size = rng.choice([2, 3]), 4
    members = _batch(rng, groups=rng.randint(5, 8), size=size)
    dispatch = GroupDispatch(size, weigh=_work, keep=group_trains)
    loads: dict[int, float] = {}
    routed: dict[str, list[int]] = {}
    for i, (group, tokens, reward) in enumerate(members):
        for leader, tid, dest in dispatch.finished(group, 100 + i % 3, f"{group}/{i}", tokens, reward, loads,
                                                   range(replicas)):
            routed.setdefault(group, []).append(dest)
    assert sorted(routed) == sorted({g for g, _, _ in members})  # every group placed ...
    assert all(len(set(d)) == 1 and len(d) == size for d in routed.values())  # ... whole, each member once
    kept = {g: sum(_work(t) for gg, t, _ in members if gg == g) for g in routed
            if group_trains([r for gg, _, r in members if gg == g])}
    trained = [sum(w for g, w in kept.items() if routed[g][0] == d) for d in range(replicas)]
    assert trained == pytest.approx([loads.get(d, 0.0) for d in range(replicas)])  # the books are the work
    assert max(trained) - _optimum(kept, replicas) <= max(kept.values(), default=0) + 1e-6
    assert not dispatch.held and not dispatch.members


def test_placed_at_the_first_finish_the_heaviest_replica_carries_what_the_filter_left():
    """The case the first-finish rule lost: both replicas get two groups, but one replica's
    are groups the trainer leaves out, so it trains nothing while the other trains both."""
    members = [("a", 500, 1.0), ("b", 500, 0.0), ("c", 500, 0.0), ("d", 500, 1.0),  # first members
               ("a", 500, 0.0), ("b", 500, 0.0), ("c", 500, 1.0), ("d", 500, 1.0)]  # a, c learn; b, d do not
    first: dict[str, int] = {}
    first_loads: dict[int, float] = {}
    whole = GroupDispatch(2, weigh=_work, keep=group_trains)
    loads: dict[int, float] = {}
    for i, (group, tokens, reward) in enumerate(members):
        if group not in first:  # the old rule: placed at its first finish, by what is known then
            first[group] = least_loaded(first_loads, [0, 1])
        first_loads[first[group]] = first_loads.get(first[group], 0.0) + _work(tokens)
        whole.finished(group, 1, f"{group}/{i}", tokens, reward, loads, [0, 1])
    assert first["a"] == first["c"]  # both kept groups on one replica
    assert whole.dest["a"] != whole.dest["c"]  # placed whole: one each
    assert loads[whole.dest["a"]] == loads[whole.dest["c"]] == 2 * _work(500)


def test_groups_the_trainer_leaves_out_weigh_nothing_but_are_spread_over_the_replicas():
    """Placed by work, a left-out group (0) would always go to the replica of least work:
    after A (200) and B (160), all four left-out groups to B's. They go round instead."""
    dispatch = GroupDispatch(2, weigh=float, keep=group_trains)
    loads: dict[int, float] = {}
    for g, tokens, rewards in [("A", 100, (1.0, 0.0)), ("B", 80, (0.0, 1.0)), ("C", 100, (0.0, 0.0)),
                               ("D", 100, (1.0, 1.0)), ("E", 100, (0.0, 0.0)), ("F", 100, (0.0, 0.0))]:
        for k, reward in enumerate(rewards):
            dispatch.finished(g, 1, f"{g}/{k}", tokens, reward, loads, [0, 1], place=False)
    dispatch.place_all("ABCDEF", loads, [0, 1])
    assert loads == {0: 200.0, 1: 160.0}  # left-out groups weigh nothing
    assert [dispatch.dest[g] for g in "AB"] == [0, 1]
    assert sorted(dispatch.dest[g] for g in "CDEF") == [0, 0, 1, 1]


def test_a_group_held_at_a_leaving_leader_is_placed_before_it_is_whole():
    dispatch = GroupDispatch(4, weigh=float)
    loads: dict[int, float] = {}
    assert dispatch.finished("g", 7, "g/0", 100, 1.0, loads, [0, 1]) == []
    assert dispatch.finished("g", 8, "g/1", 300, 0.0, loads, [0, 1]) == []
    assert dispatch.finished("h", 8, "h/0", 50, 0.0, loads, [0, 1]) == []
    assert dispatch.held_at([7]) == ["g"] and sorted(dispatch.held_at([8, 9])) == ["g", "h"]
    assert dispatch.place("g", loads, [0, 1]) == [(7, "g/0", 0), (8, "g/1", 0)]
    assert loads == {0: 800.0}  # its members' mean times the group's size, as if kept
    assert dispatch.finished("g", 9, "g/2", 10, 1.0, loads, [0, 1]) == [(9, "g/2", 0)]  # the rest follow at once
    assert dispatch.forget("g") == (0, 800.0, [])
    assert dispatch.forget("h") == (None, 0.0, [(8, "h/0")])  # never placed: its held member goes nowhere
    with pytest.raises(ValueError, match="no finished member"):
        dispatch.place("h", loads, [0, 1])


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
