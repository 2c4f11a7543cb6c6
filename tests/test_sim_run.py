"""A whole small scenario: every policy runs, the comparison is reproducible from the seed,
and the output folder has the report, the JSONL and the plots."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from libra_hpc.sim.config import POLICIES, load_sim_config
from libra_hpc.sim.policies import PolicySetup
from libra_hpc.sim.report import tail_ratio, write_outputs
from libra_hpc.sim.run import run_scenario

ROOT = Path(__file__).resolve().parents[1]
FIXED_LEAST_LOAD = PolicySetup("fixed_least_load", "async", "least_load", start="hindsight")
"""A fixed split routed least-load: the rollout model's tests run homogeneous instances."""
SMALL = {"rl.steps": 6, "rl.prompts_per_step": 6, "rl.group_size": 4, "cluster.nodes": 3,
         "planner.every_steps": 2, "planner.min_dwell_steps": 0, "planner.confirm_checks": 1,
         "search.sample_steps": 2}


@pytest.fixture(scope="module")
def small():
    cfg = load_sim_config(ROOT / "configs" / "sim" / "a800-swe.yaml", SMALL)
    return cfg, run_scenario(cfg)


def test_every_policy_completes_every_step(small):
    cfg, result = small
    assert list(result.runs) == [p for p in POLICIES if p != "libra_known_start"]  # run only when named
    for name, rec in result.runs.items():
        assert [r["step"] for r in rec.rows] == list(range(cfg.rl.steps)), name
        assert all(r["gen_tokens"] > 0 and r["step_s"] > 0 for r in rec.rows)
        assert rec.summary["tokens_per_s"] > 0
        rows = rec.rows
        assert rec.summary["sim_time_s"] == pytest.approx(rows[-1]["t_end"])


def test_same_seed_same_numbers_other_seed_other_numbers(small):
    cfg, result = small
    again = run_scenario(cfg, ["libra", "async_static"])
    for name in again.runs:
        a, b = result.runs[name].summary, again.runs[name].summary
        assert {k: v for k, v in a.items() if k != "wall_s"} == {k: v for k, v in b.items() if k != "wall_s"}
    other = run_scenario(load_sim_config(ROOT / "configs" / "sim" / "a800-swe.yaml", {**SMALL, "rl.seed": 1}),
                         ["libra"])
    assert other.runs["libra"].summary["tokens_per_s"] != result.runs["libra"].summary["tokens_per_s"]


def test_outputs(small, tmp_path):
    _, result = small
    report = write_outputs(result, tmp_path)
    text = report.read_text()
    assert "| libra |" in text and "## Assumptions" in text and "libra_vs_colocated" in text
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert set(summary["ratios"]) == {"libra_vs_colocated", "libra_vs_static_hindsight", "libra_vs_static_pilot",
                                      "libra_vs_phase_static", "phase_gain", "libra_vs_phase_static_late",
                                      "phase_late_share", "libra_vs_true_lengths", "known_start_vs_static_hindsight",
                                      "true_lengths_used", "libra_vs_bound", "libra_predicted_over_simulated",
                                      "static_pilot_failed_steps", "bound_violations"}
    assert "## Lower bound" in text and "| *bound* |" in text and summary["bound_violations"]
    assert len((tmp_path / "metrics-libra.jsonl").read_text().splitlines()) == 6
    for png in ("allocation.png", "throughput.png", "step_cdf.png"):
        assert (tmp_path / png).stat().st_size > 1000


def test_the_simulator_imports_neither_mpi_nor_torch():
    import subprocess
    import sys
    code = ("import sys, libra_hpc.sim.__main__, libra_hpc.sim.report; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'mpi4py', 'matplotlib'}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_no_policy_beats_the_bound(small):
    """The bound is a floor at every step: every policy's time to finish steps 0..k is at
    least the bound's cumulative time there, and it is the larger of its two floors."""
    cfg, result = small
    b = result.bound
    assert len(b["steps"]) == len(b["cumulative_s"]) == cfg.rl.steps
    assert b["bound_s"] == b["cumulative_s"][-1] == max(b["work_s"], b["chain_s"]) > 0
    assert result.bound_violations() == {name: [] for name in result.runs}
    for name, rec in result.runs.items():
        assert 0 < result.vs_bound(name) <= 1.0, name
        # no batch's rollout beats its critical path (whole trajectories: the default)
        assert tail_ratio(result, name) >= 1.0 - 1e-9, name


def test_the_rollout_model_prices_the_tail_under_load_like_the_simulator():
    """The planner's rollout makespan (the longest chain at the decode step time of the
    load beside it, the next batch included) against the simulated makespans of the same
    batches on the same instances: the mean within 20% on two workloads, where pricing
    every trajectory at the full instance batch (tail_aware=False) misses the simulation
    by more on one of them."""
    from libra_hpc.planner.costs import LengthProfile, rollout_makespan
    from libra_hpc.sim.context import Context, samples_of
    from libra_hpc.sim.controller import PolicyRun

    worse = 0
    for scenario, tp, n in (("a800-swe", 8, 2), ("math-code", 8, 2)):
        cfg = load_sim_config(ROOT / "configs" / "sim" / f"{scenario}.yaml", {"rl.steps": 6})
        ctx = Context(cfg)
        g = cfg.cluster.gpus_per_node
        train = 8 if scenario == "math-code" else 32
        from libra_hpc.sim.training import best_shape
        shape = best_shape(ctx.model, ctx.hw, train, cfg.batch_size, 8192, ctx.cal)
        layout = ctx.static_layout(shape, tp)
        layout = layout.__class__(layout.nodes, g, layout.groups[: 1 + n], reason="test")
        rec = PolicyRun(ctx, FIXED_LEAST_LOAD, layout, shape, cfg.rl.steps).run()
        sim = sum(r["rollout_s"] for r in rec.rows) / len(rec.rows)
        pools = [(ctx.rollout_costs[tp], n)]
        lps = [LengthProfile.from_samples(samples_of(ctx.batch(j)), cfg.batch_size) for j in range(cfg.rl.steps)]
        model = sum(rollout_makespan(pools, lp, in_flight=cfg.rl.max_staleness + 1).makespan_s for lp in lps) / len(lps)
        fixed = sum(rollout_makespan(pools, lp, tail_aware=False).makespan_s for lp in lps) / len(lps)
        assert model == pytest.approx(sim, rel=0.2), (scenario, model, sim)
        worse += abs(fixed - sim) > abs(model - sim)
    assert worse >= 1


def test_the_rollout_model_counts_tool_outputs_as_they_arrive():
    """Where tools return much (context-growth's coding agent, grown fivefold), a generated
    token sees half of what its trajectory's tools return, not all of it from the first
    turn: the model is within 20% of the simulated makespans with ``tool_tokens`` and
    further off without them (counted as prompt from the start, as before)."""
    from libra_hpc.planner.costs import LengthProfile, LengthSample, rollout_makespan
    from libra_hpc.sim.context import Context, samples_of
    from libra_hpc.sim.controller import PolicyRun
    from libra_hpc.sim.training import best_shape

    cfg = load_sim_config(ROOT / "configs" / "sim" / "context-growth.yaml",
                          {"rl.steps": 6, "workload.drift.peak_step": 2})
    ctx = Context(cfg)
    shape = best_shape(ctx.model, ctx.hw, 8, cfg.batch_size, 8192, ctx.cal)
    layout = ctx.static_layout(shape, 8)
    rec = PolicyRun(ctx, FIXED_LEAST_LOAD, layout, shape, cfg.rl.steps, train_time=lambda s, tokens: 30.0).run()
    rows = rec.rows[2:-1]  # grown, and another batch in flight beside each (the last has none)
    sim = sum(r["rollout_s"] for r in rows) / len(rows)
    pools = [(ctx.rollout_costs[8], 1)]
    samples = [samples_of(ctx.batch(r["step"])) for r in rows]
    assert all(sum(x.tool_tokens for x in s) > 0.3 * sum(x.prompt_len for x in s) for s in samples)  # tools return much

    def model(batches):
        return sum(rollout_makespan(pools, LengthProfile.from_samples(s, cfg.batch_size),
                                    in_flight=cfg.rl.max_staleness + 1).makespan_s for s in batches) / len(batches)

    arrived = model(samples)
    upfront = model([[LengthSample(*x[:4]) for x in s] for s in samples])
    assert arrived == pytest.approx(sim, rel=0.2), (arrived, upfront, sim)
    assert abs(upfront - sim) > abs(arrived - sim), (upfront, arrived, sim)


def test_a_samples_decode_context_counts_half_of_what_its_tools_return():
    from libra_hpc.planner.costs import LengthSample

    assert LengthSample(1000, 400, 3, 2.0).decode_context == 1200
    assert LengthSample(3000, 400, 3, 2.0, tool_tokens=2000).decode_context == 1000 + 1000 + 200
