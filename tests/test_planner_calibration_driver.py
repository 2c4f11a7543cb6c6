"""The job's planner driver predicts each step from what came before it (issue 30, item 4):
the default config's layout and control loop, fed synthetic steps whose times are
injected numbers (no MPI, no engines, no clock)."""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest

from libra_hpc.cluster.layout import layout_from_config, lend_hybrid_to_training
from libra_hpc.config import load_config
from libra_hpc.runtime.planning import PlannerDriver
from libra_hpc.runtime.records import predicted_over_measured
from libra_hpc.runtime.roles import roles_from_layout
from libra_hpc.runtime.state import JobState

REPO = Path(__file__).resolve().parents[1]


class _Log:
    def __init__(self):
        self.events: list[tuple[str, dict]] = []

    def event(self, kind: str, **fields) -> None:
        self.events.append((kind, fields))


class _Still:
    def moving(self) -> bool:
        return False


def _driver() -> PlannerDriver:
    cfg = load_config(REPO / "configs" / "default.yaml", ["rl.update_epochs={}"])
    s = JobState(cfg, _Log(), rank_of=lambda slot: 0)
    s.layout = s.initial = layout_from_config(cfg)
    s.ids = {g.slots: g.gid for g in s.layout.rollout_instances}
    s.roles = roles_from_layout(s.layout, lambda slot: 1 + slot.node * cfg.cluster.gpus_per_node + slot.gpu, s.ids)
    return PlannerDriver(s, _Still())


def _step(d: PlannerDriver, b: int, rng: random.Random, turn_s: float = 0.8) -> tuple[dict, list[dict]]:
    """Batch ``b``: 48 trajectories whose wall time is 20 ms per token + 1.2 × tools + ``turn_s``
    per turn after their batch's submission; one training pass of 6 s."""
    instances = sorted(d.s.roles.tps)
    submitted, rows = 100.0 * b, []
    for i in range(48):  # 6 GRPO groups of 8, each with unequal rewards: every one trains
        turns = rng.randint(1, 5)
        gen, tool = rng.randint(20, 90) * turns, rng.uniform(0, 0.3) * (turns - 1)
        rows.append({"tid": f"{b}/p{i // 8}/{i % 8}", "reward": float(i % 2),
                     "tokens": 200 + gen + 40 * turns, "gen_tokens": gen, "turns": turns, "tool_s": tool,
                     "prompt_tokens": 200, "instance": rng.choice(instances),
                     "finished_at": submitted + 0.02 * gen + 1.2 * tool + turn_s * turns})
    for i in instances:
        d.load({"instance": i, "running": 6})
        d.s.leader_load[i] = {"tokens": 2000 * (b + 1), "busy_s": 30.0 * (b + 1)}
    record = {"submitted": submitted, "complete": max(r["finished_at"] for r in rows), "rows": rows}
    return record, [{"train_s": 5.0, "stream_s": 1.0}]


def _warm(d, rng, steps: int) -> list[dict]:
    """Steps 0..steps-1 as the controller runs them: predicted first, then observed."""
    out = []
    for b in range(steps):
        record, reports = _step(d, b, rng)
        out.append(d.predict(b, record, reports, 12.0))
        d.observe(b, record["rows"], reports, 1)
    return out


def test_step_k_is_predicted_without_looking_at_step_k():
    d, rng = _driver(), random.Random(0)
    _warm(d, rng, 4)
    record, reports = _step(d, 4, rng)
    slow = copy.deepcopy(record)
    for r in slow["rows"]:
        r["finished_at"] += 30.0  # the same lengths, every trajectory of step 4 far slower
    slow["complete"] += 30.0
    other = copy.deepcopy(d)
    got, got_slow = d.predict(4, record, reports, 12.0), other.predict(4, slow, reports, 40.0)
    assert got["planner_predicted_s"] == got_slow["planner_predicted_s"]
    assert got_slow["planner_terms"]["rollout_s"][1] == pytest.approx(got["planner_terms"]["rollout_s"][1] + 30, abs=1e-3)


def test_the_fitted_terms_predict_the_steps_they_were_not_fitted_on():
    """Trajectory times made of known per-token, tool and per-turn costs: from the third
    step on the fit has them, and the predicted rollout makespan lands near the measured
    one; the per-turn cost is what a model without it misses most here."""
    d, rng = _driver(), random.Random(1)
    rows = _warm(d, rng, 8)
    cal = d.control.cal
    assert cal.turn_latency_s == pytest.approx(0.8, rel=0.15) and cal.tool_latency_scale == pytest.approx(1.2, rel=0.3)
    for m in rows[3:]:
        predicted, measured = m["planner_terms"]["rollout_s"]
        assert 0.8 <= predicted / measured <= 1.25
        assert m["planner_terms"]["train_s"][0] == pytest.approx(6.0, rel=0.05)
    assert predicted_over_measured(rows) is not None
    kinds = [k for k, _ in d.s.runlog.events]
    assert kinds.count("planner_prediction") == 8


def test_the_step_is_priced_as_the_pipeline_runs_it():
    """Training-bound (the batch was complete long before the last step ended): the step is
    the whole training; rollout-bound: the batch's predicted completion after the last
    step's end, plus training's tail."""
    d, rng = _driver(), random.Random(2)
    _warm(d, rng, 3)
    record, reports = _step(d, 3, rng)
    early = copy.deepcopy(d).predict(3, record, reports, 12.0, ended=record["submitted"] + 500.0)
    t_train, rollout = early["planner_terms"]["train_s"][0], early["planner_terms"]["rollout_s"][0]
    assert early["planner_predicted_s"] == pytest.approx(t_train, abs=1e-3)
    late = d.predict(3, record, reports, 12.0, ended=record["submitted"] + 12.0)  # the last step ended at submission
    tail = late["planner_terms"]["train_tail_s"][0]
    assert 0 < tail < t_train
    assert late["planner_predicted_s"] == pytest.approx(rollout + tail, abs=2e-3)
    assert late["planner_steady_s"] == early["planner_steady_s"]


def test_a_streamed_steps_tail_is_fitted_on_the_tails_it_measured():
    """Every step streamed over the default config's 12 groups, a pass of 6 s, the trainers
    reporting 5 s after the last group arrived: the fit takes 5 - 6/12 s as the tail's
    fixed part, and a rollout-bound step is priced with a 5-s tail (its last group's share
    alone, 0.5 s, is what the search and the old per-step price both missed). A step of
    several passes does not stream and gives no tail record."""
    d, rng = _driver(), random.Random(3)
    _warm(d, rng, 4)
    assert d.control.cal.stream_tail_s == pytest.approx(4.5, rel=0.05)
    assert [r.step for r in d.records["tail"]] == [0, 1, 2, 3]
    record, reports = _step(d, 4, rng)
    got = d.predict(4, record, reports, 12.0, ended=record["submitted"] + 12.0)
    assert got["planner_terms"]["train_tail_s"] == pytest.approx([5.0, 5.0], rel=0.05)
    assert got["planner_predicted_s"] == pytest.approx(got["planner_terms"]["rollout_s"][0] + 5.0, rel=0.02)
    d.observe(4, record["rows"], [{"train_s": 24.0}], 4)  # four passes: trained whole
    assert [r.step for r in d.records["tail"]] == [0, 1, 2, 3]


def test_a_step_run_with_the_hybrid_pool_lent_is_predicted_too():
    """The default layout with the hybrid node lent to training (one TP-2 instance left
    beside four TP-1 ones): the blind router's share of a small batch used to leave the
    TP-2 pool nothing, whose loaded step time was then infinite, and so was the step."""
    d, rng = _driver(), random.Random(3)
    _warm(d, rng, 4)
    d.s.layout = lend_hybrid_to_training(d.s.layout, "test: the hybrid node joins training")
    assert sorted(g.tp for g in d.s.layout.rollout_instances) == [1, 1, 1, 1, 2] and d.s.layout.training.dp == 3
    record, reports = _step(d, 4, rng)
    got = d.predict(4, record, reports, 12.0)
    predicted, measured = got["planner_terms"]["rollout_s"]
    assert 0.8 <= predicted / measured <= 1.25


def test_a_trajectorys_wait_for_its_first_turn_is_not_fitted_as_its_chain():
    """Trajectories that waited behind the previous batch before their first turn (their
    report time since submission is ``wait`` longer than they ran): with the leaders'
    ``active_s`` the fit finds the same per-turn and tool costs as without the wait;
    without it, the wait is fitted into them."""
    fitted = {}
    for label, wait, report_active in (("no wait", 0.0, False), ("active_s", 20.0, True), ("no active_s", 20.0, False)):
        d, rng = _driver(), random.Random(1)
        for b in range(8):
            record, reports = _step(d, b, rng)
            for i, r in enumerate(record["rows"]):
                ran = r["finished_at"] - record["submitted"]
                delay = wait * (i % 2)  # half the batch waited
                r["finished_at"] += delay
                if report_active:
                    r["active_s"] = ran
            record["complete"] = max(r["finished_at"] for r in record["rows"])
            d.predict(b, record, reports, 12.0)
            d.observe(b, record["rows"], reports, 1)
        cal = d.control.cal
        fitted[label] = (cal.turn_latency_s, cal.tool_latency_scale)
    assert fitted["active_s"] == pytest.approx(fitted["no wait"], rel=1e-6)
    assert fitted["no active_s"][0] > 1.5 * fitted["no wait"][0], fitted


def test_a_step_is_priced_on_the_groups_it_trains():
    """GRPO leaves out the groups whose rewards are all equal (``rl.filter_zero_variance``):
    a step that trains 1 group of 6 is priced on those 8 sequences, not on the batch's 48;
    without the filter, on all of them. The timing record says the same."""
    d, rng = _driver(), random.Random(4)
    _warm(d, rng, 4)
    record, reports = _step(d, 4, rng)
    flat = copy.deepcopy(record)
    for r in flat["rows"]:
        if not r["tid"].startswith("4/p0/"):
            r["reward"] = 1.0  # five groups all right: nothing to learn from them
    assert d.trained_batch(flat["rows"], reports).global_batch == 8
    assert d.trained_batch(record["rows"], reports).global_batch == 48
    whole = copy.deepcopy(d).predict(4, record, reports, 12.0)["planner_terms"]["train_s"][0]
    one = copy.deepcopy(d).predict(4, flat, reports, 12.0)["planner_terms"]["train_s"][0]
    assert one < 0.75 * whole  # the fixed part (optimizer step, collectives) is paid either way
    assert d.kept(flat["rows"]) == {r["tid"] for r in flat["rows"] if r["tid"].startswith("4/p0/")}
    d.s.cfg = d.s.cfg.model_copy(update={"rl": d.s.cfg.rl.model_copy(update={"filter_zero_variance": False})})
    assert d.trained_batch(flat["rows"], reports).global_batch == 48


def test_a_step_is_priced_on_the_replica_with_the_most_work():
    """Each replica's first trainer reports the trajectories it trained: the step is priced
    on the replica that had the most work, not on an even share of the batch."""
    d, rng = _driver(), random.Random(5)
    _warm(d, rng, 4)
    record, _ = _step(d, 4, rng)
    groups = sorted({r["tid"].rsplit("/", 1)[0] for r in record["rows"]})
    assert d.s.layout.training.dp == 2 and len(groups) == 6

    def placed(first: list[str]) -> list[dict]:
        tids = [[r["tid"] for r in record["rows"] if (r["tid"].rsplit("/", 1)[0] in first) == (d_ == 0)]
                for d_ in (0, 1)]
        return [{"train_s": 5.0, "stream_s": 1.0, "replica": d_, "tids": tids[d_]} for d_ in (0, 1)]

    even, lopsided = placed(groups[:3]), placed(groups[:5])
    assert [len(r["tids"]) for r in lopsided] == [40, 8]
    batch = d.trained_batch(record["rows"], lopsided)
    assert [len(s) for s in batch.shares] == [40, 8]
    priced = {name: copy.deepcopy(d).predict(4, record, reports, 12.0)["planner_terms"]["train_s"][0]
              for name, reports in (("even", even), ("lopsided", lopsided))}
    assert priced["lopsided"] > 1.2 * priced["even"]
    assert d.trained_batch(record["rows"], [{"replica": 1, "tids": []}]).shares == ()  # not every replica: unknown
