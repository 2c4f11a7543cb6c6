"""C-MLFQ's view of the shared synthetic agentic workload, and a routing-accuracy replay.

The trajectories are those of :mod:`libra_hpc.envs.synthetic` (the workload the simulator
simulates; its module docstring gives the process): this module only looks at them as the
router does. Each turn's output tokens, and after each turn the tool return as the queue
service classifies it: the text the tool hands back (:meth:`ToolCall.output
<libra_hpc.envs.synthetic.ToolCall.output>`) through the service's
:class:`~libra_hpc.scheduler.state.Classifier` into a ``(tool, size class, status)``
:class:`~libra_hpc.scheduler.types.ToolState`, the states the simulator's queue service
sees for the same trajectory.

The workload's process has the premise C-MLFQ rests on (failures causally lengthen what
follows; prompts differ; lengths are long-tailed); how strongly depends on the spec. The
scenario configs/sim/cmlfq-premise.yaml makes it hold, so that a router can be checked to
exploit it; that says nothing about how strongly real workloads hold it. How much causal
routing gains depends on how the remaining work after a given state spreads relative to
the bucket widths (4x apart with the default limits) and on how many finished trajectories
reach each tree node. Measured with the default limits, 16 samples per prompt, the last 4
for testing (``evaluate_routing``):

- configs/sim/cmlfq-premise.yaml (tool returns say how much work is left: a failure's
  output grows with the bugs left): C-MLFQ routes 0.74-0.76 of post-tool-return turns to
  their true bucket against 0.65-0.70 for keeping the top level (seeds 0-3, 300 prompts;
  0.77 against 0.67 with 1000 prompts, seed 0);
- the same without the per-bug growth (``failure_output_per_bug: 0``): 0.64-0.67 against
  0.65-0.68, 1 point below;
- the paper's SWE scenario configs/sim/a800-swe.yaml (turn noise sigma 0.7, an editor
  tool that never fails on bugs, failure sizes unrelated to the work left): 0.46-0.50
  against 0.50-0.53 (seeds 0-3, 300 prompts): there C-MLFQ's premise does not hold.

Trajectories carry their per-turn output tokens, so every remaining length is known:
``remaining_after[d]`` = tokens of turns ``d..end`` (what is still to generate after the
``d``-th tool return).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from libra_hpc.config import SchedulerConfig
from libra_hpc.envs.synthetic import SyntheticWorkload, Trajectory, WorkloadSpec
from libra_hpc.scheduler.state import Classifier
from libra_hpc.scheduler.types import (
    BucketSpec,
    FinishedTrajectory,
    Router,
    ToolState,
    TrajectoryView,
)

_DEFAULTS = SchedulerConfig()


@dataclass(frozen=True)
class SyntheticTrajectory:
    """One rollout as the router sees it: ``turns[i]`` output tokens of turn ``i``;
    ``states[i]`` the tool return after turn ``i`` (none after the last turn, so
    ``len(states) == len(turns) - 1``)."""

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
        """Output tokens over all turns."""
        return sum(self.turns)

    def finished(self) -> FinishedTrajectory:
        return FinishedTrajectory(self.prompt_id, self.states, self.remaining_after)


def router_views(trajectories: Iterable[Trajectory], size_thresholds: Sequence[int] = tuple(_DEFAULTS.size_thresholds),
                 error_markers: Sequence[str] = tuple(_DEFAULTS.error_markers)) -> list[SyntheticTrajectory]:
    """The router's view of each trajectory: its tool returns classified as the queue
    service classifies them with these ``size_thresholds`` (characters) and
    ``error_markers`` (a failure's text carries the first)."""
    classify = Classifier(size_thresholds, error_markers)
    marker = error_markers[0] if error_markers else ""
    return [SyntheticTrajectory(t.tid, t.prompt_id, t.sample, t.turns,
                                tuple(classify(c.tool, *c.output(size_thresholds, marker)) for c in t.calls))
            for t in trajectories]


def generate(spec: WorkloadSpec, n_prompts: int, samples_per_prompt: int, seed: int, *, seq_len: int,
             size_thresholds: Sequence[int] = tuple(_DEFAULTS.size_thresholds),
             error_markers: Sequence[str] = tuple(_DEFAULTS.error_markers)) -> list[SyntheticTrajectory]:
    """``n_prompts × samples_per_prompt`` trajectories, group by group: the first RL step of
    ``spec``'s workload over its first ``n_prompts`` prompts, each rolled out
    ``samples_per_prompt`` times (:meth:`SyntheticWorkload.groups`; the simulator's batch of
    a scenario with ``workload.prompt_pool = rl.prompts_per_step = n_prompts`` and
    ``rl.group_size = samples_per_prompt``), seen through :func:`router_views`.
    ``seq_len``: the longest trajectory in tokens (a scenario's ``training.seq_len``)."""
    if n_prompts < 1 or samples_per_prompt < 1:
        raise ValueError(f"generate: n_prompts={n_prompts} and samples_per_prompt={samples_per_prompt} "
                         "must both be >= 1")
    workload = SyntheticWorkload.groups(spec, n_prompts, samples_per_prompt, seed, seq_len)
    return router_views(workload.batch(0), size_thresholds, error_markers)


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
    """One instance per TP size with ``limits`` (TP size → token limit; default:
    ``SchedulerConfig.bucket_token_limits``'s)."""
    limits = limits or _DEFAULTS.bucket_token_limits
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
