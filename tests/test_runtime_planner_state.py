"""A resumed job decides as the unbroken one would (issue 31, item 3): the planner
driver's state (the control loop's calibration, windows, gate, hybrid pool, lend trial, TP
selector; the timing records; the layout in force) goes into the checkpoint as plain data,
and a fresh driver that loads it equals the saved one field by field and, fed the same
measurements afterwards, makes the same decisions. A hybrid lend under way when the
checkpoint was saved is finished or undone to match the layout the world resumes in.
The default config's layout; injected numbers, no MPI, no clock."""

from __future__ import annotations

import json
import random

from test_planner_calibration_driver import _driver, _step, _warm

from libra_hpc.cluster.layout import lend_hybrid_to_training
from libra_hpc.planner import loop_state as S
from libra_hpc.runtime.planning import PlannerDriver, resumed_layout
from libra_hpc.runtime.roles import roles_from_layout


def _resumed(saved: dict, version: int) -> PlannerDriver:
    """A fresh driver as a resumed controller builds it: the saved layout first, then the state."""
    d = _driver()
    s = d.s
    s.layout, s.initial, s.ids = resumed_layout({"planner": saved}, s.layout)
    s.roles = roles_from_layout(s.layout, lambda slot: 1 + slot.node * 8 + slot.gpu, s.ids)
    d = PlannerDriver(s, d.relayout)
    d.load_state_dict(saved, version)
    return d


def _without_clock(state: dict) -> dict:
    return {k: v for k, v in state.items() if k != "now"}


def test_the_restored_driver_equals_the_saved_one_and_decides_the_same_after():
    d, rng = _driver(), random.Random(3)
    _warm(d, rng, 6)
    for b in range(6):
        d.window.record(b, 20.0 + b, 9.0, 24.0)
    saved = json.loads(json.dumps(d.state_dict()))  # through state.json
    r = _resumed(saved, version=6)
    assert _without_clock(r.state_dict()) == _without_clock(saved)
    assert abs(r.now() - saved["now"]) < 60  # the pool's clock goes on from where it was
    assert r.control.cal == d.control.cal and r.records == d.records
    # the same measurements from here on: the same calibration, predictions and decisions
    rng_a, rng_b = random.Random(9), random.Random(9)
    for b in range(6, 10):
        for driver, g in ((d, rng_a), (r, rng_b)):
            record, reports = _step(driver, b, g)
            driver.predict(b, record, reports, 12.0)
            driver.observe(b, record["rows"], reports, 1)
        assert r.control.cal == d.control.cal
        outs = [driver.control.after_rollout(b, 100.0 * b, 30.0 - b, 9.0 + b) for driver in (d, r)]
        assert S.plain(outs[0].change) == S.plain(outs[1].change)
        assert [(e.replica, e.to_state, e.reason) for e in outs[0].pool_events] == \
            [(e.replica, e.to_state, e.reason) for e in outs[1].pool_events]
    assert r.control.considered == d.control.considered
    assert _without_clock(r.state_dict()) == _without_clock(d.state_dict())


def test_a_checkpoint_from_before_the_tail_records_loads():
    d, rng = _driver(), random.Random(4)
    _warm(d, rng, 3)
    saved = json.loads(json.dumps(d.state_dict()))
    del saved["records"]["tail"]
    del saved["control"]["calibration"]["stream_tail_s"]
    r = _resumed(saved, version=3)
    assert r.records["tail"] == [] and r.control.cal.stream_tail_s == 0.0
    record, reports = _step(r, 3, rng)
    r.predict(3, record, reports, 12.0)
    r.observe(3, record["rows"], reports, 1)
    assert [x.step for x in r.records["tail"]] == [3] and r.control.cal.stream_tail_s > 0


def test_a_resumed_job_starts_in_the_layout_it_was_saved_in_with_its_lent_replica():
    d = _driver()
    s = d.s
    lent = lend_hybrid_to_training(s.layout, "borrow")
    s.layout = lent
    saved = json.loads(json.dumps(d.state_dict()))
    layout, initial, ids = resumed_layout({"planner": saved}, s.initial)
    assert layout == lent and initial == s.initial and ids == s.ids
    assert resumed_layout({"trained_tids": []}, s.initial) == (s.initial, s.initial, s.ids)  # an older checkpoint
    assert resumed_layout(None, s.initial)[0] is s.initial


def _pool_with(state: str, rid: int = 0) -> dict:
    d = _driver()
    control = json.loads(json.dumps(d.control.state_dict()))
    control["pool"]["now"] = 500.0
    replica = control["pool"]["replicas"][rid]
    replica.update(state=state, since=400.0, requested_at=390.0)
    control["lending"]["trial"] = {"rid": replica["rid"], "step": 3, "before_s": 20.0, "ratio": 1.5}
    return d, control, replica


def test_a_lend_under_way_is_finished_or_undone_to_match_the_layout_resumed_in():
    for state in ("requested", "fetching_state", "zero_grad_sync", "active", "releasing", "rollout"):
        d, control, replica = _pool_with(state)
        rollout_side = S.layout_state(d.s.layout)  # saved before the join was applied
        lent_side = S.layout_state(lend_hybrid_to_training(d.s.layout, "borrow"))
        undone = S.settled(control, rollout_side)
        [back] = [x for x in undone["pool"]["replicas"] if x["rid"] == replica["rid"]]
        assert back["state"] == "rollout" and (undone["lending"]["trial"] is None) == (state != "rollout")
        assert back["since"] == (400.0 if state == "rollout" else 500.0)
        done = S.settled(control, lent_side)
        [joined] = [x for x in done["pool"]["replicas"] if x["rid"] == replica["rid"]]
        assert joined["state"] == "active" and done["lending"]["trial"] == control["lending"]["trial"]
        assert joined["activated_at"] is not None
        assert control["pool"]["replicas"][0]["state"] == state  # the saved state is left as it was
        d.control.load_state_dict(done)  # a pool the loop takes
        assert [r.state for r in d.control.pool.all_replicas() if r.rid == replica["rid"]] == ["active"]
