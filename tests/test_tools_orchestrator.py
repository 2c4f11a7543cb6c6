"""The live orchestrator: real sandboxes and a real local HTTP scorer endpoint, driven by
the same schedulers as the replay, through one interface for both policies."""

from __future__ import annotations

import threading
import time

import pytest

from libra_hpc.config import validate_config
from libra_hpc.tools.endpoint import EndpointError, EndpointRunner, serve_scorer
from libra_hpc.tools.isolation import SandboxLimits, SandboxUnavailable
from libra_hpc.tools.orchestrator import (
    SandboxRunner,
    ToolOrchestrator,
    orchestrator_from_config,
)
from libra_hpc.tools.pool import ResourceSpec
from libra_hpc.tools.procs import owned_pids
from libra_hpc.tools.scheduling import make_scheduler

UID_BASE = 220000
WALL_S = 60.0  # the sandboxes' wall limit: a hang guard, no call here is meant to reach it
WAIT_S = 120.0  # how long a test waits for a result (or for its peers at a barrier): a hang guard too


def _overlap(records, key):
    """Peak number of actions running at once per ``key(record)``."""
    edges = sorted([(r["started"], 1, key(r)) for r in records] + [(r["done"], 0, key(r)) for r in records])
    live, peak = {}, {}
    for _time, up, group in edges:
        live[group] = live.get(group, 0) + (1 if up else -1)
        peak[group] = max(peak.get(group, 0), live[group])
    return peak


class SleepRunner:
    """A runner that records concurrency: payload = seconds to hold the unit."""

    def __init__(self):
        self.lock = threading.Lock()
        self.live = self.peak = 0
        self.units_seen = set()

    def run(self, unit, payload):
        with self.lock:
            self.live += 1
            self.peak = max(self.peak, self.live)
            self.units_seen.add(unit)
        time.sleep(payload)
        with self.lock:
            self.live -= 1
        return payload


class GatedRunner(SleepRunner):
    """A SleepRunner whose ``"together"`` actions each wait until ``together`` of them run at
    once (other payloads return at once): the peak reaches ``together`` whatever the speed of
    the host; the barrier's timeout only guards against a hang."""

    def __init__(self, together: int):
        super().__init__()
        self.barrier = threading.Barrier(together)

    def run(self, unit, payload):
        with self.lock:
            self.live += 1
            self.peak = max(self.peak, self.live)
            self.units_seen.add(unit)
        if payload == "together":
            self.barrier.wait(timeout=WAIT_S)
        with self.lock:
            self.live -= 1
        return payload


class FakeClock:
    """Monotonic seconds that move only when the test says so."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def exact_match_reward(payload):
    """Toy reward model: 1 when the answer equals the reference; takes 50 ms like a small model."""
    time.sleep(0.05)
    return {"reward": float(payload["answer"] == payload["reference"])}


class CountedScorer:
    """A scorer that records how many of its calls run at once. The server's own
    ``peak_in_flight`` counts a request until after its answer is written, by when the client
    may have sent its next one; a call of the scorer ends before its answer leaves."""

    def __init__(self, score):
        self.score, self.lock = score, threading.Lock()
        self.live = self.peak = 0

    def __call__(self, payload):
        with self.lock:
            self.live += 1
            self.peak = max(self.peak, self.live)
        try:
            return self.score(payload)
        finally:
            with self.lock:
                self.live -= 1


@pytest.fixture()
def scoring():
    return CountedScorer(exact_match_reward)


@pytest.fixture()
def scorer(scoring):
    server = serve_scorer(scoring)
    yield server
    server.close()


@pytest.mark.parametrize("policy", ["tangram", "dedicated"])
def test_real_sandboxes_and_endpoint_complete_every_call_within_capacity(policy, scorer, scoring):
    specs = [ResourceSpec("cpu", 2, idle_timeout_s=0.5), ResourceSpec("reward", 2)]
    runners = {"cpu": SandboxRunner(SandboxLimits(wall_time_s=WALL_S), uid_base=UID_BASE),
               "reward": EndpointRunner(scorer.url)}
    orch = ToolOrchestrator(make_scheduler(policy, specs, quotas={"search": 1}), runners)
    futures = {}
    for traj in range(4):
        for call in range(2):
            futures[(traj, call, "cpu")] = orch.submit(f"t{traj}", "python", "cpu", f"print({traj} * 100 + {call})")
        futures[(traj, 0, "search")] = orch.submit(f"t{traj}", "search", "cpu", {"code": "print('q')", "tool": "search"})
        futures[(traj, 0, "reward")] = orch.submit(f"t{traj}", "reward", "reward",
                                                   {"answer": str(traj), "reference": "2"})
    for traj in range(4):  # the dedicated baseline frees a trajectory's unit only when it ends
        for key in [k for k in futures if k[0] == traj]:
            futures[key].result(timeout=WAIT_S)
        orch.end_trajectory(f"t{traj}")
    orch.close()
    for (traj, call, kind), future in futures.items():
        result = future.result()
        if kind == "cpu":
            assert result.stdout == f"{traj * 100 + call}\n" and result.state.status == "success"
        elif kind == "reward":
            assert result["reward"] == (1.0 if traj == 2 else 0.0)
    records = orch.records
    assert sorted(r["aid"] for r in records) == sorted({r["aid"] for r in records}) and len(records) == len(futures)
    peak = _overlap(records, key=lambda r: r["resource"])
    assert peak["cpu"] <= 2 and peak["reward"] <= 2 and scoring.peak <= 2
    assert _overlap(records, key=lambda r: r["tool"])["search"] <= 1
    assert owned_pids(uid=UID_BASE) == [] and owned_pids(uid=UID_BASE + 1) == []
    assert orch.held_seconds() > 0


def test_tangram_shares_units_across_trajectories_and_shrinks_when_idle():
    runner, clock = GatedRunner(together=3), FakeClock()
    orch = ToolOrchestrator(make_scheduler("tangram", [ResourceSpec("cpu", 3, idle_timeout_s=0.2)]), {"cpu": runner},
                            clock=clock)
    futures = [orch.submit(f"t{i}", "x", "cpu", "together") for i in range(9)]
    assert [f.result(timeout=WAIT_S) for f in futures] == ["together"] * 9  # three rounds of three at once
    assert runner.peak == 3 and runner.units_seen == {0, 1, 2}  # nine trajectories on three units
    pool = orch.scheduler.pools["cpu"]
    assert orch.submit("early", "x", "cpu", 0.0).result(timeout=WAIT_S) == 0.0 and len(pool.units) == 3  # idle 0 s
    clock.now += 0.2  # every unit has been idle for the timeout
    assert orch.submit("late", "x", "cpu", 0.0).result(timeout=WAIT_S) == 0.0  # a dispatch notices the idle units
    assert len(pool.units) == 1  # the three retired, one grown again for the late call
    orch.close()


def test_dedicated_baseline_makes_other_trajectories_wait_for_the_owner_to_end():
    runner = SleepRunner()
    orch = ToolOrchestrator(make_scheduler("dedicated", [ResourceSpec("cpu", 1)]), {"cpu": runner})
    first = orch.submit("A", "x", "cpu", 0.05)
    other = orch.submit("B", "x", "cpu", 0.0)
    first.result(timeout=WAIT_S)  # A's completion has dispatched again (under the lock) by now
    scheduler = orch.scheduler
    assert not other.running() and not other.done()  # A holds the only sandbox during its (simulated) LLM turn
    assert scheduler.queued() == 1 and list(scheduler.waiting["cpu"]) == ["B"] and scheduler.running == {}
    assert scheduler.pools["cpu"].units[0].bound_to == "A"
    orch.end_trajectory("A")
    assert other.result(timeout=WAIT_S) == 0.0
    orch.close()


def test_runner_errors_reach_the_caller_and_free_the_unit():
    orch = ToolOrchestrator(make_scheduler("tangram", [ResourceSpec("reward", 1)]),
                            {"reward": EndpointRunner("http://127.0.0.1:9/score", timeout_s=1.0)})
    with pytest.raises(EndpointError, match="unreachable"):
        orch.submit("t", "reward", "reward", {"x": 1}).result(timeout=WAIT_S)
    assert orch.scheduler.running == {}
    orch.close()


@pytest.mark.parametrize("policy", ["tangram", "dedicated"])
def test_when_no_sandbox_can_start_every_action_fails_at_once_with_the_reason(policy):
    """An interpreter that cannot run inside the sandbox (here: missing) fails the probe. The
    running action, the queued ones (trajectories that never got a unit, and whose callers
    never end them) and later ones fail at once; close() finds nothing pending."""
    runner = SandboxRunner(SandboxLimits(wall_time_s=WALL_S), uid_base=UID_BASE + 20, python="/nonexistent/bin/python")
    orch = ToolOrchestrator(make_scheduler(policy, [ResourceSpec("cpu", 2), ResourceSpec("reward", 1)]),
                            {"cpu": runner, "reward": SleepRunner()})
    futures = [orch.submit(f"t{traj}", "python", "cpu", "print(1)") for traj in range(4) for _call in range(3)]
    for future in futures:
        with pytest.raises(SandboxUnavailable, match="needs bwrap, which cannot run here"):
            future.result(timeout=WAIT_S)
    late = orch.submit("t9", "python", "cpu", "print(1)")
    assert late.done() and isinstance(late.exception(), SandboxUnavailable)
    assert orch.submit("t0", "reward", "reward", 0.0).result(timeout=WAIT_S) == 0.0  # other kinds still run
    orch.close(timeout_s=WAIT_S)
    assert orch.scheduler.queued() == 0 and orch.scheduler.running == {}


def test_scorer_failure_is_an_http_error_with_the_reason():
    server = serve_scorer(lambda p: 1 / 0)
    try:
        with pytest.raises(EndpointError, match="500.*ZeroDivisionError"):
            EndpointRunner(server.url).run(0, {})
    finally:
        server.close()


def test_orchestrator_from_config_uses_the_tools_section(scorer):
    cfg = validate_config({"tools": {"max_workers": 2, "wall_time_s": WALL_S, "quotas": {"search": 1},
                                     "reward_endpoint": scorer.url, "reward_concurrency": 3, "uid_base": UID_BASE + 10,
                                     "policy": "tangram", "expected_s": {"python": 0.2}},
                           "scheduler": {"size_thresholds": [4]}})
    orch = orchestrator_from_config(cfg.tools, cfg.scheduler)
    assert {n: p.spec.max_units for n, p in orch.scheduler.pools.items()} == {"cpu": 2, "reward": 3}
    assert orch.scheduler.estimator.expected("python") == 0.2 and orch.scheduler.quotas == {"search": 1}
    result = orch.submit("t", "python", "cpu", "print('hello')").result(timeout=WAIT_S)
    assert result.state.key() == "python|L|success"  # 6 characters ≥ the single threshold 4
    reward = orch.submit("t", "reward", "reward", {"answer": "a", "reference": "a"}).result(timeout=WAIT_S)
    assert reward["reward"] == 1.0
    orch.close()
    with pytest.raises(ValueError, match="no runner for resource kinds"):
        ToolOrchestrator(make_scheduler("tangram", [ResourceSpec("gpu", 1)]), {"cpu": SleepRunner()})
