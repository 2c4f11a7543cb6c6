"""The live job's partial-rollout bookkeeping (libra_hpc/runtime/partial.py) driven by
hand, the way the controller drives it: groups submitted, trajectories finishing or
aborted at leaders, steps decided. The controller's side only (the rest is
tests/test_job.py's partial run): what is routed where, what is aborted, regenerated,
discarded and trained, and that no key is trained twice or lost."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from libra_hpc.runtime.controller import JobController
from libra_hpc.runtime.episodes import group_of
from libra_hpc.runtime.partial import PartialDriver


class FakeService:
    def __init__(self):
        self.submitted: list[tuple[str, str]] = []

    def submit(self, tid: str, pid: str) -> None:
        self.submitted.append((tid, pid))

    def drain_finished(self) -> list:
        return []


class FakeController:
    """What PartialDriver uses of JobController, recording the commands it sends."""

    def __init__(self, prompts_per_step=2, group_size=2, k=1, budget=0.5):
        self.cfg = SimpleNamespace(rl=SimpleNamespace(max_staleness=k, group_size=group_size,
                                                      prompts_per_step=prompts_per_step, partial_waste_budget=budget),
                                   parallel=SimpleNamespace(dispatch="direct"))
        self.service = FakeService()
        self.roles = SimpleNamespace(leaders={0: 10, 1: 11}, replicas=[[20], [21]])
        self.sent: list[tuple[int, dict]] = []
        self.events: list[tuple[str, dict]] = []
        self.runlog = SimpleNamespace(event=lambda kind, **kw: self.events.append((kind, kw)))
        self.train_calls = 0
        self.hybrid = SimpleNamespace(drained={1})  # instance 1's leader left for training: no commands

    def _send(self, rank: int, message: dict) -> None:
        self.sent.append((rank, message))

    route = JobController.route  # the real one: the command a leader gets

    def pick_replica(self, tokens: dict) -> int:
        return min(range(2), key=lambda d: tokens.get(d, 0))

    def _maybe_train(self) -> None:
        self.train_calls += 1


def prompts(*pids):
    return [SimpleNamespace(pid=p) for p in pids]


def finish(driver, tid, gen=10, min_version=0, leader=10):
    driver.finished({"tid": tid, "gen_tokens": gen, "tokens": gen + 5, "min_version": min_version}, leader)


def test_a_step_trains_the_first_groups_to_finish_and_regenerates_the_expiring_one():
    c = FakeController()
    d = PartialDriver(c)
    d.submit(0, prompts("p0", "p1"))
    d.submit(1, prompts("p2", "p3"))
    assert [t for t, _ in c.service.submitted] == ["b0/p0/0", "b0/p0/1", "b0/p1/0", "b0/p1/1",
                                                   "b1/p2/0", "b1/p2/1", "b1/p3/0", "b1/p3/1"]
    # batch 0's group p1 is slow; p0 and both groups of batch 1 finish
    for tid in ["b0/p0/0", "b0/p0/1", "b1/p2/0", "b1/p2/1", "b1/p3/0"]:
        finish(d, tid)
    finish(d, "b0/p1/0", gen=40)  # half of the slow group is done
    groups, discard = d.decide(0)  # step 0 trains the first two to finish (floors 0)
    assert sorted(g for gs in groups.values() for g in gs) == ["b0/p0", "b1/p2"] and discard == []
    d.submit(2, prompts("p4", "p5"))  # after step 0, as the controller does: floor 1
    finish(d, "b1/p3/1")
    finish(d, "b2/p4/0")
    finish(d, "b2/p4/1")
    c.sent.clear()
    # step 1: p3 (floor 0) and p4 (floor 1) train it; p1 (floor 0) still running could not
    # train step 2, so it is regenerated: its unfinished half aborted, its finished half discarded
    groups, discard = d.decide(1)
    assert sorted(g for gs in groups.values() for g in gs) == ["b1/p3", "b2/p4"] and discard == ["b0/p1"]
    aborts = [(rank, m) for rank, m in c.sent if m["op"] == "abort"]
    assert {rank for rank, _ in aborts} == {10} and aborts[0][1]["tids"] == ["b0/p1/1"]  # not the drained leader
    regen = [t for t, _ in c.service.submitted if "~r1" in t]
    assert regen == ["b2/p1~r1/0", "b2/p1~r1/1"]  # batch step + k: leaders start it on policy ≥ 1
    assert any(kind == "regenerated" for kind, _ in c.events)
    # the aborted trajectory reports its tokens (wasted); the finished half was wasted already
    d.aborted({"tid": "b0/p1/1", "gen_tokens": 25}, 11)
    assert d.decoupler.stats.wasted_tokens == 40 + 25 and not d.aborting
    with pytest.raises(RuntimeError, match="no regeneration asked"):
        d.aborted({"tid": "b0/p0/0", "gen_tokens": 1}, 11)


def test_a_trajectory_that_finishes_before_its_abort_arrives_is_routed_nowhere():
    c = FakeController(prompts_per_step=1)
    d = PartialDriver(c)
    d.submit(0, prompts("p0"))
    d.submit(1, prompts("p1"))
    finish(d, "b1/p1/0")
    finish(d, "b1/p1/1")
    finish(d, "b0/p0/0", gen=3)
    groups, discard = d.decide(0)  # p1 trains step 0 (floor 0); p0 runs on and could still train step 1
    assert groups == {0: ["b1/p1"]} and discard == []
    d.submit(2, prompts("p2"))
    finish(d, "b2/p2/0")
    finish(d, "b2/p2/1")
    groups, discard = d.decide(1)  # step 1: p0 (floor 0) expires after it: p2 would train, p0 regenerated
    assert discard == ["b0/p0"] and [g for gs in groups.values() for g in gs] == ["b2/p2"]
    c.sent.clear()
    finish(d, "b0/p0/1", gen=7)  # it finished before the leader saw the abort
    [(rank, route)] = c.sent
    assert route == {"op": "route", "tid": "b0/p0/1", "dest": [], "replica": None}
    assert d.late_finishes == 1 and not d.aborting
    # the regenerated group finishes and trains; the key trains once
    finish(d, "b2/p0~r1/0")
    finish(d, "b2/p0~r1/1")
    groups, _ = d.decide(2)
    assert [g for gs in groups.values() for g in gs] == ["b2/p0~r1"]
    assert not d.in_flight()
    summary = d.summary()
    assert summary["regenerated"] == 1 and summary["unresolved_aborts"] == 0
    assert summary["dropped_token_share"] == pytest.approx((3 + 7) / (10 + 10 + 3 + 10 + 10 + 7 + 10 + 10), abs=1e-4)


def test_the_step_waits_for_an_expiring_group_past_the_waste_budget():
    c = FakeController(prompts_per_step=1, budget=0.0)
    d = PartialDriver(c)
    d.submit(0, prompts("p0"))
    d.submit(1, prompts("p1"))
    finish(d, "b1/p1/0")
    finish(d, "b1/p1/1")
    assert d.decide(0) is not None
    d.submit(2, prompts("p2"))
    finish(d, "b2/p2/0")
    finish(d, "b2/p2/1")
    finish(d, "b0/p0/0")
    assert d.decide(1) is None  # p0 would be wasted and the budget is 0: wait for it
    assert not [m for _, m in c.sent if m["op"] == "abort"]
    finish(d, "b0/p0/1")
    groups, discard = d.decide(1)
    assert [g for gs in groups.values() for g in gs] == ["b0/p0"] and discard == []  # oldest first


def test_groups_keep_one_replica_and_the_step_record_names_their_batches():
    c = FakeController(prompts_per_step=2)
    d = PartialDriver(c)
    d.submit(0, prompts("p0", "p1"))
    for tid in ["b0/p0/0", "b0/p1/0", "b0/p0/1", "b0/p1/1"]:
        finish(d, tid)
    routes = {m["tid"]: m["replica"] for _, m in c.sent if m["op"] == "route"}
    assert routes["b0/p0/0"] == routes["b0/p0/1"] and routes["b0/p1/0"] == routes["b0/p1/1"]
    assert routes["b0/p0/0"] != routes["b0/p1/0"]  # the fewest tokens so far
    assert d.untrained_on(0) and d.untrained_on(1)
    groups, _ = d.decide(0)
    assert sorted(g for gs in groups.values() for g in gs) == ["b0/p0", "b0/p1"]
    record = d.step_record(0)
    assert len(record["rows"]) == 4 and record["partial"]["batches"] == [0]
    assert not d.untrained_on(0) and not d.in_flight()
    assert {group_of(r["tid"]) for r in record["rows"]} == {"b0/p0", "b0/p1"}
