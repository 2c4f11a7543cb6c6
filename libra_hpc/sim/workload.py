"""Synthetic multi-turn agentic workload: what each trajectory generates, calls and waits for.

The process (every draw from one seeded generator per RL step, so a step's batch does not
depend on which other steps were generated, and search can simulate a few steps alone):

- A pool of ``prompt_pool`` prompts, each with a difficulty (log-normal multiplier on turn
  length), a bug rate (uniform in ``bug_rate``), a timeout rate (uniform in 0..2×the tool's)
  and a main tool (``primary_tool_weight`` times likelier than each other tool).
- Each step samples ``prompts_per_step`` prompts without replacement; each prompt is rolled
  out ``group_size`` times (GRPO group): the samples share the prompt's parameters and differ
  in their draws.
- A trajectory has a hidden number of bugs (geometric with the prompt's rate). Its first turn
  writes a solution; unless it answers without a tool (``no_tool``), every turn ends in a tool
  call. While bugs remain, a bug-sensitive tool fails (large traceback), the agent spends a
  long turn (``stretch.failure``) fixing one bug; a hang costs the tool's full ``timeout_s``
  and a retry turn; a success leads to a short turn and, with ``check_again``, one more call.
  So failures causally lengthen what follows: the signal C-MLFQ routes on.
- Drift: a multiplier ``m(step)`` (:func:`drift`) on turn length and on the odds of calling
  again after a success (the policy learns to use tools, then becomes more economical).
- Every trajectory stops at ``max_turns`` turns or when its context reaches ``seq_len``
  (prompts are capped at half of ``seq_len``, the rest is room for turns and tool outputs).

Tool output sizes in characters (what the scheduler's size classes see) are 4 characters
per token (an assumption: typical BPE tokenisers of English and code).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from libra_hpc.config import RLConfig
from libra_hpc.sim.config import DriftSpec, ToolSpec, WorkloadSpec

CHARS_PER_TOKEN = 4


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One tool call after a turn: type, seconds it takes, outcome, tokens it returns."""

    tool: str
    latency_s: float
    status: str  # success | failure | timeout
    output_tokens: int


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
        return sum(c.latency_s for c in self.calls)


def drift(step: int, steps: int, spec: DriftSpec) -> float:
    """Multiplier at ``step`` (0-based) of ``steps``: 1 → 1 + growth at ``peak_step``,
    then down by ``decline × growth`` at the last step."""
    if spec.growth == 0:
        return 1.0
    if step <= spec.peak_step:
        return 1.0 + spec.growth * step / spec.peak_step
    tail = max(1, steps - 1 - spec.peak_step)
    return 1.0 + spec.growth * (1.0 - spec.decline * min(1.0, (step - spec.peak_step) / tail))


@dataclass(frozen=True)
class _Prompt:
    pid: str
    prompt_tokens: int
    difficulty: float
    bug_rate: float
    timeout_scale: float  # prompt's timeout rate relative to the tool's (0..2)
    tool_weights: tuple[float, ...]


class SyntheticWorkload:
    """Batches of trajectories per RL step (module docstring). Deterministic in ``seed``.
    ``seq_len``: the longest trajectory in tokens (the scenario's ``training.seq_len``)."""

    def __init__(self, spec: WorkloadSpec, rl: RLConfig, seed: int, seq_len: int):
        if rl.prompts_per_step > spec.prompt_pool:
            raise ValueError(f"rl.prompts_per_step={rl.prompts_per_step} exceeds workload.prompt_pool="
                             f"{spec.prompt_pool}: a step samples prompts without replacement")
        self.spec, self.rl, self.seed, self.seq_len = spec, rl, seed, seq_len
        rng = random.Random(f"{seed}:prompts")
        self.prompts = [self._prompt(rng, i) for i in range(spec.prompt_pool)]

    def _prompt(self, rng: random.Random, index: int) -> _Prompt:
        s = self.spec
        primary = rng.randrange(len(s.tools))
        weights = tuple(t.weight * (s.primary_tool_weight if i == primary else 1.0) for i, t in enumerate(s.tools))
        tokens = max(1, min(self.seq_len // 2, round(_lognormal(rng, s.prompt_tokens.median, s.prompt_tokens.sigma))))
        return _Prompt(f"p{index}", tokens, rng.lognormvariate(0.0, s.difficulty_sigma), rng.uniform(*s.bug_rate),
                       rng.uniform(0.0, 2.0), weights)

    def batch(self, step: int) -> list[Trajectory]:
        """The ``prompts_per_step × group_size`` trajectories of RL step ``step``."""
        rng = random.Random(f"{self.seed}:step:{step}")
        scale = drift(step, self.rl.steps, self.spec.drift)
        chosen = rng.sample(self.prompts, self.rl.prompts_per_step)
        return [self._trajectory(rng, p, step, k, scale) for p in chosen for k in range(self.rl.group_size)]

    def _trajectory(self, rng: random.Random, p: _Prompt, step: int, sample: int, scale: float) -> Trajectory:
        s = self.spec
        room = self.seq_len - p.prompt_tokens  # context left for turns and tool outputs

        def turn(kind: str) -> int:
            return max(1, round(_lognormal(rng, s.turn_tokens.median * p.difficulty * scale * s.stretch[kind],
                                           s.turn_tokens.sigma)))

        bugs = 0
        while rng.random() < p.bug_rate:
            bugs += 1
        turns, calls = [min(turn("write"), max(1, room))], []
        room -= turns[0]
        more = rng.random() >= s.no_tool
        while more and len(turns) < s.max_turns and room > 1:
            tool = rng.choices(s.tools, p.tool_weights)[0]
            call, fixed = _call(rng, tool, p, bugs)
            bugs -= fixed
            nxt = turn(call.status)
            if call.output_tokens + nxt > room:  # the context is full: the trajectory is cut here
                break
            calls.append(call)
            turns.append(nxt)
            room -= call.output_tokens + nxt
            if call.status == "success" and not bugs:
                more = rng.random() < min(0.95, s.check_again * scale)
        return Trajectory(f"s{step}/{p.pid}/{sample}", p.pid, step, sample, p.prompt_tokens, tuple(turns), tuple(calls))


def _call(rng: random.Random, tool: ToolSpec, p: _Prompt, bugs: int) -> tuple[ToolCall, int]:
    """One call of ``tool`` while ``bugs`` remain; returns it and the bugs it fixes (the
    agent fixes one bug per failing call's follow-up turn)."""
    if rng.random() < tool.timeout_rate * p.timeout_scale:
        status, latency, fixed = "timeout", tool.timeout_s, 0
    elif (tool.fails_on_bug and bugs) or rng.random() < tool.error_rate:
        status = "failure"
        latency = min(tool.timeout_s, _lognormal(rng, tool.latency_s.median, tool.latency_s.sigma)
                      * tool.failure_latency_factor)
        fixed = 1 if tool.fails_on_bug and bugs else 0
    else:
        status, fixed = "success", 0
        latency = min(tool.timeout_s, _lognormal(rng, tool.latency_s.median, tool.latency_s.sigma))
    out = tool.output_tokens[status]
    return ToolCall(tool.name, latency, status, max(1, round(_lognormal(rng, out.median, out.sigma)))), fixed


def _lognormal(rng: random.Random, median: float, sigma: float) -> float:
    return median * math.exp(rng.gauss(0.0, sigma)) if sigma else median


def summary(trajectories: list[Trajectory]) -> dict:
    """Generated-token median, p90, p99 (nearest rank), p99/median, mean turns, tool share."""
    gen = sorted(t.gen_tokens for t in trajectories)

    def rank(q: float) -> int:
        return gen[max(0, math.ceil(q * len(gen)) - 1)]
    calls = [c for t in trajectories for c in t.calls]
    return {"trajectories": len(gen), "gen_median": rank(0.5), "gen_p90": rank(0.9), "gen_p99": rank(0.99),
            "p99_over_median": rank(0.99) / max(1, rank(0.5)),
            "mean_turns": sum(len(t.turns) for t in trajectories) / len(trajectories),
            "failure_share": sum(c.status == "failure" for c in calls) / max(1, len(calls)),
            "mean_tool_s": sum(t.tool_time_s for t in trajectories) / len(trajectories)}
