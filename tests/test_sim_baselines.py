"""The fixed-split yardsticks (libra_hpc/sim/baselines.py): ``static_hindsight`` is the best
of what it simulated, Libra's layouts included; ``static_pilot`` never changes its split;
``phase_static`` changes only at window boundaries and pays the relayout Libra pays;
``phase_static_late`` makes the same changes late; the old policy names still load."""

from __future__ import annotations

from pathlib import Path

import pytest

from libra_hpc.sim.config import load_sim_config, policy_name
from libra_hpc.sim.context import Context
from libra_hpc.sim.controller import PolicyRun
from libra_hpc.sim.policies import SETUPS
from libra_hpc.sim.run import run_policy, run_scenario
from libra_hpc.sim.search import as_candidate, pilot_plan, top_plans

ROOT = Path(__file__).resolve().parents[1]
SMALL = {"rl.steps": 6, "rl.prompts_per_step": 6, "rl.group_size": 4, "cluster.nodes": 3,
         "planner.every_steps": 2, "planner.min_dwell_steps": 0, "planner.confirm_checks": 1,
         "search.top_plans": 3, "search.phase_window": 3}


@pytest.fixture(scope="module")
def small():
    cfg = load_sim_config(ROOT / "configs" / "sim" / "a800-swe.yaml", SMALL)
    ctx = Context(cfg)
    memo: dict = {}
    runs = {name: run_policy(ctx, name, memo=memo)[0] for name in ("libra", "static_hindsight")}
    return cfg, ctx, memo, runs


def test_static_hindsight_is_never_worse_than_a_candidate_it_had(small):
    """Every layout Libra applied and each of the search's top plans, run fixed over the
    same batches, makes no more tokens/s than static_hindsight's split."""
    cfg, ctx, memo, runs = small
    best = runs["static_hindsight"].summary["tokens_per_s"]
    applied = memo["libra_applied"]
    assert applied
    plans = [as_candidate(ctx, p, "top")[1:] for p in top_plans(ctx, range(cfg.rl.steps), cfg.search.top_plans)]
    assert len(plans) == cfg.search.top_plans
    for layout, train in plans + applied:
        fixed = PolicyRun(ctx, SETUPS["static_hindsight"], layout, train, cfg.rl.steps).run()
        assert fixed.summary["tokens_per_s"] <= best * (1 + 1e-9)


def test_static_pilot_never_replans_or_lends(small):
    cfg, ctx, _, _ = small
    rec, _, start = run_policy(ctx, "static_pilot")
    s = rec.summary
    assert s["steps"] == cfg.rl.steps and s["replans"] == 0 and s["hybrid_transitions"] == 0
    assert len(rec.timeline) == 1 and "pilot on steps 0..4" in start
    assert {r["train_gpus"] for r in rec.rows} == {pilot_plan(ctx, 5).train_gpus}


def test_phase_static_changes_only_at_window_boundaries_and_pays_the_relayout(small):
    """A schedule that changes split at step 3: batches 0-2 run on the first, 3-5 on the
    second; the change waits until everything before it is trained (it moves training)
    and batch 3 starts ``costs.reconfig_s`` after it (plus the weight sync)."""
    cfg, ctx, _, _ = small
    a, b = (as_candidate(ctx, p, "w")[1:] for p in top_plans(ctx, range(cfg.rl.steps), 2))
    rec = PolicyRun(ctx, SETUPS["phase_static"], *a, cfg.rl.steps, phases={3: b}).run()
    [change] = [e for e in rec.events if e["kind"] == "phase_change"]
    assert change["step"] == 3 and rec.summary["replans"] == 1
    rows = {r["step"]: r for r in rec.rows}
    assert rows[2]["t_end"] <= change["applied_t"]  # drained: the old split finished its batches
    assert rows[3]["rollout_start"] >= change["applied_t"] + cfg.costs.reconfig_s
    assert {rows[j]["train_gpus"] for j in range(3)} == {a[1].gpus}
    assert {rows[j]["train_gpus"] for j in range(3, 6)} == {b[1].gpus}
    free = PolicyRun(ctx, SETUPS["phase_static"], *a, cfg.rl.steps, phases={3: b})
    free.cfg = free.cfg.model_copy(update={"costs": cfg.costs.model_copy(update={"reconfig_s": 0.0})})
    assert free.run().summary["sim_time_s"] <= rec.summary["sim_time_s"] - cfg.costs.reconfig_s + 1e-6


def test_phase_static_in_a_scenario_changes_on_window_starts_only(small):
    cfg, ctx, memo, _ = small
    rec, windows, _ = run_policy(ctx, "phase_static", memo=memo)
    assert [w["first_step"] for w in windows] == [0, 3]
    changed = [w["first_step"] for w in windows if w["changed"]]
    assert [e["step"] for e in rec.events if e["kind"] == "phase_change"] == changed
    assert all(any(c["chosen"] for c in w["candidates"]) for w in windows)


def test_phase_static_late_makes_the_same_changes_lag_steps_later(small):
    """``phase_static_late`` runs ``phase_static``'s schedule with each change requested
    ``search.phase_lag`` steps after its window's first step (the first split from step 0;
    a change due past the last step is not made), drained and paused the same way."""
    from libra_hpc.sim.baselines import late

    cfg, ctx, memo, _ = small
    a, b = (as_candidate(ctx, p, "w") for p in top_plans(ctx, range(cfg.rl.steps), 2))
    setup = SETUPS["phase_static_late"]
    for lag, changes in ((1, [4]), (2, [5]), (3, [])):
        rec = late(ctx, setup, cfg.rl.steps, [(0, a), (3, b)], lag)
        assert [e["step"] for e in rec.events if e["kind"] == "phase_change"] == changes
        rows = {r["step"]: r["train_gpus"] for r in rec.rows}
        first_b = changes[0] if changes else cfg.rl.steps
        assert {rows[j] for j in range(first_b)} == {a[2].gpus}
        assert {rows[j] for j in range(first_b, cfg.rl.steps)} <= {b[2].gpus}
    on_time = PolicyRun(ctx, SETUPS["phase_static"], *a[1:], cfg.rl.steps, phases={3: b[1:]}).run().summary
    no_lag = late(ctx, setup, cfg.rl.steps, [(0, a), (3, b)], 0).summary
    same = lambda summary: {k: v for k, v in summary.items() if k not in ("wall_s", "policy")}  # noqa: E731
    assert same(no_lag) == same(on_time)
    # in a scenario: phase_static's own schedule, one step late by default
    rec, _, start = run_policy(ctx, "phase_static_late", memo=memo)
    assert cfg.search.phase_lag == 1 and "each change 1 step(s) late" in start
    on_time_steps = [e["step"] for e in run_policy(ctx, "phase_static", memo=memo)[0].events if e["kind"] == "phase_change"]
    assert [e["step"] for e in rec.events if e["kind"] == "phase_change"] == [k + 1 for k in on_time_steps if k + 1 < cfg.rl.steps]


def test_old_policy_names_load_as_the_new_ones():
    cfg = load_sim_config(ROOT / "configs" / "sim" / "a800-swe.yaml",
                          {**SMALL, "rl.steps": 2, "policies": ["async_static", "oracle", "oracle_best", "libra"]})
    assert cfg.policies == ["static_hindsight", "libra_true_lengths", "static_true_lengths", "libra"]
    assert policy_name("async_static") == "static_hindsight" and policy_name("libra") == "libra"
    result = run_scenario(cfg, ["async_static", "libra"])
    assert list(result.runs) == ["static_hindsight", "libra"]
    assert "async_static" not in load_sim_config(ROOT / "configs" / "sim" / "scale-4096.yaml").policies


def test_a_lent_hybrid_replica_is_a_fixed_candidate_with_it_in_training(tmp_path):
    """Libra's layouts as fixed splits include the lent state: the hybrid node's replica in
    training (DP grown by one), its rollout instance gone; run fixed, it trains on 16 GPUs
    from the first step."""
    from libra_hpc.sim.policies import control_loop
    from sim_cases import hybrid_case

    ctx, plan = hybrid_case(tmp_path)
    control = control_loop(ctx, SETUPS["libra_no_replan"])
    first = control.start(plan, "test plan")
    run = PolicyRun(ctx, SETUPS["libra_no_replan"], first.layout, plan.train, 14, control,
                    train_time=lambda s, tokens: 3.0 / s.dp)
    run.run()
    lent = [(layout, train) for layout, train in run.applied if train.dp == 2]
    assert lent and run.applied[0][1].dp == 1
    layout, train = lent[0]
    assert len(layout.training.slots) == train.gpus == 16 and [g.tp for g in layout.rollout_instances] == [8]
    fixed = PolicyRun(ctx, SETUPS["static_hindsight"], layout, train, 14, train_time=lambda s, tokens: 3.0 / s.dp).run()
    assert {r["train_gpus"] for r in fixed.rows} == {16}


def test_libra_known_start_plans_its_first_layout_on_the_first_batchs_true_lengths():
    """``libra_known_start`` differs from ``libra`` only in its first layout: the plan on
    batch 0's true lengths, not on ``planner.prior`` (what starting on the prior costs)."""
    from libra_hpc.planner.valuation import length_profile
    from libra_hpc.sim.context import describe, samples_of
    from libra_hpc.sim.policies import control_loop

    cfg = load_sim_config(ROOT / "configs" / "sim" / "train-bound.yaml", {"rl.steps": 2})
    ctx = Context(cfg)
    starts = {}
    for name in ("libra", "libra_known_start"):
        control = control_loop(ctx, SETUPS[name])
        known = length_profile(samples_of(ctx.batch(0)), cfg.batch_size) if name == "libra_known_start" else None
        first = control.initial(known)
        starts[name] = describe(first.layout, first.plan.train, control.pool, False)
        assert run_policy(ctx, name, steps=2)[2] == starts[name]
    assert starts["libra"] != starts["libra_known_start"]  # train-bound's prior is far from its lengths
