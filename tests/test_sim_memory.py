"""Context growth without running out of memory: plans fit the lengths the batch can reach
(``planner.memory_headroom``), a running shape that no longer would is replaced at once,
and a fixed policy whose shape overflows is reported with its out-of-memory step instead of
crashing the comparison."""

from __future__ import annotations

import statistics
from dataclasses import replace
from pathlib import Path

import pytest

from libra_hpc.planner.costs import LengthProfile, LengthSample
from libra_hpc.planner.profiles import load_hardware, load_model
from libra_hpc.planner.search import PlannerOptions, RLBatch, fitting_training_cost, plan
from libra_hpc.sim.config import load_sim_config
from libra_hpc.sim.context import Context
from libra_hpc.sim.controller import PolicyRun
from libra_hpc.sim.policies import SETUPS
from libra_hpc.sim.report import ratios, table
from libra_hpc.sim.run import run_scenario
from libra_hpc.sim.search import as_candidate, top_plans

ROOT = Path(__file__).resolve().parents[1]
GROWTH = ROOT / "configs" / "sim" / "context-growth.yaml"


def test_a_plan_fits_the_length_the_batch_can_reach():
    """fit_seq_len: every training shape of the plan also runs sequences that long."""
    q14, a800 = load_model("qwen3-14b"), load_hardware("a800-80g")
    lengths = LengthProfile.from_samples([LengthSample(4000, 4000, 4, 10.0)] * 64, 128)
    batch = RLBatch(128, 8000)
    loose = plan(q14, a800, 2, 8, lengths, batch).plan
    safe = plan(q14, a800, 2, 8, lengths, batch, options=PlannerOptions(fit_seq_len=60000)).plan
    assert not fitting_training_cost(q14, a800, replace(safe.train, seq_len=60000)).infeasible
    assert fitting_training_cost(q14, a800, replace(loose.train, seq_len=60000)).infeasible
    assert safe.train.recompute  # it needs recomputation at that length, and is priced with it


@pytest.fixture(scope="module")
def growth():
    """Libra over context-growth's 60 steps from a prior far shorter than the first batches
    (so that its first training shape is sized for short contexts and must move when they
    grow; from the scenario's own prior it starts on a shape that holds all 60 steps), and
    beside it (as ``static_pilot``) one of the best plans for the first 5 batches with
    training sized for them alone, fixed: the best whose shape cannot hold the contexts of
    step 50 even with recomputation."""
    cfg = load_sim_config(GROWTH, {"planner.prior": {"prompt_tokens": 1000, "gen_tokens_median": 300,
                                                     "tail_shape": 1.5, "turns": 2, "tool_s_per_turn": 2.0}})
    result = run_scenario(cfg, ["libra"])
    ctx = Context(cfg)
    late = statistics.fmean(t.total_tokens for t in ctx.batch(50))
    early = [p for p in top_plans(ctx, range(5), 5)
             if fitting_training_cost(ctx.model, ctx.hw, replace(p.train, seq_len=round(late)), ctx.cal).infeasible]
    _, layout, train = as_candidate(ctx, early[0], "early")
    result.runs["static_pilot"] = PolicyRun(ctx, SETUPS["static_pilot"], layout, train, cfg.rl.steps).run()
    return cfg, result


def test_libra_moves_to_a_shape_that_fits_before_it_would_run_out_of_memory(growth):
    cfg, result = growth
    libra = result.runs["libra"]
    assert libra.summary["steps"] == cfg.rl.steps and not result.oom("libra")
    memory = [e for e in libra.events if e.get("trigger") == "memory"]
    assert memory and all(e["apply"] for e in memory)
    assert "cannot run sequences of" in memory[0]["reason"] and "GB per GPU" in memory[0]["reason"]


def test_a_fixed_policy_that_overflows_is_reported_with_its_step_not_raised(growth):
    cfg, result = growth
    oom = result.oom("static_pilot")
    assert oom is not None and 0 < oom["step"] < cfg.rl.steps
    assert oom["shape"].startswith("TP") and oom["seq_tokens"] > 0 and "GB per GPU" in oom["why"]
    assert result.runs["static_pilot"].summary["steps"] == oom["step"]  # every step before it ran
    assert result.failed_steps("static_pilot") == cfg.rl.steps - oom["step"] and result.failed_steps("libra") == 0
    # compared over the steps both completed: the time each took to finish steps 0..oom-1
    m = oom["step"] - 1
    assert result.ratio("libra", "static_pilot") == pytest.approx(result.time_to("static_pilot", m)
                                                                  / result.time_to("libra", m))
    # and its distance to the bound over the steps it completed
    assert result.vs_bound("static_pilot") == pytest.approx(result.bound["cumulative_s"][m]
                                                            / result.time_to("static_pilot", m))
    assert ratios(result)["static_pilot_failed_steps"] == cfg.rl.steps - oom["step"]
    assert any(f"out of memory at step {oom['step']}" in line for line in table(result))


def test_growing_contexts_re_shard_training_to_a_larger_tp_without_draining_rollout(growth):
    """EARL's selector (``parallel.on_memory: reshard``): when the running shape cannot
    hold the sequences the batch may reach, training moves to a larger TP size on the same
    GPUs, the rollout instances stay as they were, and no step is lost."""
    cfg, result = growth
    libra = result.runs["libra"]
    [reshard] = [e for e in libra.events if e["kind"] == "reshard_check" and e["trigger"] == "memory"]
    assert reshard["apply"] and reshard["to_tp"] > reshard["from_tp"]
    moved = [e for e in libra.events if e["kind"] == "tp_reshard"]
    assert [e["step"] for e in moved] == [reshard["step"]]
    allocations = [e for e in libra.events if e["kind"] == "allocation"]
    at = next(i for i, e in enumerate(allocations) if e["why"] == "re-shard")
    rollout = [allocations[i]["describe"].split("| rollout")[1].split(", hybrid")[0] for i in (at - 1, at)]
    assert rollout[0] == rollout[1]  # (the hybrid pool may not form around the new replica shape)
    assert allocations[at]["describe"].startswith(f"train TP{reshard['to_tp']} ")
    assert libra.summary["steps"] == cfg.rl.steps


def _loop(table):
    from libra_hpc.planner.control import ControlLoop, ControlOptions, feasible_tps
    from libra_hpc.planner.costs import Calibration

    q14, a800 = load_model("qwen3-14b"), load_hardware("a800-80g")
    tps = feasible_tps(q14, a800, (8, 4, 2, 1), Calibration())
    options = ControlOptions(nodes=2, gpus_per_node=8, global_batch=64, seq_len=65536, max_staleness=1,
                             rollout_tps=tps, hybrid=False, replan=False, tp_table=table, tp_confirm=2, window=64)
    loop = ControlLoop(q14, a800, options)
    loop.initial()
    return loop


def _after(loop, step: int, context: int):
    loop.observe([LengthSample(context // 2, context - context // 2, 4, 10.0)] * 64)
    return loop.after_rollout(step, 100.0 * step, 60.0, 50.0).change


def test_a_measured_table_re_shards_down_as_contexts_shrink_and_up_as_they_grow():
    """``parallel.training_tp_by_context``: two checks in a row below a threshold move
    training down (DP grows on the same GPUs); back above it two checks move it up; near
    the threshold (within the hysteresis) it stays."""
    start = _loop(None).plan.train
    assert start.tp >= 2, start  # the planner's first shape for this batch; the table halves it below 6000
    loop = _loop(((0, start.tp // 2), (6000, start.tp)))
    assert _after(loop, 1, 9000) is None
    assert _after(loop, 2, 2000) is None  # one check is not enough
    down = _after(loop, 3, 2000)
    assert down is not None and down.reshard and down.plan.train.tp == start.tp // 2
    assert down.plan.train.gpus == start.gpus and down.plan.train.dp == 2 * start.dp
    assert down.plan.rollout == loop.plan.rollout and "the table says" in down.reason
    loop.apply(down)
    assert _after(loop, 4, 2000) is None and _after(loop, 5, 2000) is None
    assert _after(loop, 6, 9000) is None  # TP1 still holds 9000 tokens: no forced move, one check
    up = _after(loop, 7, 9000)
    assert up is not None and up.reshard and up.plan.train.tp == start.tp
    loop.apply(up)
    assert _after(loop, 8, 5500) is None and _after(loop, 9, 5500) is None  # within 10% of 6000: stays


def _held(loop, shape=None) -> int:
    """The longest packed sequence training ``shape`` (the running one by default) holds
    without recomputation."""
    shape = shape or loop.training_shape()
    lo, hi = 1, loop.o.seq_len
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fitting_training_cost(loop.model, loop.hw, replace(shape, seq_len=mid, recompute=False), loop.cal).infeasible:
            hi = mid - 1
        else:
            lo = mid
    return lo


def test_a_change_waiting_while_the_batch_outgrows_the_running_shape_is_waited_for_as_for_memory():
    """``ControlLoop.while_waiting`` on the real loop: a change waits for its moment
    (rollout draining) and the next batch no longer fits the running shape at
    ``memory_headroom`` × its mean. A waiting change whose shape holds it is named again, as
    made for memory (the job and the simulator then hold training for it); one whose shape
    does not is replaced by the memory change the loop makes then; while the running shape
    holds the batch, nothing."""
    loop = _loop(None)
    loop.o = replace(loop.o, replan=True)
    held = _held(loop)

    def batch(context: int):
        return [LengthSample(context // 2, context - context // 2, 4, 10.0)] * 64

    roomy = loop._change(1, loop.best_plan(LengthProfile.from_samples(batch(held), 64)), "a replan for speed", None)
    assert _held(loop, roomy.plan.train) >= 1.25 * held
    stay = replace(roomy, plan=loop.plan)  # a change that keeps the running training shape
    loop.observe(batch(held // 2))
    assert loop.while_waiting(1, roomy) is None
    loop.observe(batch(int(held / 1.1)))  # 1.25 × its mean is over what the running shape holds
    named = loop.while_waiting(2, roomy)
    assert named is not None and named.plan is roomy.plan
    assert named.reason.startswith("memory") and "the waiting change holds them" in named.reason
    instead = loop.while_waiting(2, stay)
    assert instead is not None and instead.reason.startswith("memory")
    assert _held(loop, instead.plan.train) >= 1.25 * int(held / 1.1)
