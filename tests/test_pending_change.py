"""One rule for a layout change that waits for its moment (libra_hpc/planner/window.py
``PendingChange``), in the live job and in the simulator. The rule alone, then the job's
planner driver (runtime/planning.py) and the simulator's policy run (sim/controller.py)
driven through one scripted trace of the pipeline: both apply each change at the same
moment of the trace, in the same order."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from libra_hpc.cluster.layout import Group, Layout, Slot
from libra_hpc.planner.window import PendingChange, moves_training
from libra_hpc.runtime.planning import PlannerDriver
from libra_hpc.sim.controller import PolicyRun


def change(reason="pressure", reshard=False, tag="a"):
    return SimpleNamespace(reason=reason, reshard=reshard, tag=tag, step=0,
                           layout=SimpleNamespace(training=None),
                           plan=SimpleNamespace(train=tag, describe=lambda: f"plan {tag}"))


def test_the_rule_waits_for_rollout_the_step_boundary_and_untrained_batches_only_when_training_moves():
    moving = PendingChange(change(), 0.0, moves_training=True)
    rollout_only = PendingChange(change(), 0.0, moves_training=False)
    memory = PendingChange(change(reason="memory: 40 GB needed"), 0.0, moves_training=True)
    quiet = dict(rolling=False, untrained=False, training=False, moving=False)
    for p in (moving, rollout_only, memory):
        assert p.due(**quiet)
        for busy in ("rolling", "training", "moving"):
            assert not p.due(**{**quiet, busy: True}), busy
    waiting = {**quiet, "untrained": True}
    assert not moving.due(**waiting) and rollout_only.due(**waiting) and memory.due(**waiting)


def test_moves_training_compares_the_training_groups_slots_and_shape():
    slots = tuple(Slot(0, g) for g in range(4))
    def layout(tp, dp, n=4):
        return Layout(nodes=1, gpus_per_node=4, groups=(Group(0, "training", slots[:n], tp=tp, dp=dp),))
    assert not moves_training(layout(2, 2), layout(2, 2))
    assert moves_training(layout(2, 2), layout(1, 4))  # a re-shard
    assert moves_training(layout(2, 1, n=2), layout(2, 2))  # other slots


# ------------------------------------------------------------------ the job and the simulator on one trace

# (rolling, untrained, training) at each moment the job and the simulator consult the rule:
# a change is decided at moment 0 with batches in flight; rollout drains, then training.
TRACE = [(True, False, True), (True, True, False), (False, True, True), (False, True, False),
         (False, False, True), (False, False, False), (False, False, False)]


def job_driver(applied):
    d = object.__new__(PlannerDriver)
    d.s = SimpleNamespace(training=False)
    d.relayout = SimpleNamespace(pending=None, moving=lambda: False,
                                 replace=lambda c, pool: applied.append(c.tag) or [])
    d.instances = {}
    return d


def sim_run(applied):
    run = object.__new__(PolicyRun)
    run.rollout = SimpleNamespace(active=set(), configure=lambda *a: None)
    run.ready, run.finished_traj, run.training = set(), {}, False
    run.control = SimpleNamespace(apply=lambda c: applied.append(c.tag))
    run.cfg = SimpleNamespace(costs=SimpleNamespace(reconfig_s=30.0, reshard_s=10.0))
    run.fetching, run.blocked_until, run.reshard_due_s = set(), 0.0, 0.0
    run.rec = SimpleNamespace(events=[])
    run.layout = run.train = None
    run.recent = []
    run._record_allocation = lambda now, why: None
    run._instances = lambda: []
    return run


def decisions(changes, moves):
    """Which change each side applies at each moment of TRACE (the first change decided at
    moment 0, the next once the first is applied)."""
    job, sim = [], []
    d, run = job_driver(job), sim_run(sim)
    d.pending = PendingChange(changes[0], 0.0, moves)
    run.pending = PendingChange(changes[0], 0.0, moves)
    out_job, out_sim = [], []
    for t, (rolling, untrained, training) in enumerate(TRACE):
        d.s.training = training
        n = len(job)
        d.maybe_apply(rolling, untrained)
        if len(job) > n:
            d.pending = None  # carried out (the relayout's Applied clears it in the job)
        run.rollout.active = {1} if rolling else set()
        run.ready, run.training = ({0} if untrained else set()), training
        run._apply_pending(float(t))
        out_job.append(list(job))
        out_sim.append(list(sim))
        for side, applied in ((d, job), (run, sim)):  # the next change is decided once one is applied
            left = [c for c in changes if c.tag not in applied]
            if side.pending is None and left:
                side.pending = PendingChange(left[0], float(t), moves)
    return out_job, out_sim


@pytest.mark.parametrize("moves", [True, False])
def test_the_job_and_the_simulator_apply_the_same_changes_at_the_same_moments(moves):
    first, second = change(tag="replan"), change(reshard=True, tag="reshard")
    job, sim = decisions([first, second], moves)
    assert job == sim
    applied_at = [next(t for t, done in enumerate(job) if tag in done) for tag in ("replan", "reshard")]
    # training moves: it waits for the untrained batches (moment 5); rollout only: the first
    # quiet step boundary with rollout drained (moment 3); the second change follows at once
    assert applied_at == ([5, 6] if moves else [3, 5])


# ------------------------------------------------------------------ a waiting change and the running shape's memory

MEMORY = "memory: training TP2 PP1 DP4 cannot run sequences of 12091 tokens"


def test_a_change_waiting_when_the_running_shape_outgrows_the_batch_is_waited_for_as_for_memory():
    """The job and the simulator, one trace: a replan waits for rollout to drain; a batch
    done meanwhile no longer fits the running shape, and the control loop says the waiting
    change holds it. Both sides then wait for it as for memory: no step trains on the old
    shape, and the change is applied with the batches that wait untrained (they train on it)."""
    job, sim = [], []
    d, run = job_driver(job), sim_run(sim)
    waiting, instead = change(tag="replan"), change(reason=f"{MEMORY}; the waiting change holds them", tag="replan")
    asked = []
    control = SimpleNamespace(while_waiting=lambda step, c: asked.append((step, c.tag)) or instead,
                              apply=lambda c: sim.append(c.tag))
    d.control, run.control = control, control
    d.s.layout, d.s.version = SimpleNamespace(training=None), 6
    run.layout = SimpleNamespace(training=None)
    d.s.runlog = SimpleNamespace(event=lambda kind, **f: None)
    d.pending, run.pending = PendingChange(waiting, 0.0, True, held=[9]), PendingChange(waiting, 0.0, True)
    assert not d.holds_training() and not run._memory_pending()
    d._while_waiting(6)
    run._while_waiting(6, 1.0)
    assert asked == [(6, "replan"), (6, "replan")]
    assert d.holds_training() and run._memory_pending() and d.pending.held == [9]  # the held batch is not lost
    run.oom, run.ready = None, {6}
    assert run._start_training(2.0) == []  # batch 6 waits for the new shape
    d.maybe_apply(rolling=True, untrained=True)
    run.rollout.active = {1}
    run._apply_pending(2.0)
    assert job == sim == []  # rollout still drains
    d.maybe_apply(rolling=False, untrained=True)
    run.rollout.active = set()
    run._apply_pending(3.0)
    assert job == sim == ["replan"]  # applied with batch 6 untrained: it trains on the new shape
    d.pending = None
    assert not d.holds_training()


def test_the_controller_holds_training_and_asks_for_the_change_while_a_memory_change_waits():
    from libra_hpc.runtime.controller import JobController

    c = object.__new__(JobController)
    asked, started = [], []
    c.state = SimpleNamespace(training=False, version=6)
    c.cfg = SimpleNamespace(rl=SimpleNamespace(steps=20))
    c.stop = None
    c.relayout = SimpleNamespace(advance=lambda: [], busy=lambda: False)
    c.batches = SimpleNamespace(rolling=lambda: True, untrained=lambda: True, start=lambda b: started.append(b))
    c._send_all = lambda sends: None
    holds = [True]
    c.planner = SimpleNamespace(holds_training=lambda: holds[0],
                                maybe_apply=lambda rolling, untrained: asked.append((rolling, untrained)) or [])
    c._maybe_train()
    assert started == [] and asked == [(True, True)]
    holds[0] = False
    c._maybe_train()
    assert started == [6]


@pytest.mark.parametrize("partial", [False, True], ids=["whole-batches", "partial-rollout"])
def test_the_simulator_no_longer_trains_a_batch_on_a_shape_it_outgrew_while_a_change_waits(partial):
    """tests/test_control_golden.py's stream with the gate's confirmation at the next step:
    a replan confirmed at step 5 drains while batch 6 outgrows the running shape (out of
    memory at step 6 before the waiting change was checked); now it is waited for as for
    memory and the run completes; now the memory check also holds the last batch's mean,
    and moves training before the replan (the window's mean, over four batches of 128, lags
    the growth). With partial rollout (out of memory at step 3 before either): batch 3's
    mean outgrew the shape while the window's still fit it; and the batch the tail
    decoupler took while the memory change waits trains on the new shape."""
    from libra_hpc.sim.config import load_sim_config
    from libra_hpc.sim.context import Context
    from libra_hpc.sim.policies import SETUPS, control_loop

    repo = __import__("pathlib").Path(__file__).resolve().parent.parent
    ctx = Context(load_sim_config(repo / "configs/sim/context-growth.yaml", {
        "rl.steps": 20, "rl.max_staleness": 3, "planner.prior": {"gen_tokens_median": 200, "turns": 2},
        "planner.confirm_next_step": True, "planner.dwell_same_way": True, "rl.partial_rollout": partial}))
    control = control_loop(ctx, SETUPS["libra"])
    first = control.initial()
    run = PolicyRun(ctx, SETUPS["libra"], first.layout, first.plan.train, ctx.cfg.rl.steps, control)
    run.run()
    assert run.oom is None and len(run.train_done) == 20
    [memory] = [c for c in control.considered if c.get("trigger") == "memory"]
    assert memory["apply"] and "the last batch's" in memory["reason"]  # the window's mean alone still fit
