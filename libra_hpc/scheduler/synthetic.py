"""A seeded synthetic agentic workload with known true lengths, and a routing-accuracy replay.

The workload embodies the premise C-MLFQ rests on, so that a router can be checked to
exploit it (it says nothing about how strongly real workloads hold it):

- Prompts differ: a per-prompt multiplier on turn length (difficulty), a per-prompt bug
  rate and timeout rate, and a main tool.
- Tool returns causally shape what follows. A trajectory's code has a hidden number of
  bugs (geometric, more for buggy prompts). While bugs remain, each tool call fails and
  the agent spends a long turn reading the traceback and fixing one bug; the traceback is
  large (``L``) while two or more bugs remain, medium (``M``) for the last one. A timeout
  (a hang) costs a medium retry turn. Once the code works the tool succeeds and the agent
  wraps up in short turns (sometimes one more, always successful, check).
- Lengths are long-tailed: bug counts and difficulty compound; with the defaults the
  total output's p99 is about ten times its median.

How much causal routing gains depends on how the remaining work after a given state
spreads relative to the bucket widths (4x apart with the default limits) and on how
many finished trajectories reach each tree node. With these defaults (seeds 0-3, 300
prompts x 16 samples) C-MLFQ routes 0.71-0.74 of post-tool-return turns to their true
bucket against 0.65-0.66 for keeping the top level. With ``base_turn_tokens=400`` the
two are level; with 300 (most work fits the top level, and the long-tailed means of the
failure states straddle its 1024 limit) keeping the top level wins by 2-7 points; with
each prompt's calls spread evenly over the three tools (sparser trees) the gap shrinks
to 0-3 points.

Trajectories carry their per-turn output tokens, so every remaining length is known:
``remaining_after[d]`` = tokens of turns ``d..end`` (what is still to generate after the
``d``-th tool return).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from libra_hpc.scheduler.types import (
    BucketSpec,
    FinishedTrajectory,
    Router,
    ToolState,
    TrajectoryView,
)

TOOLS = ("python", "bash", "search")
DEFAULT_LIMITS = {1: 1024, 2: 4096, 4: 16384, 8: 1 << 30}
DIFFICULTY_SIGMA = 0.4  # log-normal sigma of the per-prompt turn-length multiplier
TURN_SIGMA = 0.3  # log-normal sigma of one turn's length around what its causes predict
PRIMARY_TOOL_WEIGHT = 30.0  # odds of a prompt's main tool against each other tool
NO_TOOL = 0.15  # probability that the agent answers without calling a tool
CHECK_AGAIN = 0.3  # probability of one more (successful) check after the code works
BUG_RATE = (0.1, 0.65)  # per-prompt range: P(one more bug), so bugs ~ geometric
TIMEOUT_RATE = (0.0, 0.1)  # per-prompt range: P(a tool call hangs)
STRETCH = {"write": 1.0, "failure": 2.5, "timeout": 1.5, "success": 0.4}  # turn length / base


@dataclass(frozen=True)
class SyntheticTrajectory:
    """One rollout: ``turns[i]`` output tokens of turn ``i``; ``states[i]`` the tool return
    after turn ``i`` (none after the last turn, so ``len(states) == len(turns) - 1``)."""

    tid: str
    prompt_id: str
    sample: int  # index within its prompt's group
    turns: tuple[int, ...]
    states: tuple[ToolState, ...]

    @property
    def remaining_after(self) -> tuple[int, ...]:
        """Output tokens still to generate after the d-th tool return, d = 0..len(states)."""
        suffix, out = 0, []
        for tokens in reversed(self.turns):
            suffix += tokens
            out.append(suffix)
        return tuple(reversed(out))

    @property
    def total(self) -> int:
        return sum(self.turns)

    def finished(self) -> FinishedTrajectory:
        return FinishedTrajectory(self.prompt_id, self.states, self.remaining_after)


@dataclass(frozen=True)
class _Prompt:
    pid: str
    difficulty: float  # multiplier on turn length
    bug_rate: float  # probability of each further bug
    timeout_rate: float  # probability that a tool call hangs
    tool_weights: tuple[float, ...]


def _prompt(rng: random.Random, index: int) -> _Prompt:
    primary = rng.randrange(len(TOOLS))  # a task mostly needs one kind of tool
    weights = tuple(PRIMARY_TOOL_WEIGHT if i == primary else 1.0 for i in range(len(TOOLS)))
    return _Prompt(f"p{index}", rng.lognormvariate(0.0, DIFFICULTY_SIGMA), rng.uniform(*BUG_RATE),
                   rng.uniform(*TIMEOUT_RATE), weights)


def _tool_return(rng: random.Random, prompt: _Prompt, bugs: int) -> ToolState:
    """What the tool reports while ``bugs`` remain in the agent's code."""
    tool = rng.choices(TOOLS, prompt.tool_weights)[0]
    if rng.random() < prompt.timeout_rate:
        return ToolState(tool, "S", "timeout")
    if bugs:
        return ToolState(tool, "L" if bugs >= 2 else "M", "failure")
    return ToolState(tool, rng.choices(("S", "M"), (3, 1))[0], "success")


def _trajectory(rng: random.Random, prompt: _Prompt, sample: int, base_turn_tokens: int,
                max_turns: int) -> SyntheticTrajectory:
    def turn(kind: str) -> int:
        tokens = base_turn_tokens * prompt.difficulty * STRETCH[kind] * rng.lognormvariate(0.0, TURN_SIGMA)
        return max(8, int(tokens))

    bugs = 0
    while rng.random() < prompt.bug_rate:
        bugs += 1
    turns, states = [turn("write")], []
    calls_left = 0 if rng.random() < NO_TOOL else max_turns - 1
    while len(turns) < max_turns and calls_left:
        state = _tool_return(rng, prompt, bugs)
        states.append(state)
        turns.append(turn(state.status))
        if state.status == "failure":
            bugs -= 1
        elif state.status == "success":  # done, unless it checks once more
            calls_left = 1 if calls_left > 1 and rng.random() < CHECK_AGAIN else 0
    return SyntheticTrajectory(f"{prompt.pid}/{sample}", prompt.pid, sample, tuple(turns), tuple(states))


def generate(n_prompts: int, samples_per_prompt: int, seed: int, *, base_turn_tokens: int = 500,
             max_turns: int = 16) -> list[SyntheticTrajectory]:
    """``n_prompts × samples_per_prompt`` trajectories (prompt by prompt), all from
    ``random.Random(seed)``. ``base_turn_tokens``: median tokens of a first turn of a
    prompt of median difficulty. ``max_turns``: cap on turns per trajectory."""
    if n_prompts < 1 or samples_per_prompt < 1 or max_turns < 1 or base_turn_tokens < 1:
        raise ValueError(f"generate: n_prompts={n_prompts}, samples_per_prompt={samples_per_prompt}, "
                         f"max_turns={max_turns}, base_turn_tokens={base_turn_tokens} must all be >= 1")
    rng = random.Random(seed)
    out = []
    for index in range(n_prompts):
        prompt = _prompt(rng, index)
        out.extend(_trajectory(rng, prompt, s, base_turn_tokens, max_turns) for s in range(samples_per_prompt))
    return out


def split_by_sample(trajectories: Sequence[SyntheticTrajectory], test_per_prompt: int
                    ) -> tuple[list[SyntheticTrajectory], list[SyntheticTrajectory]]:
    """(train, test): the last ``test_per_prompt`` samples of every prompt are the test set,
    so test prompts were seen in training (as in GRPO groups across epochs). Both come in
sample order (all prompts' sample 0, then sample 1, ...), as an RL run visits them, so
windows over recent samples see many prompts."""
    last = {}
    for t in trajectories:
        last[t.prompt_id] = max(last.get(t.prompt_id, -1), t.sample)
    ordered = sorted(trajectories, key=lambda t: t.sample)  # stable: epoch by epoch, prompts interleaved
    test = [t for t in ordered if t.sample > last[t.prompt_id] - test_per_prompt]
    train = [t for t in ordered if t.sample <= last[t.prompt_id] - test_per_prompt]
    return train, test


def default_buckets(limits: dict[int, int] | None = None) -> list[BucketSpec]:
    """One instance per TP size with ``SchedulerConfig``'s default token limits."""
    limits = limits or DEFAULT_LIMITS
    return [BucketSpec(f"tp{tp}", tp, limit, (i,)) for i, (tp, limit) in enumerate(sorted(limits.items()))]


def evaluate_routing(router_factory: Callable[[list[BucketSpec]], Router], train: Sequence[SyntheticTrajectory],
                     test: Sequence[SyntheticTrajectory], buckets: Sequence[BucketSpec], *,
                     learn_online: bool = False) -> dict:
    """Train the router on ``train`` (as finished trajectories), then replay ``test`` turn
    by turn, one trajectory at a time (no load: nothing saturates, nothing falls back).

    For every decision after a tool return it compares the chosen bucket with the bucket
    the TRUE remaining length maps to. Returns ``decisions``, ``bucket_accuracy``,
    ``top_level_accuracy`` (a router that always keeps the top level), ``mean_level_error``
    (levels between chosen and true bucket), ``migrations``. ``learn_online``: the router
    also observes each test trajectory once it is replayed."""
    router = router_factory(list(buckets))
    for trajectory in train:
        router.observe(trajectory.finished())
    ordered = sorted(buckets, key=lambda b: b.token_limit)
    level = {b.name: i for i, b in enumerate(ordered)}
    decisions = correct = top_correct = level_error = migrations = 0
    for trajectory in test:
        remaining, bucket = trajectory.remaining_after, None
        for d, tokens in enumerate(trajectory.turns):
            view = TrajectoryView(trajectory.tid, trajectory.prompt_id, trajectory.states[:d],
                                  sum(trajectory.turns[:d]), bucket, remaining[d], tuple(trajectory.turns[:d]))
            placement = router.place(view)
            router.turn_started(placement.instance, tokens)
            router.turn_ended(placement.instance, tokens)
            migrations += placement.migrated
            if d:
                truth = _true_level(remaining[d], ordered)
                decisions += 1
                correct += level[placement.bucket] == truth
                top_correct += truth == 0
                level_error += abs(level[placement.bucket] - truth)
            bucket = placement.bucket
        if learn_online:
            router.observe(trajectory.finished())
    denominator = max(decisions, 1)
    return {"decisions": decisions, "bucket_accuracy": correct / denominator,
            "top_level_accuracy": top_correct / denominator, "mean_level_error": level_error / denominator,
            "migrations": migrations}


def _true_level(tokens: int, ordered: Sequence[BucketSpec]) -> int:
    for i, bucket in enumerate(ordered):
        if tokens <= bucket.token_limit:
            return i
    return len(ordered) - 1


def length_summary(trajectories: Sequence[SyntheticTrajectory]) -> dict:
    """Median, p90, p99 (nearest rank) of total output tokens and mean turns."""
    totals = sorted(t.total for t in trajectories)

    def rank(q: float) -> int:
        return totals[max(0, math.ceil(q * len(totals)) - 1)]
    return {"median": rank(0.5), "p90": rank(0.9), "p99": rank(0.99),
            "mean_turns": sum(len(t.turns) for t in trajectories) / len(trajectories)}
