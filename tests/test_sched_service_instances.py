"""The C-MLFQ queue service's instances (pure, injected clock): one that falls silent (a
lease expired, or work waits for it and it never asks) hands its queue to a live neighbour
and gets work again when it comes back; a retired one (the hybrid pool lent to training)
gets none until restored; every router skips silent instances while any is live. Split
from test_sched_service.py, whose helpers these use."""

from __future__ import annotations

from collections import Counter

import pytest

from libra_hpc.scheduler.routers import make_router
from libra_hpc.scheduler.types import BucketSpec, TrajectoryView
from test_sched_service import ask, BUCKETS, finish, LEASE_S, make_service


def test_a_silent_instance_alone_in_its_bucket_hands_its_queue_to_a_neighbour():
    buckets = (BucketSpec("tp1", 1, 1024, (0,)), BucketSpec("tp4", 4, 1 << 30, (1,)))
    router = make_router("fifo", buckets, window=8, min_samples=1, rebuild_every=10)
    service, _ = make_service(router)
    for i in range(3):
        service.submit(f"t{i}", "p")  # round-robin over all: t0, t2 on instance 0, t1 on 1
    [leased] = ask(service, 0, now=0.0, max=1)
    assert leased["tid"] == "t0"
    assert service.expire(LEASE_S) == 1  # instance 0 never came back
    stats = service.stats()
    assert stats["silent"] == [0] and stats["instances_silent"] == 1
    assert stats["queued"] == {"tp1": 0, "tp4": 3} and stats["leased"] == 0
    turns = ask(service, 1, now=LEASE_S)
    assert sorted(t["tid"] for t in turns) == ["t0", "t1", "t2"]
    assert all(t["migrated"] for t in turns if t["tid"] != "t1")  # recomputed where they now run
    assert service.handle({"op": "heartbeat", "instance": 0}, LEASE_S + 1)["ok"]
    assert service.stats()["silent"] == []
    service.submit("t3", "p")
    service.submit("t4", "p")
    assert {t["tid"] for t in ask(service, 0, now=LEASE_S + 1)} & {"t3", "t4"}  # new work reaches it again
    service.audit()


def test_a_retired_instance_gets_no_work_until_restored_and_its_leases_still_end_there():
    """The hybrid pool lent to training: its instance finishes the turn it holds, its
    queue goes elsewhere, asks and heartbeats do not bring it back; restore() does."""
    buckets = (BucketSpec("tp1", 1, 1024, (0, 1)), BucketSpec("tp4", 4, 1 << 30, (2,)))
    router = make_router("fifo", buckets, window=8, min_samples=1, rebuild_every=10)
    service, _ = make_service(router)
    for i in range(6):
        service.submit(f"t{i}", "p")
    [held] = ask(service, 2, now=0.0, max=1)
    moved = service.retire(2, now=1.0)
    assert moved == 1 and service.stats()["queued"]["tp4"] == 0
    assert service.stats()["instances_silent"] == 0  # lent, not a fault
    assert ask(service, 2, now=2.0) == []  # asking does not bring it back
    assert service.handle({"op": "heartbeat", "instance": 2}, 2.0)["ok"] and 2 in service.stats()["silent"]
    reply = service.handle({"op": "finish", "lease": held["lease"], "tokens": 5}, 3.0)
    assert reply["ok"]  # the lease it held still ends there
    service.submit("t9", "p")
    assert "t9" in {t["tid"] for t in ask(service, 0, now=4.0) + ask(service, 1, now=4.0)}
    service.restore(2)
    assert service.stats()["silent"] == []
    service.submit("t10", "p")
    service.submit("t11", "p")
    service.submit("t12", "p")
    assert {t["tid"] for t in ask(service, 2, now=5.0)} & {"t10", "t11", "t12"}  # new work reaches it again
    service.audit()

@pytest.mark.parametrize("policy", ["cmlfq", "fifo", "least_load", "oracle"])
def test_routers_skip_silent_instances_while_any_is_live(policy):
    buckets = (BucketSpec("tp1", 1, 1024, (0, 1)), BucketSpec("tp4", 4, 1 << 30, (2,)))
    router = make_router(policy, buckets, window=8, min_samples=1, rebuild_every=10)
    router.set_down(0, True)
    router.set_down(1, True)
    placed = {router.place(TrajectoryView(f"t{i}", "p", true_remaining=100)).instance for i in range(6)}
    assert placed == {2}
    router.set_down(2, True)  # nobody left: the turn still gets a queue, where it waits
    assert router.place(TrajectoryView("t9", "p", true_remaining=100)).instance in (0, 1, 2)
    router.set_down(1, False)
    assert router.place(TrajectoryView("t10", "p", true_remaining=100)).instance == 1
    with pytest.raises(KeyError, match="unknown rollout instance 7"):
        router.set_down(7, True)


def test_least_load_sees_queued_turns_not_only_running_ones():
    router = make_router("least_load", BUCKETS, window=8, min_samples=1, rebuild_every=10)
    service, _ = make_service(router)
    placed = Counter(service.submit(f"t{i}", "p").instance for i in range(6))
    assert placed == Counter({0: 2, 1: 2, 2: 2})  # each queued turn counts where it waits
    assert router.outstanding == {0: 512, 1: 512, 2: 512}
    ask(service, 0, max=16)  # instance 0 takes its two and instance 1's two: their load moves with them
    assert router.outstanding == {0: 1024, 1: 0, 2: 512}


def test_turns_queued_while_every_instance_was_silent_move_when_one_comes_back():
    buckets = (BucketSpec("tp1", 1, 1024, (0,)), BucketSpec("tp4", 4, 1 << 30, (1,)))
    router = make_router("least_load", buckets, window=8, min_samples=1, rebuild_every=10)
    service, _ = make_service(router)
    for i in range(4):
        service.submit(f"t{i}", "p")
    ask(service, 0, now=0.0)
    ask(service, 1, now=0.0)
    service.expire(LEASE_S)  # both silent: the expired turns still need a queue, on a silent instance
    assert service.stats()["silent"] == [0, 1] and service.stats()["active"] == 4
    done = 0
    for k in range(5):  # instance 1 comes back and works; nothing may stay stranded on instance 0
        for turn in ask(service, 1, now=LEASE_S + 1 + k):
            done += service.handle(finish(turn["lease"]), LEASE_S + 1 + k)["ok"]
    assert done == 4 and service.stats()["active"] == 0 and service.stats()["silent"] == [0]


def test_an_instance_that_dies_holding_no_lease_falls_silent_once_work_waits_for_it():
    buckets = (BucketSpec("tp1", 1, 1024, (0,)), BucketSpec("tp4", 4, 1 << 30, (1,)))
    router = make_router("least_load", buckets, window=8, min_samples=1, rebuild_every=10)
    service, _ = make_service(router)
    service.maintain(0.0)
    assert ask(service, 1, now=0.0) == []  # instance 1 asks, finds nothing, then its engine dies
    for i in range(4):
        service.submit(f"t{i}", "p")  # least load: two of them queued on instance 1
    assert service.stats()["queued"] == {"tp1": 2, "tp4": 2}
    service.maintain(LEASE_S - 0.01)
    assert service.stats()["silent"] == []  # not yet: it may still ask
    later = LEASE_S * 1.25  # the check runs at most every lease_s / 4
    service.handle({"op": "heartbeat", "instance": 0}, later)
    service.maintain(later)
    assert service.stats()["silent"] == [1] and service.stats()["queued"] == {"tp1": 4, "tp4": 0}
    turns = ask(service, 0, now=later)
    assert sorted(t["tid"] for t in turns) == ["t0", "t1", "t2", "t3"]
