"""Layouts: initial placement, lending the hybrid pool and giving it back, invariants."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from libra_hpc.cluster.layout import (
    Group,
    Layout,
    LayoutError,
    Slot,
    check_layout,
    initial_layout,
    layout_from_config,
    lend_hybrid_to_training,
    return_hybrid_to_rollout,
)
from libra_hpc.config import load_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


@pytest.fixture
def a800():
    return layout_from_config(load_config(CONFIGS / "a800-6node.yaml"))


def assert_invariants(layout: Layout) -> None:
    """Independent of check_layout: every slot once, TP groups on one node, sizes right."""
    every = [s for g in layout.groups for s in g.slots]
    counts = Counter(every)
    assert all(c == 1 for c in counts.values()), [s for s, c in counts.items() if c > 1]
    assert set(every) == {Slot(n, g) for n in range(layout.nodes) for g in range(layout.gpus_per_node)}
    for group in layout.groups:
        assert len(group.slots) == group.tp * group.pp * group.dp
        for chunk in group.tp_groups():
            assert len(chunk) == group.tp
            assert len({s.node for s in chunk}) == 1, (group.name, chunk)
    assert [g.gid for g in layout.groups] == list(range(len(layout.groups)))
    check_layout(layout)


def shapes(layout: Layout) -> list[tuple]:
    return sorted((g.role, g.slots, g.tp, g.pp, g.dp, g.hybrid) for g in layout.groups)


# ------------------------------------------------------------------ initial layout


def test_a800_initial_layout(a800):
    assert_invariants(a800)
    train = a800.training
    assert (train.tp, train.pp, train.dp) == (8, 1, 4)
    assert sorted(train.slots) == [Slot(n, g) for n in range(4) for g in range(8)]
    for chunk in train.tp_groups():  # each TP8 group is one whole node
        assert {s.gpu for s in chunk} == set(range(8))
    for node in (4, 5):
        on_node = [g for g in a800.rollout_instances if g.slots[0].node == node]
        assert [g.tp for g in on_node] == [1, 1, 2, 4]
        assert sorted(s for g in on_node for s in g.slots) == [Slot(node, g) for g in range(8)]
    assert a800.hybrid == frozenset(Slot(5, g) for g in range(8))
    assert {g.slots[0].node for g in a800.rollout_instances if g.hybrid} == {5}
    assert all(not g.hybrid for g in a800.rollout_instances if g.slots[0].node == 4)
    assert (a800.version, a800.reason) == (0, "initial")


def test_partial_node_becomes_tp1_instances():
    # 3 nodes × 4 GPUs, TP2 × DP3 = 6 slots: node 0 whole, node 1 slots 0-1 training.
    layout = initial_layout(3, 4, 2, 1, 3, [[4]])
    assert_invariants(layout)
    assert sorted(layout.training.slots) == [Slot(0, g) for g in range(4)] + [Slot(1, 0), Slot(1, 1)]
    node1 = [g for g in layout.rollout_instances if g.slots[0].node == 1]
    assert [(g.tp, g.slots) for g in node1] == [(1, (Slot(1, 2),)), (1, (Slot(1, 3),))]
    node2 = [g for g in layout.rollout_instances if g.slots[0].node == 2]
    assert [g.tp for g in node2] == [4]  # a whole node takes the pattern


def test_alternating_patterns_apply_to_whole_rollout_nodes_in_turn():
    # 6 × 2, TP2 × DP2: nodes 2-5 are rollout; the partial-node rule does not advance the pattern.
    layout = initial_layout(6, 2, 2, 1, 2, [[1, 1], [2]], hybrid_nodes=1)
    assert_invariants(layout)
    per_node = {n: [g.tp for g in layout.rollout_instances if g.slots[0].node == n] for n in range(2, 6)}
    assert per_node == {2: [1, 1], 3: [2], 4: [1, 1], 5: [2]}
    layout = initial_layout(3, 4, 2, 1, 3, [[2, 2], [4]])  # node 1 partial, node 2 first whole
    assert [g.tp for g in layout.rollout_instances if g.slots[0].node == 2] == [2, 2]


def test_default_config_layout():
    layout = layout_from_config(load_config(CONFIGS / "default.yaml"))
    assert_invariants(layout)
    assert layout.hybrid == {Slot(5, 0), Slot(5, 1)}
    assert [g.tp for g in layout.rollout_instances] == [1, 1, 2, 1, 1, 2]


def test_pipeline_parallel_tp_groups_stay_on_nodes():
    layout = initial_layout(4, 4, 2, 3, 2, [[4]])  # 12 slots over 3 nodes
    assert_invariants(layout)
    assert len(layout.training.tp_groups()) == 6


def test_training_larger_than_cluster():
    with pytest.raises(LayoutError, match="training needs 12 slots, the cluster has 8"):
        initial_layout(2, 4, 4, 1, 3, [[4]])


# ------------------------------------------------------------- lending and return


def test_lend_hybrid_to_training(a800):
    lent = lend_hybrid_to_training(a800, "borrow")
    assert_invariants(lent)
    train = lent.training
    # 8 hybrid slots / (TP8 × PP1) = one more DP replica
    assert (train.tp, train.pp, train.dp) == (8, 1, 5)
    assert set(train.slots) == set(a800.training.slots) | a800.hybrid
    assert train.slots[:32] == a800.training.slots  # core replicas keep their ranks
    assert not any(g.hybrid for g in lent.rollout_instances)
    assert {s.node for g in lent.rollout_instances for s in g.slots} == {4}
    assert (lent.version, lent.reason) == (1, "borrow")
    assert lent.hybrid == a800.hybrid
    assert lent.summary()["gpus"] == {"training": 40, "rollout": 8}


def test_lend_adds_dp_by_hybrid_slots_over_tp_pp():
    # 4 × 4, TP2 × DP2 = node 0; hybrid nodes 2-3 = 8 slots = 4 replicas of TP2
    layout = initial_layout(4, 4, 2, 1, 2, [[2, 2]], hybrid_nodes=2)
    lent = lend_hybrid_to_training(layout, "borrow")
    assert_invariants(lent)
    assert lent.training.dp == 2 + 8 // 2


def test_one_replica_of_several_is_lent_and_returned_alone():
    """A pool of two TP-1 replicas (TP-1 training, a hybrid node of two TP-1 instances):
    the control loop lends one replica at a time, and only its instance leaves rollout."""
    from libra_hpc.cluster.layout import Slot

    base = initial_layout(4, 2, 1, 1, 2, [[1, 1]], hybrid_nodes=1)
    one = frozenset({Slot(3, 0)})
    lent = lend_hybrid_to_training(base, "borrow one", only=one)
    assert_invariants(lent)
    assert lent.training.dp == 3 and Slot(3, 0) in lent.training.slots
    assert [g.slots for g in lent.rollout_instances if g.hybrid] == [(Slot(3, 1),)]
    both = lend_hybrid_to_training(lent, "borrow the other", only=frozenset({Slot(3, 1)}))
    assert both.training.dp == 4
    back = return_hybrid_to_rollout(both, base, "return one", only=one)
    assert_invariants(back)
    assert back.training.dp == 3 and Slot(3, 1) in back.training.slots and Slot(3, 0) not in back.training.slots
    assert [g.slots for g in back.rollout_instances if g.hybrid] == [(Slot(3, 0),)]


def test_lending_twice_raises(a800):
    lent = lend_hybrid_to_training(a800, "borrow")
    with pytest.raises(LayoutError, match="already lent"):
        lend_hybrid_to_training(lent, "again")


def test_lending_without_hybrid_pool_raises():
    layout = initial_layout(3, 4, 2, 1, 2, [[4]], hybrid_nodes=0)
    with pytest.raises(LayoutError, match="nothing to lend"):
        lend_hybrid_to_training(layout, "borrow")


def test_return_restores_initial_shapes(a800):
    lent = lend_hybrid_to_training(a800, "borrow")
    back = return_hybrid_to_rollout(lent, a800, "return")
    assert_invariants(back)
    assert shapes(back) == shapes(a800)
    assert (back.version, back.reason) == (2, "return")
    assert back.training.slots == a800.training.slots
    with pytest.raises(LayoutError, match="not lent"):
        return_hybrid_to_rollout(back, a800, "again")
    # the cycle can repeat
    assert shapes(lend_hybrid_to_training(back, "borrow")) == shapes(lent)


def test_return_with_alternating_patterns():
    base = initial_layout(6, 2, 2, 1, 2, [[1, 1], [2]], hybrid_nodes=2)
    back = return_hybrid_to_rollout(lend_hybrid_to_training(base, "b"), base, "r")
    assert_invariants(back)
    assert shapes(back) == shapes(base)


def test_lend_with_pipeline_parallel_keeps_replicas_whole():
    base = initial_layout(3, 4, 2, 2, 1, [[4]], hybrid_nodes=1)  # core replica = node 0
    lent = lend_hybrid_to_training(base, "borrow")
    train = lent.training
    tp, pp, dp = train.tp, train.pp, train.dp
    assert dp == 2

    def replica(d: int) -> set[Slot]:  # Megatron order: rank = pp·(TP·DP) + dp·TP + tp
        return {train.slots[p * tp * dp + d * tp + t] for p in range(pp) for t in range(tp)}

    assert replica(0) == set(base.training.slots)
    assert replica(1) == set(base.hybrid)


# --------------------------------------------------------------------- check_layout


def _two_by_two(groups) -> Layout:
    return Layout(2, 2, tuple(groups))


def test_check_layout_slot_in_two_groups():
    layout = _two_by_two([
        Group(0, "training", (Slot(0, 0), Slot(0, 1)), tp=2),
        Group(1, "rollout", (Slot(0, 1),), tp=1),
        Group(2, "rollout", (Slot(1, 0), Slot(1, 1)), tp=2),
    ])
    with pytest.raises(LayoutError, match=r"slot n0g1 is in both training and rollout-1"):
        check_layout(layout)


def test_check_layout_missing_slot():
    layout = _two_by_two([
        Group(0, "training", (Slot(0, 0), Slot(0, 1)), tp=2),
        Group(1, "rollout", (Slot(1, 0),), tp=1),
    ])
    with pytest.raises(LayoutError, match=r"\['n1g1'\] are in no group"):
        check_layout(layout)


def test_check_layout_tp_group_across_nodes():
    layout = _two_by_two([
        Group(0, "training", (Slot(0, 0),), tp=1),
        Group(1, "rollout", (Slot(0, 1), Slot(1, 0)), tp=2),
        Group(2, "rollout", (Slot(1, 1),), tp=1),
    ])
    with pytest.raises(LayoutError, match=r"rollout-1: TP group \['n0g1', 'n1g0'\] crosses nodes"):
        check_layout(layout)


def test_check_layout_wrong_slot_count():
    layout = _two_by_two([
        Group(0, "training", (Slot(0, 0), Slot(0, 1), Slot(1, 0)), tp=1, dp=2),
        Group(1, "rollout", (Slot(1, 1),), tp=1),
    ])
    with pytest.raises(LayoutError, match=r"training: 3 slots but TP×PP×DP = 2"):
        check_layout(layout)


def test_check_layout_slot_outside_cluster():
    layout = _two_by_two([
        Group(0, "training", (Slot(0, 0), Slot(0, 1)), tp=2),
        Group(1, "rollout", (Slot(1, 0), Slot(1, 1)), tp=2),
        Group(2, "rollout", (Slot(2, 0),), tp=1),
    ])
    with pytest.raises(LayoutError, match=r"slot n2g0 is outside"):
        check_layout(layout)


# ----------------------------------------------------------------- table / summary


def test_table(a800):
    rows = a800.table().splitlines()
    assert len(rows) == 1 + 6  # header + one row per node
    assert rows[0].split() == ["node"] + [f"gpu{g}" for g in range(8)]
    for n, row in enumerate(rows[1:]):
        cells = row.split()
        assert cells[0] == str(n) and len(cells) == 1 + 8
        assert sum(c.endswith("*") for c in cells[1:]) == (8 if n == 5 else 0)
    assert rows[1].split()[1:] == ["T(tp8)"] * 8
    lent_rows = lend_hybrid_to_training(a800, "b").table().splitlines()
    assert lent_rows[6].split()[1:] == ["T(tp8)*"] * 8


@pytest.mark.parametrize("lend", [False, True])
def test_summary_counts(a800, lend):
    layout = lend_hybrid_to_training(a800, "b") if lend else a800
    summary = layout.summary()
    gpus = summary["gpus"]
    assert gpus["training"] + gpus["rollout"] == 48
    t = summary["training"]
    assert t["gpus"] == t["tp"] * t["pp"] * t["dp"] == gpus["training"]
    assert sum(summary["rollout_tp"]) == gpus["rollout"]
    assert sum(len(v) for v in summary["groups"].values()) == 48
    assert summary["version"] == layout.version
