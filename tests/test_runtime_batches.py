"""The controller's batch trackers (libra_hpc/runtime/batches.py, runtime/partial.py) driven
by hand, the way the controller drives them: batches submitted, trajectories finishing or
aborted at leaders, steps started. What is routed where, aborted, regenerated, discarded and
trained, and that no key is trained twice or lost; and the controller's own handling of a
trajectory reported twice (an expired lease), on the real ``_on_traj``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from libra_hpc.runtime.batches import WholeBatches
from libra_hpc.runtime.state import JobFailed
from libra_hpc.runtime.controller import JobController
from libra_hpc.runtime.episodes import group_of
from libra_hpc.runtime.partial import TailDecoupledBatches
from libra_hpc.runtime.state import JobState

OPEN = [0, 1]  # the DP replicas a group may go to
LEADER = 10  # the leader the scripted trajectories finish at


class FakeService:
    def __init__(self):
        self.submitted: list[tuple[str, str]] = []

    def submit(self, tid: str, pid: str) -> None:
        self.submitted.append((tid, pid))

    def drain_finished(self) -> list:
        return []


class ScriptedSampler:
    """The prompt stream: each ``next`` gives the next scripted batch of prompt ids."""

    def __init__(self):
        self.batches: list[list[str]] = []
        self.drawn = 0

    def next(self, n: int, why) -> list:
        self.drawn += 1
        return [SimpleNamespace(pid=p) for p in self.batches.pop(0)]

    def state(self) -> dict:
        return {"drawn": self.drawn}

    def restore(self, state: dict) -> None:
        self.drawn = state["drawn"]


def rl(prompts_per_step=2, group_size=2, k=1, budget=0.5, steps=10, stream=False):
    return SimpleNamespace(max_staleness=k, group_size=group_size, prompts_per_step=prompts_per_step,
                           partial_waste_budget=budget, steps=steps, stream_training=stream, update_epochs={},
                           filter_zero_variance=True)


def state(**kw):
    events: list = []
    s = JobState(SimpleNamespace(), SimpleNamespace(event=lambda kind, **f: events.append((kind, f))), lambda slot: 0)
    s.service, s.events = FakeService(), events
    return s


def partial(**kw):
    s, sampler = state(), ScriptedSampler()
    return TailDecoupledBatches(rl(**kw), s, sampler), s, sampler


def submit(tracker, sampler, b, *pids):
    sampler.batches.append(list(pids))
    tracker.submit(b)


def finish(tracker, tid, gen=10, min_version=0, reward=None, leader=LEADER):
    """Member ``tid`` finishes at ``leader``; by default sample 0 of a group solves it and
    the others do not (every group has something to learn). The routes and whether a step
    may start."""
    reward = float(tid.endswith("/0")) if reward is None else reward
    return tracker.finished({"tid": tid, "gen_tokens": gen, "tokens": gen + 5, "min_version": min_version,
                             "reward": reward}, leader, OPEN)


def trained(start):
    return sorted(g for gs in start.groups.values() for g in gs)


def test_a_step_trains_the_first_groups_to_finish_and_regenerates_the_expiring_one():
    d, s, sampler = partial()
    submit(d, sampler, 0, "p0", "p1")
    submit(d, sampler, 1, "p2", "p3")
    assert [t for t, _ in s.service.submitted] == ["b0/p0/0", "b0/p0/1", "b0/p1/0", "b0/p1/1",
                                                   "b1/p2/0", "b1/p2/1", "b1/p3/0", "b1/p3/1"]
    for tid in ["b0/p0/0", "b0/p0/1", "b1/p2/0", "b1/p2/1", "b1/p3/0"]:  # batch 0's group p1 is slow
        finish(d, tid)
    finish(d, "b0/p1/0", gen=40)  # half of the slow group is done
    start = d.start(0)  # step 0 trains the first two to finish (floors 0)
    assert trained(start) == ["b0/p0", "b1/p2"] and start.discard == [] and start.abort == []
    submit(d, sampler, 2, "p4", "p5")  # after step 0, as the controller does: floor 1
    for tid in ["b1/p3/1", "b2/p4/0", "b2/p4/1"]:
        finish(d, tid)
    # step 1: p3 (floor 0) and p4 (floor 1) train it; p1 (floor 0) still running could not
    # train step 2, so it is regenerated: its unfinished half aborted, its finished half discarded
    start = d.start(1)
    assert trained(start) == ["b1/p3", "b2/p4"] and start.discard == ["b0/p1"] and start.abort == ["b0/p1/1"]
    assert start.nowhere == [(LEADER, "b0/p1/0")]  # never placed: its finished half still waits at its leader
    regen = [t for t, _ in s.service.submitted if "~r1" in t]
    assert regen == ["b2/p1~r1/0", "b2/p1~r1/1"]  # batch step + k: leaders start it on policy ≥ 1
    assert any(kind == "regenerated" for kind, _ in s.events)
    d.aborted({"tid": "b0/p1/1", "gen_tokens": 25}, 11)  # the aborted one reports its tokens (wasted)
    assert d.decoupler.stats.wasted_tokens == 40 + 25 and not d.aborting
    with pytest.raises(RuntimeError, match="no regeneration asked"):
        d.aborted({"tid": "b0/p0/0", "gen_tokens": 1}, 11)


def test_a_trajectory_that_finishes_before_its_abort_arrives_is_routed_nowhere():
    d, s, sampler = partial(prompts_per_step=1)
    submit(d, sampler, 0, "p0")
    submit(d, sampler, 1, "p1")
    finish(d, "b1/p1/0")
    finish(d, "b1/p1/1")
    finish(d, "b0/p0/0", gen=3)
    start = d.start(0)  # p1 trains step 0 (floor 0); p0 runs on and could still train step 1
    assert start.groups == {0: ["b1/p1"]} and start.discard == []
    submit(d, sampler, 2, "p2")
    finish(d, "b2/p2/0")
    finish(d, "b2/p2/1")
    start = d.start(1)  # step 1: p0 (floor 0) expires after it: p2 trains, p0 is regenerated
    assert start.discard == ["b0/p0"] and trained(start) == ["b2/p2"] and start.nowhere == [(LEADER, "b0/p0/0")]
    assert not d.reported("b0/p0/1")  # its abort is awaited: a late finish is not a copy
    # it finished before the leader saw the abort: routed nowhere
    assert finish(d, "b0/p0/1", gen=7, leader=11) == ([(11, "b0/p0/1", None)], False)
    assert d.late_finishes == 1 and not d.aborting
    finish(d, "b2/p0~r1/0")  # the regenerated group finishes and trains; the key trains once
    assert finish(d, "b2/p0~r1/1")[1]
    assert trained(d.start(2)) == ["b2/p0~r1"]
    assert not d.rolling() and not d.untrained()
    summary = d.summary([])["partial_rollout"]
    assert summary["regenerated"] == 1 and summary["unresolved_aborts"] == 0
    assert summary["dropped_token_share"] == pytest.approx((3 + 7) / (10 + 10 + 3 + 10 + 10 + 7 + 10 + 10), abs=1e-4)


def test_the_step_waits_for_an_expiring_group_past_the_waste_budget():
    d, s, sampler = partial(prompts_per_step=1, budget=0.0)
    submit(d, sampler, 0, "p0")
    submit(d, sampler, 1, "p1")
    finish(d, "b1/p1/0")
    finish(d, "b1/p1/1")
    assert d.start(0) is not None
    submit(d, sampler, 2, "p2")
    for tid in ["b2/p2/0", "b2/p2/1", "b0/p0/0"]:
        finish(d, tid)
    assert d.start(1) is None  # p0 would be wasted and the budget is 0: wait for it
    finish(d, "b0/p0/1")
    start = d.start(1)
    assert trained(start) == ["b0/p0"] and start.discard == [] and start.abort == []  # oldest first


def test_groups_are_placed_whole_when_their_last_member_finishes_and_the_step_record_names_their_batches():
    d, s, sampler = partial()
    submit(d, sampler, 0, "p0", "p1")
    assert finish(d, "b0/p0/0", leader=10) == ([], False)  # held at its leader: p0 is not whole
    assert finish(d, "b0/p1/0", leader=11) == ([], False)
    assert not d.untrained_on(0) and not d.untrained_on(1)
    assert finish(d, "b0/p0/1", leader=12) == ([(10, "b0/p0/0", 0), (12, "b0/p0/1", 0)], True)
    assert finish(d, "b0/p1/1", leader=10) == ([(11, "b0/p1/0", 1), (10, "b0/p1/1", 1)], True)  # the least work
    assert d.untrained_on(0) and d.untrained_on(1)
    assert trained(d.start(0)) == ["b0/p0", "b0/p1"]
    record = d.step_record(0)
    assert len(record["rows"]) == 4 and record["extra"]["partial"]["batches"] == [0]
    assert not d.untrained_on(0) and not d.rolling() and not d.untrained()
    assert {group_of(r["tid"]) for r in record["rows"]} == {"b0/p0", "b0/p1"}


def test_the_partial_checkpoint_relaunches_its_groups_in_flight_on_resume():
    d, s, sampler = partial(prompts_per_step=1)
    submit(d, sampler, 0, "p0")
    finish(d, "b0/p0/0")
    saved = d.checkpoint(0)
    assert saved["regenerate"] == ["b0/p0/0", "b0/p0/1"] and saved["sampler"] == {"drawn": 1}
    again, s2, sampler2 = partial(prompts_per_step=1)
    again.restore(saved)
    sampler2.batches.append(["p1"])
    again.begin(0)  # the kept group, generated again from scratch under the same ids, then batch 1
    assert [t for t, _ in s2.service.submitted] == ["b0/p0/0", "b0/p0/1", "b1/p1/0", "b1/p1/1"]
    assert sampler2.drawn == 2


def test_a_resume_from_a_steps_checkpoint_draws_the_batch_the_step_had_not_drawn_yet():
    """The checkpoint of step 2 (version 3) is saved before the controller draws batch
    3 + k: the resumed run must draw it, or its last step waits for groups that never come
    (seen in the job: a 6-step partial run resumed from its step-3 checkpoint hung)."""
    d, s, sampler = partial(prompts_per_step=1, k=1, steps=6)
    for b in range(4):  # b0, b1 at the start, then one batch after each of steps 0, 1, 2
        submit(d, sampler, b, f"p{b}")
    for b in range(3):  # steps 0..2 train b0..b2
        for i in range(2):
            finish(d, f"b{b}/p{b}/{i}")
        assert trained(d.start(b)) == [f"b{b}/p{b}"]
    saved = d.checkpoint(3)
    assert saved["partial"]["drawn"] == 4
    again, s2, sampler2 = partial(prompts_per_step=1, k=1, steps=6)
    again.restore(saved)
    sampler2.batches.append(["p4"])
    again.begin(3)
    assert [t for t, _ in s2.service.submitted] == ["b3/p3/0", "b3/p3/1", "b4/p4/0", "b4/p4/1"]
    sampler2.batches.append(["p5"])
    again.submit(5)  # what the controller draws after step 3: every batch of the run is drawn once
    assert again.drawn == 6 and sampler2.drawn == 6


# ------------------------------------------------------------------ whole batches


def whole(stream=False, prompts_per_step=1):
    s, sampler = state(), ScriptedSampler()
    cfg = SimpleNamespace(rl=rl(prompts_per_step=prompts_per_step, stream=stream),
                          batch_size=prompts_per_step * 2)
    return WholeBatches(cfg, s, sampler), s, sampler


def test_a_whole_batch_starts_its_step_when_complete_and_streams_the_next_steps_groups():
    d, s, sampler = whole(stream=True, prompts_per_step=2)
    submit(d, sampler, 0, "p0", "p1")
    submit(d, sampler, 1, "p2", "p3")
    assert finish(d, "b0/p0/0") == ([], False) and d.start(0) is None  # held until p0 is whole
    finish(d, "b1/p2/0")
    finish(d, "b1/p2/1")  # batch 1's group p2 is complete, but step 0 is not taken yet
    s.version, s.training = 0, False
    assert d.stream(s) is None  # batch 0 is next: none of its groups is complete
    finish(d, "b0/p0/1")
    assert d.stream(s) == (0, {0: ["b0/p0"]}) and d.stream(s) is None  # sent once
    finish(d, "b0/p1/0")
    assert finish(d, "b0/p1/1") == ([(LEADER, "b0/p1/0", 1), (LEADER, "b0/p1/1", 1)], True)  # the one of less work
    assert d.start(0).groups == {0: ["b0/p0"], 1: ["b0/p1"]}
    s.training = True  # step 0 trains: batch 1 is next
    assert d.stream(s) == (1, {0: ["b1/p2"]})
    s.stop = "SIGUSR2"
    finish(d, "b1/p3/0")
    finish(d, "b1/p3/1")
    assert d.stream(s) is None  # after the stop signal nothing new streams
    record = d.step_record(0)
    assert len(record["rows"]) == 4 and record["extra"] == {}
    assert d.untrained_on(0) and d.untrained() and not d.rolling()  # batch 1 is complete, not trained


def test_a_batch_that_trains_nothing_ahead_places_its_groups_when_complete_the_largest_first():
    """Without stream_training no group trains before its batch is complete, so none is
    placed before: then every group's work is known, and the largest goes first. In the
    order these groups finish, placing each when whole would put A and C together (320
    tokens against 120); largest first, C alone (200 against 240)."""
    d, s, sampler = whole(prompts_per_step=3)
    submit(d, sampler, 0, "pA", "pB", "pC")
    for tid, gen in [("b0/pA/0", 55), ("b0/pA/1", 55), ("b0/pB/0", 55), ("b0/pB/1", 55), ("b0/pC/0", 95)]:
        assert finish(d, tid, gen=gen) == ([], False)  # held at their leaders, whole or not
    out, complete = finish(d, "b0/pC/1", gen=95)
    assert complete and sorted(out) == sorted([(LEADER, "b0/pC/0", 0), (LEADER, "b0/pC/1", 0), (LEADER, "b0/pA/0", 1),
                                                (LEADER, "b0/pA/1", 1), (LEADER, "b0/pB/0", 1), (LEADER, "b0/pB/1", 1)])
    assert d.batches[0]["work"] == {0: 200.0, 1: 240.0}
    assert d.start(0).groups == {0: ["b0/pC"], 1: ["b0/pA", "b0/pB"]}


def test_a_whole_batch_checkpoint_draws_the_batches_in_flight_again():
    d, s, sampler = whole()
    submit(d, sampler, 0, "p0")
    submit(d, sampler, 1, "p1")
    saved = d.checkpoint(0)
    assert saved == {"sampler": {"drawn": 0}, "regenerate": ["b0/p0/0", "b0/p0/1", "b1/p1/0", "b1/p1/1"]}
    with pytest.raises(JobFailed, match="partial_rollout is off"):
        d.aborted({"tid": "b0/p0/0"}, 3)


# ------------------------------------------------------------------ the controller's _on_traj


class Comm:
    def __init__(self):
        self.sent: list[tuple[int, dict]] = []

    def send(self, message, dest, tag):
        self.sent.append((dest, message))


def controller(tracker, s):
    c = object.__new__(JobController)  # the report path needs no world
    c.state, c.batches, c.cfg, c.runlog, c.comm = s, tracker, SimpleNamespace(
        parallel=SimpleNamespace(dispatch="direct"), rl=tracker.cfg.rl), s.runlog, Comm()
    c.outbox = c.comm  # the same send(message, dest, tag)
    c.held_routes = []
    s.roles = SimpleNamespace(leaders={1: 10, 2: 11}, replicas=[[20], [21]], trainers=(20, 21))
    c.relayout = SimpleNamespace(open_replicas=lambda: OPEN, leaving=set())
    c.duplicate_reports, c.trains = 0, []
    c._maybe_train = lambda: c.trains.append(s.version)
    return c


def report(tid, leader, instance=1):
    return {"op": "traj", "tid": tid, "instance": instance, "tokens": 12, "gen_tokens": 7,
            "reward": float(tid.endswith("/0"))}, leader


def routes(c):
    return [(rank, m["tid"], m["dest"]) for rank, m in c.comm.sent if m["op"] == "route"]


def test_a_trajectory_finished_twice_counts_once_and_its_copy_is_routed_nowhere():
    d, s, sampler = whole()
    c = controller(d, s)
    submit(d, sampler, 0, "p0")
    c._on_traj(*report("b0/p0/0", leader=10))
    c._on_traj(*report("b0/p0/0", leader=11, instance=2))  # the re-run copy at another leader
    assert d.batches[0]["done"] == 1 and len(d.batches[0]["rows"]) == 1 and c.trains == []
    assert routes(c) == [(11, "b0/p0/0", [])]  # the first waits at rank 10 for its group
    assert c.duplicate_reports == 1
    [(kind, warning)] = s.events
    assert kind == "warning" and "b0/p0/0" in warning["line"] and warning["rank"] == 11
    c._on_traj(*report("b0/p0/1", leader=11, instance=2))  # the batch completes with its other member
    assert d.batches[0]["done"] == 2 and c.trains == [0]
    assert routes(c)[1:] == [(10, "b0/p0/0", [20]), (11, "b0/p0/1", [20])]  # the group, placed whole
    d.step_record(0)  # step 0 trained: its books are gone
    c._on_traj(*report("b0/p0/1", leader=12, instance=3))  # a copy after its batch trained: dropped
    assert routes(c)[-1] == (12, "b0/p0/1", []) and c.duplicate_reports == 2


def test_a_trajectory_that_finishes_while_a_step_trains_is_routed_when_the_step_ends():
    """Trainers inside a step take no message: a route then would leave the trajectory in
    MPICH's shared-memory cells of its leader, which run out after about 64 and block every
    send the leader makes (its queue requests included). It waits at its leader instead."""
    d, s, sampler = whole()
    c = controller(d, s)
    submit(d, sampler, 0, "p0")
    s.training = True  # step -1's pass, say: the trainers are busy
    c._on_traj(*report("b0/p0/0", leader=10))
    c._on_traj(*report("b0/p0/1", leader=11, instance=2))
    assert routes(c) == [] and c.trains == [0]  # counted (the batch is complete), not routed
    s.training = False
    c._release_routes()
    assert routes(c) == [(10, "b0/p0/0", [20]), (11, "b0/p0/1", [20])]
    c._release_routes()
    assert len(routes(c)) == 2  # each once


def test_a_leader_that_leaves_rollout_is_not_left_holding_a_member_of_an_unplaced_group():
    """A leader leaves (a lend, a replan) once it holds no finished trajectory; one whose
    group is not whole would wait there for the rest of the group. Its group is placed at
    once instead: when the leave is sent, and when a member finishes at a leaving leader."""
    d, s, sampler = whole(prompts_per_step=2)
    c = controller(d, s)
    submit(d, sampler, 0, "p0", "p1")
    c._on_traj(*report("b0/p0/0", leader=11, instance=2))
    assert routes(c) == []  # held: p0 is not whole
    c._send_all([(11, {"op": "leave", "until_version": 1})])
    assert routes(c) == [(11, "b0/p0/0", [20])]  # placed before it is whole
    c.relayout.leaving = {2}  # instance 2 (leader 11) drains
    c._on_traj(*report("b0/p1/0", leader=11, instance=2))
    assert routes(c)[-1] == (11, "b0/p1/0", [21])  # at once, to the other replica (less work)
    c._on_traj(*report("b0/p0/1", leader=10))
    c._on_traj(*report("b0/p1/1", leader=10))
    assert routes(c)[-2:] == [(10, "b0/p0/1", [20]), (10, "b0/p1/1", [21])] and c.trains == [0]
