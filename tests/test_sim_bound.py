"""The lower bound (libra_hpc/sim/bound.py): its parts against the cost model they bound,
and no policy beating it at any step on any shipped scenario."""

from __future__ import annotations

from pathlib import Path

import pytest

from libra_hpc.sim.bound import DecodeTerms, Floors, kv_read, run_bound, train_floor
from libra_hpc.sim.config import load_sim_config
from libra_hpc.sim.context import Context
from libra_hpc.sim.run import run_scenario
from libra_hpc.sim.training import best_shape, step_s

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def ctx():
    return Context(load_sim_config(ROOT / "configs" / "sim" / "search-agent.yaml",
                                   {"rl.steps": 3, "rl.prompts_per_step": 8}))


def test_decode_terms_rebuild_the_cost_models_step(ctx):
    """``P + c·b + max(M + m·K, f·b + a·K)`` is the decode step of a dense model exactly."""
    for cost in ctx.rollout_costs.values():
        t = DecodeTerms.of(cost)
        for b, k in ((1, 500), (64, 64 * 3000), (256, 256 * 12000)):
            mine = t.per_step + t.per_seq * b + max(t.weights + t.per_kv_mem * k, t.per_seq_flops * b + t.per_kv_flops * k)
            assert mine == pytest.approx(cost.decode_step_s(b, k), rel=1e-9)


def test_decode_floor_is_below_any_schedule_of_the_tokens(ctx):
    """Tokens decoded in full steps of any TP size, each reading its context: no cheaper
    than the floor; a batch of one costs more than the floor."""
    f = Floors(ctx)
    seats = ctx.cfg.costs.max_num_seqs
    for cost in ctx.rollout_costs.values():
        for b, context in ((seats, 2000), (seats // 4, 8000), (1, 300)):
            steps = 100
            gpu_s = cost.tp * steps * cost.decode_step_s(b, b * context)
            assert f.decode_gpu_s(steps * b, steps * b * context) <= gpu_s * (1 + 1e-9)
    assert f.decode_gpu_s(1000, 1000 * 2000) < min(c.tp * 1000 * c.decode_step_s(1, 2000)
                                                  for c in ctx.rollout_costs.values())


def test_kv_read_counts_each_tokens_context_less_the_pricing_slack():
    assert kv_read(1000, 4, 0) == 1000 + 1001 + 1002 + 1003
    assert kv_read(1000, 4, 384) == 616 + 617 + 618 + 619
    assert kv_read(100, 300, 384) == sum(max(0, 100 + i - 384) for i in range(300))
    assert kv_read(0, 10, 384) == 0


def test_training_floor_is_below_every_shape_on_any_gpu_count(ctx):
    cfg = ctx.cfg
    gpu_s, wall = train_floor(ctx.model, ctx.hw, ctx.cal, cfg.batch_size, 6000, ctx.gpus)
    for n in range(1, ctx.gpus + 1):
        shape = best_shape(ctx.model, ctx.hw, n, cfg.batch_size, 6000, ctx.cal)
        if shape is not None:
            t = step_s(ctx.model, ctx.hw, shape, 6000, ctx.cal)
            assert gpu_s <= n * t * (1 + 1e-9) and wall <= t * (1 + 1e-9)


def test_the_bound_is_cumulative_and_each_floor_grows(ctx):
    b = run_bound(ctx)
    cum = b["cumulative_s"]
    assert len(cum) == ctx.cfg.rl.steps and all(x < y for x, y in zip(cum, cum[1:]))
    assert b["bound_s"] == cum[-1] == max(b["work_s"], b["chain_s"])
    for r in b["steps"]:
        assert r["cumulative_s"] == max(r["work_s"], r["chain_s"])
        assert 0 < r["chain_floor_s"] <= r["critical_path_s"] * (1 + 1e-9)


SCENARIOS = sorted(p.stem for p in (ROOT / "configs" / "sim").glob("*.yaml") if p.stem != "scale-4096")
SHORT = {"rl.steps": 3, "search.top_plans": 2, "search.phase_window": 2, "search.sample_steps": 1}


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_no_policy_completes_steps_before_the_bound(scenario, seed):
    """Every policy of every shipped scenario (scale-4096 aside: 4096 GPUs), 3 steps of a
    smaller batch, two seeds: for every k, steps 0..k end no earlier than the bound's
    cumulative time; and the bound is not trivially loose (Libra within 4× of it)."""
    cfg = load_sim_config(ROOT / "configs" / "sim" / f"{scenario}.yaml", {**SHORT, "rl.seed": seed})
    small = min(cfg.rl.prompts_per_step, 8)
    cfg = load_sim_config(ROOT / "configs" / "sim" / f"{scenario}.yaml",
                          {**SHORT, "rl.seed": seed, "rl.prompts_per_step": small})
    result = run_scenario(cfg)
    assert result.bound_violations() == {n: [] for n in result.runs}
    assert 0.25 < result.vs_bound("libra") <= 1.0


@pytest.mark.parametrize("scenario, extra", [("search-agent", {"rl.partial_rollout": True, "rl.max_staleness": 2}),
                                             ("a800-swe", {"rl.stream_training": True})])
def test_no_policy_beats_the_bound_with_partial_rollout_or_streamed_training(scenario, extra):
    """The bound's other two paths: partial rollout (chains per trained segment, the
    cheapest trajectories a step may train) and streamed training (nothing after the rollout)."""
    cfg = load_sim_config(ROOT / "configs" / "sim" / f"{scenario}.yaml", {**SHORT, "rl.prompts_per_step": 8, **extra})
    result = run_scenario(cfg)
    assert result.bound_violations() == {n: [] for n in result.runs}
