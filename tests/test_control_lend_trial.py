"""A replica lent to training is on trial (``ControlLoop._judge_lend``): the cost models
price a lend as 1/DP faster training against 1/GPUs slower rollout, but where a few long
trajectories set the rollout's makespan, taking GPUs from it cost far more, and the pool
lent and released on alternate checks (search agent, streamed: 22 transitions). Driven by
hand: a pinned plan whose hybrid node can lend one TP8 replica (tests/sim_cases.py)."""

from __future__ import annotations

from types import SimpleNamespace

from libra_hpc.planner.hybrid import PoolEvent
from libra_hpc.runtime.planning import PlannerDriver
from libra_hpc.sim.policies import SETUPS, control_loop
from tests.sim_cases import hybrid_case


def _lent(tmp_path, t_train=3.0, makespan=1.0):
    ctx, plan = hybrid_case(tmp_path)
    control = control_loop(ctx, SETUPS["libra_no_replan"])
    control.start(plan, "pinned for the test")
    out = control.after_rollout(0, 10.0, makespan, t_train)  # training binds: borrow
    [(rid, state)] = [(e.replica, e.to_state) for e in out.pool_events if e.changed]
    assert state == "requested" and control.lend_trial["before_s"] == t_train
    control.progress(rid, 11.0)  # drained
    control.progress(rid, 12.0)  # fetched the training state
    control.after_training_step(13.0)  # its zero-gradient step: active
    assert [r.rid for r in control.pool.training_replicas()] == [rid]
    return control, rid


def _moves(out):
    return [(e.replica, e.to_state) for e in out.pool_events if e.changed]


def test_a_lend_that_made_the_step_slower_goes_back_and_is_not_tried_again_at_that_balance(tmp_path):
    control, rid = _lent(tmp_path)
    # both sides now take ~3.5 s, within the margin of each other (the pool alone would hold),
    # and the step took 3 s before the lend
    first = control.after_rollout(1, 20.0, 3.5, 3.4)  # one measurement
    assert _moves(first) == [] and control.lend_trial is not None
    second = control.after_rollout(2, 30.0, 3.5, 3.4)
    assert _moves(second) == [(rid, "releasing")]
    [trial] = [c for c in control.considered if c["kind"] == "hybrid_trial"]
    assert trial["apply"] and trial["before_s"] == 3.0 and trial["after_s"] == 3.5
    control.after_training_step(31.0)  # the release completes
    assert not control.pool.training_replicas()
    again = control.after_rollout(3, 40.0, 1.0, 3.0)  # the balance it was lent at: held
    assert _moves(again) == [] and control.borrow_floor == 3.0 * 1.1
    job = object.__new__(PlannerDriver)  # what the job logs for that check
    job.control = control
    assert "made the step slower" in job.assess(3.0, 1.0)["held_by"] and "held_by" not in job.assess(4.0, 1.0)
    harder = control.after_rollout(4, 50.0, 1.0, 4.0)  # training clearly heavier than then: lend again
    assert _moves(harder) == [(rid, "requested")]


def test_a_lend_that_shortened_the_step_stays(tmp_path):
    control, rid = _lent(tmp_path)
    for step, now in ((1, 20.0), (2, 30.0)):
        out = control.after_rollout(step, now, 2.0, 1.9)  # 2 s against 3 s before
        assert all(to != "releasing" for _, to in _moves(out))
    [trial] = [c for c in control.considered if c["kind"] == "hybrid_trial"]
    assert not trial["apply"] and control.lend_trial is None and control.borrow_floor is None
    assert [r.rid for r in control.pool.training_replicas()] == [rid]


def test_the_jobs_log_says_why_a_trial_sent_a_replica_back_or_held_a_borrow():
    """``runtime/planning.py``: the ``plan_considered`` event of a pool decision names the
    trial's verdict, not the balance of the two times (which says hold, or borrow)."""
    logged, released = [], []
    driver = object.__new__(PlannerDriver)
    driver.s = SimpleNamespace(version=5, runlog=SimpleNamespace(event=lambda kind, **kw: logged.append((kind, kw))))
    driver.control = SimpleNamespace(pool=SimpleNamespace(replica=lambda rid: SimpleNamespace(slots=())))
    driver.instances = {0: [3]}
    driver.relayout = SimpleNamespace(give_back=lambda rid, *rest: released.append(rid) or [])
    back = PoolEvent(10.0, 0, "active", "releasing", "release: lending made the step slower (replica 0 lent at step 2)")
    driver.carry_out([back], {"direction": None, "t_train": 3.4, "t_rollout": 3.5, "predicted_gain_s": None})
    [(kind, first)] = [(k, e) for k, e in logged if k == "plan_considered"]
    assert first["what"] == "hybrid pool: release" and first["decision"] == "applied"
    assert first["reason"].startswith("release: lending made the step slower") and released == [0]
    held = {"direction": "borrow", "t_train": 3.0, "t_rollout": 1.0, "predicted_gain_s": 1.0,
            "held_by": "a lend at this balance made the step slower (training/rollout ≤ 3.3)"}
    driver.carry_out([], held)
    last = [e for k, e in logged if k == "plan_considered"][-1]
    assert last["what"] == "hybrid pool: borrow" and last["decision"] == "kept" and last["reason"] == held["held_by"]
