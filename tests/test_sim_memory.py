"""Context growth without running out of memory: plans fit the lengths the batch can reach
(``planner.memory_headroom``), a running shape that no longer would is replaced at once,
and a fixed policy whose shape overflows is reported with its out-of-memory step instead of
crashing the comparison."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from libra_hpc.planner.costs import LengthProfile, LengthSample
from libra_hpc.planner.profiles import load_hardware, load_model
from libra_hpc.planner.search import PlannerOptions, RLBatch, fitting_training_cost, plan
from libra_hpc.sim.config import load_sim_config
from libra_hpc.sim.report import table
from libra_hpc.sim.run import run_scenario

ROOT = Path(__file__).resolve().parents[1]
GROWTH = ROOT / "configs" / "sim" / "context-growth.yaml"


def test_a_plan_fits_the_length_the_batch_can_reach():
    """fit_seq_len: every training shape of the plan also runs sequences that long."""
    q14, a800 = load_model("qwen3-14b"), load_hardware("a800-80g")
    lengths = LengthProfile.from_samples([LengthSample(4000, 4000, 4, 10.0)] * 64, 128)
    batch = RLBatch(128, 8000)
    loose = plan(q14, a800, 2, 8, lengths, batch).plan
    safe = plan(q14, a800, 2, 8, lengths, batch, options=PlannerOptions(fit_seq_len=60000)).plan
    assert not fitting_training_cost(q14, a800, replace(safe.train, seq_len=60000)).infeasible
    assert fitting_training_cost(q14, a800, replace(loose.train, seq_len=60000)).infeasible
    assert safe.train.recompute  # it needs recomputation at that length, and is priced with it


@pytest.fixture(scope="module")
def growth():
    cfg = load_sim_config(GROWTH)  # 60 steps: the searched static split overflows at step 50
    return cfg, run_scenario(cfg, ["async_static", "libra"])


def test_libra_moves_to_a_shape_that_fits_before_it_would_run_out_of_memory(growth):
    cfg, result = growth
    libra = result.runs["libra"]
    assert libra.summary["steps"] == cfg.rl.steps and not result.oom("libra")
    memory = [e for e in libra.events if e.get("trigger") == "memory"]
    assert memory and all(e["apply"] for e in memory)
    assert "cannot run sequences of" in memory[0]["reason"] and "GB per GPU" in memory[0]["reason"]


def test_a_fixed_policy_that_overflows_is_reported_with_its_step_not_raised(growth):
    cfg, result = growth
    oom = result.oom("async_static")
    assert oom is not None and 0 < oom["step"] < cfg.rl.steps
    assert oom["shape"].startswith("TP") and oom["seq_tokens"] > 0 and "GB per GPU" in oom["why"]
    assert result.runs["async_static"].summary["steps"] == oom["step"]  # every step before it ran
    assert result.ratio("libra", "async_static") is None and result.vs_bound("async_static") is None
    assert any(f"out of memory at step {oom['step']}" in line for line in table(result))
