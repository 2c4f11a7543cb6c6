"""Plan search: slots used once, TP groups on one node, minimums per side, memory-infeasible
shapes never chosen, the objective equals an exhaustive search on small clusters, async
takes the max and sync the sum, a plan at every scale, and GPUs follow the lengths."""

from __future__ import annotations

import math
import random

import pytest

from libra_hpc.cluster.layout import LayoutError, Slot, check_layout
from libra_hpc.planner.costs import (
    LengthProfile,
    LengthSample,
    RolloutCost,
    TrainingCost,
)
from libra_hpc.planner.exhaustive import exhaustive
from libra_hpc.planner.pipeline import pipelined_step_s
from libra_hpc.planner.profiles import load_hardware, load_model
from libra_hpc.planner.search import (
    PlanError,
    PlannerOptions,
    RLBatch,
    objective,
    plan,
    plan_to_layout,
)

Q4, Q14, Q32 = (load_model(n) for n in ("qwen3-4b", "qwen3-14b", "qwen3-32b"))
A800 = load_hardware("a800-80g")
BATCH = RLBatch(global_batch=256, seq_len=8192)


def lengths(scale: float = 1.0, seed: int = 0, batch: int = 256, tail: int = 16000) -> LengthProfile:
    """A long-tailed (Pareto) profile; ``scale`` multiplies every generated length."""
    rng = random.Random(seed)
    samples = [LengthSample(rng.randint(200, 1500), max(1, int(scale * min(tail, rng.paretovariate(1.3) * 600))),
                            rng.randint(1, 4), rng.uniform(0, 10)) for _ in range(256)]
    return LengthProfile.from_samples(samples, batch, buckets=16)


LP = lengths()


DEFAULTS = PlannerOptions()


def check_plan(p, nodes, g, opt=DEFAULTS):
    slots = list(p.train_slots) + [s for inst in p.rollout for s in inst.slots]
    assert sorted(slots) == [Slot(n, i) for n in range(nodes) for i in range(g)]  # every slot exactly once
    assert len(p.train_slots) == p.train.gpus >= opt.min_train_gpus
    assert p.rollout_gpus >= opt.min_rollout_gpus
    for inst in p.rollout:
        assert len(inst.slots) == inst.tp and len({s.node for s in inst.slots}) == 1
    chunks = [p.train_slots[i : i + p.train.tp] for i in range(0, p.train.gpus, p.train.tp)]
    assert all(len({s.node for s in c}) == 1 for c in chunks)
    check_layout(plan_to_layout(p, nodes, g))
    assert p.objective == objective(p.t_train, p.t_rollout, p.mode, opt.in_flight, opt.stream_groups)


@pytest.mark.parametrize("nodes,g", [(1, 8), (2, 8), (6, 8), (3, 4)])
def test_plan_uses_every_slot_once_with_tp_groups_on_one_node(nodes, g):
    r = plan(Q14, A800, nodes, g, LP, BATCH)
    check_plan(r.plan, nodes, g)
    assert r.runners_up and all(c.reason for c in r.runners_up)
    assert TrainingCost(Q14, A800.model_copy(update={"gpus_per_node": g}), r.plan.train).infeasible is None


def test_minimums_per_side_are_respected():
    opt = PlannerOptions(min_train_gpus=24, min_rollout_gpus=16)
    r = plan(Q14, A800, 6, 8, LP, BATCH, options=opt)
    check_plan(r.plan, 6, 8, opt)
    assert r.plan.train_gpus >= 24 and r.plan.rollout_gpus >= 16
    with pytest.raises(PlanError, match="exceed the 16 GPUs"):
        plan(Q14, A800, 2, 8, LP, BATCH, options=PlannerOptions(min_train_gpus=8, min_rollout_gpus=9))


def test_memory_infeasible_candidates_are_never_chosen_and_say_why():
    # Qwen3-32B: a TP1 rollout instance has ~17k KV tokens (< the 16k+prompt longest sequence
    # at scale 1.2), training needs several GPUs per replica.
    lp = lengths(scale=1.2)
    r = plan(Q32, A800, 4, 8, lp, BATCH)
    check_plan(r.plan, 4, 8)
    assert RolloutCost(Q32, A800, 1).kv_capacity_tokens < lp.max_seq_tokens
    assert all(inst.tp > 1 for inst in r.plan.rollout)
    assert TrainingCost(Q32, A800, r.plan.train).infeasible is None
    assert any(c.reason.startswith("infeasible:") and "GB per GPU" in c.reason for c in r.runners_up)


def test_nothing_fits_raises_with_the_reason():
    with pytest.raises(PlanError, match="training shape fits"):
        plan(Q32, A800, 1, 2, LP, BATCH)


SMALL = [(1, 4), (1, 8), (2, 2), (2, 4), (2, 8), (4, 4), (8, 2)]


@pytest.mark.parametrize("mode", ["async", "sync", "pipelined"])
@pytest.mark.parametrize("scale", [0.3, 2.0])
def test_objective_matches_exhaustive_on_small_clusters(mode, scale):
    lp = lengths(scale=scale, seed=3)
    opts = PlannerOptions(in_flight=2) if mode == "pipelined" else PlannerOptions()
    for nodes, g in SMALL:
        want, desc = exhaustive(Q4, A800, nodes, g, lp, BATCH, mode=mode, options=opts)
        got = plan(Q4, A800, nodes, g, lp, BATCH, mode=mode, options=opts).plan
        check_plan(got, nodes, g, opts)
        assert got.objective == pytest.approx(want, rel=1e-9), (nodes, g, got.describe(), desc)


def test_exhaustive_refuses_big_clusters():
    with pytest.raises(PlanError, match="<= 16 GPUs"):
        exhaustive(Q4, A800, 4, 8, LP, BATCH)


def test_async_takes_the_max_and_sync_the_sum():
    a = plan(Q14, A800, 2, 8, LP, BATCH, mode="async").plan
    s = plan(Q14, A800, 2, 8, LP, BATCH, mode="sync").plan
    assert a.objective == max(a.t_train, a.t_rollout)
    assert s.objective == s.t_train + s.t_rollout
    assert s.objective >= a.objective
    with pytest.raises(PlanError, match="mode"):
        plan(Q14, A800, 2, 8, LP, BATCH, mode="overlapped")  # type: ignore[arg-type]


@pytest.mark.parametrize("in_flight,groups", [(1, 0), (2, 0), (2, 16), (4, 0)])
def test_pipelined_minimises_the_pipelines_own_step(in_flight, groups):
    """``pipelined`` values a plan at the bounded-staleness pipeline's step (the control
    loop's objective), and its pick is at least as good under that objective as the
    asynchronous and synchronous searches' picks (k = 0: it is the synchronous sum)."""
    opts = PlannerOptions(in_flight=in_flight, stream_groups=groups)
    p = plan(Q14, A800, 6, 8, LP, BATCH, mode="pipelined", options=opts).plan
    assert p.objective == pytest.approx(pipelined_step_s(p.t_train, p.t_rollout, in_flight - 1, groups))
    for mode in ("async", "sync"):
        other = plan(Q14, A800, 6, 8, LP, BATCH, mode=mode, options=opts).plan
        assert p.objective <= pipelined_step_s(other.t_train, other.t_rollout, in_flight - 1, groups) * (1 + 1e-9)
    if in_flight == 1:
        assert p.objective == pytest.approx(p.t_train + p.t_rollout)


@pytest.mark.parametrize("gpus", [8, 48, 512, 8192])
def test_a_plan_at_every_scale(gpus):
    r = plan(Q14, A800, gpus // 8, 8, LP, BATCH)
    assert math.isfinite(r.plan.objective) and r.plan.train_gpus + r.plan.rollout_gpus == gpus
    if gpus <= 512:
        check_plan(r.plan, gpus // 8, 8)


def test_gpus_follow_the_lengths():
    """Lengths growing step after step move GPUs to rollout; shrinking, back to training."""
    scales = [0.25, 0.5, 1.0, 2.0, 4.0]
    rollout = [plan(Q14, A800, 6, 8, lengths(scale=s, tail=8000), BATCH).plan.rollout_gpus for s in scales]
    assert rollout == sorted(rollout) and rollout[-1] > rollout[0], rollout
    back = [plan(Q14, A800, 6, 8, lengths(scale=s, tail=8000), BATCH).plan.rollout_gpus for s in reversed(scales)]
    assert back == rollout[::-1]


def test_layout_hybrid_nodes_hold_rollout_only():
    p = plan(Q14, A800, 6, 8, LP, BATCH).plan
    layout = plan_to_layout(p, 6, 8, hybrid_nodes=1)
    assert layout.hybrid and all(g.role == "rollout" for g in layout.groups if g.hybrid)
    with pytest.raises(LayoutError, match="hybrid_nodes"):
        plan_to_layout(p, 6, 8, hybrid_nodes=6)


def test_reprice_prices_the_current_plan_on_the_candidates_batch():
    from dataclasses import replace

    from libra_hpc.planner.search import reprice
    current = plan(Q14, A800, 6, 8, LP, BATCH).plan
    assert reprice(current, Q14, A800, 8, LP, batch=BATCH).objective == pytest.approx(current.objective)
    longer = RLBatch(BATCH.global_batch, 2 * BATCH.seq_len)
    same_plan_longer = reprice(current, Q14, A800, 8, LP, batch=longer)
    longer_shape = replace(current.train, seq_len=longer.seq_len)
    assert TrainingCost(Q14, A800, longer_shape).infeasible  # twice the length needs recomputation to fit...
    expected = TrainingCost(Q14, A800, replace(longer_shape, recompute=True)).step_s
    assert same_plan_longer.t_train == pytest.approx(expected) and current.t_train < expected < math.inf
    assert reprice(current, Q14, A800, 8, LP).t_train == pytest.approx(current.t_train)  # no batch: its own
    far = reprice(current, Q14, A800, 8, LP, batch=RLBatch(BATCH.global_batch, 64 * BATCH.seq_len))
    assert far.t_train == math.inf  # ...64 times does not fit even then


def test_reprice_drops_recomputation_the_shorter_batch_does_not_need():
    from dataclasses import replace

    from libra_hpc.planner.search import reprice
    current = plan(Q14, A800, 6, 8, LP, BATCH).plan
    recomputing = replace(current, train=replace(current.train, recompute=True))
    assert reprice(recomputing, Q14, A800, 8, LP, batch=BATCH).t_train == pytest.approx(current.t_train)


def test_training_is_priced_on_the_share_the_step_trains():
    """GRPO groups left out of training (every reward equal, ``rl.filter_zero_variance``):
    rollout still generates them, training does not see them. A profile whose samples are
    a third trained prices training on that third (fewer GPUs to training, the same
    rollout makespan for the same instances); its plan keeps the whole batch's shape."""
    from dataclasses import replace

    from libra_hpc.planner.search import reprice
    rng = random.Random(3)
    base = [LengthSample(rng.randint(200, 1500), max(1, int(0.25 * min(8000, rng.paretovariate(1.3) * 600))),
                         rng.randint(1, 4), rng.uniform(0, 10)) for _ in range(256)]  # training-heavy
    third = [x._replace(trained=i % 3 == 0) for i, x in enumerate(base)]
    whole, part = (LengthProfile.from_samples(s, 256, buckets=16) for s in (base, third))
    assert whole.trained_share == 1.0 and part.trained_share == pytest.approx(86 / 256)
    assert RLBatch.of(256, whole) == RLBatch(256, math.ceil(whole.mean_seq_tokens))  # as before: nothing left out
    batch = RLBatch.of(256, part)
    assert batch.trained == 86 and batch.seq_len == math.ceil(
        sum(x.prompt_len + x.gen_len for x in third if x.trained) / 86)
    p_whole = plan(Q14, A800, 6, 8, whole, RLBatch.of(256, whole)).plan
    p_part = plan(Q14, A800, 6, 8, part, batch).plan
    assert p_part.train_gpus < p_whole.train_gpus, (p_part.describe(), p_whole.describe())
    assert p_part.train.global_batch == 256 and not p_part.train.uneven  # the plan's shape: the whole batch
    same = reprice(p_whole, Q14, A800, 8, part, batch=batch)
    trained_shape = replace(p_whole.train, global_batch=86, seq_len=batch.seq_len, uneven=True)
    assert same.t_train == pytest.approx(TrainingCost(Q14, A800, trained_shape).step_s)
    assert same.t_train < p_whole.t_train
    assert same.t_rollout == pytest.approx(reprice(p_whole, Q14, A800, 8, whole).t_rollout)
