"""The rollout side through the real queue service, and the RL pipeline's steady state,
on cases computed by hand (fixed step times injected; the cost models are tested in
tests/test_planner_costs.py)."""

from __future__ import annotations

import statistics

import pytest

from libra_hpc.planner.costs import TrainShape
from libra_hpc.config import SchedulerConfig
from libra_hpc.sim.config import CostSpec, validate_sim_config
from libra_hpc.cluster.layout import Group, Layout, Slot
from libra_hpc.sim.context import Context
from libra_hpc.sim.controller import PolicyRun
from libra_hpc.sim.engine import SimClock
from libra_hpc.sim.instance import ConstantStepModel
from libra_hpc.sim.policies import SETUPS
from libra_hpc.sim.rollout import InstanceSpec, RolloutSide, share_limits
from libra_hpc.sim.trace import write_trace
from libra_hpc.envs.synthetic import ToolCall, Trajectory

SCHED = SchedulerConfig(bucket_token_limits={1: 1 << 30}, bucket_limits="fixed")


def rollout(trajectories, model, seats=256, policy="cmlfq"):
    """Roll one batch out on one TP1 instance; returns (batch end time, side)."""
    ended = {}
    side = RolloutSide({1: model}, SCHED, CostSpec(max_num_seqs=seats), policy, 0,
                       lambda batch, now: ended.setdefault(batch, now) and None)
    side.configure([InstanceSpec(1, 1)], 0.0)
    clock = SimClock()
    clock.schedule_all(side.submit(0, trajectories, 0.0))
    clock.run()
    return ended[0], side


def test_a_tool_call_holds_the_trajectory_and_its_outcome_reaches_the_scheduler():
    # Turn 1: 10 steps of 10 ms; the tool fails after 1 s; turn 2 prefills only the 50
    # output tokens (same instance, prefix cached) at 1 ms/token, then 10 steps: 1.25 s.
    t = Trajectory("t0", "p0", 0, 0, 100, (10, 10), (ToolCall("bash", 1.0, "failure", 50),))
    end, side = rollout([t], ConstantStepModel(0.01, prefill_per_token=0.001))
    assert end == pytest.approx(0.1 + 0.1 + 1.0 + 0.05 + 0.1)  # first turn prefills the 100-token prompt
    (done,) = side.service.drain_finished()
    assert done.turn_tokens == (10, 10) and [s.status for s in done.states] == ["failure"]
    assert side.gen_tokens == 20 and side.counts["tool_calls"] == 1


def test_a_replan_from_the_batch_end_callback_leaves_the_waking_instance_alone():
    """The controller applies a waiting plan when the last trajectory of a batch ends, which
    happens inside that instance's wake event: the event must not touch the instance (or
    the layout's per-instance state) once the layout has changed under it."""
    model = ConstantStepModel(0.01)
    sides = []

    def replan(batch, now):
        sides[0].configure([InstanceSpec(7, 1)], now)  # instance 1 leaves the layout

    side = RolloutSide({1: model}, SCHED, CostSpec(max_num_seqs=4), "cmlfq", 0, replan)
    sides.append(side)
    side.configure([InstanceSpec(1, 1)], 0.0)
    clock = SimClock()
    clock.schedule_all(side.submit(0, [Trajectory("t0", "p", 0, 0, 1, (10,), ())], 0.0))
    clock.run()
    assert list(side.instances) == [7] and side.service.stats()["completed"] == 0  # a fresh service
    clock.schedule_all(side.submit(1, [Trajectory("t1", "p", 1, 0, 1, (5,), ())], clock.now))
    clock.run()
    assert side.gen_tokens == 15


def test_one_instance_batch_makespan_with_limited_seats():
    # 4 single-turn trajectories of 10/20/30/40 tokens, 2 seats, 10 ms steps:
    # 10 and 20 run; 30 joins at 0.1 (ends step 40), 40 joins at 0.2 (ends step 60) → 0.6 s.
    batch = [Trajectory(f"t{n}", "p", 0, i, 1, (n,), ()) for i, n in enumerate((10, 20, 30, 40))]
    end, side = rollout(batch, ConstantStepModel(0.01), seats=2)
    assert end == pytest.approx(0.6)
    assert side.service.stats()["completed"] == 4


def test_share_limits_follow_gpu_shares_of_the_token_mass():
    layout = (InstanceSpec(1, 1), InstanceSpec(2, 1), InstanceSpec(3, 2))  # TP1: 2 GPUs, TP2: 2 GPUs
    # First turns (1+1+1) run on the top level. Later turns, as (remaining, tokens decoded):
    # (6, 4), (2, 2) | (3, 3) | (9, 9): sorted by remaining, the top level's mass reaches
    # half of 21 (TP1 holds half the GPUs) at remaining 6 -> 3 + 2 + 3 + 4 = 12.
    assert share_limits(layout, [(1, 4, 2), (1, 3), (1, 9)]) == {1: 6, 2: 1 << 30}
    # First turns already fill the top level's share: only the shortest remaining joins it.
    assert share_limits(layout, [(100, 1), (1, 2), (1, 3)]) == {1: 1, 2: 1 << 30}


@pytest.fixture
def pipeline_ctx(tmp_path):
    """Each step: 4 single-turn trajectories of 100 tokens; one TP1 instance of 10 ms steps
    and no prefill, so a batch rolls out in exactly M = 1.0 s."""
    trajectories = [Trajectory(f"s{s}/p{i}/0", f"p{i}", s, 0, 10, (100,), ()) for s in range(12) for i in range(4)]
    write_trace(tmp_path / "trace.jsonl", trajectories)

    def make(staleness, switch=0.4):
        cfg = validate_sim_config({
            "name": "pipeline", "trace": str(tmp_path / "trace.jsonl"),
            "cluster": {"nodes": 2, "gpus_per_node": 8, "hardware": "a800-80g"}, "model": {"name": "qwen3-14b"},
            "training": {"seq_len": 4096}, "planner": {"min_rollout_gpus": 8},
            "rl": {"steps": 12, "prompts_per_step": 4, "group_size": 1, "max_staleness": staleness},
            "costs": {"weight_sync_s": 0.0, "colocate_switch_s": switch},
            "scheduler": {"bucket_token_limits": {1: 1 << 30}, "bucket_limits": "fixed"}})
        ctx = Context(cfg)
        ctx.step_models = {1: ConstantStepModel(0.01)}
        return ctx
    return make


def steady_step(ctx, policy, train_s, colocated=False):
    layout = Layout(1, 1, (Group(1, "rollout", (Slot(0, 0),), 1),))  # one TP1 instance (training beside or on it)
    rec = PolicyRun(ctx, SETUPS[policy], layout, TrainShape(1, 1, 1, 1, 4, 128), 12,
                    train_time=lambda shape, tokens: train_s, colocated=colocated).run()
    assert [r["rollout_s"] for r in rec.rows][:1] == pytest.approx([1.0])
    return statistics.fmean(r["step_s"] for r in rec.rows[4:])


@pytest.mark.parametrize("train_s, expected", [(0.5, 0.75), (3.0, 3.0)])
def test_async_steady_state_is_max_of_training_and_half_the_cycle(pipeline_ctx, train_s, expected):
    # Staleness 1: step s ends at max(end(s-2) + M, end(s-1)) + T, i.e. max(T, (M + T) / 2).
    assert steady_step(pipeline_ctx(1), "static_hindsight", train_s) == pytest.approx(expected)


def test_zero_staleness_serialises_and_colocated_adds_the_switch(pipeline_ctx):
    assert steady_step(pipeline_ctx(0), "static_hindsight", 0.5) == pytest.approx(1.5)
    assert steady_step(pipeline_ctx(1, switch=0.4), "colocated", 0.5, colocated=True) == pytest.approx(1.9)


def test_hybrid_replica_is_lent_when_training_is_the_bottleneck(tmp_path):
    """Node 0 trains (TP8), nodes 1-2 roll out (one TP8 instance each), node 2 is the
    hybrid pool. Training takes 3 s per DP replica's share (3 s at DP1, 1.5 s at DP2),
    rollout 1 s: training is the bottleneck, so the pool lends node 2 (drain, fetch,
    zero-gradient step) and the step drops from 3 s to 1.5 s."""
    from libra_hpc.sim.context import instances_of
    from libra_hpc.sim.policies import control_loop
    from sim_cases import hybrid_case

    ctx, plan = hybrid_case(tmp_path)
    shape = plan.train
    control = control_loop(ctx, SETUPS["libra_no_replan"])
    first = control.start(plan, "test plan")
    assert first.pool is not None and [s.replica for s in instances_of(first.layout, first.pool)] == [None, 0]
    run = PolicyRun(ctx, SETUPS["libra_no_replan"], first.layout, shape, 14, control,
                    train_time=lambda s, tokens: 3.0 / s.dp)
    rec = run.run()
    moves = [(e["from_state"], e["to_state"]) for e in rec.events if e["kind"] == "hybrid_transition"]
    assert moves[:4] == [("rollout", "requested"), ("requested", "fetching_state"),
                         ("fetching_state", "zero_grad_sync"), ("zero_grad_sync", "active")]
    assert rec.rows[0]["train_gpus"] == 8 and rec.rows[-1]["train_gpus"] == 16
    assert rec.rows[-1]["rollout_gpus"] == 8
    assert statistics.fmean(r["step_s"] for r in rec.rows[-4:]) == pytest.approx(1.5)


@pytest.fixture
def spread_ctx(tmp_path):
    """Each step: 4 single-trajectory groups of 25, 50, 75 and 100 tokens on one TP1
    instance of 10 ms steps: they finish 0.25, 0.5, 0.75 and 1.0 s after the batch starts."""
    trajectories = [Trajectory(f"s{s}/p{i}/0", f"p{i}", s, 0, 10, (25 * (i + 1),), ())
                    for s in range(12) for i in range(4)]
    write_trace(tmp_path / "trace.jsonl", trajectories)

    def make(stream):
        cfg = validate_sim_config({
            "name": "stream", "trace": str(tmp_path / "trace.jsonl"),
            "cluster": {"nodes": 2, "gpus_per_node": 8, "hardware": "a800-80g"}, "model": {"name": "qwen3-14b"},
            "training": {"seq_len": 4096}, "planner": {"min_rollout_gpus": 8},
            "rl": {"steps": 12, "prompts_per_step": 4, "group_size": 1, "max_staleness": 1,
                   "stream_training": stream},
            "costs": {"weight_sync_s": 0.0},
            "scheduler": {"bucket_token_limits": {1: 1 << 30}, "bucket_limits": "fixed"}})
        ctx = Context(cfg)
        ctx.step_models = {1: ConstantStepModel(0.01)}
        return ctx
    return make


@pytest.mark.parametrize("train_s", [0.5, 0.9, 3.0])
def test_streamed_training_leaves_only_the_last_groups_share_after_the_rollout(spread_ctx, train_s):
    """rl.stream_training: the trainers work through each group as it finishes (after the
    previous step), so a step takes max(T, (M + T / G) / (k + 1)), the planner's
    pipelined_step_s with stream_groups G; without it max(T, (M + T) / (k + 1))."""
    from libra_hpc.planner.control import pipelined_step_s

    streamed = steady_step(spread_ctx(True), "static_hindsight", train_s)
    whole = steady_step(spread_ctx(False), "static_hindsight", train_s)
    assert whole == pytest.approx(pipelined_step_s(train_s, 1.0, 1))
    assert streamed == pytest.approx(pipelined_step_s(train_s, 1.0, 1, stream_groups=4), rel=0.01)  # 10 ms steps
    assert streamed < whole or train_s >= 1.0  # training-bound: nothing to hide
