"""Which way the hybrid pool moves a replica (``ControlLoop.hybrid_gain``, ``HybridLending.decide``):
the move the cost models predict to shorten the pipelined step the most, not "lend when
training is the slower side". With staleness 1 a step is (makespan + training) / 2 while
rollout is the longer side, so a lend that halves training pays when the rollout's makespan
is set by its tool chains and barely moves without the replica's instance, and does not
when it is set by decoding, which the instance taken away slows. Driven by hand: a pinned
plan whose hybrid node can lend one TP8 replica (tests/sim_cases.py)."""

from __future__ import annotations

from libra_hpc.cluster.layout import Group, Layout, Slot, lend_hybrid_to_training
from libra_hpc.planner.costs import LengthSample
from libra_hpc.planner.hybrid import HybridPool
from libra_hpc.sim.policies import SETUPS, control_loop
from tests.sim_cases import hybrid_case


def _moves(out):
    return [(e.replica, e.to_state) for e in out.pool_events if e.changed]


def _loop(tmp_path, samples):
    ctx, plan = hybrid_case(tmp_path)
    control = control_loop(ctx, SETUPS["libra_no_replan"])
    control.start(plan, "pinned for the test")
    control.observe(samples)
    return control


def test_a_replica_is_lent_while_rollout_is_longer_when_the_tool_chains_set_its_makespan(tmp_path):
    # four trajectories of 12 turns that wait 10 s on a tool each turn: 120 s of chain, a few
    # hundred decoded tokens; the instance of the hybrid node adds almost nothing to them
    control = _loop(tmp_path, [LengthSample(500, 400, 12, 120.0)] * 4)
    makespan, t_train = 125.0, 60.0  # rollout the longer side: the step is (125 + 60) / 2
    direction, gain = control.hybrid_move(t_train, makespan)
    assert direction == "borrow" and gain > 0.1 * makespan  # about (60 - 30) / 2 saved
    out = control.after_rollout(0, 10.0, makespan, t_train)
    assert _moves(out) == [(0, "requested")]


def test_no_replica_is_lent_when_decoding_sets_the_makespan(tmp_path):
    # the same times, but long generations and no tool: the makespan is decode steps, which
    # half the rollout GPUs make about twice as long
    control = _loop(tmp_path, [LengthSample(500, 60_000, 1, 0.0)] * 4)
    makespan, t_train = 125.0, 60.0
    assert control.hybrid_gain("borrow", t_train, makespan) < 0
    out = control.after_rollout(0, 10.0, makespan, t_train)
    assert _moves(out) == [] and not control.pool.training_replicas()


def test_a_replica_goes_back_when_rollout_would_gain_more_than_training_loses(tmp_path):
    control = _loop(tmp_path, [LengthSample(500, 60_000, 1, 0.0)] * 4)
    out = control.after_rollout(0, 10.0, 1.0, 30.0)  # training binds: lend
    [(rid, _)] = _moves(out)
    control.progress(rid, 11.0)
    control.progress(rid, 12.0)
    control.after_training_step(13.0)
    control.lending.trial = None  # judged already (the trial's own test is below)
    direction, gain = control.hybrid_move(1.0, 400.0)  # then decoding binds: 400 s a batch
    assert direction == "release" and gain > 0


def test_lent_replicas_are_whole_runs_of_the_hybrid_node_so_that_narrow_instances_form_a_pool():
    """TP1 PP4 training: a replica is 4 slots; the hybrid node's two TP4 instances must each be
    one replica (lending one stops no other). Replicas strided over the pipeline stages took
    every other slot of the node, and no TP4 or TP8 instance there could form a pool."""
    nodes, per = 3, 8
    node = lambda n: tuple(Slot(n, g) for g in range(per))
    train = Group(0, "training", node(0) + node(1)[:4] + node(1)[4:], 1, 4, 4)
    groups = (train, Group(1, "rollout", node(2)[:4], 4, hybrid=True), Group(2, "rollout", node(2)[4:], 4, hybrid=True))
    layout = Layout(nodes, per, groups, frozenset(node(2)))
    pool = HybridPool.from_layout(layout, min_rollout_gpus=1)
    assert [set(r.slots) for r in pool.all_replicas()] == [set(node(2)[:4]), set(node(2)[4:])]
    grown = lend_hybrid_to_training(layout, "both").training
    assert grown.dp == 6 and set(grown.replica_slots(4)) == set(node(2)[:4])


def test_a_lend_on_trial_is_judged_by_what_it_did_not_released_on_a_prediction(tmp_path):
    control = _loop(tmp_path, [LengthSample(500, 60_000, 1, 0.0)] * 4)
    [(rid, _)] = _moves(control.after_rollout(0, 10.0, 1.0, 30.0))  # training binds: lend
    control.progress(rid, 11.0)
    control.progress(rid, 12.0)
    control.after_training_step(13.0)
    assert control.hybrid_gain("release", 1.0, 400.0) > 0  # predicted to pay ...
    assert control.hybrid_move(1.0, 400.0) == (None, None)  # ... but not a move the gate weighs on trial
    out = control.after_rollout(1, 20.0, 400.0, 1.0)
    assert _moves(out) == [] and control.lend_trial is not None  # ... but the trial has one rollout of two
    out = control.after_rollout(2, 30.0, 400.0, 1.0)  # its verdict: the step got slower, back it goes
    assert _moves(out) == [(rid, "releasing")] and "lending made the step slower" in out.pool_events[-1].reason


def test_no_second_replica_is_lent_while_the_first_is_on_trial():
    """A second lend while the first is on trial would replace its trial, so that the first
    was never judged: the pool waits for the verdict, then may lend the next replica."""
    from libra_hpc.planner.hybrid import HybridReplica
    from libra_hpc.planner.lending import HybridLending

    pool = HybridPool([HybridReplica(i, (Slot(1 + i, 0), Slot(1 + i, 1))) for i in range(2)],
                      min_rollout_gpus=2, rollout_core_gpus=2, training_core_gpus=4)
    lending = HybridLending(0.1)
    pays = {"borrow": 40.0, "release": -40.0}  # a lend predicted to save 40 s of a 100 s step

    def decide(step, now, t_train=100.0, t_roll=80.0):
        events, _ = lending.decide(pool, step, now, t_train, t_roll, gain=pays.get, can_grow=lambda: True)
        return [(e.replica, e.to_state) for e in events or [] if e.changed]

    assert decide(0, 0.0) == [(0, "requested")] and lending.trial["rid"] == 0
    for phase in range(3):  # requested -> fetching_state -> zero_grad_sync -> active
        pool.progress(0, 1.0 + phase)
    assert [r.rid for r in pool.training_replicas()] == [0]
    assert decide(1, 10.0) == []  # on trial (one measured rollout of two): no second lend
    assert lending.trial["rid"] == 0
    assert decide(2, 20.0, t_train=70.0, t_roll=80.0) == [(1, "requested")]  # kept: the next one goes
    assert lending.trial["rid"] == 1
