"""Elastic hybrid pool: every transition, every rollback path, the bounds, the policy,
illegal inputs, and a random-sequence property test of the invariants."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from libra_hpc.cluster.layout import Slot, initial_layout
from libra_hpc.planner.hybrid import (
    JOINING,
    STATES,
    HybridPool,
    HybridPoolError,
    HybridReplica,
    PhaseTimeouts,
    PoolEvent,
    replay_states,
)

TIMEOUTS = PhaseTimeouts(requested=10, fetching_state=20, zero_grad_sync=30, releasing=40)
SIZE = 2  # TP×PP of the toy training shape


def make_pool(n: int = 3, *, min_rollout: int = 2, rollout_core: int = 2, training_core: int = 4) -> HybridPool:
    replicas = [HybridReplica(i, tuple(Slot(1 + i, g) for g in range(SIZE))) for i in range(n)]
    return HybridPool(replicas, min_rollout_gpus=min_rollout, rollout_core_gpus=rollout_core,
                      training_core_gpus=training_core, timeouts=TIMEOUTS)


def states(pool: HybridPool) -> dict[int, str]:
    return {r.rid: r.state for r in pool.all_replicas()}


def one(events: list[PoolEvent]) -> PoolEvent:
    assert len(events) == 1, events
    return events[0]


def to_active(pool: HybridPool, now: float = 0.0) -> int:
    rid = one(pool.borrow(now, "test")).replica
    for _ in JOINING:
        pool.progress(rid, now)
    assert pool.replica(rid).state == "active"
    return rid


def advance_to(pool: HybridPool, rid: int, state: str, now: float = 0.0) -> None:
    one(pool.borrow(now, "test"))
    path = ["requested", "fetching_state", "zero_grad_sync", "active", "releasing"]
    for _ in range(path.index(state)):
        if pool.replica(rid).state == "active":
            one(pool.release(now, "test"))
        else:
            one(pool.progress(rid, now))
    assert pool.replica(rid).state == state


# ------------------------------------------------------------------ happy paths
def test_a_replica_joins_through_every_phase_then_is_released():
    pool = make_pool()
    assert pool.rollout_gpus() == 2 + 3 * SIZE and pool.training_gpus() == 4
    e = one(pool.borrow(1.0, "train slow"))
    assert (e.replica, e.from_state, e.to_state, e.time) == (0, "rollout", "requested", 1.0)
    assert "train slow" in e.reason and not e.refused and e.changed
    assert pool.rollout_gpus() == 2 + 2 * SIZE and pool.training_gpus() == 4  # joining counts on neither side
    assert [r.rid for r in pool.joining()] == [0]
    seen = [(e.from_state, e.to_state) for t in (2.0, 3.0, 4.0) for e in pool.progress(0, t)]
    assert seen == [("requested", "fetching_state"), ("fetching_state", "zero_grad_sync"), ("zero_grad_sync", "active")]
    assert [r.rid for r in pool.training_replicas()] == [0] and pool.joining() == []
    assert pool.training_gpus() == 4 + SIZE
    e = one(pool.release(5.0, "rollout slow"))
    assert (e.from_state, e.to_state) == ("active", "releasing") and "rollout slow" in e.reason
    assert pool.training_gpus() == 4 and pool.rollout_gpus() == 2 + 2 * SIZE
    e = one(pool.progress(0, 6.0))
    assert (e.from_state, e.to_state) == ("releasing", "rollout")
    assert pool.rollout_gpus() == 2 + 3 * SIZE


def test_core_group_keeps_stepping_while_a_replica_joins():
    # The pool never owns the core: its GPUs count in training in every state, and no
    # transition needs a core-group input.
    pool = make_pool()
    one(pool.borrow(0, "x"))
    for t in (1, 2):
        assert pool.training_gpus() == 4
        one(pool.progress(0, t))
    one(pool.progress(0, 3))
    assert pool.training_gpus() == 4 + SIZE


def test_events_serialise_and_snapshot_is_plain_data():
    import json

    pool = make_pool()
    e = one(pool.borrow(0.5, "x"))
    d = e.to_dict()
    assert d["kind"] == "hybrid_transition" and d["replica"] == 0 and d["to_state"] == "requested"
    snap = pool.snapshot()
    json.dumps(snap), json.dumps(d)
    assert snap["rollout_gpus"] == 2 + 2 * SIZE and snap["replicas"][0]["deadline"] == 0.5 + TIMEOUTS.requested
    assert snap["replicas"][0]["slots"] == ["n1g0", "n1g1"]


# ------------------------------------------------------------------ rollbacks
@pytest.mark.parametrize("phase", ["requested", "fetching_state", "zero_grad_sync", "releasing"])
def test_timeout_in_each_transient_phase_rolls_back(phase):
    pool = make_pool()
    advance_to(pool, 0, phase, now=100.0)
    limit = TIMEOUTS.of(phase)
    assert pool.tick(100.0 + limit - 0.001) == []
    e = one(pool.tick(100.0 + limit))
    assert (e.replica, e.from_state, e.to_state) == (0, phase, "rollout") and "timeout" in e.reason and phase in e.reason
    assert pool.tick(1e6) == []


def test_timeout_is_applied_before_a_late_progress_which_is_then_refused():
    pool = make_pool()
    one(pool.borrow(0, "x"))
    timeout, refusal = pool.progress(0, TIMEOUTS.requested + 1)
    assert (timeout.from_state, timeout.to_state) == ("requested", "rollout")
    assert refusal.refused and refusal.from_state == refusal.to_state == "rollout"


def test_active_replicas_never_time_out():
    pool = make_pool()
    to_active(pool)
    assert pool.tick(1e9) == [] and pool.replica(0).state == "active"


@pytest.mark.parametrize("phase", JOINING)
def test_cancel_in_each_joining_phase_rolls_back(phase):
    pool = make_pool()
    advance_to(pool, 0, phase)
    e = one(pool.cancel(0, 1.0, "operator"))
    assert (e.from_state, e.to_state) == (phase, "rollout") and "operator" in e.reason


@pytest.mark.parametrize("phase", ["requested", "fetching_state", "zero_grad_sync", "active", "releasing"])
def test_member_failure_in_any_phase_rolls_the_whole_replica_back(phase):
    pool = make_pool()
    advance_to(pool, 0, phase)
    before = pool.rollout_gpus()
    e = one(pool.fail(0, Slot(1, 1), 2.0, "NCCL timeout"))
    assert (e.from_state, e.to_state) == (phase, "rollout")
    assert "n1g1" in e.reason and "NCCL timeout" in e.reason
    assert pool.replica(0).state == "rollout" and pool.rollout_gpus() == before + SIZE
    assert pool.training_gpus() == 4


def test_a_rolled_back_replica_can_be_borrowed_again():
    pool = make_pool()
    one(pool.borrow(0, "x"))
    one(pool.fail(0, Slot(1, 0), 1, "oom"))
    assert one(pool.borrow(2, "again")).replica == 0
    assert pool.replica(0).requested_at == 2


# ------------------------------------------------------------------ bounds and order
def test_borrow_never_drops_rollout_below_the_minimum():
    pool = make_pool(3, min_rollout=5, rollout_core=2)  # 8 rollout GPUs: one borrow leaves 6, a second 4 < 5
    assert one(pool.borrow(0, "a")).to_state == "requested"
    e = one(pool.borrow(0, "b"))
    assert e.refused and e.replica == 1 and "min_rollout_gpus=5" in e.reason and e.from_state == e.to_state == "rollout"
    assert pool.rollout_gpus() == 6


def test_borrow_with_everything_lent_is_refused():
    pool = make_pool(2, min_rollout=0)
    one(pool.borrow(0, "a")), one(pool.borrow(0, "b"))
    e = one(pool.borrow(0, "c"))
    assert e.refused and e.replica is None and "no hybrid replica is on the rollout side" in e.reason


def test_borrow_takes_the_lowest_id_rollout_replica():
    pool = make_pool(3, min_rollout=0)
    assert [one(pool.borrow(0, "x")).replica for _ in range(3)] == [0, 1, 2]
    one(pool.cancel(1, 1, "x"))
    assert one(pool.borrow(2, "x")).replica == 1


def test_release_gives_back_the_last_activated_first():
    pool = make_pool(3, min_rollout=0)
    for rid, t in ((0, 1.0), (1, 2.0), (2, 3.0)):
        assert one(pool.borrow(t, "x")).replica == rid  # borrowing takes the lowest id first
    for rid, t in ((2, 4.0), (0, 5.0), (1, 6.0)):  # activation order 2, 0, 1
        for _ in JOINING:
            pool.progress(rid, t)
    assert [r.rid for r in pool.training_replicas()] == [2, 0, 1]
    assert [one(pool.release(7.0, "r")).replica for _ in range(3)] == [1, 0, 2]
    assert pool.training_gpus() == 4  # the core is never released
    e = one(pool.release(8.0, "r"))
    assert e.refused and e.replica is None and "core group" in e.reason


def test_release_with_none_active_abandons_the_latest_join():
    pool = make_pool(3, min_rollout=0)
    one(pool.borrow(1.0, "x")), one(pool.borrow(2.0, "x"))
    e = one(pool.release(3.0, "rollout slow"))
    assert (e.replica, e.from_state, e.to_state) == (1, "requested", "rollout") and "abandoned" in e.reason
    to_active_rid = 0
    for _ in JOINING:
        pool.progress(to_active_rid, 4.0)
    one(pool.borrow(5.0, "x"))  # replica 1 joining again, 0 active: release prefers the active one
    assert one(pool.release(6.0, "r")).replica == 0


# ------------------------------------------------------------------ policy
def test_decide_borrows_releases_and_holds_with_the_margin():
    pool = make_pool(3, min_rollout=0)
    assert pool.decide(0, t_train=10.5, t_rollout=10.0, margin=0.1) == []  # within the margin: hold
    assert pool.decide(0, t_train=10.0, t_rollout=10.5, margin=0.1) == []
    e = one(pool.decide(1, t_train=12.0, t_rollout=10.0, margin=0.1))
    assert e.to_state == "requested" and "training is the bottleneck" in e.reason
    assert pool.decide(2, t_train=12.0, t_rollout=10.0, margin=0.1) == []  # a join is in flight: hold
    for _ in JOINING:
        pool.progress(0, 3)
    assert one(pool.decide(4, t_train=12.0, t_rollout=10.0, margin=0.1)).replica == 1
    for _ in JOINING:
        pool.progress(1, 5)
    e = one(pool.decide(6, t_train=10.0, t_rollout=12.0, margin=0.1))
    assert (e.replica, e.to_state) == (1, "releasing") and "rollout is the bottleneck" in e.reason
    assert pool.decide(7, t_train=12.0, t_rollout=10.0) == []  # releasing in flight: hold borrowing


def test_decide_borrow_respects_the_minimum_and_reports_why():
    pool = make_pool(1, min_rollout=3, rollout_core=2)
    e = one(pool.decide(0, t_train=20, t_rollout=10))
    assert e.refused and "min_rollout_gpus" in e.reason


def test_decide_still_applies_timeouts_on_hold():
    pool = make_pool()
    one(pool.borrow(0, "x"))
    e = one(pool.decide(100, t_train=10, t_rollout=10))
    assert (e.from_state, e.to_state) == ("requested", "rollout")


# ------------------------------------------------------------------ illegal inputs
@pytest.mark.parametrize("state", ["rollout", "active"])
def test_progress_outside_a_transient_phase_is_refused(state):
    pool = make_pool()
    if state == "active":
        to_active(pool)
    e = one(pool.progress(0, 1))
    assert e.refused and e.from_state == e.to_state == state and "not joining" in e.reason
    assert pool.replica(0).state == state


@pytest.mark.parametrize("state", ["rollout", "active", "releasing"])
def test_cancel_outside_a_join_is_refused(state):
    pool = make_pool()
    if state != "rollout":
        advance_to(pool, 0, state)
    e = one(pool.cancel(0, 1, "x"))
    assert e.refused and pool.replica(0).state == state


def test_failure_of_a_rollout_side_replica_is_refused():
    pool = make_pool()
    e = one(pool.fail(0, Slot(1, 0), 1, "xid 79"))
    assert e.refused and "leases" in e.reason


def test_inputs_that_can_never_be_right_raise():
    pool = make_pool()
    for call in (lambda: pool.progress(9, 0), lambda: pool.cancel(9, 0, "x"), lambda: pool.fail(9, Slot(1, 0), 0, "x"),
                 lambda: pool.replica(-1)):
        with pytest.raises(HybridPoolError, match="unknown hybrid replica"):
            call()
    with pytest.raises(HybridPoolError, match="not a member of hybrid replica 0"):
        pool.fail(0, Slot(2, 0), 0, "x")
    pool.tick(5)
    with pytest.raises(HybridPoolError, match="time went backwards"):
        pool.borrow(4, "x")
    with pytest.raises(HybridPoolError, match="margin"):
        pool.decide(6, 1, 1, margin=-0.1)
    assert all(r.state == "rollout" for r in pool.all_replicas())


@pytest.mark.parametrize("kwargs, match", [
    ({"replicas": [HybridReplica(0, (Slot(0, 0),)), HybridReplica(0, (Slot(0, 1),))]}, "duplicate"),
    ({"replicas": [HybridReplica(0, (Slot(0, 0),)), HybridReplica(1, (Slot(0, 1), Slot(0, 2)))]}, "sizes"),
    ({"replicas": [HybridReplica(0, (Slot(0, 0),)), HybridReplica(1, (Slot(0, 0),))]}, "slot n0g0"),
    ({"replicas": [HybridReplica(0, (Slot(0, 0),), state="active")]}, "starts in 'active'"),
    ({"min_rollout_gpus": 99}, "min_rollout_gpus=99"),
    ({"rollout_core_gpus": -1}, "rollout_core_gpus"),
])
def test_malformed_pools_are_refused(kwargs, match):
    args = {"replicas": [HybridReplica(0, (Slot(0, 0),))], "min_rollout_gpus": 1, "rollout_core_gpus": 1} | kwargs
    with pytest.raises(HybridPoolError, match=match):
        HybridPool(args.pop("replicas"), **args)


def test_timeouts_must_be_positive():
    with pytest.raises(HybridPoolError, match="PhaseTimeouts.fetching_state"):
        PhaseTimeouts(fetching_state=0)


# ------------------------------------------------------------------ from a layout
def test_pool_from_a_layout_cuts_whole_replicas_of_the_training_shape():
    layout = initial_layout(3, 4, 2, 1, 1, [[2, 2]], hybrid_nodes=1)  # node 2: two TP-2 hybrid instances
    pool = HybridPool.from_layout(layout, min_rollout_gpus=2)
    assert [tuple(map(str, r.slots)) for r in pool.all_replicas()] == [("n2g0", "n2g1"), ("n2g2", "n2g3")]
    assert pool.training_gpus() == 2 and pool.rollout_gpus() == 10 and pool.rollout_core_gpus == 6


def test_pool_from_a_layout_refuses_replicas_that_split_a_rollout_instance():
    layout = initial_layout(3, 4, 2, 1, 1, [[4]], hybrid_nodes=1)  # a TP-4 hybrid instance, replicas of 2
    with pytest.raises(HybridPoolError, match="straddles hybrid replicas"):
        HybridPool.from_layout(layout, min_rollout_gpus=0)


# ------------------------------------------------------------------ property
REACHED: set[tuple[str | None, str | None]] = set()  # transitions the property test exercised
OPS = ["borrow", "borrow", "release", "progress", "advance", "advance", "advance", "advance", "fail", "cancel",
       "tick", "decide"]  # repeated names weigh the draw towards joins that get somewhere
ops = st.tuples(st.sampled_from(OPS), st.integers(0, 3))
gaps = st.sampled_from([0.0, 0.0, 0.5, 2.0, 5.0, 12.0, 50.0])  # seconds; timeouts are 10/20/30/40


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(st.tuples(ops, gaps), min_size=20, max_size=60),
       min_rollout=st.sampled_from([0, 0, 4, 10]))
def test_invariants_hold_under_random_inputs(steps, min_rollout):
    pool = make_pool(4, min_rollout=min_rollout, rollout_core=2)
    now = 0.0
    log: list[PoolEvent] = []
    for (op, arg), dt in steps:
        now += dt
        before = states(pool)
        if op == "borrow":
            events = pool.borrow(now, "p")
        elif op == "release":
            events = pool.release(now, "p")
        elif op == "progress":
            events = pool.progress(arg, now)
        elif op == "advance":
            moving = [r.rid for r in pool.all_replicas() if r.state not in ("rollout", "active")] or [arg]
            events = pool.progress(moving[arg % len(moving)], now)
        elif op == "fail":
            events = pool.fail(arg, pool.replica(arg).slots[-1], now, "p")
            assert pool.replica(arg).state == "rollout"  # a failed replica is back in rollout
        elif op == "cancel":
            events = pool.cancel(arg, now, "p")
        elif op == "tick":
            events = pool.tick(now)
        else:
            t_train, t_rollout = [(12.0, 10.0), (10.0, 12.0), (10.0, 10.0), (12.0, 10.0)][arg]
            events = pool.decide(now, t_train, t_rollout, margin=0.1)
        after = states(pool)
        # every state change emitted exactly one event, and no event without a change
        assert replay_states(events, before) == after
        changed = {rid for rid in after if before[rid] != after[rid]}
        assert changed <= {e.replica for e in events if e.changed}  # (replay checks each event's from_state)
        for e in events:
            assert e.time == now and e.reason
            assert e.refused == (e.from_state == e.to_state)
        log += events
        # each replica in exactly one known state; the side sizes
        assert all(s in STATES for s in after.values()) and len(after) == 4
        assert pool.rollout_gpus() >= min_rollout
        assert pool.training_gpus() == 4 + len(pool.training_replicas()) * SIZE
        assert pool.rollout_gpus() == 2 + sum(SIZE for s in after.values() if s == "rollout")
        # no transient phase outlives its timeout once time has been observed
        for r in pool.all_replicas():
            limit = TIMEOUTS.of(r.state)
            assert limit is None or now < r.since + limit
    assert replay_states(log, {i: "rollout" for i in range(4)}) == states(pool)
    REACHED.update((e.from_state, e.to_state) for e in log)


def test_decide_holds_releasing_while_a_release_is_in_flight():
    pool = make_pool(3, min_rollout=0)
    for _ in range(2):
        to_active(pool)
    first = one(pool.decide(1, t_train=10.0, t_rollout=20.0))
    assert first.to_state == "releasing"
    assert pool.decide(2, t_train=10.0, t_rollout=20.0) == []  # not measured yet: no second release
    assert len(pool.training_replicas()) == 1


def test_pool_replicas_are_the_dp_replicas_the_layout_lends_with_pipeline_parallelism():
    from libra_hpc.cluster.layout import lend_hybrid_to_training

    base = initial_layout(3, 2, 1, 2, 1, [[1, 1]], hybrid_nodes=2)  # TP1 PP2: replicas of 2 slots
    pool = HybridPool.from_layout(base, min_rollout_gpus=0)
    lent = lend_hybrid_to_training(base, "borrow").training
    tp, pp, dp = lent.tp, lent.pp, lent.dp

    def replica(d: int) -> set[Slot]:  # Megatron order: rank = pp·(TP·DP) + dp·TP + tp
        return {lent.slots[p * tp * dp + d * tp + t] for p in range(pp) for t in range(tp)}

    assert [set(r.slots) for r in pool.all_replicas()] == [replica(1), replica(2)]
