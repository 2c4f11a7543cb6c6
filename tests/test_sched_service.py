"""The C-MLFQ queue service alone (pure, injected clock): each protocol operation, leases,
refused reports, malformed requests, exactly-once completion, and a stateful property
test over random interleavings. A small deterministic router stub keeps these tests
independent of the routing core; one test drives the real ``cmlfq`` router."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from libra_hpc.scheduler.routers import make_router
from libra_hpc.scheduler.service import QueueService, RouterError
from libra_hpc.scheduler.types import (
    BucketSpec,
    FinishedTrajectory,
    Placement,
    ToolState,
    TrajectoryView,
)

BUCKETS = (BucketSpec("tp1", 1, 1024, (0, 1)), BucketSpec("tp4", 4, 1 << 30, (2,)))
THRESHOLDS = [256, 4096]
MARKERS = ["Traceback (most recent call last)", "Error:"]
LEASE_S = 10.0


class StubRouter:
    """Level = number of tool returns (capped at the last bucket); round-robin inside a
    bucket. Checks its own load accounting: a turn never ends twice."""

    name = "stub"

    def __init__(self, buckets=BUCKETS):
        self.buckets = tuple(buckets)
        self.load: Counter[int] = Counter()  # instance → expected tokens outstanding
        self.turns: Counter[int] = Counter()  # instance → turns outstanding
        self.observed: list[FinishedTrajectory] = []
        self.views: list[TrajectoryView] = []
        self._next = 0

    def place(self, view: TrajectoryView) -> Placement:
        self.views.append(view)
        bucket = self.buckets[min(len(view.states), len(self.buckets) - 1)]
        instance = bucket.instances[self._next % len(bucket.instances)]
        self._next += 1
        return Placement(bucket.name, instance, view.bucket is not None and view.bucket != bucket.name, "stub")

    def turn_started(self, instance: int, expected_tokens: int) -> None:
        self.load[instance] += expected_tokens
        self.turns[instance] += 1

    def turn_ended(self, instance: int, expected_tokens: int) -> None:
        self.load[instance] -= expected_tokens
        self.turns[instance] -= 1
        assert self.load[instance] >= 0 and self.turns[instance] >= 0, f"instance {instance}: turn ended twice"

    def observe(self, finished: FinishedTrajectory) -> None:
        self.observed.append(finished)


def make_service(router=None, **kw) -> tuple[QueueService, StubRouter]:
    router = router or StubRouter()
    options = {"lease_s": LEASE_S, "max_batch": 4, "size_thresholds": THRESHOLDS, "error_markers": MARKERS}
    options.update(kw)
    return QueueService(router, **options), router


def ask(service, instance, now=0.0, max=16):
    reply = service.handle({"op": "ask", "instance": instance, "max": max}, now)
    assert reply["ok"], reply
    return reply["turns"]


def tool_return(lease, tokens=10, tool="python", output="ok", exit_code=0, timed_out=False):
    return {"op": "tool_return", "lease": lease, "tool": tool, "output": output, "exit_code": exit_code,
            "timed_out": timed_out, "tokens": tokens}


def finish(lease, tokens=10):
    return {"op": "finish", "lease": lease, "tokens": tokens}


# ----------------------------------------------------------------------- operations

def test_submit_places_the_first_turn_and_ask_leases_it():
    service, router = make_service()
    placement = service.submit("t0", "p0")
    assert (placement.bucket, placement.instance, placement.migrated) == ("tp1", 0, False)
    assert router.views[0].bucket is None and router.views[0].states == ()
    assert service.stats()["queued"] == {"tp1": 1, "tp4": 0}
    [turn] = ask(service, 0, now=5.0)
    assert turn == {"lease": turn["lease"], "tid": "t0", "prompt_id": "p0", "turn": 0, "bucket": "tp1",
                    "migrated": False, "prev_instance": None, "lease_s": LEASE_S}
    assert router.turns[0] == 1 and router.load[0] == 256  # default expected tokens before any report
    stats = service.stats()
    assert stats["queued"] == {"tp1": 0, "tp4": 0} and stats["leased"] == 1 and stats["handed_out"] == 1
    assert ask(service, 0) == []


def test_ask_caps_at_max_batch_and_drains_siblings_of_its_bucket_only():
    service, router = make_service(max_batch=3)
    for i in range(6):
        service.submit(f"t{i}", "p")  # round-robin: t0,t2,t4 on instance 0; t1,t3,t5 on 1
    assert [t["tid"] for t in ask(service, 0, max=100)] == ["t0", "t2", "t4"]
    assert [t["tid"] for t in ask(service, 0, max=2)] == ["t1", "t3"]  # own queue empty: sibling's
    assert ask(service, 2) == []  # instance 2 is in another bucket
    assert [t["tid"] for t in ask(service, 1)] == ["t5"]
    assert router.turns == Counter({0: 5, 1: 1})  # the load moved with the turns instance 0 took from 1


def test_tool_return_classifies_records_and_places_the_next_turn():
    service, router = make_service()
    service.submit("t0", "p0")
    [turn] = ask(service, 0)
    reply = service.handle(tool_return(turn["lease"], tokens=40, output="Traceback (most recent call last): x"), 1.0)
    assert reply == {"ok": True, "tid": "t0", "bucket": "tp4", "instance": 2, "migrated": True, "reason": "stub"}
    view = router.views[-1]
    assert view.states == (ToolState("python", "S", "failure"),) and view.generated_tokens == 40
    assert view.bucket == "tp1"
    assert router.turns[0] == 0  # the turn ended
    stats = service.stats()
    assert (stats["decisions"], stats["migrations"], stats["placements"]) == (1, 1, 2)
    assert stats["queued"] == {"tp1": 0, "tp4": 1}
    [nxt] = ask(service, 2)
    assert (nxt["turn"], nxt["migrated"], nxt["prev_instance"], nxt["bucket"]) == (1, True, 0, "tp4")
    assert router.load[2] == 40  # expected tokens: the mean turn length so far


def test_tool_return_status_timeout_and_size_classes():
    service, router = make_service(buckets=BUCKETS)
    service.submit("t0", "p0")
    lease = ask(service, 0)[0]["lease"]
    service.handle(tool_return(lease, tool="search", output="x" * 5000, exit_code=None, timed_out=True), 0.0)
    lease = ask(service, 2)[0]["lease"]
    service.handle(tool_return(lease, tool="search", output="x" * 300, exit_code=1), 0.0)
    assert router.views[-1].states == (ToolState("search", "L", "timeout"), ToolState("search", "M", "failure"))


def test_finish_completes_once_with_remaining_after():
    service, router = make_service()
    service.submit("t0", "p0")
    lease = ask(service, 0)[0]["lease"]
    service.handle(tool_return(lease, tokens=10), 0.0)
    lease = ask(service, 2)[0]["lease"]
    service.handle(tool_return(lease, tokens=20, tool="search"), 0.0)
    lease = ask(service, 2)[0]["lease"]
    assert service.handle(finish(lease, tokens=30), 0.0) == {"ok": True, "tid": "t0", "turns": 3}
    [observed] = router.observed
    assert observed.prompt_id == "p0" and observed.remaining_after == (60, 50, 30)
    assert [s.tool for s in observed.states] == ["python", "search"]
    [record] = service.drain_finished()
    assert (record.tid, record.turn_tokens, record.migrations, record.requeues) == ("t0", (10, 20, 30), 1, 0)
    assert service.drain_finished() == []
    again = service.handle(finish(lease, tokens=30), 0.0)
    assert again["ok"] is False and again["reason"] == "duplicate_report" and f"lease {lease}" in again["error"]
    stale_return = service.handle(tool_return(lease), 0.0)
    assert stale_return["reason"] == "duplicate_report"
    stats = service.stats()
    assert stats["completed"] == 1 and stats["duplicate_reports"] == 2 and stats["active"] == 0
    assert len(router.observed) == 1 and service.drain_finished() == []
    assert router.turns == Counter({0: 0, 2: 0})


def test_finish_without_tool_returns():
    service, router = make_service()
    service.submit("t0", "p0")
    service.handle(finish(ask(service, 0)[0]["lease"], tokens=7), 0.0)
    assert router.observed[0].states == () and router.observed[0].remaining_after == (7,)


def test_expired_lease_requeues_at_the_front_and_refuses_the_late_report():
    service, router = make_service()
    service.submit("t0", "p0")
    service.submit("t1", "p1")  # on instance 1
    [turn] = ask(service, 0, now=0.0, max=1)
    lease = turn["lease"]
    assert service.expire(LEASE_S - 0.001) == 0
    reply = service.handle({"op": "heartbeat", "instance": 1}, LEASE_S)  # any request expires leases first
    assert reply == {"ok": True, "leases": 0}
    assert router.turns == Counter({0: 1, 1: 1}) and len(router.views) == 3  # re-placed, queued on 0 again
    stats = service.stats()
    assert stats["requeued_on_expiry"] == 1 and stats["leased"] == 0 and stats["queued"]["tp1"] == 2
    late = service.handle(finish(lease), LEASE_S + 1)
    assert late["ok"] is False and late["reason"] == "late_report" and "expired" in late["error"]
    assert service.stats()["late_reports"] == 1 and service.stats()["completed"] == 0
    # re-placed round-robin on instance 0 again, ahead of queued work
    turns = ask(service, 1, now=LEASE_S + 1)
    assert [t["tid"] for t in turns] == ["t1", "t0"]
    service.handle(finish(turns[1]["lease"], tokens=5), LEASE_S + 2)
    assert service.drain_finished()[0].requeues == 1


def test_heartbeat_and_ask_renew_every_lease_of_the_instance():
    service, router = make_service()
    for i in range(3):
        service.submit(f"t{i}", "p")
    leases = [t["lease"] for t in ask(service, 0, now=0.0)]
    assert len(leases) == 3
    assert service.handle({"op": "heartbeat", "instance": 0}, 8.0) == {"ok": True, "leases": 3}
    assert service.expire(17.9) == 0
    ask(service, 0, now=15.0)  # asking renews too
    assert service.expire(24.9) == 0
    assert service.expire(25.0) == 3
    assert sum(router.turns.values()) == 3  # placed again: their load is on the queues they wait in


def test_expiry_heap_stays_bounded_by_live_leases():
    service, _ = make_service()
    service.submit("t0", "p0")
    for step in range(6000):  # thousands of leases within one lease period, all ended by reports
        [turn] = ask(service, 0 if step == 0 else 2, now=0.0)
        assert service.handle(tool_return(turn["lease"]), 0.0)["ok"]
    assert len(service._expiry) <= 4 * 1 + 4096 + 1
    ask(service, 2, now=0.0)
    assert service.expire(LEASE_S) == 1 and service.stats()["requeued_on_expiry"] == 1


def test_unknown_lease_and_unknown_instance():
    service, _ = make_service()
    reply = service.handle(finish(99), 0.0)
    assert reply["reason"] == "unknown_lease" and "99" in reply["error"]
    reply = service.handle({"op": "ask", "instance": 7, "max": 1}, 0.0)
    assert reply["reason"] == "unknown_instance" and "instance 7" in reply["error"] and "[0, 1, 2]" in reply["error"]
    assert service.stats()["rejected"]["unknown_instance"] == 1


@pytest.mark.parametrize("message, where", [
    (None, "got NoneType"),
    ([1, 2], "got list"),
    ({}, "op None is unknown"),
    ({"op": ["ask"]}, "op ['ask'] is unknown"),
    ({"op": "steal"}, "op 'steal' is unknown here; valid ops: ask, tool_return"),
    ({"op": "batch", "requests": {}}, "batch: field 'requests' must be a list of at most 1024 requests, got dict"),
    ({"op": "batch", "requests": [{}] * 1025}, "got list of 1025"),
    ({"op": "ask", "instance": 0}, "ask: field 'max' must be an int >= 1, missing"),
    ({"op": "ask", "instance": 0, "max": 0}, "ask: field 'max' must be an int >= 1, got 0"),
    ({"op": "ask", "instance": True, "max": 1}, "ask: field 'instance' must be an int, got True (bool)"),
    ({"op": "heartbeat", "instance": "0"}, "heartbeat: field 'instance' must be an int, got '0' (str)"),
    ({"op": "finish", "lease": 1, "tokens": -1}, "finish: field 'tokens' must be an int >= 0 and <= 16777216, got -1"),
    ({"op": "finish", "tokens": 3}, "finish: field 'lease' must be an int, missing"),
    ({**tool_return(1), "output": b"bytes"}, "tool_return: field 'output' must be a str, got bytes"),
    ({**tool_return(1), "exit_code": "0"}, "tool_return: field 'exit_code' must be an int or None"),
    ({**tool_return(1), "timed_out": 1}, "tool_return: field 'timed_out' must be a bool"),
    ({**tool_return(1), "tool": "a|b"}, "tool_return (lease 1): tool name 'a|b'"),
])
def test_malformed_requests_are_answered_and_counted(message, where):
    service, _ = make_service()
    service.submit("t0", "p0")
    ask(service, 0)
    reply = service.handle(message, 0.0)
    assert reply["ok"] is False and reply["reason"] == "malformed", reply
    assert where in reply["error"], reply["error"]
    assert service.stats()["rejected"]["malformed"] == 1 and service.stats()["leased"] == 1


def test_a_malformed_report_leaves_the_lease_usable():
    service, _ = make_service()
    service.submit("t0", "p0")
    lease = ask(service, 0)[0]["lease"]
    assert service.handle({**tool_return(lease), "tokens": "ten"}, 0.0)["ok"] is False
    assert service.handle(tool_return(lease), 0.0)["ok"] is True


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                           max_leaves=8)
ops = st.sampled_from(["ask", "tool_return", "finish", "heartbeat", "stats", "batch", "nope"])
fields = st.sampled_from(["instance", "max", "lease", "tool", "output", "exit_code", "timed_out", "tokens",
                          "requests"])


@settings(max_examples=300, deadline=None)
@given(st.one_of(json_values, st.builds(lambda op, extra: {"op": op, **extra}, ops,
                                        st.dictionaries(fields, json_values | st.integers(-2, 3), max_size=6))))
def test_no_request_makes_handle_raise(message):
    service, _ = make_service()
    service.submit("t0", "p0")
    ask(service, 0)
    reply = service.handle(message, 1.0)
    assert isinstance(reply, dict) and isinstance(reply["ok"], bool)
    assert reply["ok"] or reply["reason"] in service.stats()["rejected"]
    service.audit()


def test_batch_answers_each_request_as_if_alone_in_order():
    service, _ = make_service()
    service.submit("t0", "p0")
    service.submit("t1", "p1")
    t0, t1 = ask(service, 0, max=2)
    reply = service.handle({"op": "batch", "requests": [
        tool_return(t0["lease"], tokens=5), finish(t1["lease"], tokens=6), finish(t1["lease"], tokens=6),
        {"op": "batch", "requests": []}, "junk", {"op": "ask", "instance": 2, "max": 4}]}, 0.0)
    assert reply["ok"] is True
    ret, done, dup, nested, junk, asked = reply["replies"]
    assert ret["ok"] and ret["bucket"] == "tp4" and done == {"ok": True, "tid": "t1", "turns": 1}
    assert dup["reason"] == "duplicate_report"
    assert nested["reason"] == "malformed" and "'batch' is unknown here" in nested["error"]
    assert junk["reason"] == "malformed"
    assert [t["tid"] for t in asked["turns"]] == ["t0"] and asked["turns"][0]["turn"] == 1
    assert service.stats()["rejected"] == {"malformed": 2, "unknown_instance": 0, "unknown_lease": 0,
                                           "late_report": 0, "duplicate_report": 1}


def test_a_router_that_places_on_a_missing_instance_is_a_router_error():
    class Lost(StubRouter):
        def place(self, view):
            return Placement("tp1", 9)
    with pytest.raises(RouterError, match="instance 9"):
        make_service(Lost())[0].submit("t0", "p0")


def test_constructor_refuses_bad_settings():
    with pytest.raises(ValueError, match="lease_s"):
        make_service(lease_s=0)
    with pytest.raises(ValueError, match="size_thresholds"):
        make_service(size_thresholds=[10, 5])
    with pytest.raises(ValueError, match="buckets"):
        QueueService(object(), lease_s=1, max_batch=1, size_thresholds=THRESHOLDS, error_markers=MARKERS)
    service, _ = make_service()
    service.submit("t0", "p0")
    with pytest.raises(ValueError, match="already active"):
        service.submit("t0", "p0")


# ------------------------------------------------------------------ property test

class QueueMachine(RuleBasedStateMachine):
    """Random interleavings of submits, asks, reports, heartbeats, clock jumps and stale
    reports. A model predicts which leases are live (the service's rule: a lease lasts
    LEASE_S from its hand-out or from its instance's last ask/heartbeat, whichever is
    later) and so which reports must be accepted; invariants: no trajectory lost or in
    two places, none completed twice, accepted tokens are what the trainer receives."""

    used = Bundle("used")

    def __init__(self):
        super().__init__()
        self.service, self.router = make_service()
        self.now = 0.0
        self.next_tid = 0
        self.submitted: set[str] = set()
        self.completed: dict[str, tuple[int, ...]] = {}
        self.tokens: dict[str, list[int]] = {}
        self.held: dict[int, tuple[str, int, float]] = {}  # lease → (tid, instance, handed out at)
        self.renewed: dict[int, float] = {}
        self.expired: list[int] = []

    def _expire_model(self):
        for lid, (_tid, instance, start) in list(self.held.items()):
            if max(start, self.renewed.get(instance, start)) + LEASE_S <= self.now:
                del self.held[lid]
                self.expired.append(lid)

    def _send(self, message):
        self._expire_model()
        return self.service.handle(message, self.now)

    @rule()
    def submit(self):
        tid = f"t{self.next_tid}"
        self.next_tid += 1
        self.service.submit(tid, f"p{self.next_tid % 3}")
        self.submitted.add(tid)
        self.tokens[tid] = []

    @rule(instance=st.sampled_from([0, 1, 2]), want=st.integers(1, 6))
    def ask(self, instance, want):
        reply = self._send({"op": "ask", "instance": instance, "max": want})
        assert reply["ok"] and len(reply["turns"]) <= min(want, 4)
        self.renewed[instance] = self.now
        for turn in reply["turns"]:
            assert turn["lease"] not in self.held
            assert turn["turn"] == len(self.tokens[turn["tid"]])
            self.held[turn["lease"]] = (turn["tid"], instance, self.now)

    @precondition(lambda self: self.held)
    @rule(target=used, pick=st.integers(0, 1 << 30), tokens=st.integers(0, 500), end=st.booleans(),
          fail=st.booleans())
    def report(self, pick, tokens, end, fail):
        lid = sorted(self.held)[pick % len(self.held)]
        message = finish(lid, tokens) if end else tool_return(lid, tokens, output="Error: no" if fail else "ok")
        reply = self._send(message)
        if lid not in self.held:  # the clock moved past it before this report
            assert reply["reason"] == "late_report"
            return lid
        assert reply["ok"], reply
        tid, _, _ = self.held.pop(lid)
        self.tokens[tid].append(tokens)
        if end:
            assert tid not in self.completed
            self.completed[tid] = tuple(self.tokens[tid])
        return lid

    @precondition(lambda self: self.expired)
    @rule(pick=st.integers(0, 1 << 30), end=st.booleans())
    def report_late(self, pick, end):
        lid = self.expired[pick % len(self.expired)]
        reply = self._send(finish(lid) if end else tool_return(lid))
        assert reply["ok"] is False and reply["reason"] == "late_report", reply

    @rule(lid=used, end=st.booleans())
    def report_again(self, lid, end):
        reply = self._send(finish(lid) if end else tool_return(lid))
        assert reply["ok"] is False and reply["reason"] in ("duplicate_report", "late_report")

    @rule(instance=st.sampled_from([0, 1, 2]))
    def heartbeat(self, instance):
        reply = self._send({"op": "heartbeat", "instance": instance})
        self.renewed[instance] = self.now
        assert reply["leases"] == sum(1 for _, i, _ in self.held.values() if i == instance)

    @rule(dt=st.sampled_from([0.5, 3.0, LEASE_S / 2, LEASE_S, 2 * LEASE_S]))
    def advance(self, dt):
        self.now += dt

    @rule(lid=st.integers(-3, 1000))
    def report_unknown(self, lid):
        assume(lid not in self.held)
        assert self._send(finish(lid))["ok"] is False

    @invariant()
    def nothing_lost_nothing_twice(self):
        phases = self.service.audit()
        for record in self.service.drain_finished():
            assert record.tid in self.completed and record.turn_tokens == self.completed[record.tid]
            assert record.tid not in phases
        assert phases.keys().isdisjoint(self.completed)
        assert phases.keys() | self.completed.keys() == self.submitted
        self._expire_model()
        self.service.expire(self.now)
        assert {lid for lid in self.held} == set(self.service._leases)
        observed = Counter(f.prompt_id for f in self.router.observed)
        assert sum(observed.values()) == len(self.completed) == self.service.stats()["completed"]
        assert all(n >= 0 for n in self.router.turns.values())
        assert sum(self.router.turns.values()) == len(phases)  # each active trajectory: one turn, queued or leased


QueueMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None,
                                          suppress_health_check=[HealthCheck.filter_too_much])
test_queue_machine = QueueMachine.TestCase


# ------------------------------------------------------------------- real router

def test_with_the_real_cmlfq_router():
    router = make_router("cmlfq", BUCKETS, window=32, min_samples=2, rebuild_every=10)
    service, _ = make_service(router)
    now = 0.0
    for wave in range(4):  # waves: later ones are routed by what earlier ones taught the tree
        for i in range(10):
            service.submit(f"t{wave}.{i}", f"p{i % 4}")
        while service.stats()["active"]:
            for instance in (0, 1, 2):
                for turn in ask(service, instance, now=now):
                    long_one = turn["prompt_id"] in ("p0", "p1")
                    if turn["turn"] < 2:
                        reply = service.handle(tool_return(turn["lease"], tokens=2000 if long_one else 20,
                                                           output="Error: x" if long_one else "fine"), now)
                    else:
                        reply = service.handle(finish(turn["lease"], tokens=30), now)
                    assert reply["ok"], reply
            now += 1.0
    assert service.stats()["completed"] == 40 and len(service.drain_finished()) == 40
    assert router.outstanding == {0: 0, 1: 0, 2: 0}
    json.dumps(router.state_dict())
    assert service.stats()["migrations"] > 0  # learned: long prompts' later turns moved to tp4


# ------------------------------------------------------------------- review fixes

def test_an_absurd_token_count_is_refused_before_it_reaches_the_tree():
    service, router = make_service()
    service.submit("t0", "p0")
    [turn] = ask(service, 0)
    reply = service.handle({"op": "finish", "lease": turn["lease"], "tokens": 10**400}, 0.0)
    assert reply["ok"] is False and reply["reason"] == "malformed" and "<=" in reply["error"]
    assert router.observed == []  # nothing learned from it
    assert service.handle({"op": "finish", "lease": turn["lease"], "tokens": 5}, 0.0)["ok"]  # the lease still works


def test_turns_expiring_together_come_back_in_their_order_and_keep_their_migration():
    service, _ = make_service()
    for tid in ("a", "b", "c"):
        service.submit(tid, "p")
    # Move each to tp4 (one tool return: the stub's level 1), where instance 2 takes them all.
    for turn in ask(service, 0) + ask(service, 1):
        assert service.handle(tool_return(turn["lease"]), 0.0)["migrated"] is True
    held = ask(service, 2, now=1.0)
    order = [t["tid"] for t in held]
    assert sorted(order) == ["a", "b", "c"] and all(t["migrated"] for t in held)
    assert service.expire(1.0 + LEASE_S) == 3
    again = ask(service, 2, now=20.0)
    assert [t["tid"] for t in again] == order  # oldest lease first, as they were held
    assert all(t["migrated"] for t in again)  # the KV cache was never built on tp4


def test_a_tool_return_classified_by_the_worker_is_taken_as_the_same_state():
    service, router = make_service()
    for tid in ("a", "b"):
        service.submit(tid, "p")
    first, second = ask(service, 0, max=2) + ask(service, 1, max=2)
    compact = {"op": "tool_return", "lease": first["lease"], "tool": "python", "size": "S", "status": "failure",
               "tokens": 7}
    assert service.handle(compact, 0.0)["ok"]
    assert service.handle(tool_return(second["lease"], output="Error: boom"), 0.0)["ok"]
    assert router.views[-2].states == router.views[-1].states == (ToolState("python", "S", "failure"),)
    assert router.views[-2].states[0] is router.views[-1].states[0]  # one interned state
    assert router.views[-2].generated_tokens == 7


@pytest.mark.parametrize(("fields", "message"), [
    ({"size": "XXL", "status": "failure"}, r"size 'XXL' must be one of \['S', 'M', 'L'\]"),
    ({"size": "S", "status": "crashed"}, "status 'crashed' must be one of"),
    ({"size": "S", "status": 3}, "field 'status' must be a str"),
    ({"size": "S"}, "field 'status' must be a str, missing"),
    ({"size": "S", "status": "success", "tool": "a|b"}, "must not contain '|'"),
])
def test_a_malformed_worker_classification_is_refused_by_name(fields, message):
    service, _ = make_service()
    service.submit("a", "p")
    [turn] = ask(service, 0)
    reply = service.handle({"op": "tool_return", "lease": turn["lease"], "tool": "python", "tokens": 1, **fields}, 0.0)
    assert reply["ok"] is False and reply["reason"] == "malformed"
    assert re.search(message, reply["error"]), reply["error"]
    assert service.handle(tool_return(turn["lease"]), 0.0)["ok"]  # the lease is still usable
