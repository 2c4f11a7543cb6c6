"""C-MLFQ's migrations in the plan valuation (libra_hpc/planner/migration.py and
``rollout_makespan(migration=...)``): the moves a trajectory makes as its remaining tokens
cross the buckets' limits, their re-prefill priced on the destination, no change for one
pool or length-aware routing, the share limits the simulator uses, and a plan search that
the pricing turns from a mixed layout to a homogeneous one."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest

from libra_hpc.planner.costs import LengthProfile, LengthSample, RolloutCost, rollout_makespan
from libra_hpc.planner.migration import UNBOUNDED, MigrationPricing, crossings, share_limits
from libra_hpc.planner.profiles import load_hardware, load_model
from libra_hpc.planner.search import PlannerOptions, RLBatch, plan

Q14 = load_model("qwen3-14b")
A800 = load_hardware("a800-80g")
COST = {tp: RolloutCost(Q14, A800, tp) for tp in (2, 4, 8)}
FIXED = MigrationPricing(((4, 6000), (8, UNBOUNDED)))
REPO = Path(__file__).resolve().parent.parent


def one_bucket(prompt: float, gen: float, turns: int, count: int, tool_tokens: float = 0.0) -> LengthProfile:
    """``count`` identical trajectories (no tool time), as one bucket."""
    x = LengthSample(prompt, gen, turns, 0.0, tool_tokens)
    return LengthProfile(prompt=(prompt,), gen=(gen,), tool_s=(0.0,), count=(count,), extremes=(x,),
                         mean_seq_tokens=prompt + gen, mean_context=x.decode_context, max_seq_tokens=prompt + gen,
                         context=(x.decode_context,), turns=(float(turns),))


# ---------------------------------------------------------------------------- crossings


def test_a_trajectory_moves_up_when_its_remaining_tokens_pass_a_limit_and_back_down():
    # 3 turns of 4000 tokens: first turn on TP4 (the top level); after the first tool return
    # 8000 remain (> 6000: TP8), after the second 4000 (TP4 again). Each move re-prefills the
    # first prompt, the turns generated and the tool outputs returned so far.
    assert crossings(FIXED.limits, 1000, 12000, 3) == [(8, 1000 + 4000), (4, 1000 + 8000)]
    # 600 tool tokens over 2 tool returns (300 each), part of the 1600-token prompt
    assert crossings(FIXED.limits, 1600, 12000, 3, tool_tokens=600) == [(8, 1000 + 4300), (4, 1000 + 8600)]


def test_no_move_below_the_first_limit_one_turn_or_one_bucket():
    assert crossings(FIXED.limits, 1000, 5000, 4) == []  # never more than 6000 remain after a tool return
    assert crossings(FIXED.limits, 1000, 50000, 1) == []  # no tool return, no decision
    assert crossings(((8, UNBOUNDED),), 1000, 50000, 8) == []


def test_a_long_trajectory_stays_on_the_large_bucket_until_its_remainder_fits_the_small_one():
    # 5 turns of 3000: 12000, 9000, 6000, 3000 remain after the returns: up after the first,
    # down after the third (6000 fits the limit), with 9000 tokens of context
    assert crossings(FIXED.limits, 0, 15000, 5) == [(8, 3000), (4, 9000)]


def test_share_limits_place_the_cut_at_the_gpu_share_of_decoded_tokens():
    # first turns 100 tokens (on the top level), later turns (remaining, decoded): equal GPUs →
    # half of the 400 decoded tokens is reached with the turns that have 100 left; a quarter
    # of the GPUs on TP4: the first turns alone fill it (the limit stays above 0)
    samples = [(500, 100), (300, 100), (100, 100)]
    assert share_limits({4: 8, 8: 8}, 100, samples) == {4: 100, 8: UNBOUNDED}
    assert share_limits({4: 8, 8: 24}, 100, samples) == {4: 100, 8: UNBOUNDED}
    assert share_limits({4: 24, 8: 8}, 100, samples) == {4: 300, 8: UNBOUNDED}


def test_the_simulators_share_limits_are_the_planners():
    from libra_hpc.sim.rollout import InstanceSpec
    from libra_hpc.sim.rollout import share_limits as sim_share_limits

    rng = random.Random(1)
    turns = [tuple(rng.randint(10, 3000) for _ in range(rng.randint(1, 6))) for _ in range(200)]
    layout = (InstanceSpec(0, 8), InstanceSpec(1, 4), InstanceSpec(2, 4), InstanceSpec(3, 2))
    first = sum(t[0] for t in turns)
    samples = [(sum(t[d:]), t[d]) for t in turns for d in range(1, len(t))]
    assert sim_share_limits(layout, turns) == share_limits({8: 8, 4: 8, 2: 2}, first, samples)


def test_buckets_of_a_plan_are_the_limits_of_the_tp_sizes_present_the_last_unbounded():
    pricing = MigrationPricing(((1, 1024), (2, 4096), (4, 16384), (8, UNBOUNDED)))
    assert pricing.buckets({2: 8, 4: 8}, (), (), (), ()) == ((2, 4096), (4, UNBOUNDED))
    assert pricing.buckets({8: 32}, (), (), (), ()) == ((8, UNBOUNDED),)
    # share: 10 trajectories of 4 turns × 1000; TP4 holds a quarter of the GPUs
    shared = MigrationPricing(pricing.limits, share=True).buckets({4: 8, 8: 24}, (0,), (4000,), (4,), (10,))
    assert shared[-1] == (8, UNBOUNDED) and 0 < shared[0][1] < 4000


# ---------------------------------------------------------------------------- makespan


def test_a_mixed_layout_pays_the_reprefill_of_each_crossing_on_its_destination():
    lp = one_bucket(1000, 12000, 3, count=2)  # one trajectory per pool under the blind spread
    pools = [(COST[8], 1), (COST[4], 1)]
    blind = rollout_makespan(pools, lp, tail_aware=False)
    priced = rollout_makespan(pools, lp, tail_aware=False, migration=FIXED)
    reprefill = COST[8].prefill_s(5000) + COST[4].prefill_s(9000)  # up to TP8, back to TP4
    assert priced.makespan_s - blind.makespan_s == pytest.approx(reprefill)
    assert priced.migrations == 4 and priced.migration_s == pytest.approx(2 * reprefill)
    assert blind.migrations == 0 and blind.migration_s == 0


def test_the_loaded_model_prices_the_moves_too():
    rng = random.Random(0)
    samples = [LengthSample(4000 * rng.uniform(0.8, 1.2), 12000 * rng.uniform(0.3, 2), 3, 6.0) for _ in range(256)]
    lp = LengthProfile.from_samples(samples, 256, buckets=8)
    pools = [(COST[8], 2), (COST[4], 2)]
    blind = rollout_makespan(pools, lp, in_flight=2)
    priced = rollout_makespan(pools, lp, in_flight=2, migration=FIXED)
    assert priced.makespan_s > blind.makespan_s
    assert priced.migrations > 0 and priced.pools == blind.pools


def test_one_pool_or_length_aware_routing_prices_no_move():
    lp = one_bucket(1000, 12000, 3, count=64)
    for pools, aware in (([(COST[8], 2)], False), ([(COST[8], 1), (COST[4], 2)], True)):
        assert rollout_makespan(pools, lp, in_flight=2, length_aware=aware, migration=FIXED) == \
            rollout_makespan(pools, lp, in_flight=2, length_aware=aware)


def test_the_pricing_turns_the_plan_search_from_a_mixed_layout_to_a_homogeneous_one():
    # 4 training GPUs (TP4), 12 rollout GPUs: 1×TP8 + 1×TP4 or 3×TP4. Long 3-turn
    # trajectories whose remainder crosses the TP4 limit: blind to moves, the mixed layout
    # looks faster; priced, the homogeneous one is.
    rng = random.Random(0)
    samples = [LengthSample(4000 * rng.uniform(0.8, 1.2), 12000 * rng.uniform(0.3, 2), 3, 6.0) for _ in range(256)]
    lp = LengthProfile.from_samples(samples, 256, buckets=8)
    base = PlannerOptions(rollout_tps=(8, 4), train_tps=(4,), max_pp=1, micro_batches=(1,), min_rollout_gpus=12,
                          in_flight=2)
    pricing = MigrationPricing(((4, 2000), (8, UNBOUNDED)))
    batch = RLBatch(256, 4096)
    blind = plan(Q14, A800, 2, 8, lp, batch, mode="async", options=base).plan
    priced = plan(Q14, A800, 2, 8, lp, batch, mode="async",
                  options=replace(base, migration=pricing)).plan
    assert blind.rollout_counts == {8: 1, 4: 1}
    assert priced.rollout_counts == {4: 3}


# ---------------------------------------------------------------------------- options


def test_the_options_price_cmlfq_only_and_follow_the_config():
    from libra_hpc.planner.options import ControlOptions, migration_pricing
    from libra_hpc.sim.config import load_sim_config

    cfg = load_sim_config(REPO / "configs/sim/a800-swe-drift.yaml")
    options = ControlOptions.from_config(cfg, (8, 4, 2))
    assert options.migration == MigrationPricing(tuple(sorted(cfg.scheduler.bucket_token_limits.items())), share=True)
    assert migration_pricing(cfg, "least_load") is None and migration_pricing(cfg, "oracle") is None
    assert migration_pricing(cfg, "cmlfq", share=False).share is False
    off = load_sim_config(REPO / "configs/sim/a800-swe-drift.yaml", {"planner": {"price_migrations": False}})
    assert ControlOptions.from_config(off, (8, 4, 2)).migration is None
