"""The control loop's decision state (``ControlLoop.state_dict``): plain data that survives
JSON, and a fresh loop built from the same config that loads it decides as the saved one
would have. Driven by hand on the default config's layout (its last node is the hybrid
pool: one TP2 replica), through a hybrid borrow whose lend is on trial when the state is
taken."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from libra_hpc.cluster.layout import layout_from_config
from libra_hpc.config import load_config
from libra_hpc.planner.control import ControlLoop, journal_form
from libra_hpc.planner.costs import LengthSample, TrainShape
from libra_hpc.planner.search import Plan, RolloutInstance

CONFIG = Path(__file__).resolve().parent.parent / "configs" / "default.yaml"


@pytest.fixture(scope="module")
def cfg():
    """The default config with the gate's confirmation at its usual spacing: the scripted
    steps drive a lend through its trial, and with ``planner.confirm_next_step`` (on by
    default) the replan that step 2's check wins is confirmed at step 3 and replaces the
    pool before the trial's verdict (that path: the last test here)."""
    return load_config(CONFIG, overrides=["planner.confirm_next_step=false"])


def _started(cfg) -> ControlLoop:
    """A loop from the config, started on the config's layout (as the job starts)."""
    layout = layout_from_config(cfg)
    t = layout.training
    shape = TrainShape(t.tp, t.pp, t.dp, cfg.training.micro_batch_size, cfg.batch_size, cfg.training.seq_len)
    plan = Plan(shape, t.slots, tuple(RolloutInstance(g.tp, g.slots) for g in layout.rollout_instances),
                0.0, 0.0, 0.0, "async")
    loop = ControlLoop.from_config(cfg)
    loop.start(plan, "the config's layout")
    assert loop.pool is not None and len(loop.pool.all_replicas()) == 1
    return loop


def _batch(step: int, n: int) -> list[LengthSample]:
    return [LengthSample(200 + 7 * i, 100 + 13 * ((5 * i + step) % 17), 2, 0.5, 20) for i in range(n)]


def _drive(loop: ControlLoop, cfg, steps: list[tuple[int, float, float, float | None]]) -> list:
    """Feed each step's lengths and times; a lent replica goes through its phases at once.
    Returns every decision as plain data."""
    out = []
    for step, now, makespan, t_train in steps:
        loop.observe(_batch(step, cfg.batch_size))
        decided = loop.after_rollout(step, now, makespan, t_train)
        out.append(journal_form(decided))
        if decided.change is not None:
            loop.apply(decided.change)
        for e in decided.pool_events:
            if e.changed and e.to_state == "requested":
                out.append(journal_form(loop.progress(e.replica, now + 1)))  # drained
                out.append(journal_form(loop.progress(e.replica, now + 2)))  # fetched its state
        out.append(journal_form(loop.after_training_step(now + 3)))
    return out


BEFORE = [(0, 10.0, 10.0, None), (1, 20.0, 10.0, 30.0), (2, 30.0, 12.0, 20.0)]
"""Training binds at step 1: the pool lends its replica, which is active (and measured
once) when the state is taken."""
AFTER = [(3, 40.0, 10.0, 35.0), (4, 50.0, 10.0, 30.0), (5, 60.0, 9.0, 40.0), (6, 70.0, 9.0, 12.0),
         (7, 80.0, 20.0, 15.0)]
"""The lend made the step slower (the trial sends it back), borrows at that balance are
held, a heavier one lends again, and the gate's checks go on."""


def test_the_state_survives_json_and_a_fresh_loop_takes_it_on_field_by_field(cfg):
    saved = _started(cfg)
    _drive(saved, cfg, BEFORE)
    state = saved.state_dict()
    assert state["lending"]["trial"] is not None and state["lending"]["trial"]["measured"] == 1
    assert [r["state"] for r in state["pool"]["replicas"]] == ["active"]
    assert state["gate"]["last_check"] is not None and state["window"]
    text = json.dumps(state)
    assert json.loads(text) == state  # plain data: nothing a JSON round trip changes
    restored = ControlLoop.from_config(cfg)
    restored.load_state_dict(json.loads(text))
    again = restored.state_dict()
    assert set(again) == set(state)
    for key in state:
        assert again[key] == state[key], key
    assert restored.layout == saved.layout and restored.plan == saved.plan and restored.cal == saved.cal
    assert restored.pool.snapshot() == saved.pool.snapshot()
    assert restored.gate.pending == saved.gate.pending and restored.training_shape() == saved.training_shape()


def test_a_restored_loop_makes_the_same_decisions(cfg):
    saved = _started(cfg)
    _drive(saved, cfg, BEFORE)
    restored = ControlLoop.from_config(cfg)
    restored.load_state_dict(json.loads(json.dumps(saved.state_dict())))
    expected = _drive(saved, cfg, AFTER)
    assert _drive(restored, cfg, AFTER) == expected
    assert restored.state_dict() == json.loads(json.dumps(saved.state_dict()))
    moves = [(ev["replica"], ev["to_state"]) for out in expected if isinstance(out, dict)
             for ev in out["pool_events"] if not ev["refused"]]
    assert (0, "releasing") in moves and saved.borrow_floor is not None  # the trial's verdict came after the save
    # the comparison can fail: without the state, a loop on the same layout decides otherwise
    fresh = _started(cfg)
    assert _drive(fresh, cfg, AFTER) != expected


def test_a_state_for_another_cluster_is_refused(cfg):
    state = _started(cfg).state_dict()
    state["cluster"] = [state["cluster"][0] + 1, state["cluster"][1]]
    with pytest.raises(ValueError, match="saved for 7 nodes"):
        ControlLoop.from_config(cfg).load_state_dict(state)


def test_a_restored_loop_confirms_the_winner_it_saved_at_the_next_step():
    """The default config (``planner.confirm_next_step`` on): step 2's check wins and the
    state is taken; the restored loop confirms and applies that plan at step 3, as the
    saved one does, and a fresh loop on the same layout does not."""
    cfg = load_config(CONFIG)
    saved = _started(cfg)
    _drive(saved, cfg, BEFORE)
    assert saved.gate.pending is not None  # a winner waits for its confirmation
    restored = ControlLoop.from_config(cfg)
    restored.load_state_dict(json.loads(json.dumps(saved.state_dict())))
    expected = _drive(saved, cfg, AFTER)
    assert _drive(restored, cfg, AFTER) == expected
    assert expected[0]["change"] is not None and expected[0]["change"]["step"] == 3
    assert _drive(_started(cfg), cfg, AFTER)[0]["change"] is None
