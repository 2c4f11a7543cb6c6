"""Per-field drift (``workload.drift``): the piecewise multipliers, that each one moves the
generated trajectories the way its docstring says, and that the older form still draws the
same batches."""

from __future__ import annotations

import hashlib
import statistics
from pathlib import Path

import pytest

from libra_hpc.config import ConfigError
from libra_hpc.envs.synthetic import DriftSpec, SyntheticWorkload, multipliers, piecewise, summary
from libra_hpc.sim.config import load_sim_config

ROOT = Path(__file__).resolve().parents[1]
SWE = ROOT / "configs" / "sim" / "a800-swe.yaml"


def test_piecewise_is_linear_between_points_and_flat_outside():
    points = [[10, 1.0], [30, 3.0], [40, 0.5]]
    assert piecewise(points, 0) == 1.0 and piecewise(points, 10) == 1.0
    assert piecewise(points, 20) == pytest.approx(2.0)
    assert piecewise(points, 30) == 3.0
    assert piecewise(points, 35) == pytest.approx(1.75)
    assert piecewise(points, 40) == 0.5 and piecewise(points, 1000) == 0.5
    assert piecewise([[5, 2.0]], 0) == 2.0 and piecewise([[5, 2.0]], 9) == 2.0
    assert piecewise(None, 7) == 1.0


def test_the_older_form_multiplies_turn_tokens_and_tool_odds_under_the_per_field_ones():
    spec = DriftSpec(growth=1.0, peak_step=10, turn_tokens=[[0, 2.0]], timeout_rate=[[0, 1.0], [10, 0.5]])
    m = multipliers(10, 20, spec)
    assert m.turn_tokens == pytest.approx(4.0)  # 2 (old form at its peak) × 2
    assert m.check_again == pytest.approx(2.0)
    assert m.timeout_rate == pytest.approx(0.5)
    assert m.tool_output_tokens == m.prompt_tokens == m.max_turns == 1.0


# Digests of the shipped scenarios' batches (steps 0, 1, n/3, n/2, 2n/3, n-1), taken before
# the per-field drift existed: the older form {growth, peak_step, decline} draws the same.
SHIPPED = {"a800-swe": "e0d3534fe075d911", "cmlfq-premise": "1c07e6635bf777f9",
           "context-growth": "e41ad027db7a311c", "math-code": "24fe8f0159483864",
           "scale-4096": "c60375c27aa69064", "search-agent": "e44e0ca647593fdd",
           "train-bound": "e6e4ff0934c78c03"}


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_scenarios_draw_the_same_batches_as_before_per_field_drift(name):
    cfg = load_sim_config(ROOT / "configs" / "sim" / f"{name}.yaml")
    w = SyntheticWorkload(cfg.workload, cfg.rl, cfg.rl.seed, cfg.training.seq_len)
    n, digest = cfg.rl.steps, hashlib.sha256()
    for s in sorted({0, 1, n // 3, n // 2, 2 * n // 3, n - 1}):
        digest.update(repr(w.batch(s)).encode())
    assert digest.hexdigest()[:16] == SHIPPED[name], (
        f"{name}: its batches changed; if configs/sim/{name}.yaml was edited on purpose, update SHIPPED")


def batches(drift: dict, steps=range(0, 5), seq_len=131072):
    """The a800-swe workload (40 prompts × 8) with ``drift`` and a context too long to cut a
    trajectory, so the same seed makes the same decisions with and without drift."""
    cfg = load_sim_config(SWE, {"workload.drift": drift, "training.seq_len": seq_len})
    w = SyntheticWorkload(cfg.workload, cfg.rl, 0, cfg.training.seq_len)
    return [t for s in steps for t in w.batch(s)]


def calls(trajs, tool=None, status=None):
    return [c for t in trajs for c in t.calls if (tool is None or c.tool == tool) and (status is None or c.status == status)]


def share(trajs, status, tool=None):
    every = calls(trajs, tool)
    return sum(c.status == status for c in every) / len(every)


LATE = range(30, 35)
RAMP = [[0, 1.0], [10, 1.0], [20, 2.0]]  # x1 early, x2 from step 20


def test_tool_output_tokens_doubled_late_double_the_late_outputs():
    trajs = batches({"tool_output_tokens": RAMP}, steps=list(range(5)) + list(LATE))
    early = statistics.fmean(c.output_tokens for c in calls([t for t in trajs if t.step < 5]))
    late = statistics.fmean(c.output_tokens for c in calls([t for t in trajs if t.step >= 30]))
    assert 1.6 < late / early < 2.5, (early, late)
    # the same steps without drift: the same draws, every output twice as long
    plain = calls(batches({}, steps=LATE))
    doubled = calls(batches({"tool_output_tokens": RAMP}, steps=LATE))
    assert [c.status for c in plain] == [c.status for c in doubled]
    assert sum(c.output_tokens for c in doubled) / sum(c.output_tokens for c in plain) == pytest.approx(2.0, rel=0.01)


@pytest.mark.parametrize("field, measure, ratio", [
    ("prompt_tokens", lambda ts: statistics.fmean(t.prompt_tokens for t in ts), (1.95, 2.05)),
    ("turn_tokens", lambda ts: statistics.fmean(x for t in ts for x in t.turns), (1.9, 2.1)),
    ("tool_latency", lambda ts: statistics.fmean(c.latency_s for c in calls(ts, status="success")), (1.5, 2.05)),
    ("error_rate", lambda ts: share(ts, "failure", tool="editor"), (1.6, 2.4)),
    ("timeout_rate", lambda ts: share(ts, "timeout"), (1.6, 2.4)),
])
def test_each_field_doubled_doubles_what_it_names(field, measure, ratio):
    plain, drifted = batches({}, steps=LATE), batches({field: RAMP}, steps=LATE)
    got = measure(drifted) / measure(plain)
    assert ratio[0] < got < ratio[1], (field, got)


def test_bug_rate_check_again_and_max_turns_move_the_number_of_turns():
    def mean_turns(ts):
        return statistics.fmean(len(t.turns) for t in ts)
    plain = batches({}, steps=LATE)
    assert mean_turns(batches({"bug_rate": [[0, 0.3]]}, steps=LATE)) < 0.8 * mean_turns(plain)
    assert share(batches({"bug_rate": [[0, 0.3]]}, steps=LATE), "failure", tool="bash") < share(plain, "failure", "bash")
    assert mean_turns(batches({"check_again": [[0, 0.1]]}, steps=LATE)) < mean_turns(plain)
    assert mean_turns(batches({"check_again": [[0, 1.8]]}, steps=LATE)) > mean_turns(plain)
    short = batches({"max_turns": [[0, 1.0], [20, 0.5]]}, steps=LATE)  # 30 -> 15 turns
    assert max(len(t.turns) for t in short) == 15 < max(len(t.turns) for t in plain)


def test_an_unknown_drift_field_is_refused_naming_it_and_the_valid_ones():
    with pytest.raises(ConfigError) as err:
        load_sim_config(SWE, {"workload.drift.tool_outputs": [[0, 2.0]]})
    text = str(err.value)
    assert "workload.drift.tool_outputs" in text and "tool_output_tokens" in text and "timeout_rate" in text


@pytest.mark.parametrize("points, says", [
    ([[10, 1.0], [5, 2.0]], "strictly increasing"),
    ([[1.5, 1.0]], "whole number"),
    ([[0, -1.0]], ">= 0"),
    ([[0, 1.0, 2.0]], "[step, multiplier]"),
    ([], "at least one"),
])
def test_bad_points_are_refused_saying_why(points, says):
    with pytest.raises(ConfigError, match="workload.drift.turn_tokens") as err:
        load_sim_config(SWE, {"workload.drift.turn_tokens": points})
    assert says in str(err.value)


def test_solve_rates_give_rewards_and_the_trainer_leaves_uniform_groups_out():
    """``workload.solve_rate``: every sample gets a 0/1 reward from its prompt's solve rate
    (drawn apart: the turns and tool calls are those of the batch without rewards), and
    the simulator's trainer leaves out the groups whose rewards are all equal, as the
    job's does (``rl.filter_zero_variance``); ``drift.solve_rate`` moves how many."""
    from libra_hpc.sim.context import Context, samples_of, trained_of

    plain = load_sim_config(SWE, {"rl.steps": 40})
    rewarded = load_sim_config(SWE, {"rl.steps": 40, "workload.solve_rate": [0.0, 0.5],
                                     "workload.drift.solve_rate": [[0, 0.2], [20, 1.0]]})
    a, b = Context(plain).batch(30), Context(rewarded).batch(30)
    assert repr(a) == repr(b) and all(t.reward is None and t.trained for t in a)
    assert {t.reward for t in b} == {0.0, 1.0}
    groups: dict[str, list] = {}
    for t in b:
        groups.setdefault(t.prompt_id, []).append(t)
    for members in groups.values():
        uniform = len({t.reward for t in members}) == 1
        assert all(t.trained != uniform for t in members)
    assert 0 < len(trained_of(b)) < len(b)
    assert [x.trained for x in samples_of(b)] == [t.trained for t in b]  # what the planner is told
    assert summary(b)["trained_share"] == len(trained_of(b)) / len(b) < 1 == summary(a)["trained_share"]  # the report
    early, late = Context(rewarded).batch(0), Context(rewarded).batch(30)
    assert sum(t.reward for t in early) < 0.5 * sum(t.reward for t in late)
    assert len(trained_of(early)) < len(trained_of(late))
    unfiltered = load_sim_config(SWE, {"rl.steps": 40, "workload.solve_rate": [0.0, 0.5],
                                       "rl.filter_zero_variance": False})
    assert all(t.trained for t in Context(unfiltered).batch(30))
    with pytest.raises(ConfigError, match="solve_rate"):
        load_sim_config(SWE, {"workload.solve_rate": [0.6, 0.2]})


def test_a_simulated_step_trains_only_the_groups_it_keeps():
    """The same batches, with most groups left out: training takes fewer GPU-seconds
    (whatever split the search picks for each), and the bound (which counts the trained
    sequences only) still holds."""
    from libra_hpc.sim.context import Context
    from libra_hpc.sim.run import run_scenario

    short = {"rl.steps": 3, "rl.prompts_per_step": 8, "search.sample_steps": 1, "search.top_plans": 2}
    plain = run_scenario(load_sim_config(SWE, short), policies=["static_hindsight"])
    rare = run_scenario(load_sim_config(SWE, {**short, "workload.solve_rate": [0.0, 0.1]}),
                        policies=["static_hindsight"])
    kept = [t for j in range(3) for t in Context(rare.cfg).batch(j) if t.trained]
    assert 0 < len(kept) < 0.6 * 3 * 64

    def gpu_s(result):
        return sum(r["train_s"] * r["train_gpus"] for r in result.runs["static_hindsight"].rows)
    assert gpu_s(rare) < 0.75 * gpu_s(plain), (gpu_s(rare), gpu_s(plain))
    assert rare.bound_violations() == {"static_hindsight": []}
