"""The live planner's per-term calibration and its bookkeeping (issue 30, item 4): pure,
no MPI, no clock (every time is an injected number)."""

from __future__ import annotations

import random

import pytest

from libra_hpc.planner.calibration import Calibration, TimingRecord, fit_calibration
from libra_hpc.planner.costs import LengthProfile, LengthSample, RolloutCost, rollout_makespan
from libra_hpc.planner.profiles import load_hardware, load_model
from libra_hpc.planner.window import StepWindow, layout_gain
from libra_hpc.runtime.records import predicted_over_measured

TINY, CPU = load_model("tiny"), load_hardware("cpu")
TRUE = Calibration(decode_step_overhead_s=0.021, tool_latency_scale=1.3, turn_latency_s=0.7)


def _chains(steps: range, rng: random.Random, truth: Calibration = TRUE, per_step: int = 24) -> list[TimingRecord]:
    """Trajectories of independent lengths, turns and tool times, timed by ``truth``."""
    out = []
    for step in steps:
        for _ in range(per_step):
            turns = rng.randint(1, 6)
            parts = RolloutCost(TINY, CPU, rng.choice((1, 2)), truth).chain_components(
                rng.uniform(100, 1500), rng.uniform(20, 900), rng.uniform(0, 3), turns, rng.uniform(1, 8), 2000)
            out.append(TimingRecord("chain", parts, truth.time("chain", parts), step))
    return out


def test_chain_fit_recovers_known_per_term_coefficients():
    fit = fit_calibration(_chains(range(4), random.Random(0)))
    for name in ("decode_step_overhead_s", "tool_latency_scale", "turn_latency_s"):
        assert getattr(fit, name) == pytest.approx(getattr(TRUE, name), rel=1e-6), name
    assert "chain n=96" in fit.note and "turn_latency_s 0->0.7" in fit.note and "rms rel err 0.0%" in fit.note


def test_the_chain_fit_leaves_prefill_to_the_engine():
    """Each turn waits 0.7 s in the queue, and a trajectory's prefilled tokens (prompt and
    tool outputs) grow with its turns: the wall times cannot tell the two apart. The chain
    fit keeps the prefill efficiency it was given and puts the wait where it is, per turn."""
    rng, records = random.Random(5), []
    for step in range(4):
        for _ in range(24):
            turns = rng.randint(1, 6)
            parts = RolloutCost(TINY, CPU, 1, TRUE).chain_components(
                300 + 150 * turns, rng.uniform(20, 900), 0.0, turns, 4, 2000)
            records.append(TimingRecord("chain", parts, TRUE.time("chain", parts), step))
    fit = fit_calibration(records)
    assert fit.prefill_mfu == TRUE.prefill_mfu
    assert fit.turn_latency_s == pytest.approx(0.7, rel=1e-6)


def test_a_half_life_follows_costs_that_moved():
    """Steps 0-5 cost one thing, steps 6-7 another (a new layout, other work beside it):
    weighing every record the same, the fit sits between the two; with a half-life of one
    step it is near the new costs, and with all records of one step alike, weights change
    nothing."""
    rng = random.Random(6)
    later = Calibration(decode_step_overhead_s=0.042, tool_latency_scale=1.3, turn_latency_s=1.4)
    records = _chains(range(6), rng) + _chains(range(6, 8), rng, truth=later)
    flat, recent = fit_calibration(records), fit_calibration(records, half_life=1.0)
    assert abs(recent.turn_latency_s - 1.4) < 0.4 * abs(flat.turn_latency_s - 1.4)
    assert abs(recent.decode_step_overhead_s - 0.042) < 0.4 * abs(flat.decode_step_overhead_s - 0.042)
    same = _chains(range(3), rng)
    assert fit_calibration(same, half_life=1.0).turn_latency_s == pytest.approx(0.7, rel=1e-6)


def test_fit_for_step_k_uses_only_the_steps_before_k():
    rng = random.Random(1)
    before = _chains(range(3), rng)
    wild = Calibration(decode_step_overhead_s=0.5, turn_latency_s=9.0)  # steps 3 and on: nothing like the past
    later = _chains(range(3, 6), rng, truth=wild)
    fit = fit_calibration(before + later, before=3)
    assert fit.turn_latency_s == pytest.approx(0.7) and fit.decode_step_overhead_s == pytest.approx(0.021)
    assert fit == fit_calibration(before)  # the same fit as if the later steps had not happened
    assert fit_calibration(before + later, before=6).turn_latency_s > 3  # with them, it moves
    assert fit_calibration(later, before=3).note == "defaults"


def test_a_term_the_records_cannot_tell_apart_keeps_its_value():
    """Every trajectory with the same turns: the turn term is a constant the decode steps
    cannot be told from; the fit keeps the prior for what it cannot determine, never a
    negative or infinite coefficient."""
    rng, records = random.Random(2), []
    for step in range(3):
        for _ in range(20):
            parts = RolloutCost(TINY, CPU, 1, TRUE).chain_components(300, rng.uniform(50, 500), 0.0, 2, 4, 1000)
            records.append(TimingRecord("chain", parts, TRUE.time("chain", parts), step))
    fit = fit_calibration(records)
    assert fit.tool_latency_scale == 1.0  # no tool time in any record: kept
    assert fit.turn_latency_s >= 0 and fit.decode_step_overhead_s > 0
    for r in records:  # the held prefill efficiency also prices the decode steps' compute side: close, not exact
        assert fit.time("chain", r.components) == pytest.approx(r.measured_s, rel=0.05)


def test_turns_and_tool_latency_price_the_makespan():
    """A trajectory's turns and tool time are priced by the calibration; the defaults (no
    turn cost, tools at their measured time) price them as before the terms existed."""
    samples = [LengthSample(300, 200, 5, 1.0), LengthSample(300, 100, 1, 0.0)] * 4
    lengths = LengthProfile.from_samples(samples, 8)
    assert lengths.turns[0] == 5
    base = Calibration(decode_step_overhead_s=0.02)
    slow = Calibration(decode_step_overhead_s=0.02, turn_latency_s=0.5, tool_latency_scale=2.0)
    m0 = rollout_makespan([(RolloutCost(TINY, CPU, 1, base), 4)], lengths).makespan_s
    m1 = rollout_makespan([(RolloutCost(TINY, CPU, 1, slow), 4)], lengths).makespan_s
    assert m1 - m0 == pytest.approx(5 * 0.5 + 1.0 * (2.0 - 1.0), rel=0.05)  # the longest chain: 5 turns, 1 s tools
    assert RolloutCost(TINY, CPU, 1, slow).serial_s(300, 200, 1.0, turns=5) - RolloutCost(TINY, CPU, 1, base).serial_s(
        300, 200, 1.0) == pytest.approx(3.5)


def test_predicted_over_measured_is_the_mean_ratio_of_the_last_ten_steps():
    rows = [{"step": k} for k in range(3)]  # no prediction (the planner off): left out
    rows += [{"planner_predicted_s": 10.0, "measured_step_s": 40.0}] * 5  # early: outside the last 10
    rows += [{"planner_predicted_s": 12.0, "measured_step_s": 10.0}] * 5 + [
        {"planner_predicted_s": 9.0, "measured_step_s": 10.0}] * 5
    assert predicted_over_measured(rows) == pytest.approx(1.05)
    assert predicted_over_measured(rows[:3]) is None


def test_layout_gains_are_predicted_and_realised_per_change():
    w = StepWindow(max_staleness=1, steps=20)
    for k, s in enumerate((10, 10, 10)):
        w.record(k, 5, 5, s)
    w.switched(3, {"direction": "join", "predicted_gain_s": 2.0})
    w.record(3, 5, 5, 12)  # the step that carried the pause
    w.record(4, 5, 5, 7)
    assert w.realised_gains() == []  # two steps after it so far
    w.record(5, 5, 5, 8)
    (gain,) = w.realised_gains()
    assert layout_gain(gain) == {"predicted_s": 2.0, "realised_s": 1.0, "at_step": 3, "direction": "join",
                                 "steps_after": 3}
    w.switched(7, {"predicted_gain_s": 1.5})  # a replan's record: no direction
    w.record(6, 5, 5, 8)
    w.record(7, 5, 5, 6)
    assert w.realised_gains() == []
    (last,) = w.realised_gains(final=True)  # the run ended one step after it
    assert layout_gain(last) == {"predicted_s": 1.5, "realised_s": pytest.approx(7.667 - 6, abs=1e-3),
                                 "at_step": 7, "direction": "replan", "steps_after": 1}
    assert w.realised_gains(final=True) == []  # once each


def test_terms_that_move_together_do_not_throw_each_other_out():
    """A default run's training passes (steps 0-9, as measured on 2 shared cores): compute and
    the gradients' all-reduce both grow with the sequences trained, and the times are noisy.
    Dropping the first bad term for good left nothing fitted (the prior then priced a pass
    at a fifth of what it took); the best subset keeps compute and the step's fixed cost."""
    measured = [(0.5456, 0.0062, 6.9143), (2.232, 0.0219, 32.8299), (0.8155, 0.0087, 19.1606),
                (1.0049, 0.0105, 11.5993), (1.2108, 0.0128, 7.3652), (1.3392, 0.0138, 20.5132),
                (1.2305, 0.0125, 17.1124), (0.402, 0.005, 8.4135), (0.9456, 0.0103, 15.1844),
                (0.6811, 0.0075, 8.0068)]
    records = [TimingRecord("train", {"compute_s": c, "comm_s": m, "steps": 1.0}, t, step)
               for step, (c, m, t) in enumerate(measured)]
    fit = fit_calibration(records, half_life=1.0)
    assert "nothing fitted" not in fit.note
    assert fit.train_comm_eff == Calibration().train_comm_eff  # held: the records cannot tell it from compute
    assert 0.05 < fit.train_mfu < 0.1 and fit.train_step_overhead_s > 0
    last = records[-1]
    assert fit.time("train", last.components) == pytest.approx(last.measured_s, rel=0.5)


def test_a_micro_batch_fixed_cost_is_fitted_and_priced():
    """Steps whose time is mostly a fixed cost per micro-batch (a small model on a large GPU:
    25 ms a micro-batch of 4 whatever its tokens, scripts/gpu_calibration.py on an H200):
    the fit recovers that cost and the compute, and predicts batches it did not see."""
    from libra_hpc.planner.costs import TrainingCost, TrainShape

    truth = Calibration(train_mfu=0.25, train_step_overhead_s=0.02, train_microbatch_overhead_s=0.025)
    h200 = load_hardware("h200-141g")

    def record(seqs, length, mbs=4):
        parts = TrainingCost(TINY, h200, TrainShape(1, 1, 1, mbs, seqs, length, uneven=True)).components()
        return TimingRecord("train", parts, truth.time("train", parts))

    assert record(64, 512).components["microbatches"] == 16
    fit = fit_calibration([record(s, n) for s in (8, 256) for n in (256, 2048)])
    assert fit.train_microbatch_overhead_s == pytest.approx(0.025, rel=1e-6)
    for seqs, length, mbs in ((32, 1024, 4), (128, 512, 2), (16, 256, 8)):
        r = record(seqs, length, mbs)
        assert fit.time("train", r.components) == pytest.approx(r.measured_s, rel=1e-6)
    assert Calibration().time("train", record(64, 512).components) == Calibration().time(  # default: no such cost
        "train", {k: v for k, v in record(64, 512).components.items() if k != "microbatches"})
