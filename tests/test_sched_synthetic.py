"""C-MLFQ's view of the shared synthetic workload, and its routing quality on it."""

from __future__ import annotations

import itertools
import statistics
from pathlib import Path

import pytest

from libra_hpc.config import SchedulerConfig
from libra_hpc.envs.synthetic import SyntheticWorkload
from libra_hpc.scheduler.routers import make_router
from libra_hpc.scheduler.synthetic import (
    default_buckets,
    evaluate_routing,
    generate,
    length_summary,
    router_views,
    split_by_sample,
)
from libra_hpc.sim.config import load_sim_config
from libra_hpc.sim.context import Context

SCENARIOS = Path(__file__).resolve().parents[1] / "configs" / "sim"
PREMISE = load_sim_config(SCENARIOS / "cmlfq-premise.yaml")


def premise(n_prompts, samples, seed):
    return generate(PREMISE.workload, n_prompts, samples, seed, seq_len=PREMISE.training.seq_len)


@pytest.fixture(scope="module")
def workload():
    return premise(300, 16, seed=0)


def test_generation_is_seeded():
    assert premise(20, 4, seed=5) == premise(20, 4, seed=5)
    assert premise(20, 4, seed=5) != premise(20, 4, seed=6)


@pytest.mark.parametrize("scenario", ["cmlfq-premise", "a800-swe"])
def test_the_router_sees_the_simulators_trajectories(scenario):
    """generate() is the simulator's first batch of the scenario with every prompt of its
    pool in one step, seen through the service's classification of each tool's output."""
    cfg = load_sim_config(SCENARIOS / f"{scenario}.yaml",
                          {"workload.prompt_pool": 30, "rl.prompts_per_step": 30, "rl.group_size": 4})
    simulated = Context(cfg).batch(0)
    views = generate(cfg.workload, 30, 4, cfg.rl.seed, seq_len=cfg.training.seq_len)
    assert len(views) == len(simulated) == 120
    assert [(v.tid, v.prompt_id, v.sample, v.turns) for v in views] == \
        [(t.tid, t.prompt_id, t.sample, t.turns) for t in simulated]
    limits = SchedulerConfig().size_thresholds  # characters: S below the first, L from the last
    for view, trajectory in zip(views, simulated):
        for state, call in zip(view.states, trajectory.calls, strict=True):
            chars = call.output_tokens * 4
            size = "S" if chars < limits[0] else "M" if chars < limits[1] else "L"
            assert (state.tool, state.size, state.status) == (call.tool, size, call.status)


def test_the_view_classifies_with_the_services_thresholds():
    """Other thresholds give other size classes for the same trajectories (the view is
    computed, not stored): with one threshold at 1 character every output is large."""
    trajectories = SyntheticWorkload.groups(PREMISE.workload, 10, 4, 0, PREMISE.training.seq_len).batch(0)
    assert {s.size for v in router_views(trajectories, [1]) for s in v.states} == {"L"}
    assert {s.size for v in router_views(trajectories) for s in v.states} == {"S", "M", "L"}


def test_trajectories_are_consistent(workload):
    for t in workload:
        assert len(t.states) == len(t.turns) - 1 and all(tokens > 0 for tokens in t.turns)
        remaining = t.remaining_after
        assert remaining[0] == t.total and remaining[-1] == t.turns[-1]
        assert all(a > b for a, b in itertools.pairwise(remaining))
        assert t.finished().remaining_after == remaining


def test_failures_causally_lengthen_what_follows(workload):
    after = {"failure": [], "success": []}
    for t in workload:
        for d, state in enumerate(t.states, start=1):
            if state.status in after:
                after[state.status].append((t.remaining_after[d], len(t.turns) - d))
    tokens = {k: statistics.mean(r for r, _ in v) for k, v in after.items()}
    turns = {k: statistics.mean(n for _, n in v) for k, v in after.items()}
    assert tokens["failure"] > 3 * tokens["success"] and turns["failure"] > turns["success"] + 1


def test_lengths_are_long_tailed_and_prompts_differ(workload):
    summary = length_summary(workload)
    assert 7 <= summary["p99"] / summary["median"] <= 14
    by_prompt = {}
    for t in workload:
        by_prompt.setdefault(t.prompt_id, []).append(t.total)
    means = sorted(statistics.mean(v) for v in by_prompt.values())
    assert means[-len(means) // 10] > 3 * means[len(means) // 10]  # p90 vs p10 prompt


def test_split_keeps_the_last_samples_of_every_prompt_for_test(workload):
    train, test = split_by_sample(workload, 4)
    assert len(test) == 300 * 4 and len(train) == 300 * 12
    assert {t.sample for t in test} == {12, 13, 14, 15}
    assert [t.sample for t in train[:300]] == [0] * 300  # epoch order: prompts interleaved


def test_oracle_is_exact_and_fifo_ignores_lengths(workload):
    train, test = split_by_sample(workload, 4)
    oracle = evaluate_routing(lambda b: make_router("oracle", b, window=8, min_samples=1, rebuild_every=10),
                              train, test, default_buckets())
    assert oracle["bucket_accuracy"] == 1.0 and oracle["mean_level_error"] == 0.0 and oracle["decisions"] > 1000
    fifo = evaluate_routing(lambda b: make_router("fifo", b, window=8, min_samples=1, rebuild_every=10),
                            train, test, default_buckets())
    assert fifo["migrations"] == 0 and fifo["bucket_accuracy"] < oracle["top_level_accuracy"]


def test_cmlfq_routes_more_turns_to_their_true_bucket_than_keeping_the_top_level(workload):
    """The quality bar on the workload where C-MLFQ's premise holds (cmlfq-premise): with
    the configured defaults (window 256, 8 samples to trust a node, rebuild every 1000),
    causal routing beats a router that never moves."""
    train, test = split_by_sample(workload, 4)
    result = evaluate_routing(lambda b: make_router("cmlfq", b, window=256, min_samples=8, rebuild_every=1000),
                              train, test, default_buckets())
    assert result["bucket_accuracy"] > result["top_level_accuracy"] + 0.03, result
    assert result["migrations"] > 0


def _cmlfq(self_check):
    from libra_hpc.scheduler.routers import router_from_config

    return lambda b: router_from_config(SchedulerConfig(policy="cmlfq", self_check=self_check), b)


def test_the_self_check_falls_back_to_the_top_level_where_the_causal_signal_loses():
    """The paper's SWE workload (a800-swe: tool returns say little about the work left):
    raw causal verdicts score below keeping the top level; with the self-check the router
    notices on the trajectories it learns from, keeps every turn on the top level and
    scores as the top level does, never below it."""
    swe = load_sim_config(SCENARIOS / "a800-swe.yaml")
    train, test = split_by_sample(generate(swe.workload, 300, 16, 0, seq_len=swe.training.seq_len), 4)
    raw = evaluate_routing(_cmlfq(0), train, test, default_buckets())
    checked = evaluate_routing(_cmlfq(SchedulerConfig().self_check), train, test, default_buckets())
    assert raw["bucket_accuracy"] < raw["top_level_accuracy"], raw
    assert checked["bucket_accuracy"] >= checked["top_level_accuracy"], checked
    assert checked["migrations"] < raw["migrations"]


def test_the_self_check_keeps_the_causal_verdicts_where_they_win(workload):
    train, test = split_by_sample(workload, 4)
    router = _cmlfq(SchedulerConfig().self_check)(default_buckets())
    for trajectory in train:
        router.observe(trajectory.finished())
    counters = router.counters()
    assert not router.falling_back and counters["self_check_scored"] == SchedulerConfig().self_check
    assert counters["self_check_causal_right"] > counters["self_check_top_right"]
    checked = evaluate_routing(_cmlfq(SchedulerConfig().self_check), train, test, default_buckets())
    assert checked["bucket_accuracy"] > checked["top_level_accuracy"] + 0.03, checked


def test_the_self_check_scores_only_what_it_had_not_learnt_and_turns_off():
    """Prequential: a trajectory is scored against the index before it is learnt, so
    the very first trajectories (an empty index: every verdict stays on the top level)
    score the same for both, and a tie sends turns to the top level; with
    ``self_check=0`` nothing is scored."""
    from libra_hpc.scheduler.types import FinishedTrajectory, ToolState

    state = ToolState("bash", "S", "success")
    long_one = FinishedTrajectory("p", (state, state), (9000, 8000, 7000))
    router = _cmlfq(8)(default_buckets())
    router.observe(long_one)
    counters = router.counters()
    assert counters["self_check_scored"] == 2 and counters["self_check_causal_right"] == 0
    assert counters["self_check_top_right"] == 0
    assert router.falling_back  # a quarter of the window is in, and a tie goes to the top level
    off = _cmlfq(0)(default_buckets())
    off.observe(long_one)
    assert off.counters()["self_check_scored"] == 0
    with pytest.raises(ValueError, match="self_check"):
        make_router("cmlfq", default_buckets(), window=8, min_samples=1, rebuild_every=1, self_check=-1)
