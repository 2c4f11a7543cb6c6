"""Replanning gate: periodic and pressure triggers, the margin, hysteresis (no flapping
under alternating candidates), reasons; and the loop planner + gate following lengths
that grow, then shrink."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from libra_hpc.cluster.layout import Slot
from libra_hpc.planner.costs import LengthProfile, LengthSample, TrainShape
from libra_hpc.planner.gate import GateOptions, ReplanGate
from libra_hpc.planner.profiles import load_hardware, load_model
from libra_hpc.planner.search import (
    Plan,
    PlanResult,
    RLBatch,
    RolloutInstance,
    plan,
    reprice,
)


def candidate(objective: float, train_gpus: int = 8) -> PlanResult:
    """A 16-GPU plan with ``train_gpus`` GPUs training and TP-1 rollout instances."""
    slots = [Slot(n, g) for n in range(2) for g in range(8)]
    shape = TrainShape(tp=2, pp=1, dp=train_gpus // 2, micro_batch=1, global_batch=64, seq_len=4096)
    p = Plan(shape, tuple(slots[:train_gpus]), tuple(RolloutInstance(1, (s,)) for s in slots[train_gpus:]),
             objective, objective, objective, "async")
    return PlanResult(p, (), 0, 0.0)


OPT = GateOptions(every_steps=10, queue_depth_threshold=100, ratio_band=(0.8, 1.25), margin_s=10.0,
                  confirm_checks=2, min_dwell_steps=20)


def test_checks_run_every_k_steps_and_on_pressure():
    gate = ReplanGate(OPT)
    better = candidate(50.0)
    d0 = gate.consider(0, 100.0, better, 0.0)
    assert d0.checked and d0.trigger == "periodic" and not d0.apply and "1/2" in d0.reason
    d5 = gate.consider(5, 100.0, better, 0.0)
    assert not d5.checked and not d5.apply and "next periodic check at step 10" in d5.reason
    d7 = gate.consider(7, 100.0, better, 0.0, {"queue_depth": 150})
    assert d7.checked and d7.trigger.startswith("pressure: queue depth 150") and d7.apply
    gate = ReplanGate(OPT)
    gate.consider(0, 100.0, candidate(100.0), 0.0)
    d3 = gate.consider(3, 100.0, candidate(100.0), 0.0, {"rollout_train_ratio": 2.0, "queue_depth": 3})
    assert d3.checked and "ratio 2.00 outside [0.8, 1.25]" in d3.trigger
    assert not gate.consider(4, 100.0, candidate(100.0), 0.0, {"rollout_train_ratio": 1.1}).checked


def test_apply_only_when_gain_over_horizon_minus_cost_beats_the_margin():
    gate = ReplanGate(GateOptions(confirm_checks=1, margin_s=10.0, every_steps=10, min_dwell_steps=0))
    # gain 2 s/step × 10 steps − 15 s = 5 s <= 10 s margin
    d = gate.consider(0, 100.0, candidate(98.0), 15.0)
    assert not d.apply and d.net_gain_s == pytest.approx(5.0) and "<= margin 10 s" in d.reason
    # gain 3 s/step × 10 − 15 = 15 s > 10 s
    d = gate.consider(10, 100.0, candidate(97.0), 15.0)
    assert d.apply and d.net_gain_s == pytest.approx(15.0) and d.reason.startswith("periodic; apply")
    # a worse candidate is never applied
    assert not gate.consider(20, 100.0, candidate(120.0), 0.0).apply


def test_a_gate_checking_every_step_counts_the_gain_over_its_horizon():
    """Checked every step, a change saving 50 s a step does not pay a 200 s switch in one
    step; over a 10-step horizon it does (the clairvoyant policy's gate: counted over one
    step, it never left a layout twice as slow)."""
    myopic = ReplanGate(GateOptions(every_steps=1, margin_s=0.0, confirm_checks=1, min_dwell_steps=0))
    assert not myopic.consider(0, 100.0, candidate(50.0), 200.0).apply
    gate = ReplanGate(GateOptions(every_steps=1, margin_s=0.0, confirm_checks=1, min_dwell_steps=0, horizon_steps=10))
    d = gate.consider(0, 100.0, candidate(50.0), 200.0)
    assert d.apply and d.net_gain_s == pytest.approx(300.0) and "× 10 steps" in d.reason
    with pytest.raises(ValueError, match="GateOptions"):
        GateOptions(horizon_steps=0)


def test_no_flapping_under_alternating_candidates():
    gate = ReplanGate(OPT)
    a, b = candidate(60.0, train_gpus=8), candidate(60.0, train_gpus=4)
    applied = [gate.consider(step, 100.0, a if (step // 10) % 2 else b, 0.0).apply for step in range(0, 200, 10)]
    assert not any(applied)  # a different winner each check restarts the confirmation count


def test_dwell_after_a_change():
    gate = ReplanGate(GateOptions(every_steps=10, confirm_checks=1, min_dwell_steps=25, margin_s=0.0))
    assert gate.consider(0, 100.0, candidate(50.0, 8), 0.0).apply
    d = gate.consider(10, 100.0, candidate(50.0, 4), 0.0)
    assert not d.apply and "dwell: last change at step 0, none before step 25" in d.reason
    assert not gate.consider(20, 100.0, candidate(50.0, 4), 0.0).apply
    assert gate.consider(30, 100.0, candidate(50.0, 4), 0.0).apply


@pytest.mark.parametrize("same_way", [True, False])
def test_the_dwell_holds_a_move_back_but_not_a_further_move_the_same_way(same_way):
    """Halfway through a regime change the gate may apply a split that is only part of the
    way there; the dwell then holds back a move back (flapping), but with ``dwell_same_way``
    not the rest of the way (context-drift-tp: a plan applied at step 64 stayed ten steps)."""
    gate = ReplanGate(GateOptions(every_steps=1, confirm_checks=1, min_dwell_steps=10, margin_s=0.0,
                                  dwell_same_way=same_way))
    start = candidate(100.0, train_gpus=8).plan
    halfway = candidate(80.0, train_gpus=4)  # 4 GPUs toward rollout
    assert gate.consider(0, 100.0, halfway, 0.0, current=start).apply
    back = gate.consider(1, 80.0, candidate(60.0, train_gpus=8), 0.0, current=halfway.plan)
    assert not back.apply and "dwell" in back.reason
    further = gate.consider(2, 80.0, candidate(60.0, train_gpus=2), 0.0, current=halfway.plan)
    assert further.apply is same_way
    if not same_way:
        assert "dwell: last change at step 0" in further.reason
    # a change the caller applied past the gate (memory) has no direction: the dwell holds all
    gate = ReplanGate(GateOptions(every_steps=1, confirm_checks=1, min_dwell_steps=10, margin_s=0.0))
    gate.last_apply, gate.moved = 0, None
    assert not gate.consider(1, 80.0, candidate(60.0, train_gpus=2), 0.0, current=halfway.plan).apply


@pytest.mark.parametrize("next_step", [True, False])
def test_a_winning_candidate_asks_for_its_confirmation_at_the_next_step(next_step):
    gate = ReplanGate(GateOptions(every_steps=10, confirm_checks=2, min_dwell_steps=10, margin_s=0.0,
                                  confirm_next_step=next_step))
    start = candidate(100.0, train_gpus=8).plan
    assert not gate.confirming(0)
    first = gate.consider(0, 100.0, candidate(60.0, train_gpus=4), 0.0, current=start)
    assert not first.apply and "1/2" in first.reason
    assert gate.confirming(1) is next_step
    assert gate.consider(1, 100.0, candidate(60.0, train_gpus=4), 0.0, {"rollout_train_ratio": 2.0},
                         current=start).apply
    assert not gate.confirming(2)  # nothing waits after the change
    # a winner the dwell holds back (it moves back) does not ask for a check every step
    gate.consider(3, 60.0, candidate(40.0, train_gpus=8), 0.0, {"rollout_train_ratio": 2.0},
                  current=candidate(60.0, train_gpus=4).plan)
    assert not gate.confirming(4)


def test_every_decision_has_a_reason():
    gate = ReplanGate(OPT)
    rng = random.Random(0)
    for step in range(60):
        d = gate.consider(step, 100.0, candidate(rng.uniform(50, 150), rng.choice([4, 8])), rng.uniform(0, 50),
                          {"queue_depth": rng.randint(0, 200)})
        assert d.reason


def test_bad_options_fail_with_the_field():
    with pytest.raises(ValueError, match="ratio_band"):
        GateOptions(ratio_band=(1.5, 2.0))
    with pytest.raises(ValueError, match="every_steps"):
        GateOptions(every_steps=0)


def test_replanner_follows_lengths_that_grow_then_shrink():
    q14, a800 = load_model("qwen3-14b"), load_hardware("a800-80g")
    batch = RLBatch(256, 8192)

    def lengths(scale: float) -> LengthProfile:
        rng = random.Random(0)
        return LengthProfile.from_samples(
            [LengthSample(rng.randint(200, 1500), max(1, int(scale * min(8000, rng.paretovariate(1.3) * 600))), 2,
                          rng.uniform(0, 10)) for _ in range(256)], 256, buckets=16)

    gate = ReplanGate(GateOptions(every_steps=5, confirm_checks=2, min_dwell_steps=10, margin_s=5.0))
    current = plan(q14, a800, 6, 8, lengths(0.25), batch).plan
    scales = [0.25 * 1.15 ** i for i in range(20)]
    history = [current.rollout_gpus]
    for step, scale in enumerate(scales + scales[::-1]):
        lp = lengths(scale)
        now = reprice(current, q14, a800, 8, lp)
        d = gate.consider(step, now.objective, plan(q14, a800, 6, 8, lp, batch), 30.0, current=current)
        if d.apply:
            current = plan(q14, a800, 6, 8, lp, batch).plan
            history.append(current.rollout_gpus)
    peak = history.index(max(history))
    assert max(history) > history[0] and history[-1] < max(history), history
    assert history[: peak + 1] == sorted(history[: peak + 1]), history  # growing: only toward rollout
    assert history[peak:] == sorted(history[peak:], reverse=True), history  # shrinking: back to training


def test_alternating_workload_does_not_flap():
    """Long and short batches every other check: the plan that suits one is never confirmed."""
    q14, a800 = load_model("qwen3-14b"), load_hardware("a800-80g")
    batch = RLBatch(256, 8192)

    def lengths(scale: float) -> LengthProfile:
        rng = random.Random(1)
        return LengthProfile.from_samples(
            [LengthSample(rng.randint(200, 1500), max(1, int(scale * min(8000, rng.paretovariate(1.3) * 600))), 2,
                          rng.uniform(0, 10)) for _ in range(256)], 256, buckets=16)

    short, long_ = lengths(0.3), lengths(2.0)
    candidates = {0: plan(q14, a800, 6, 8, short, batch), 1: plan(q14, a800, 6, 8, long_, batch)}
    current = candidates[0].plan
    gate = ReplanGate(GateOptions(every_steps=1, confirm_checks=2, min_dwell_steps=0, margin_s=1.0))
    decisions = []
    for step in range(20):
        lp = long_ if step % 2 else short
        now = reprice(current, q14, a800, 8, lp)
        decisions.append(gate.consider(step, now.objective, candidates[step % 2], 10.0, current=current))
    assert not any(d.apply for d in decisions)
    assert any("1/2 consecutive checks" in d.reason for d in decisions)


def test_a_gain_within_the_cost_models_error_is_kept_out():
    """min_gain: a candidate predicted 5% faster is noise at 10%; 20% faster wins."""
    from dataclasses import replace

    gate = ReplanGate(replace(OPT, confirm_checks=1, min_gain=0.1))
    d = gate.consider(0, 100.0, candidate(95.0), reconfig_cost_s=0.0)  # 5 s/step × 10 = 50 s > margin
    assert not d.apply and "min_gain 0.1" in d.reason
    d = gate.consider(10, 100.0, candidate(80.0), reconfig_cost_s=0.0)
    assert d.apply
    with pytest.raises(ValueError, match="min_gain"):
        GateOptions(min_gain=1.0)


def test_a_training_shape_change_on_the_same_instances_is_not_held_to_min_gain():
    from dataclasses import replace

    gate = ReplanGate(replace(OPT, confirm_checks=1, min_gain=0.1))
    current = candidate(100.0).plan
    reshard = candidate(95.0)  # same 8 training GPUs and instances, 5% faster
    assert gate.consider(0, 100.0, reshard, reconfig_cost_s=0.0, current=current).apply


def test_the_measured_model_error_raises_the_bar_for_rollout_changes():
    """A fitted calibration that predicts decode steps with 50% error cannot justify a 20%
    rollout gain; min_gain 0 still takes any gain (the bar is off)."""
    from dataclasses import replace

    current = candidate(100.0, train_gpus=8).plan
    other = candidate(80.0, train_gpus=4)  # moves GPUs to rollout, predicted 20% faster
    gate = ReplanGate(replace(OPT, confirm_checks=1, min_gain=0.1))
    d = gate.consider(0, 100.0, other, 0.0, current=current, model_error=0.5)
    assert not d.apply and "measured error 50%" in d.reason
    assert gate.consider(10, 100.0, other, 0.0, current=current, model_error=0.05).apply
    off = ReplanGate(replace(OPT, confirm_checks=1, min_gain=0.0))
    assert off.consider(0, 100.0, other, 0.0, current=current, model_error=0.5).apply


def test_a_decisive_gain_is_applied_at_its_first_check_unless_the_models_error_is_as_large():
    """decisive_gain 0.5: a candidate predicted to halve the step is applied at once (no
    second check); one predicted 40% faster still waits for its confirmation; a fitted
    calibration off by 30% (twice: 60% > 55%) keeps even the 55% gain to the confirmation;
    the dwell still holds; the default (1.0) always confirms."""
    from dataclasses import replace

    gate = ReplanGate(replace(OPT, decisive_gain=0.5, min_dwell_steps=0))
    d = gate.consider(0, 100.0, candidate(60.0), 0.0)
    assert not d.apply and "1/2" in d.reason
    d = gate.consider(10, 100.0, candidate(45.0), 0.0)  # streak 2 of the same plan anyway: confirmed
    assert d.apply and "2 consecutive checks" in d.reason
    gate = ReplanGate(replace(OPT, decisive_gain=0.5, min_dwell_steps=0))
    d = gate.consider(0, 100.0, candidate(45.0), 0.0)
    assert d.apply and "decisive: gain 55% of the current step" in d.reason
    assert not gate.consider(10, 100.0, candidate(45.0, train_gpus=4), 0.0, model_error=0.3).apply
    dwell = ReplanGate(replace(OPT, decisive_gain=0.5, min_dwell_steps=20))
    assert dwell.consider(0, 100.0, candidate(45.0), 0.0).apply
    assert "dwell" in dwell.consider(10, 45.0, candidate(10.0, train_gpus=4), 0.0).reason
    assert not ReplanGate(OPT).consider(0, 100.0, candidate(10.0), 0.0).apply  # default: confirm
    with pytest.raises(ValueError, match="decisive_gain > 0"):
        GateOptions(decisive_gain=0.0)


def test_a_fitted_calibration_carries_its_error_per_kind():
    from libra_hpc.planner.costs import TimingRecord, fit_calibration

    records = [TimingRecord("decode", {"mem_s": 0.001 * i, "steps": 1.0}, 0.004 * i + 0.002 * (i % 2))
               for i in range(1, 9)]
    cal = fit_calibration(records)
    errors = dict(cal.fit_errors)
    assert set(errors) == {"decode"} and 0 < errors["decode"] < 1


@pytest.mark.parametrize("hybrid_nodes", [0, 1])
def test_the_candidate_is_valued_as_the_running_plan_is_with_or_without_a_hybrid_pool(hybrid_nodes):
    """The gate compares the running plan's objective, scaled by what it measured against
    its prediction, with the search's best: the best must be scaled the same way. Without
    a hybrid pool it was not, so a job faster than the cost model (scale < 1) never found a
    plan worth switching to (tests/test_job.py's replan test, on a fast machine)."""
    from pathlib import Path

    from libra_hpc.config import load_config
    from libra_hpc.planner.control import ControlLoop

    cfg = load_config(Path(__file__).resolve().parent.parent / "configs" / "default.yaml",
                      [f"planner.hybrid_nodes={hybrid_nodes}"])
    loop = ControlLoop.from_config(cfg)
    prior = loop.prior()
    unscaled = loop.best_plan(prior).plan
    loop.scale = (0.5, 0.2)
    scaled = loop.best_plan(prior).plan
    at_scale = loop.valuation().step_objective(scaled.t_train * 0.5, scaled.t_rollout * 0.2)
    if hybrid_nodes == 0:
        assert scaled.objective == pytest.approx(at_scale, rel=1e-9)
    else:  # a lent replica can only shorten the scaled step
        assert scaled.objective <= at_scale * (1 + 1e-9)
    assert scaled.objective < unscaled.objective * 0.6


def test_the_gate_reads_the_error_of_every_kind_the_run_fitted():
    """The job fits trajectory chains and training passes, not engine decode steps: the
    error the gate weighs is the largest of the kinds fitted, none when nothing was."""
    from libra_hpc.planner.calibration import Calibration
    from libra_hpc.planner.control import model_error

    assert model_error(Calibration()) == 0.0
    assert model_error(Calibration(fit_errors=(("train", 0.2), ("chain", 0.6)))) == 0.6
    assert model_error(Calibration(fit_errors=(("decode", 0.1),))) == 0.1
    assert model_error(Calibration(fit_errors=(("train", 0.2), ("tail", 0.9)))) == 0.2  # seconds of the step


@pytest.mark.parametrize("t_train, t_rollout, k, groups, drain", [
    (0.5, 1.0, 0, 0, 0.0),      # synchronous: nothing overlaps, nothing to drain
    (0.5, 1.0, 1, 0, 0.75),     # rollout-bound, step (M + T) / 2: the series M + T costs one step more
    (3.0, 1.0, 1, 0, 1.0),      # training-bound, step T: the rollout of the first new batch
    (0.5, 1.0, 1, 4, 0.5625),   # streamed: only the last group's share T / G follows the rollout
])
def test_the_drain_of_a_change_is_a_rollout_and_a_training_step_in_series(t_train, t_rollout, k, groups, drain):
    from libra_hpc.planner.pipeline import switch_drain_s

    assert switch_drain_s(t_train, t_rollout, k, groups) == pytest.approx(drain)
    if groups:  # a fitted fixed tail of 0.25 s: the step (M + T/G + 0.25) / 2, the series M + T/G + 0.25
        assert switch_drain_s(t_train, t_rollout, k, groups, 0.25) == pytest.approx((t_rollout + t_train / groups + 0.25) / 2)


@pytest.mark.parametrize("makespan, k, groups, tail_s", [(10.0, 1, 0, 0.0), (10.0, 1, 12, 0.0), (10.0, 1, 12, 3.0),
                                                         (10.0, 2, 4, 1.5), (1.0, 1, 12, 50.0)])
def test_the_rollout_side_is_the_training_time_at_which_training_starts_to_bind(makespan, k, groups, tail_s):
    """The balance the hybrid pool and the gate weigh: at T = rollout_side_s(M) the step is
    T, a little below it the rollout sets the step. A streamed step's fixed tail
    (``Calibration.stream_tail_s``) weighs on the rollout side; one longer than the pass is
    capped at the pass (the last case)."""
    from libra_hpc.planner.pipeline import pipelined_step_s, rollout_side_s, streamed_tail_s

    t = rollout_side_s(makespan, k, groups, tail_s)
    assert pipelined_step_s(t, makespan, k, groups, tail_s) == pytest.approx(t)
    assert pipelined_step_s(0.95 * t, makespan, k, groups, tail_s) > 0.95 * t
    assert streamed_tail_s(t, groups, tail_s) == (pytest.approx(min(t, t / groups + tail_s)) if groups else t)
    if groups and tail_s:  # the fitted tail makes the rollout side heavier than the share alone
        assert t > rollout_side_s(makespan, k, groups)


def test_the_gate_weighs_a_replan_against_the_pipelines_drain():
    """A re-plan stops the pipeline: the gate counts that drain (at the last measured times)
    with ``reconfig_s``. On a800-swe with a prior far shorter than what is observed, the
    search's plan saves 44 s a step, less than the 164 s drain: kept over a one-step
    horizon; ``planner.price_drain: false`` applies it."""
    import math

    from libra_hpc.planner.control import ControlLoop, length_profile
    from libra_hpc.planner.costs import LengthSample
    from libra_hpc.planner.search import RLBatch, reprice
    from libra_hpc.sim.config import load_sim_config

    gate = {"planner.hybrid_nodes": 0, "planner.every_steps": 1, "planner.confirm_checks": 1, "planner.margin_s": 0,
            "planner.min_dwell_steps": 0, "planner.min_gain": 0, "planner.prior": {"gen_tokens_median": 200, "turns": 2},
            "rl.stream_training": False}  # training whole after the rollout: the drain this test is about
    decided = {}
    for price in (True, False):
        cfg = load_sim_config(Path(__file__).resolve().parent.parent / "configs" / "sim" / "a800-swe.yaml",
                              {**gate, "planner.price_drain": price})
        loop = ControlLoop.from_config(cfg, reconfig_s=0.0)
        loop.initial()
        loop.observe([LengthSample(2000, 8000, 10, 30.0)] * 256)
        o = loop.o
        lengths = length_profile(list(loop.window), o.global_batch)
        now = reprice(loop.plan, loop.model, loop.hw, o.gpus_per_node, lengths, loop.cal,
                      RLBatch(o.global_batch, math.ceil(lengths.mean_seq_tokens)), in_flight=o.max_staleness + 1,
                      length_aware=o.length_aware_routing, migration=o.migration)
        out = loop.after_rollout(1, 0.0, now.t_rollout, now.t_train)  # measured as predicted: scale 1
        gain = loop.considered[-1]["current_objective_s"] - loop.considered[-1]["candidate_objective_s"]
        decided[price] = (out.change is not None, gain, loop.drain_s())
    (kept, gain, drain), (applied, _, free) = decided[True], decided[False]
    assert 0 < gain < drain and free == 0.0, decided
    assert not kept and applied, decided


def test_the_running_plans_scale_is_measured_while_a_replica_is_lent():
    """With a hybrid replica training, the measured times are those of the moved layout:
    they are set against the plan's times moved as the pool moved them, not left at
    (1, 1) (which let rollout run at 0.55-0.6 of its prediction unseen on a800-swe-drift)."""
    from libra_hpc.planner.pipeline import moved_times
    from libra_hpc.planner.valuation import measured_scale

    now = candidate(100.0).plan  # 8 training GPUs (DP 4), 8 TP-1 rollout GPUs, 100 s each side
    assert measured_scale((100.0, 100.0), now) == pytest.approx((1.0, 1.0))
    assert measured_scale((50.0, 120.0), now) == pytest.approx((1.2, 0.5))
    t_train, t_roll = moved_times(100.0, 100.0, 4, 8, 2, 1)  # one replica of 2 GPUs lent: 80 s, 133 s
    assert measured_scale((t_roll, t_train), now, lent=1, replica_size=2) == pytest.approx((1.0, 1.0))
    assert measured_scale((t_roll * 0.5, t_train), now, lent=1, replica_size=2) == pytest.approx((1.0, 0.5))
    assert measured_scale((50.0, 50.0), now, lent=4, replica_size=2) == (1.0, 1.0)  # no rollout left to measure


def test_the_scale_is_not_measured_again_across_a_shift_of_the_lengths():
    """The running plan's measured / predicted scale is taken again only while the mean
    length moved by at most ``scale_shift`` since the last check: across a regime change
    the times measured belong to the old lengths, and the last steady scale to the old
    regime, so plans are valued unscaled until a steady check measures it again."""
    from types import SimpleNamespace

    from libra_hpc.planner.control import ControlLoop

    loop = object.__new__(ControlLoop)
    loop.o, loop.pool, loop.scale, loop.scale_mean = SimpleNamespace(scale_shift=0.2), None, (1.0, 1.0), None
    now = SimpleNamespace(t_train=100.0, t_rollout=200.0)

    def check(mean, makespan, t_train):
        loop.measured = (makespan, t_train)
        loop._rescale(SimpleNamespace(mean_seq_tokens=mean), now, 0)
        return loop.scale

    assert check(1000, 300.0, 150.0) == pytest.approx((1.5, 1.5))  # the first check measures
    assert check(1500, 600.0, 400.0) == pytest.approx((1.0, 1.0))  # +50 %: unscaled, neither measured nor kept
    assert check(1600, 600.0, 400.0) == pytest.approx((4.0, 3.0))  # +6.7 % since the last check: measured
    assert check(1000, 300.0, 150.0) == pytest.approx((1.0, 1.0))  # −37.5 %: unscaled again
    loop.o.scale_shift = None
    assert check(2000, 200.0, 100.0) == pytest.approx((1.0, 1.0))  # null: measured at every check
