"""The hybrid pool where it matters (configs/sim/train-bound.yaml: long contexts, short
answers, training costs more than rollout): the control loop weighs a plan by what its
pool can lend, forms the pool (re-splitting the hybrid node's instances) once the measured
times say training binds, lends replicas to training on the uneven DP sizes the job can run,
and beats the same planner without the pool."""

from __future__ import annotations

from pathlib import Path

import pytest

from libra_hpc.sim.config import load_sim_config
from libra_hpc.sim.run import run_scenario

ROOT = Path(__file__).resolve().parents[1]
TRAIN_BOUND = ROOT / "configs" / "sim" / "train-bound.yaml"


@pytest.fixture(scope="module")
def train_bound():
    cfg = load_sim_config(TRAIN_BOUND, {"rl.steps": 30})
    return run_scenario(cfg, ["libra", "libra_no_hybrid"])


def test_libra_forms_the_pool_lends_replicas_and_beats_the_planner_without_it(train_bound):
    libra, alone = train_bound.runs["libra"], train_bound.runs["libra_no_hybrid"]
    assert libra.summary["hybrid_transitions"] > 0 and alone.summary["hybrid_transitions"] == 0
    assert train_bound.ratio("libra", "libra_no_hybrid") > 1.05
    applied = [e for e in libra.events if e.get("kind") == "replan_check" and e.get("apply")]
    assert applied, "the pool-forming re-split is a replan the gate applied"
    lent = [r for r in libra.rows if r["train_gpus"] > 8]
    assert lent and all(r["trajectories"] == train_bound.cfg.batch_size for r in lent)


def test_a_lent_replica_trains_on_a_dp_size_that_does_not_divide_the_batch(train_bound):
    """DP 4 → 5 with 1024 trajectories: priced at the largest share (205), not refused."""
    libra = train_bound.runs["libra"]
    dps = {r["train_gpus"] // 2 for r in libra.rows}  # TP1 PP2: 2 GPUs per replica
    assert any(train_bound.cfg.batch_size % dp for dp in dps), dps


def test_a_replica_released_between_training_steps_serves_rollout_again():
    """a800-swe-drift-mirror: a replica lent at step 4 is sent back while no training step
    runs (releasing → rollout at once). Its instances must serve again: they stayed lent,
    8 of 48 GPUs idle for 30 steps, before the simulator unblocked them on that path."""
    cfg = load_sim_config(ROOT / "configs" / "sim" / "a800-swe-drift-mirror.yaml", {"rl.steps": 12})
    libra = run_scenario(cfg, ["libra"]).runs["libra"]
    back = [e["time"] for e in libra.events if e.get("kind") == "hybrid_transition"
            and e["from_state"] == "releasing" and e["to_state"] == "rollout"]
    assert back, "the scenario no longer releases a replica: pick another that does"
    gpus = cfg.cluster.nodes * cfg.cluster.gpus_per_node
    later = [r for r in libra.rows if r["rollout_start"] > back[0]]
    assert later and all(r["rollout_gpus"] + r["train_gpus"] == gpus for r in later), \
        [(r["step"], r["rollout_gpus"], r["train_gpus"]) for r in later]


def test_a_replica_lent_under_load_takes_no_new_turn_and_hands_its_queue_on():
    """The simulator lends a hybrid replica as the job does (runtime/relayout.py
    ``Relayouts.lend``): the queue service retires its instances, so the turns queued
    on them are placed again at once and none is placed there while they finish what
    they run; they are lent as soon as they run nothing. (They used to stay routable as
    saturated and took their bucket's queue before leaving: a lend on a800-swe-drift took
    effect six steps after it was decided.)"""
    from libra_hpc.sim.context import Context
    from libra_hpc.sim.engine import SimClock
    from libra_hpc.sim.rollout import InstanceSpec, RolloutSide

    cfg = load_sim_config(ROOT / "configs" / "sim" / "cmlfq-premise.yaml", {"rl.steps": 2, "costs.max_num_seqs": 16})
    ctx = Context(cfg)
    drained: dict[int, float] = {}
    side = RolloutSide(ctx.step_models, cfg.scheduler, cfg.costs, "cmlfq", cfg.rl.seed, lambda b, now: None,
                       on_drained=lambda iid, now: drained.setdefault(iid, now) and None)
    side.configure((InstanceSpec(0, 8), InstanceSpec(1, 4, replica=0), InstanceSpec(2, 4, replica=1)), 0.0)
    clock = SimClock()
    clock.schedule_all(side.submit(0, ctx.batch(0), 0.0))
    clock.run(until=30.0)
    lent = side.instances[1]
    queued = side.service.stats()["queued"]
    assert lent.load and sum(queued.values()) > 0, "no load at the lend: lend later"
    prefilled = lent.prefilled
    empty, events = side.block([1], clock.now)
    clock.schedule_all(events)
    assert not empty and side.mode[1] == "drain"
    clock.run()
    assert 1 in drained, "the lent instance never drained"
    assert lent.prefilled == prefilled, "the lent instance took new turns while it drained"
    assert side.left == {}, "the batch did not finish without the lent instance"
