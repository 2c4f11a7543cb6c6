"""The simulator's review fixes: batched prefill, the jump-ahead instance against a
step-by-step loop, saturation at the decode knee, cross-bucket stealing, waiting turns in
the queue depth, the identical-plan guard and the hybrid-node re-split."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest

from libra_hpc.planner.costs import RolloutCost
from libra_hpc.planner.profiles import load_hardware, load_model
from libra_hpc.config import SchedulerConfig
from libra_hpc.sim.config import CostSpec, load_sim_config
from libra_hpc.planner.control import resplit_hybrid, same_plan
from libra_hpc.sim.context import Context
from libra_hpc.sim.engine import SimClock
from libra_hpc.sim.instance import ConstantStepModel, CostStepModel, RolloutInstance, Run
from libra_hpc.sim.policies import SETUPS, control_loop
from libra_hpc.sim.rollout import InstanceSpec, RolloutSide
from libra_hpc.envs.synthetic import ToolCall, Trajectory


@pytest.fixture(scope="module")
def tp4():
    model, hw = load_model("qwen3-14b"), load_hardware("a800-80g")
    return CostStepModel(RolloutCost(model, hw, 4))


def test_sequences_joining_together_cost_the_sum_of_their_prefills(tp4):
    alone = tp4.prefill_s(2500)
    together = tp4.prefill_batch_s([2500, 2500])
    assert together == pytest.approx(2 * alone, rel=0.01)
    # Attention is per sequence (tokens²/2): 40 prompts of 2,500 tokens cost 40 prefills
    # (~5.5 s on TP4), not one of 100,000 tokens (~11.9 s).
    assert tp4.prefill_batch_s([2500] * 40) == pytest.approx(40 * alone, rel=0.01)
    assert tp4.prefill_batch_s([2500] * 40) < 0.5 * tp4.prefill_s(100_000)
    # Through an instance: both admitted at once stall it for exactly that batched prefill.
    inst = RolloutInstance(0, 4, tp4, seats=8)
    inst.offer([Run(1, "a", 2500, 10, 2500), Run(2, "b", 2500, 10, 2500)], 0.0)
    inst.wake(*inst.wake_at)
    assert inst.t_sync == pytest.approx(together) and inst.prefill_busy_s == pytest.approx(together)


class _BatchModel:
    """Step time grows with the batch; prefill linear in tokens (hand-checkable)."""

    kv_capacity = 1 << 40

    def step_s(self, batch, context_tokens):
        return 0.01 + 0.002 * batch

    def prefill_s(self, tokens):
        return 0.0005 * tokens

    def prefill_batch_s(self, tokens):
        return 0.0005 * sum(tokens)


def _jump(arrivals, seats, resync):
    """Finish time per arrival index, driving RolloutInstance as the rollout side does."""
    inst = RolloutInstance(0, 1, _BatchModel(), seats=seats, resync_steps=resync)
    order = sorted(range(len(arrivals)), key=lambda i: (arrivals[i][0], i))
    done, k = {}, 0
    while k < len(order) or inst.wake_at is not None:
        nxt = arrivals[order[k]][0] if k < len(order) else float("inf")
        if inst.wake_at is not None and inst.wake_at[0] < nxt:
            time, target = inst.wake_at
            done.update((run.lease, time) for run in inst.wake(time, target))
            continue
        i = order[k]
        k += 1
        t, tokens, prefill = arrivals[i]
        inst.offer([Run(i, str(i), 0, tokens, prefill)], t)
    return done


def _brute(arrivals, seats):
    """The same engine one decode step at a time: arrivals wait for a step boundary, the
    joining ones prefill together (no decode meanwhile), each step emits one token each."""
    m = _BatchModel()
    order = sorted(range(len(arrivals)), key=lambda i: (arrivals[i][0], i))
    t, k, running, waiting, done = 0.0, 0, {}, [], {}
    while k < len(order) or running or waiting:
        while k < len(order) and arrivals[order[k]][0] <= t + 1e-12:
            waiting.append(order[k])
            k += 1
        if not running and not waiting:
            t = arrivals[order[k]][0]
            continue
        joined = []
        while waiting and len(running) < seats:
            i = waiting.pop(0)
            running[i] = arrivals[i][1]
            joined.append(arrivals[i][2])
        if joined:
            t += m.prefill_batch_s(joined)
            continue  # arrivals during the stall join at its end
        t += m.step_s(len(running), 0)
        for i in list(running):
            running[i] -= 1
            if not running[i]:
                done[i] = t
                del running[i]
    return done


def test_jump_ahead_instance_matches_a_step_by_step_loop_on_random_cases():
    rng = random.Random(1)
    for _ in range(200):
        arrivals = [(round(rng.uniform(0, 3), 3), rng.randint(1, 120), rng.randint(0, 50))
                    for _ in range(rng.randint(1, 20))]
        seats, resync = rng.randint(1, 8), rng.choice((1, 7, 256))
        fast, slow = _jump(arrivals, seats, resync), _brute(arrivals, seats)
        assert fast.keys() == slow.keys()
        assert max(abs(fast[i] - slow[i]) for i in slow) < 1e-6, (arrivals, seats, resync)


def _two_buckets(model, seats=1, saturation=1.0):
    """A TP1 instance (top level, limit 100 remaining tokens) and a TP2 one (unbounded)."""
    ended = {}
    sched = SchedulerConfig(bucket_token_limits={1: 100, 2: 1 << 30}, bucket_limits="fixed", saturation=saturation)
    side = RolloutSide({1: model, 2: model}, sched, CostSpec(max_num_seqs=seats), "cmlfq", 0,
                       lambda batch, now: ended.setdefault(batch, now) and None)
    side.configure([InstanceSpec(1, 1), InstanceSpec(2, 2)], 0.0)
    return side, ended


def test_saturation_is_the_decode_knee():
    side, _ = _two_buckets(_BatchModel(), seats=256)
    # Alone: 12 ms. Twice that at 0.01 + 0.002 b >= 0.024: b = 7.
    assert side.saturation == {1: 7, 2: 7}
    side, _ = _two_buckets(_BatchModel(), seats=256, saturation=2.0)
    assert side.saturation == {1: 14, 2: 14}
    flat, _ = _two_buckets(ConstantStepModel(0.01), seats=5)
    assert flat.saturation == {1: 5, 2: 5}  # never slows down: the seats bound it


def test_an_idle_instance_takes_queued_turns_of_a_neighbouring_bucket():
    # New trajectories start on the top level (TP1, one seat). The TP2 instance, idle with
    # nothing queued in its bucket, takes the waiting ones: 3 turns of 100 steps in 2 s, not 3 s.
    batch = [Trajectory(f"t{i}", "p", 0, i, 1, (100,), ()) for i in range(3)]
    side, ended = _two_buckets(ConstantStepModel(0.01), seats=1, saturation=10.0)  # the router never falls back
    clock = SimClock()
    clock.schedule_all(side.submit(0, batch, 0.0))
    clock.run()
    assert side.router.fallbacks == 0
    assert ended[0] == pytest.approx(2.0)
    assert side.counts["steals"] == 1 and side.counts["migrations"] >= 1


def test_queue_depth_counts_turns_waiting_inside_an_instance():
    side, _ = _two_buckets(ConstantStepModel(0.01), seats=1)
    inst = side.instances[1]
    inst.offer([Run(i, f"x{i}", 0, 10, 0) for i in range(3)], 0.0)
    assert side.stats()["queued"] == 3  # all wait: admission happens at the wake-up
    inst.wake(*inst.wake_at)
    assert side.stats()["queued"] == 2 and side.stats()["running"] == 1


def test_prefix_cache_hit_only_where_the_previous_turn_ran():
    call = ToolCall("bash", 0.5, "success", 20)
    batch = [Trajectory("t0", "p", 0, 0, 50, (10, 10), (call,))]
    side, ended = _two_buckets(ConstantStepModel(0.01, prefill_per_token=0.001), seats=4)
    clock = SimClock()
    clock.schedule_all(side.submit(0, batch, 0.0))
    clock.run()
    assert side.counts["later_turns"] == 1 and side.counts["cache_hits"] == 1
    # prompt prefill 0.05 + 10 steps + tool 0.5 + 20-token prefill 0.02 + 10 steps
    assert ended[0] == pytest.approx(0.05 + 0.1 + 0.5 + 0.02 + 0.1)


@pytest.fixture(scope="module")
def swe():
    ctx = Context(load_sim_config("configs/sim/a800-swe.yaml", {"rl.steps": 2}))
    return ctx, control_loop(ctx, SETUPS["libra"])


def test_an_identical_candidate_plan_is_not_applied(swe):
    ctx, control = swe
    plan = control.best_plan(control.prior()).plan
    shuffled = replace(plan, rollout=tuple(reversed(plan.rollout)), objective=plan.objective - 100)
    assert same_plan(plan, shuffled)
    other = replace(plan, train=replace(plan.train, dp=plan.train.dp + 1))
    assert not same_plan(plan, other)


def test_hybrid_node_rollout_is_resplit_when_training_may_bind(swe):
    ctx, control = swe
    plan = control.best_plan(control.prior()).plan
    c = ctx.cfg.cluster
    tp2 = replace(plan, train=replace(plan.train, tp=2, pp=1, dp=plan.train_gpus // 2))
    assert control._allocation(replace(tp2, t_train=1.0, t_rollout=1e4), "test")[2] is None  # rollout-bound: kept
    resplit, layout, pool = control._allocation(replace(tp2, t_train=1e4, t_rollout=1.0), "test")
    assert pool is not None and len(pool.all_replicas()) == 4
    last = c.nodes - 1
    assert all(s.tp == 2 for s in resplit.rollout if s.slots[0].node == last)
    assert all(g.tp == 2 for g in layout.rollout_instances if g.slots[0].node == last)
    assert resplit.rollout_gpus == plan.rollout_gpus == len(layout.slots_of("rollout"))
    assert resplit_hybrid(plan, 8, last) is None  # nothing wider than TP8: unchanged
