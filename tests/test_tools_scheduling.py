"""The pure action scheduler on an injected clock: capacity, exactly-once completion,
quotas, no starvation, elastic pool accounting, and the dedicated baseline's binding."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from libra_hpc.envs.synthetic import SyntheticWorkload
from libra_hpc.sim.config import load_sim_config
from libra_hpc.tools.pool import ElasticPool, ResourceSpec
from libra_hpc.tools.replay import (
    ToolCall,
    TraceShape,
    TrajectoryTrace,
    make_trace,
    replay,
)
from libra_hpc.tools.scheduling import Action, DurationEstimator, make_scheduler

POLICIES = ["tangram", "dedicated"]


def _peak(log, key):
    """Max concurrent actions per ``key(event)`` from a replay log; checks no unit runs two."""
    live, peak, units_in_use = {}, {}, {}
    for event in sorted(log, key=lambda e: (e[0], 0 if e[1] == "done" else 1)):
        _time, kind, aid, resource, unit, _tool = event
        group = key(event)
        if kind == "start":
            assert (resource, unit) not in units_in_use.values(), f"unit {resource}/{unit} given two actions"
            units_in_use[aid] = (resource, unit)
            live[group] = live.get(group, 0) + 1
            peak[group] = max(peak.get(group, 0), live[group])
        else:
            units_in_use.pop(aid)
            live[group] -= 1
    return peak


calls = st.builds(ToolCall, gap_s=st.floats(0, 5), tool=st.sampled_from(["python", "tests", "search"]),
                  resource=st.sampled_from(["cpu", "reward"]), duration_s=st.floats(0.01, 10))
trajectories = st.lists(st.builds(TrajectoryTrace, tid=st.just(""), start_s=st.floats(0, 20),
                                  calls=st.lists(calls, max_size=6).map(tuple), tail_s=st.floats(0, 5)),
                        min_size=1, max_size=25)


@settings(max_examples=60, deadline=None)
@given(trajs=trajectories, policy=st.sampled_from(POLICIES), cpu=st.integers(1, 4), reward=st.integers(1, 3),
       startup=st.sampled_from([0.0, 0.5]), quota=st.integers(1, 2))
def test_capacity_quota_and_exactly_once_under_random_traces(trajs, policy, cpu, reward, startup, quota):
    trajs = [TrajectoryTrace(f"t{i}", t.start_s, t.calls, t.tail_s) for i, t in enumerate(trajs)]
    specs = [ResourceSpec("cpu", cpu, idle_timeout_s=1.0, startup_s=startup), ResourceSpec("reward", reward)]
    scheduler = make_scheduler(policy, specs, quotas={"search": quota}, aging_rate=0.5)
    result = replay(scheduler, trajs, keep_log=True)
    n_calls = sum(len(t.calls) for t in trajs)
    starts = [e[2] for e in result.log if e[1] == "start"]
    dones = [e[2] for e in result.log if e[1] == "done"]
    assert len(starts) == len(set(starts)) == n_calls and sorted(dones) == sorted(starts)
    peak = _peak(result.log, key=lambda e: e[3])
    assert peak.get("cpu", 0) <= cpu and peak.get("reward", 0) <= reward
    assert all(pool.peak <= pool.spec.max_units for pool in scheduler.pools.values())
    assert _peak(result.log, key=lambda e: e[5]).get("search", 0) <= quota
    assert result.held_s >= result.busy_s - 1e-6  # a unit is held whenever it runs something


def test_quota_limits_concurrency_of_one_tool():
    scheduler = make_scheduler("tangram", [ResourceSpec("cpu", 8)], quotas={"search": 2})
    for i in range(5):
        scheduler.new_action(f"t{i}", "search", "cpu", 0.0, expected_s=1.0)
    scheduler.new_action("t9", "python", "cpu", 0.0, expected_s=5.0)
    started = scheduler.dispatch(0.0)
    assert sorted(d.action.tool for d in started) == ["python", "search", "search"]
    scheduler.complete(started[0].action.aid if started[0].action.tool == "search" else started[1].action.aid, 1.0)
    assert [d.action.tool for d in scheduler.dispatch(1.0)] == ["search"]


def test_shortest_expected_first_then_aging_orders_by_virtual_deadline():
    scheduler = make_scheduler("tangram", [ResourceSpec("cpu", 1)], aging_rate=1.0)
    blocker = scheduler.new_action("b", "x", "cpu", 0.0, expected_s=0.0)
    assert [d.action for d in scheduler.dispatch(0.0)] == [blocker]
    long = scheduler.new_action("t1", "tests", "cpu", 0.0, expected_s=10.0)  # deadline 10
    short = scheduler.new_action("t2", "python", "cpu", 1.0, expected_s=1.0)  # deadline 2
    late_short = scheduler.new_action("t3", "python", "cpu", 9.5, expected_s=1.0)  # deadline 10.5
    order = []
    previous, now = blocker, 10.0
    for _ in range(3):
        scheduler.complete(previous.aid, now)
        (started,) = scheduler.dispatch(now)
        order.append(started.action)
        previous, now = started.action, now + 1
    assert order == [short, long, late_short]


@pytest.mark.parametrize("aging_rate, starves", [(0.5, False), (1e-6, True)])
def test_no_starvation_under_a_constant_stream_of_short_actions(aging_rate, starves):
    """One unit, a new 1 s action every second for 200 s (the unit is always busy), and
    one long action submitted at t=0.5. With aging it starts by its virtual deadline plus
    the work queued before it; with (almost) pure shortest-first it waits for the stream
    to end."""
    scheduler = make_scheduler("tangram", [ResourceSpec("cpu", 1)], aging_rate=aging_rate)
    stream_end, running, long, long_started = 200.0, None, None, None
    for step in range(400):
        t = float(step)
        if running is not None and running[1] <= t:
            scheduler.complete(running[0].aid, t)
            running = None
        if t < stream_end:
            scheduler.new_action("stream", "python", "cpu", t, expected_s=1.0)
        if step == 0:
            long = scheduler.new_action("long", "tests", "cpu", t, expected_s=20.0)
        for d in scheduler.dispatch(t):
            running = (d.action, t + (20.0 if d.action is long else 1.0))
            if d.action is long:
                long_started = t
        if long_started is not None:
            break
    if starves:
        assert long_started >= stream_end  # the failure mode aging exists to prevent
    else:  # its virtual deadline, plus the one short action running then
        assert long_started is not None and long_started <= 20.0 / aging_rate + 1.0


@settings(max_examples=40, deadline=None)
@given(arrivals=st.lists(st.tuples(st.floats(0, 50), st.floats(0, 30)), min_size=1, max_size=40),
       aging=st.floats(0.05, 5))
def test_every_action_waits_at_most_for_earlier_deadlines(arrivals, aging):
    """The starvation bound as a property: with one unit, when an action starts, every
    action still waiting has a virtual deadline no smaller than it."""
    scheduler = make_scheduler("tangram", [ResourceSpec("cpu", 1)], aging_rate=aging)
    events = sorted(arrivals)
    waiting: list[Action] = []
    t, running = 0.0, None
    i = 0
    while i < len(events) or waiting or running:
        next_arrival = events[i][0] if i < len(events) else float("inf")
        next_done = running[1] if running else float("inf")
        t = min(next_arrival, next_done)
        if running and running[1] == t:
            scheduler.complete(running[0].aid, t)
            running = None
        while i < len(events) and events[i][0] == t:
            waiting.append(scheduler.new_action(f"t{i}", "x", "cpu", t, expected_s=events[i][1]))
            i += 1
        for d in scheduler.dispatch(t):
            waiting.remove(d.action)
            assert all(scheduler.deadline(w) >= scheduler.deadline(d.action) for w in waiting)
            running = (d.action, t + 1.0)


def test_pool_grows_with_demand_and_shrinks_after_idle_timeout():
    spec = ResourceSpec("cpu", max_units=3, min_units=1, idle_timeout_s=10.0, startup_s=2.0)
    scheduler = make_scheduler("tangram", [spec])
    pool = scheduler.pools["cpu"]
    assert len(pool.units) == 1
    for i in range(5):
        scheduler.new_action(f"t{i}", "x", "cpu", 0.0, expected_s=1.0)
    assert len(scheduler.dispatch(0.0)) == 1 and len(pool.units) == 3  # grew to max; two still starting
    assert scheduler.next_wakeup(0.0) == 2.0
    assert len(scheduler.dispatch(2.0)) == 2
    for aid in list(scheduler.running):
        scheduler.complete(aid, 3.0)
    assert len(scheduler.dispatch(3.0)) == 2
    for aid in list(scheduler.running):
        scheduler.complete(aid, 4.0)
    assert scheduler.next_retirement(4.0) == 13.0  # unit 2, idle since 3
    retired = []
    scheduler.on_retire = lambda resource, unit: retired.append((resource, unit))
    scheduler.dispatch(100.0)
    assert len(pool.units) == 1  # shrank to min_units
    assert retired == [("cpu", 2), ("cpu", 0)] and scheduler.next_retirement(100.0) is None  # at min_units
    # unit 2 idle since 3 → retired at 13; units 0 and 1 idle since 4: the lower index goes
    # first (retired at 14), unit 1 stays (min_units) and is held until 100
    assert sorted(pool.units) == [1]
    assert scheduler.held_seconds(100.0) == pytest.approx(13.0 + 14.0 + 100.0)


def test_pool_reuses_unit_numbers_and_never_exceeds_max():
    pool = ElasticPool(ResourceSpec("cpu", max_units=2, idle_timeout_s=0.0))
    a, b = pool.grow(0.0), pool.grow(0.0)
    assert pool.grow(0.0) is None and (a.index, b.index) == (0, 1)
    a.idle_since = 0.0
    pool.retire_idle(1.0)
    assert pool.grow(1.0).index == 0


def test_dedicated_baseline_binds_one_unit_per_trajectory_until_it_ends():
    scheduler = make_scheduler("dedicated", [ResourceSpec("cpu", 1)])
    first = scheduler.new_action("A", "python", "cpu", 0.0)
    other = scheduler.new_action("B", "python", "cpu", 0.0)
    assert [d.action for d in scheduler.dispatch(0.0)] == [first]
    scheduler.complete(first.aid, 1.0)
    assert scheduler.dispatch(1.0) == []  # A still owns the unit during its LLM turn
    again = scheduler.new_action("A", "python", "cpu", 5.0)
    assert [d.action for d in scheduler.dispatch(5.0)] == [again]
    scheduler.complete(again.aid, 6.0)
    scheduler.end_trajectory("A", 8.0)
    assert [d.action for d in scheduler.dispatch(8.0)] == [other]


@pytest.mark.parametrize("policy", POLICIES)
def test_drop_queued_empties_one_resource_and_leaves_the_scheduler_usable(policy):
    """What the orchestrator does when a resource kind cannot run anything (no sandbox starts)."""
    scheduler = make_scheduler(policy, [ResourceSpec("cpu", 1), ResourceSpec("reward", 1)])
    running = scheduler.new_action("A", "python", "cpu", 0.0)
    queued = [scheduler.new_action(t, "python", "cpu", 0.0) for t in ("A", "B", "C")]
    reward = scheduler.new_action("B", "reward", "reward", 0.0)
    assert {d.action for d in scheduler.dispatch(0.0)} == {running, reward}
    assert sorted(a.aid for a in scheduler.drop_queued("cpu")) == sorted(a.aid for a in queued)
    assert scheduler.queued() == 0 and scheduler.drop_queued("cpu") == []
    scheduler.complete(running.aid, 1.0)
    scheduler.complete(reward.aid, 1.0)
    assert scheduler.dispatch(1.0) == []  # nothing of the dropped actions runs
    for trajectory in ("A", "B", "C"):
        scheduler.end_trajectory(trajectory, 1.0)
    later = scheduler.new_action("D", "python", "cpu", 2.0)
    assert [d.action for d in scheduler.dispatch(2.0)] == [later]


def test_tangram_beats_the_dedicated_baseline_on_a_bursty_trace():
    """Two waves of 48 trajectories of the paper's SWE workload on 8 CPU sandboxes (seeds
    0-3 measured: tangram's mean ACT 0.14-0.19 of dedicated's, held 0.39-0.59)."""
    cfg = load_sim_config(Path(__file__).resolve().parents[1] / "configs/sim/a800-swe.yaml", {"rl.prompts_per_step": 6})
    trace = make_trace(SyntheticWorkload(cfg.workload, cfg.rl, 3, cfg.training.seq_len), TraceShape(waves=2))
    assert len(trace) == 96
    results = {}
    for policy in POLICIES:
        specs = [ResourceSpec("cpu", 8, idle_timeout_s=10.0, startup_s=1.0), ResourceSpec("reward", 4, startup_s=1.0)]
        estimator = DurationEstimator({t.name: t.latency_s.median for t in cfg.workload.tools} | {"reward": 1.5})
        results[policy] = replay(make_scheduler(policy, specs, estimator=estimator, aging_rate=0.05), trace)
    assert results["tangram"].mean_act < results["dedicated"].mean_act / 3
    assert results["tangram"].held_s < results["dedicated"].held_s * 0.75
    assert results["tangram"].busy_s == pytest.approx(results["dedicated"].busy_s)  # same work either way


def test_bad_input_is_refused_with_the_field():
    with pytest.raises(ValueError, match="tools.policy"):
        make_scheduler("fifo", [ResourceSpec("cpu", 1)])
    with pytest.raises(ValueError, match="aging_rate"):
        make_scheduler("tangram", [ResourceSpec("cpu", 1)], aging_rate=0.0)
    with pytest.raises(ValueError, match="tools.quotas.search"):
        make_scheduler("tangram", [ResourceSpec("cpu", 1)], quotas={"search": 0})
    scheduler = make_scheduler("tangram", [ResourceSpec("cpu", 1)])
    with pytest.raises(ValueError, match="needs resource 'gpu'"):
        scheduler.new_action("t", "x", "gpu", 0.0)
    with pytest.raises(KeyError, match="not running"):
        scheduler.complete("a999", 0.0)
    with pytest.raises(ValueError, match="min_units"):
        ResourceSpec("cpu", max_units=1, min_units=2)


@pytest.mark.parametrize("module", ["libra_hpc.tools", "libra_hpc.tools.scheduling", "libra_hpc.tools.replay"])
def test_orchestration_logic_imports_neither_mpi_nor_torch(module):
    code = f"import sys, {module}; print(sorted({{m.split('.')[0] for m in sys.modules}} & {{'torch', 'mpi4py'}}))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
