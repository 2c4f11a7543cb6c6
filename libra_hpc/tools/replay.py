"""Replay a trace of tool calls against a scheduler on a simulated clock (pure).

A trajectory alternates LLM turns (``gap_s``: the tool resource is not needed, but the
dedicated baseline holds its unit) and tool calls of a known true duration. The next call
is submitted ``gap_s`` after the previous one completed, so slow tool service also delays
the trajectory's later calls, as in a real rollout. Events at one instant are handled in
the order completion, submission, trajectory end (ties by sequence number), then the
scheduler dispatches once.
"""

from __future__ import annotations

import heapq
import itertools
import math
import random
from dataclasses import dataclass, field

from libra_hpc.tools.scheduling import ActionScheduler


@dataclass(frozen=True)
class ToolCall:
    gap_s: float  # LLM time before this call (since the trajectory start or the previous return)
    tool: str
    resource: str
    duration_s: float  # true service time once it runs


@dataclass(frozen=True)
class TrajectoryTrace:
    tid: str
    start_s: float
    calls: tuple[ToolCall, ...]
    tail_s: float = 0.0  # LLM time after the last return, until the trajectory ends


@dataclass
class ReplayResult:
    act_s: list[float] = field(default_factory=list)  # completion - submission, per action
    wait_s: list[float] = field(default_factory=list)  # start - submission
    held_s: float = 0.0  # unit-seconds the pools held until the last event
    busy_s: float = 0.0  # unit-seconds actually running actions
    makespan_s: float = 0.0
    log: list[tuple] = field(default_factory=list)  # (time, "start"/"done", aid, resource, unit, tool)

    @property
    def mean_act(self) -> float:
        return sum(self.act_s) / len(self.act_s) if self.act_s else 0.0

    @property
    def p99_act(self) -> float:
        return percentile(self.act_s, 99)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]); 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def replay(scheduler: ActionScheduler, trajectories: list[TrajectoryTrace], keep_log: bool = False) -> ReplayResult:
    """Run the whole trace; every call completes exactly once (AssertionError otherwise)."""
    events: list = []
    seq = itertools.count()
    order = {"done": 0, "submit": 1, "end": 2, "wake": 3}

    def push(time: float, kind: str, payload) -> None:
        heapq.heappush(events, (time, order[kind], next(seq), kind, payload))

    for traj in trajectories:
        if traj.calls:
            push(traj.start_s + traj.calls[0].gap_s, "submit", (traj, 0))
        else:
            push(traj.start_s + traj.tail_s, "end", traj)
    result = ReplayResult()
    pending: dict[str, tuple[TrajectoryTrace, int]] = {}
    submitted_at: dict[str, float] = {}
    now = 0.0
    while events:
        now = events[0][0]
        while events and events[0][0] == now:
            _, _, _, kind, payload = heapq.heappop(events)
            if kind == "submit":
                traj, i = payload
                call = traj.calls[i]
                action = scheduler.new_action(traj.tid, call.tool, call.resource, now)
                pending[action.aid] = (traj, i)
                submitted_at[action.aid] = now
            elif kind == "done":
                aid = payload
                scheduler.complete(aid, now)
                traj, i = pending.pop(aid)
                result.act_s.append(now - submitted_at.pop(aid))
                if keep_log:
                    result.log.append((now, "done", aid, traj.calls[i].resource, None, traj.calls[i].tool))
                if i + 1 < len(traj.calls):
                    push(now + traj.calls[i + 1].gap_s, "submit", (traj, i + 1))
                else:
                    push(now + traj.tail_s, "end", traj)
            elif kind == "end":
                scheduler.end_trajectory(payload.tid, now)
        for d in scheduler.dispatch(now):
            traj, i = pending[d.action.aid]
            duration = traj.calls[i].duration_s
            result.wait_s.append(now - d.action.submitted_at)
            result.busy_s += duration
            if keep_log:
                result.log.append((now, "start", d.action.aid, d.action.resource, d.unit, d.action.tool))
            push(now + duration, "done", d.action.aid)
        wake = scheduler.next_wakeup(now)
        if wake is not None:
            push(wake, "wake", None)
    assert not pending, f"replay ended with {len(pending)} actions never completed: {sorted(pending)[:5]}"
    result.makespan_s = now
    result.held_s = scheduler.held_seconds(now)
    return result


@dataclass(frozen=True)
class TraceShape:
    """A synthetic agentic-RL trace: rollout waves of trajectories (bursts), each with a few
    tool calls of three kinds. Durations are log-normal around the given medians (s)."""

    trajectories: int = 64
    waves: int = 2
    wave_gap_s: float = 120.0
    calls_per_trajectory: tuple[int, int] = (2, 8)
    llm_gap_s: tuple[float, float] = (2.0, 15.0)
    short_s: float = 0.5  # "python": quick snippet
    long_s: float = 20.0  # "tests": running a test suite
    reward_s: float = 1.5  # "reward": a reward-model call on the endpoint resource
    long_fraction: float = 0.15
    reward_per_trajectory: int = 1


def make_trace(shape: TraceShape, seed: int = 0) -> list[TrajectoryTrace]:
    """Deterministic trace for ``seed``; trajectories of one wave start together (a burst)."""
    rng = random.Random(seed)
    out = []
    per_wave = math.ceil(shape.trajectories / shape.waves)
    for n in range(shape.trajectories):
        start = (n // per_wave) * shape.wave_gap_s + rng.uniform(0.0, 1.0)
        calls = []
        for _ in range(rng.randint(*shape.calls_per_trajectory)):
            long = rng.random() < shape.long_fraction
            median = shape.long_s if long else shape.short_s
            calls.append(ToolCall(rng.uniform(*shape.llm_gap_s), "tests" if long else "python", "cpu",
                                  median * math.exp(rng.gauss(0.0, 0.5))))
        for _ in range(shape.reward_per_trajectory):
            calls.append(ToolCall(rng.uniform(*shape.llm_gap_s), "reward", "reward",
                                  shape.reward_s * math.exp(rng.gauss(0.0, 0.3))))
        out.append(TrajectoryTrace(f"t{n}", start, tuple(calls), tail_s=rng.uniform(*shape.llm_gap_s)))
    return out
