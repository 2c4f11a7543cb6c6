"""Replay a trace of tool calls against a scheduler on a simulated clock (pure).

The trace is a view of the shared synthetic workload's trajectories (:func:`make_trace`,
:func:`trace_of`; libra_hpc/envs/synthetic.py), or any list of :class:`TrajectoryTrace`.

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
from collections.abc import Iterable
from dataclasses import dataclass, field

from libra_hpc.envs.synthetic import SyntheticWorkload, Trajectory
from libra_hpc.tools.scheduling import ActionScheduler


@dataclass(frozen=True)
class ToolCall:
    """One tool call of a trace."""

    gap_s: float  # LLM time before this call (since the trajectory start or the previous return)
    tool: str
    resource: str
    duration_s: float  # true service time once it runs


@dataclass(frozen=True)
class TrajectoryTrace:
    """One trajectory's tool calls, in order, from ``start_s`` (seconds on the replay clock)."""

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
    """How trajectories of the shared synthetic workload (:mod:`libra_hpc.envs.synthetic`)
    become a tool-call trace: each RL step is a rollout wave (its trajectories start
    together, a burst); a trajectory decodes a turn, calls its tool, and so on; after its
    last turn a reward call scores it."""

    waves: int = 2
    """RL steps (the workload's steps ``0..waves-1``) replayed by :func:`make_trace`."""
    wave_gap_s: float = 120.0
    """Seconds between the starts of two waves."""
    decode_tokens_per_s: float = 40.0
    """One sequence's decode speed in a loaded engine (an assumption): a turn of ``n``
    tokens keeps its trajectory off the tool resources for ``n / decode_tokens_per_s`` s."""
    resource: str = "cpu"
    """Resource every tool call runs on (a sandbox)."""
    reward_s: float = 1.5
    """Seconds of the reward call that ends every trajectory, on resource ``reward`` (a
    model-serving endpoint; the workload has no verifier of its own, so this constant is an
    assumption); 0: no reward call."""

    def __post_init__(self) -> None:
        for name in ("waves", "decode_tokens_per_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"TraceShape.{name}: {getattr(self, name)} must be > 0")
        for name in ("wave_gap_s", "reward_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"TraceShape.{name}: {getattr(self, name)} must be >= 0")


def trace_of(trajectories: Iterable[Trajectory], shape: TraceShape = TraceShape()) -> list[TrajectoryTrace]:
    """The tool-call trace of ``trajectories``, a view of them (no draw of its own): one of
    step ``s`` starts ``(s - first step) × wave_gap_s`` seconds in; before each tool call it
    decodes the turn that ends in it; each call takes its ``latency_s`` on
    ``shape.resource``; after the last turn comes the reward call, if any."""
    trajectories = list(trajectories)
    first = min((t.step for t in trajectories), default=0)
    rate = shape.decode_tokens_per_s
    out = []
    for t in trajectories:
        calls = [ToolCall(tokens / rate, c.tool, shape.resource, c.latency_s) for tokens, c in zip(t.turns, t.calls)]
        tail_s = t.turns[-1] / rate
        if shape.reward_s:
            calls.append(ToolCall(tail_s, "reward", "reward", shape.reward_s))
            tail_s = 0.0
        out.append(TrajectoryTrace(t.tid, (t.step - first) * shape.wave_gap_s, tuple(calls), tail_s))
    return out


def make_trace(workload: SyntheticWorkload, shape: TraceShape = TraceShape()) -> list[TrajectoryTrace]:
    """The trace of ``workload``'s first ``shape.waves`` RL steps (:func:`trace_of`):
    ``waves × prompts_per_step × group_size`` trajectories."""
    return trace_of((t for step in range(shape.waves) for t in workload.batch(step)), shape)
