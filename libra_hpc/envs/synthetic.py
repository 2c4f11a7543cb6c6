"""The synthetic multi-turn agentic workload: what each trajectory generates, calls and waits for.

The one synthetic workload of the project: the simulator simulates it, the scheduler's
routing benchmark (``scheduler/synthetic.py``) and the tool scheduler's replay
(``tools/replay.py``) look at the same trajectories through their own views. Its knobs are
:class:`WorkloadSpec` (a scenario's ``workload`` section, configs/README.md).

The process (every draw from one seeded generator per RL step, so a step's batch does not
depend on which other steps were generated, and search can simulate a few steps alone):

- A pool of ``prompt_pool`` prompts, each with a difficulty (log-normal multiplier on turn
  length), a bug rate (uniform in ``bug_rate``), a timeout rate (uniform in 0..2×the tool's)
  and a main tool (``primary_tool_weight`` times likelier than each other tool). Prompts are
  drawn in order from their own generator, so prompt ``p<i>`` is the same in any pool of
  more than ``i`` prompts.
- Each step samples ``prompts_per_step`` prompts without replacement; each prompt is rolled
  out ``group_size`` times (GRPO group): the samples share the prompt's parameters and differ
  in their draws.
- A trajectory has a hidden number of bugs (geometric with the prompt's rate). Its first turn
  writes a solution; unless it answers without a tool (``no_tool``), every turn ends in a tool
  call. While bugs remain, a bug-sensitive tool fails (large traceback), the agent spends a
  long turn (``stretch.failure``) fixing one bug; a hang costs the tool's full ``timeout_s``
  and a retry turn; a success leads to a short turn and, with ``check_again``, one more call.
  So failures causally lengthen what follows: the signal C-MLFQ routes on.
- Drift (:class:`DriftSpec`): how the policy's behaviour moves over RL steps. Per field, a
  piecewise-linear multiplier over steps (:func:`piecewise`) on prompt length, turn length,
  tool output size, tool latency, the failure and timeout rates, the bug rate, the odds of
  another call and the turn budget, so drift can move rollout and training apart (longer
  tool chains load rollout only; longer contexts load training more than decode). The older
  form, one multiplier ``m(step)`` (:func:`drift`) on turn length and on the odds of calling
  again after a success, stays valid and multiplies on top. Drift changes only the values
  drawn, never the number of draws, so a batch without drift is the same draw for draw.
- Every trajectory stops at ``max_turns`` turns or when its context reaches ``seq_len``
  (prompts are capped at half of ``seq_len``, the rest is room for turns and tool outputs).

Tool output sizes in characters (what the scheduler's size classes see) are 4 characters
per token (an assumption: typical BPE tokenisers of English and code).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from pydantic import Field, field_validator, model_validator

from libra_hpc.config import RLConfig, _Section

CHARS_PER_TOKEN = 4


# ------------------------------------------------------------------------ the spec

class LogNormal(_Section):
    """A log-normal distribution given by its median and the sigma of its logarithm."""

    median: float = Field(gt=0)
    """Median of the distribution (in the unit of the field that uses it)."""
    sigma: float = Field(0.0, ge=0)
    """Standard deviation of the natural log; 0 makes it a constant."""


class ToolSpec(_Section):
    """One tool type: its latency, how it fails, how much it returns."""

    name: str = Field(min_length=1, pattern=r"^[^|]+$")
    """Tool type name (``python``, ``bash``, ``search``); no ``|``."""
    weight: float = Field(1.0, gt=0)
    """Relative frequency among the tools of a prompt that does not favour another one."""
    latency_s: LogNormal
    """Seconds one successful call takes."""
    failure_latency_factor: float = Field(1.0, gt=0)
    """Latency of a failing call relative to a successful one."""
    timeout_s: float = Field(gt=0)
    """Wall-time limit: a hanging call costs exactly this and returns ``timeout``."""
    timeout_rate: float = Field(0.0, ge=0, lt=1)
    """Probability that one call hangs (on average over prompts; each prompt draws its own
    rate uniformly from 0 to twice this)."""
    fails_on_bug: bool = True
    """A call fails while the agent's work still has bugs (code execution, tests); a tool
    that cannot fail that way (search) sets false and fails with ``error_rate`` only."""
    error_rate: float = Field(0.0, ge=0, lt=1)
    """Probability that a call fails for reasons unrelated to bugs (bad query, flaky service)."""
    output_tokens: dict[Literal["success", "failure", "timeout"], LogNormal]
    """Tokens the tool's output adds to the context, per status."""
    failure_output_per_bug: float = Field(0.0, ge=0)
    """Growth of a bug failure's output with the bugs left besides the one it shows (a
    test run prints a traceback per failing test): its median is ``output_tokens.failure``
    × (1 + this × (bugs − 1)). 0: a failure's size says nothing about the work left."""

    @model_validator(mode="after")
    def _statuses(self) -> ToolSpec:
        missing = {"success", "failure", "timeout"} - set(self.output_tokens)
        if missing:
            raise ValueError(f"tool {self.name!r}: output_tokens needs every status, missing {sorted(missing)}")
        return self


Points = list[list[float]]
"""A piecewise-linear multiplier over RL steps: ``[[step, multiplier], ...]``."""

RATE_CAP = 0.95
"""Highest probability a drifted rate (bug, failure, timeout, another call) reaches."""


class DriftSpec(_Section):
    """Non-stationary workload over RL steps. Each per-field key (``prompt_tokens`` ...
    ``max_turns``) is a piecewise-linear multiplier ``[[step, multiplier], ...]``: steps are
    0-based RL steps, strictly increasing; the multiplier is linear between two points and
    flat before the first and after the last (``[[0, 1], [40, 2.5]]``: ×1 at step 0, ×1.75
    at step 20, ×2.5 from step 40 on). A key left out is ×1 at every step. Probabilities
    (``bug_rate``, ``error_rate``, ``timeout_rate``, ``check_again``) are capped at 0.95
    once multiplied. The older keys ``growth``, ``peak_step``, ``decline`` give one
    multiplier ``m(s)`` on turn tokens and on the odds of another tool call: it rises
    linearly from 1 to ``1 + growth`` at ``peak_step``, then falls linearly by ``decline ×
    growth`` until the last step (``rl.steps`` − 1); a per-field multiplier on the same
    quantity multiplies on top of it."""

    growth: float = Field(0.0, ge=0)
    """Relative growth of turn length and tool use at the peak (0.5: +50%)."""
    peak_step: int = Field(1, ge=1)
    """Step of the peak."""
    decline: float = Field(0.0, ge=0, le=1)
    """Fraction of the growth given back between the peak and the last step."""
    prompt_tokens: Points | None = None
    """Multiplier on the prompt length of every prompt (longer system prompts, task
    statements or retrieved context); still capped at half of ``training.seq_len``."""
    turn_tokens: Points | None = None
    """Multiplier on the tokens of every turn (the policy thinks and writes more per turn)."""
    tool_output_tokens: Points | None = None
    """Multiplier on every tool's output size, every status (the policy reads more: wider
    file views, longer test logs)."""
    tool_latency: Points | None = None
    """Multiplier on every tool's call latency (heavier commands, full test suites); a call
    still ends at its tool's ``timeout_s``."""
    error_rate: Points | None = None
    """Multiplier on every tool's ``error_rate`` (failures unrelated to bugs: malformed
    calls, bad queries)."""
    bug_rate: Points | None = None
    """Multiplier on each prompt's bug rate: more bugs make longer fail-and-fix tool chains
    on bug-sensitive tools."""
    timeout_rate: Points | None = None
    """Multiplier on every tool's ``timeout_rate`` (hanging commands; each costs the tool's
    ``timeout_s`` and a retry turn)."""
    check_again: Points | None = None
    """Multiplier on ``check_again``, the odds of one more tool call after a success
    (turns per episode: how long the agent keeps verifying)."""
    max_turns: Points | None = None
    """Multiplier on ``max_turns``, the turn budget per trajectory (rounded, at least 1)."""
    solve_rate: Points | None = None
    """Multiplier on each prompt's solve rate (``workload.solve_rate``; the policy learns
    to solve more), capped at 0.95; no effect where rewards are not modelled."""

    @field_validator("prompt_tokens", "turn_tokens", "tool_output_tokens", "tool_latency", "error_rate",
                     "bug_rate", "timeout_rate", "check_again", "max_turns", "solve_rate")
    @classmethod
    def _points(cls, points: Points | None) -> Points | None:
        if points is None:
            return None
        if not points:
            raise ValueError("needs at least one [step, multiplier] point")
        for point in points:
            if len(point) != 2:
                raise ValueError(f"point {point}: need [step, multiplier]")
            step, mult = point
            if step < 0 or step != int(step):
                raise ValueError(f"point {point}: the step must be a whole number >= 0")
            if mult < 0:
                raise ValueError(f"point {point}: the multiplier must be >= 0")
        steps = [int(p[0]) for p in points]
        if any(b <= a for a, b in zip(steps, steps[1:])):
            raise ValueError(f"steps {steps} must be strictly increasing")
        return points


PER_FIELD = ("prompt_tokens", "turn_tokens", "tool_output_tokens", "tool_latency", "error_rate", "bug_rate",
             "timeout_rate", "check_again", "max_turns", "solve_rate")
"""The per-field drift keys of :class:`DriftSpec`, in the order of :class:`Multipliers`."""


@dataclass(frozen=True, slots=True)
class Multipliers:
    """The drift's multipliers at one step, one per :data:`PER_FIELD` key; ``turn_tokens``
    and ``check_again`` include the older ``m(s)`` (:func:`drift`)."""

    prompt_tokens: float = 1.0
    turn_tokens: float = 1.0
    tool_output_tokens: float = 1.0
    tool_latency: float = 1.0
    error_rate: float = 1.0
    bug_rate: float = 1.0
    timeout_rate: float = 1.0
    check_again: float = 1.0
    max_turns: float = 1.0
    solve_rate: float = 1.0


class WorkloadSpec(_Section):
    """The synthetic agentic workload (see libra_hpc/envs/synthetic.py for the process)."""

    prompt_pool: int = Field(ge=1)
    """Distinct prompts; each step samples ``prompts_per_step`` of them (epochs repeat
    prompts, which is what the per-prompt causal trees learn from)."""
    prompt_tokens: LogNormal
    """Prompt length in tokens (system prompt + task)."""
    turn_tokens: LogNormal
    """Tokens generated by a first turn of a prompt of median difficulty; ``sigma`` is the
    turn-to-turn noise."""
    difficulty_sigma: float = Field(0.5, ge=0)
    """Log-normal sigma of the per-prompt multiplier on turn length."""
    stretch: dict[Literal["write", "success", "failure", "timeout"], float] = Field(
        default_factory=lambda: {"write": 1.0, "success": 0.4, "failure": 2.0, "timeout": 1.2})
    """Turn length relative to ``turn_tokens`` after each kind of tool return (``write``:
    the first turn)."""
    bug_rate: list[float] = Field(default_factory=lambda: [0.1, 0.7], min_length=2, max_length=2)
    """Per-prompt range of the probability of one more bug (bugs are geometric): while
    bugs remain, bug-sensitive tools fail and the agent spends a long turn on each."""
    no_tool: float = Field(0.1, ge=0, le=1)
    """Probability that a trajectory answers without any tool call."""
    check_again: float = Field(0.3, ge=0, le=1)
    """Probability of one more tool call after a success (verification)."""
    max_turns: int = Field(16, ge=1)
    """Most turns (generation segments) per trajectory."""
    primary_tool_weight: float = Field(10.0, ge=1)
    """Odds of a prompt's main tool against each other tool."""
    tools: list[ToolSpec] = Field(min_length=1)
    """Tool types."""
    solve_rate: list[float] | None = Field(None, min_length=2, max_length=2)
    """Per-prompt range of the probability that a sample solves its task (reward 1, else
    0), uniform over prompts and drawn independently of the trajectory's course (an
    assumption: the simulator prices time, not learning). None: rewards are not modelled
    and every group is trained. With ``rl.filter_zero_variance`` (the default) a group
    whose samples all got the same reward is generated but not trained, the job's rule
    (``rl/grpo.py``): an early policy that solves few tasks leaves most groups all-failed,
    so training sees a fraction of what rollout generated."""
    drift: DriftSpec = DriftSpec()

    @model_validator(mode="after")
    def _check(self) -> WorkloadSpec:
        lo, hi = self.bug_rate
        if not 0 <= lo <= hi < 1:
            raise ValueError(f"bug_rate {self.bug_rate}: need 0 <= low <= high < 1")
        if self.solve_rate is not None and not 0 <= self.solve_rate[0] <= self.solve_rate[1] <= 1:
            raise ValueError(f"solve_rate {self.solve_rate}: need 0 <= low <= high <= 1")
        names = [t.name for t in self.tools]
        if len(set(names)) != len(names):
            raise ValueError(f"tools: duplicate tool names in {names}")
        missing = {"write", "success", "failure", "timeout"} - set(self.stretch)
        if missing:
            raise ValueError(f"stretch needs write, success, failure, timeout; missing {sorted(missing)}")
        return self


# ------------------------------------------------------------------ trajectories

@dataclass(frozen=True, slots=True)
class ToolCall:
    """One tool call after a turn: type, seconds it takes, outcome, tokens it returns."""

    tool: str
    latency_s: float
    status: str  # success | failure | timeout
    output_tokens: int

    def output(self, size_thresholds: Sequence[int], error_marker: str) -> tuple[str, int, bool]:
        """What the tool hands back, as a worker reports it: ``(output text, exit code,
        timed out)``. The text has ``output_tokens × CHARS_PER_TOKEN`` characters, cut at the
        largest of ``size_thresholds`` (characters; one character where there are none):
        anything longer lands in the same, largest, size class, so a classifier with these
        thresholds sees what the full output would give. A failure's text starts with
        ``error_marker`` and exits 1; a timeout exits 0 and says it timed out."""
        cap = size_thresholds[-1] if size_thresholds else 1
        body = min(self.output_tokens * CHARS_PER_TOKEN, cap)
        if self.status == "failure":
            return (error_marker + "x" * body)[:max(body, len(error_marker))], 1, False
        return "x" * body, 0, self.status == "timeout"


@dataclass(frozen=True, slots=True)
class Trajectory:
    """One rollout: ``turns[i]`` tokens generated in turn ``i``; ``calls[i]`` the tool call
    after turn ``i`` (none after the last: ``len(calls) == len(turns) - 1``)."""

    tid: str
    prompt_id: str
    step: int
    sample: int
    prompt_tokens: int
    turns: tuple[int, ...]
    calls: tuple[ToolCall, ...]
    reward: float | None = field(default=None, repr=False)
    """1 solved, 0 not (``workload.solve_rate``); None where rewards are not modelled. (Out
    of the repr, as ``trained``: the shipped batches' digests, tests/test_sim_drift.py,
    predate both, and prove the other draws unchanged.)"""
    trained: bool = field(default=True, repr=False)
    """Whether the trainer trains it: False when its group is left out (every reward equal,
    ``rl.filter_zero_variance``; set by the simulator's :class:`~libra_hpc.sim.context.Context`)."""

    def __post_init__(self) -> None:
        if len(self.calls) != len(self.turns) - 1 or not self.turns:
            raise ValueError(f"trajectory {self.tid}: {len(self.turns)} turns need {len(self.turns) - 1} tool calls, "
                             f"got {len(self.calls)}")

    @property
    def gen_tokens(self) -> int:
        """Tokens generated over all turns (what rollout throughput counts)."""
        return sum(self.turns)

    @property
    def total_tokens(self) -> int:
        """Prompt + generated + tool output tokens: the final context (training sequence)."""
        return self.prompt_tokens + self.gen_tokens + sum(c.output_tokens for c in self.calls)

    @property
    def tool_time_s(self) -> float:
        """Seconds spent in tool calls."""
        return sum(c.latency_s for c in self.calls)


def drift(step: int, steps: int, spec: DriftSpec) -> float:
    """The older form's multiplier at ``step`` (0-based) of ``steps``: 1 → 1 + growth at
    ``peak_step``, then down by ``decline × growth`` at the last step."""
    if spec.growth == 0:
        return 1.0
    if step <= spec.peak_step:
        return 1.0 + spec.growth * step / spec.peak_step
    tail = max(1, steps - 1 - spec.peak_step)
    return 1.0 + spec.growth * (1.0 - spec.decline * min(1.0, (step - spec.peak_step) / tail))


def piecewise(points: Points | None, step: float) -> float:
    """``points`` (``[[step, multiplier], ...]``, steps increasing) at ``step``: linear
    between two points, flat outside them; 1 when there are none."""
    if not points:
        return 1.0
    if step <= points[0][0]:
        return float(points[0][1])
    for (s0, m0), (s1, m1) in zip(points, points[1:]):
        if step <= s1:
            return m0 + (m1 - m0) * (step - s0) / (s1 - s0)
    return float(points[-1][1])


def multipliers(step: int, steps: int, spec: DriftSpec) -> Multipliers:
    """Every drifted quantity's multiplier at ``step`` (0-based) of ``steps``."""
    m = {key: piecewise(getattr(spec, key), step) for key in PER_FIELD}
    old = drift(step, steps, spec)
    m["turn_tokens"] *= old
    m["check_again"] *= old
    return Multipliers(**m)


def _rate(rate: float, m: float) -> float:
    """A probability under a drift multiplier, capped at :data:`RATE_CAP` (unchanged at ×1,
    so a workload without drift draws exactly as before)."""
    return rate if m == 1.0 else min(RATE_CAP, rate * m)


@dataclass(frozen=True)
class _Prompt:
    pid: str
    prompt_tokens: int
    difficulty: float
    bug_rate: float
    timeout_scale: float  # prompt's timeout rate relative to the tool's (0..2)
    tool_weights: tuple[float, ...]
    solve_rate: float = 0.0  # workload.solve_rate: drawn from a generator of its own


class SyntheticWorkload:
    """Batches of trajectories per RL step (module docstring). Deterministic in ``seed``.
    ``rl``: ``prompts_per_step``, ``group_size`` and ``steps`` (the drift's horizon) are
    read. ``seq_len``: the longest trajectory in tokens (the scenario's ``training.seq_len``)."""

    def __init__(self, spec: WorkloadSpec, rl: RLConfig, seed: int, seq_len: int):
        if rl.prompts_per_step > spec.prompt_pool:
            raise ValueError(f"rl.prompts_per_step={rl.prompts_per_step} exceeds workload.prompt_pool="
                             f"{spec.prompt_pool}: a step samples prompts without replacement")
        self.spec, self.rl, self.seed, self.seq_len = spec, rl, seed, seq_len
        rng = random.Random(f"{seed}:prompts")
        self.prompts = [self._prompt(rng, i) for i in range(spec.prompt_pool)]
        if spec.solve_rate is not None:  # its own generator: the other draws stay as they were
            solve = random.Random(f"{seed}:solve")
            self.prompts = [replace(p, solve_rate=solve.uniform(*spec.solve_rate)) for p in self.prompts]

    @classmethod
    def groups(cls, spec: WorkloadSpec, n_prompts: int, group_size: int, seed: int, seq_len: int,
               steps: int = 1) -> SyntheticWorkload:
        """The workload over the first ``n_prompts`` prompts of ``spec``'s pool, every step
        rolling each of them out ``group_size`` times (one epoch per step): what a scenario
        with ``workload.prompt_pool = rl.prompts_per_step = n_prompts``, ``rl.group_size =
        group_size`` and ``rl.steps = steps`` simulates."""
        rl = RLConfig(steps=steps, prompts_per_step=n_prompts, group_size=group_size)
        return cls(spec.model_copy(update={"prompt_pool": n_prompts}), rl, seed, seq_len)

    def _prompt(self, rng: random.Random, index: int) -> _Prompt:
        s = self.spec
        primary = rng.randrange(len(s.tools))
        weights = tuple(t.weight * (s.primary_tool_weight if i == primary else 1.0) for i, t in enumerate(s.tools))
        tokens = max(1, min(self.seq_len // 2, round(_lognormal(rng, s.prompt_tokens.median, s.prompt_tokens.sigma))))
        return _Prompt(f"p{index}", tokens, rng.lognormvariate(0.0, s.difficulty_sigma), rng.uniform(*s.bug_rate),
                       rng.uniform(0.0, 2.0), weights)

    def batch(self, step: int) -> list[Trajectory]:
        """The ``prompts_per_step × group_size`` trajectories of RL step ``step``, group by group."""
        rng = random.Random(f"{self.seed}:step:{step}")
        m = multipliers(step, self.rl.steps, self.spec.drift)
        chosen = rng.sample(self.prompts, self.rl.prompts_per_step)
        out = [self._trajectory(rng, p, step, k, m) for p in chosen for k in range(self.rl.group_size)]
        if self.spec.solve_rate is None:
            return out
        solved = random.Random(f"{self.seed}:reward:{step}")  # its own generator, as the solve rates'
        rates = [_rate(p.solve_rate, m.solve_rate) for p in chosen for _ in range(self.rl.group_size)]
        return [replace(t, reward=float(solved.random() < r)) for t, r in zip(out, rates)]

    def _trajectory(self, rng: random.Random, p: _Prompt, step: int, sample: int, m: Multipliers) -> Trajectory:
        s = self.spec
        prompt_tokens = max(1, min(self.seq_len // 2, round(p.prompt_tokens * m.prompt_tokens)))
        room = self.seq_len - prompt_tokens  # context left for turns and tool outputs
        max_turns = max(1, round(s.max_turns * m.max_turns))

        def turn(kind: str) -> int:
            return max(1, round(_lognormal(rng, s.turn_tokens.median * p.difficulty * m.turn_tokens * s.stretch[kind],
                                           s.turn_tokens.sigma)))

        bugs, bug_rate = 0, _rate(p.bug_rate, m.bug_rate)
        while rng.random() < bug_rate:
            bugs += 1
        turns, calls = [min(turn("write"), max(1, room))], []
        room -= turns[0]
        more = rng.random() >= s.no_tool
        while more and len(turns) < max_turns and room > 1:
            tool = rng.choices(s.tools, p.tool_weights)[0]
            call, fixed = _call(rng, tool, p, bugs, m)
            bugs -= fixed
            nxt = turn(call.status)
            if call.output_tokens + nxt > room:  # the context is full: the trajectory is cut here
                break
            calls.append(call)
            turns.append(nxt)
            room -= call.output_tokens + nxt
            if call.status == "success" and not bugs:
                more = rng.random() < min(RATE_CAP, s.check_again * m.check_again)
        return Trajectory(f"s{step}/{p.pid}/{sample}", p.pid, step, sample, prompt_tokens, tuple(turns), tuple(calls))


def _call(rng: random.Random, tool: ToolSpec, p: _Prompt, bugs: int, m: Multipliers) -> tuple[ToolCall, int]:
    """One call of ``tool`` while ``bugs`` remain, under the step's drift ``m``; returns it
    and the bugs it fixes (the agent fixes one bug per failing call's follow-up turn)."""
    if rng.random() < _rate(tool.timeout_rate * p.timeout_scale, m.timeout_rate):
        status, latency, fixed = "timeout", tool.timeout_s, 0
    elif (tool.fails_on_bug and bugs) or rng.random() < _rate(tool.error_rate, m.error_rate):
        status = "failure"
        latency = min(tool.timeout_s, _lognormal(rng, tool.latency_s.median * m.tool_latency, tool.latency_s.sigma)
                      * tool.failure_latency_factor)
        fixed = 1 if tool.fails_on_bug and bugs else 0
    else:
        status, fixed = "success", 0
        latency = min(tool.timeout_s, _lognormal(rng, tool.latency_s.median * m.tool_latency, tool.latency_s.sigma))
    out = tool.output_tokens[status]
    median = out.median * m.tool_output_tokens
    if fixed and tool.failure_output_per_bug:  # a bug failure: one traceback per bug left
        median *= 1.0 + tool.failure_output_per_bug * (bugs - 1)
    return ToolCall(tool.name, latency, status, max(1, round(_lognormal(rng, median, out.sigma)))), fixed


def _lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return median * math.exp(rng.gauss(0.0, sigma)) if sigma else median


def summary(trajectories: list[Trajectory]) -> dict:
    """Generated-token median, p90, p99 (nearest rank), p99/median, mean turns, tool share,
    the share trained (:attr:`Trajectory.trained`)."""
    gen = sorted(t.gen_tokens for t in trajectories)

    def rank(q: float) -> int:
        return gen[max(0, math.ceil(q * len(gen)) - 1)]
    calls = [c for t in trajectories for c in t.calls]
    return {"trajectories": len(gen), "gen_median": rank(0.5), "gen_p90": rank(0.9), "gen_p99": rank(0.99),
            "p99_over_median": rank(0.99) / max(1, rank(0.5)),
            "mean_turns": sum(len(t.turns) for t in trajectories) / len(trajectories),
            "failure_share": sum(c.status == "failure" for c in calls) / max(1, len(calls)),
            "mean_tool_s": sum(t.tool_time_s for t in trajectories) / len(trajectories),
            "trained_share": sum(t.trained for t in trajectories) / len(trajectories)}
