"""The simulator's clock (its event heap) and rollout instance on cases with hand-computed answers."""

from __future__ import annotations

import pytest

from libra_hpc.sim.engine import Event, SimClock
from libra_hpc.sim.instance import ConstantStepModel, RolloutInstance, Run


class Note(Event):
    def __init__(self, time, kind, log, name, then=()):
        super().__init__(time)
        self.KIND = kind
        self.log, self.name, self.then = log, name, then

    def fire(self):
        self.log.append((self.time, self.name))
        return list(self.then)


def test_ties_break_by_time_then_kind_then_scheduling_order():
    log = []
    clock = SimClock()
    for e in (Note(2.0, 50, log, "late"), Note(1.0, 50, log, "b1"), Note(1.0, 10, log, "a"),
              Note(1.0, 50, log, "b2")):
        clock.schedule(e)
    clock.run()
    assert [n for _, n in log] == ["a", "b1", "b2", "late"]


def test_events_return_the_events_they_cause_and_the_past_is_refused():
    log = []
    clock = SimClock()
    clock.schedule(Note(1.0, 50, log, "first", then=[Note(3.0, 50, log, "caused")]))
    assert clock.run() == 3.0 and log == [(1.0, "first"), (3.0, "caused")]
    clock.schedule(Note(5.0, 50, log, "bad", then=[Note(4.0, 50, log, "past")]))
    with pytest.raises(ValueError, match="in the past"):
        clock.run()


def drive(inst: RolloutInstance, offers: dict[float, list[Run]]) -> dict[str, float]:
    """Run one instance alone: offers arrive at their times, wake-ups as planned."""
    finished, pending = {}, sorted(offers.items())
    while pending or inst.wake_at is not None:
        wake = inst.wake_at[0] if inst.wake_at is not None else float("inf")
        if pending and pending[0][0] < wake:
            t, runs = pending.pop(0)
            inst.offer(runs, t)
            continue
        t, target = inst.wake_at
        for run in inst.wake(t, target):
            finished[run.tid] = t
    return finished


def run(tid, tokens, prefill=0, context=0):
    return Run(lease=0, tid=tid, context=context, tokens=tokens, prefill=prefill)


def test_single_instance_fixed_lengths_hand_computed():
    # Two seats, 10 ms steps: A (10 tokens) and B (20) start at 0, C (30) takes A's seat at
    # 0.1 s and finishes at step 10 + 30 = 40; B finishes at step 20.
    inst = RolloutInstance(0, 1, ConstantStepModel(0.01), seats=2, resync_steps=1000)
    done = drive(inst, {0.0: [run("A", 10), run("B", 20), run("C", 30)]})
    assert done == pytest.approx({"A": 0.10, "B": 0.20, "C": 0.40})
    assert inst.tokens == 60 and inst.busy_s == pytest.approx(0.40)


def test_prefill_stalls_the_batch_and_arrivals_join_at_step_boundaries():
    # 1 ms per prefilled token: A and B prefill 5 tokens each (10 ms stall) before decoding;
    # C (prefill 5) joins when A leaves at 0.11 s and stalls everyone 5 ms.
    inst = RolloutInstance(0, 1, ConstantStepModel(0.01, prefill_per_token=0.001), seats=2, resync_steps=7)
    done = drive(inst, {0.0: [run("A", 10, 5), run("B", 20, 5), run("C", 30, 5)]})
    assert done == pytest.approx({"A": 0.11, "B": 0.215, "C": 0.415})
    # A lone sequence; D arrives mid-step at 35 ms and joins at the boundary of 40 ms.
    inst = RolloutInstance(0, 1, ConstantStepModel(0.01), seats=4)
    done = drive(inst, {0.0: [run("A", 10)], 0.035: [run("D", 5)]})
    assert done == pytest.approx({"A": 0.10, "D": 0.09})


def test_kv_capacity_admits_by_reservation_and_a_lone_sequence_always_runs():
    # 100 KV tokens: A reserves 10 + 50, B needs 30 + 30 = 60 > 40 left, so B waits for A.
    inst = RolloutInstance(0, 1, ConstantStepModel(0.01, kv_capacity=100), seats=8)
    done = drive(inst, {0.0: [run("A", 50, context=10), run("B", 30, context=30)]})
    assert done == pytest.approx({"A": 0.50, "B": 0.80})
    inst = RolloutInstance(0, 1, ConstantStepModel(0.01, kv_capacity=100), seats=8)
    assert drive(inst, {0.0: [run("huge", 200, context=50)]}) == pytest.approx({"huge": 2.0})


def test_step_time_follows_the_batch():
    class PerBatch(ConstantStepModel):
        def step_s(self, batch, context_tokens):
            return 0.01 * batch
    # Two sequences: 20 ms steps until A leaves at step 10 (0.2 s), then 10 ms steps.
    inst = RolloutInstance(0, 1, PerBatch(0.0), seats=2)
    done = drive(inst, {0.0: [run("A", 10), run("B", 15)]})
    assert done == pytest.approx({"A": 0.20, "B": 0.25})
