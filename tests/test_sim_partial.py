"""Tail-decoupled rollout in the simulator (``rl.partial_rollout``): every step trains a
full batch, no trajectory is trained twice or lost, no trained one is older than the
staleness bound, and the waste stays within its budget."""

from __future__ import annotations

from pathlib import Path

import pytest

from libra_hpc.sim.config import load_sim_config
from libra_hpc.sim.context import Context
from libra_hpc.sim.controller import PolicyRun
from libra_hpc.sim.policies import SETUPS
from libra_hpc.sim.search import as_candidate, top_plans

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", params=[0, 1])
def partial_run(request):
    """The best hindsight plan of a small search-agent scenario, run fixed, partial rollout on."""
    cfg = load_sim_config(ROOT / "configs" / "sim" / "search-agent.yaml",
                          {"rl.steps": 12, "rl.prompts_per_step": 16, "rl.max_staleness": request.param,
                           "rl.partial_rollout": True, "search.sample_steps": 1})
    ctx = Context(cfg)
    _, layout, train = as_candidate(ctx, top_plans(ctx, range(cfg.rl.steps), 1)[0], "best")
    run = PolicyRun(ctx, SETUPS["static_hindsight"], layout, train, cfg.rl.steps)
    rec = run.run()
    return cfg, ctx, run, rec


def test_every_step_trains_a_full_batch_within_the_staleness_bound(partial_run):
    cfg, _, run, rec = partial_run
    assert run.partial and rec.summary["partial_rollout"]
    assert [r["step"] for r in rec.rows] == list(range(cfg.rl.steps))
    assert all(r["trajectories"] == cfg.batch_size for r in rec.rows)
    assert all(0 <= r["max_lag"] <= cfg.rl.max_staleness for r in rec.rows)


def test_no_trajectory_is_trained_twice_or_lost(partial_run):
    cfg, ctx, run, _ = partial_run
    assert len(run.trained) == len(set(run.trained)) == cfg.rl.steps * cfg.batch_size
    submitted = {t.tid for j in range(run.next_submit) for t in ctx.batch(j)}
    untrained = submitted - set(run.trained)
    # what was not trained is still running or finished and waiting: nothing vanished
    assert untrained == set(run.rollout.active) | set(run.finished_traj)
    assert set(run.trained) <= submitted


def test_waste_stays_within_its_budget_and_lengths_are_not_cherry_picked(partial_run):
    cfg, _, run, rec = partial_run
    s = rec.summary
    assert s["dropped_token_share"] <= cfg.rl.partial_waste_budget + 1e-9
    assert s["regenerated"] == run.tail.stats.regenerated
    assert 0.9 <= s["trained_p90_over_generated_p90"] <= 1.1


def test_a_synchronous_policy_never_runs_partial_rollout():
    cfg = load_sim_config(ROOT / "configs" / "sim" / "search-agent.yaml",
                          {"rl.steps": 2, "rl.prompts_per_step": 4, "rl.partial_rollout": True})
    ctx = Context(cfg)
    _, layout, train = as_candidate(ctx, top_plans(ctx, range(cfg.rl.steps), 1)[0], "best")
    assert not PolicyRun(ctx, SETUPS["colocated"], layout, train, 2, colocated=True).partial
