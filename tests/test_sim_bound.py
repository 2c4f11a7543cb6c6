"""The physical bound's parts, each against a hand computation on one instance shape."""

from __future__ import annotations

from pathlib import Path

import pytest

from libra_hpc.sim.bound import decode_gpu_s_per_token, prefill_gpu_s, step_bound
from libra_hpc.sim.config import load_sim_config
from libra_hpc.sim.context import Context, critical_path_s

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ctx():
    return Context(load_sim_config(ROOT / "configs" / "sim" / "search-agent.yaml",
                                   {"rl.steps": 2, "rl.prompts_per_step": 8}))


def test_decode_cost_is_the_cheapest_full_instance(ctx):
    per_token, tp = decode_gpu_s_per_token(ctx, 4000, 2500)
    for t, cost in ctx.rollout_costs.items():
        b = cost.concurrency(4000)
        assert per_token <= t * cost.decode_step_s(b, b * 2500) / b + 1e-15
        # fuller instances are cheaper per token: a batch of one costs more
        assert per_token < t * cost.decode_step_s(1, 2500)
    assert tp in ctx.rollout_costs


def test_longer_contexts_cost_more_per_decoded_token(ctx):
    assert decode_gpu_s_per_token(ctx, 16000, 12000)[0] > decode_gpu_s_per_token(ctx, 2000, 1000)[0]


def test_prefill_floor_is_below_every_instance_prefill(ctx):
    for t, cost in ctx.rollout_costs.items():
        assert prefill_gpu_s(ctx, 3000) <= t * cost.prefill_s(3000)
    assert prefill_gpu_s(ctx, 6000) > prefill_gpu_s(ctx, 3000)


def test_step_bound_sums_its_parts(ctx):
    b = step_bound(ctx, 0)
    batch = ctx.batch(0)
    assert b.critical_path_s == critical_path_s(ctx, batch)
    assert b.chain_s == pytest.approx(b.critical_path_s / (ctx.cfg.rl.max_staleness + 1))
    assert b.work_s == pytest.approx((b.rollout_gpu_s + b.train_gpu_s) / ctx.gpus)
    gen = sum(t.gen_tokens for t in batch)
    # every token decoded at the cheapest rate of all (no context, a full instance) is less
    assert b.rollout_gpu_s > gen * decode_gpu_s_per_token(ctx, 1, 0)[0]
    assert b.train_gpu_s > 0
    assert b.floor_s == max(b.work_s, b.chain_s)
