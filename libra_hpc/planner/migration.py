"""What C-MLFQ's moves between buckets cost a plan (pure: no torch, no MPI).

C-MLFQ (``libra_hpc.scheduler.routers.CmlfqRouter``) starts every trajectory on the top
level (the bucket with the smallest token limit present) and, after each tool return, moves
its next turn to the level whose token limit is the smallest at or above the trajectory's
expected *remaining* output tokens (the last level takes everything beyond). A move is a
*migration*: the destination instance holds none of the trajectory's KV cache, so it
re-prefills the whole context (first prompt, every token generated so far and every tool
output returned so far) before the next turn decodes there. While it does, that instance
decodes nothing (the simulator's instance, ``libra_hpc.sim.instance``, and vLLM's chunked
prefill alike), so each migration costs its destination's running batch the re-prefill's
seconds, and the moved trajectory waits the same seconds.

:func:`crossings` predicts those moves for one trajectory shape and :class:`MigrationPricing`
gives the plan valuation (:func:`~libra_hpc.planner.costs.rollout_makespan`) the limits of
the buckets a plan has. Assumptions, each a simplification of the router it prices:

- the trajectory's turns are equal: ``turns`` turns of ``gen_len / turns`` tokens each, with
  a tool return between two turns (``turns - 1`` of them, each returning an equal share of
  the tool tokens);
- the router's estimate of the remaining tokens is the true remaining length (a causal
  index that has learnt the workload; its mean/p90 disagreements, which keep a turn where
  it is, and its errors, which move it needlessly, are not modelled);
- the limits are the configured ones (``scheduler.bucket_limits: fixed``) or, with
  ``share``, the ones :func:`share_limits` places on the lengths the plan is priced on, as
  the simulator places them on recent trajectories when the layout changes;
- a bucket is one rollout TP size; the plan's TP sizes are its buckets.

Units: tokens, seconds.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

UNBOUNDED = 1 << 30
"""The last bucket's limit: it takes every remaining length."""


def share_limits(gpus: Mapping[int, int], first: float, samples: Sequence[tuple[float, float]]) -> dict[int, int]:
    """Bucket token limits from GPU shares (``scheduler.bucket_limits: share``), on the
    quantity C-MLFQ compares, the remaining output tokens after a tool return.

    ``gpus``: GPUs per rollout TP size. ``first``: tokens decoded by first turns (they run
    on the top level and count there). ``samples``: per later turn, (remaining tokens after
    the tool return before it, tokens it decodes). TP sizes ascending, bucket ``i``'s limit
    is the smallest remaining length at which the decoded tokens routed to buckets ``0..i``
    reach their cumulative GPU share; the last bucket is unbounded. Limits are strictly
    increasing integers."""
    total_gpus = sum(gpus.values())
    ordered = sorted(samples)
    mass = first + sum(w for _, w in ordered)
    cum, acc = [], first
    for _, w in ordered:
        acc += w
        cum.append(acc)
    out, share, prev = {}, 0, 0
    tps = sorted(gpus)
    for k, tp in enumerate(tps):
        share += gpus[tp]
        if k == len(tps) - 1:
            out[tp] = UNBOUNDED
            break
        target = mass * share / total_gpus
        limit = int(-(-ordered[min(bisect_left(cum, target), len(ordered) - 1)][0] // 1)) if ordered else prev + 1
        out[tp] = max(limit, prev + 1)
        prev = out[tp]
    return out


def _turns(turns: float) -> int:
    return max(1, round(turns))


def crossings(limits: Sequence[tuple[int, int]], prompt_len: float, gen_len: float, turns: float,
              tool_tokens: float = 0.0) -> list[tuple[int, float]]:
    """The moves C-MLFQ makes with one trajectory over buckets ``limits`` ((TP, token
    limit), ascending limits, the last taking everything beyond): per move, (the TP it
    moves to, the context tokens re-prefilled there). The trajectory: ``prompt_len`` tokens
    of prompt including the ``tool_tokens`` its tools return, ``gen_len`` generated in
    ``turns`` equal turns (module docstring). Its first turn runs on the first bucket;
    after tool return ``d`` (``d`` = 1 .. turns-1) its remaining tokens are
    ``gen_len × (turns - d) / turns`` and its level the first whose limit holds them; a
    level different from the previous turn's is a move, which re-prefills the first
    prompt, the ``d`` turns generated and the ``d`` tool returns."""
    if len(limits) < 2:
        return []
    n = _turns(turns)
    first_prompt = max(0.0, prompt_len - tool_tokens)
    per_turn, per_return = gen_len / n, tool_tokens / max(1, n - 1)
    out, level = [], 0
    for d in range(1, n):
        remaining = per_turn * (n - d)
        now = next((i for i, (_, limit) in enumerate(limits[:-1]) if limit >= remaining), len(limits) - 1)
        if now != level:
            out.append((limits[now][0], first_prompt + d * (per_turn + per_return)))
            level = now
    return out


@dataclass(frozen=True)
class MigrationPricing:
    """The bucket limits a plan valuation prices C-MLFQ's migrations with (only for a
    router that is not length-aware over more than one rollout TP size:
    :func:`~libra_hpc.planner.costs.rollout_makespan`)."""

    limits: tuple[tuple[int, int], ...]
    """(rollout TP, token limit) as configured (``scheduler.bucket_token_limits``)."""
    share: bool = False
    """The limits follow the plan's GPU shares (``scheduler.bucket_limits: share``)."""

    @classmethod
    def from_config(cls, scheduler: object) -> MigrationPricing:
        """From a ``SchedulerConfig`` (``bucket_token_limits``, ``bucket_limits``)."""
        return cls(tuple(sorted(scheduler.bucket_token_limits.items())), scheduler.bucket_limits == "share")

    def buckets(self, gpus: Mapping[int, int], prompt: Sequence[float], gen: Sequence[float],
                turns: Sequence[float], count: Sequence[int]) -> tuple[tuple[int, int], ...]:
        """The (TP, limit) buckets of a plan with ``gpus`` GPUs per rollout TP size, ascending
        limits, the last unbounded. Fixed: the configured limits of the TP sizes present (a
        TP size without one is placed last). Share: :func:`share_limits` on the priced
        lengths (per bucket of the length profile: ``count`` trajectories of ``gen`` tokens
        in ``turns`` equal turns)."""
        tps = sorted(tp for tp, g in gpus.items() if g > 0)
        if len(tps) < 2:
            return tuple((tp, UNBOUNDED) for tp in tps)
        if self.share:
            first, samples = 0.0, []
            for g, t, c in zip(gen, turns, count):
                n = _turns(t)
                first += c * g / n
                samples += [(g * (n - d) / n, c * g / n) for d in range(1, n)]
            limits = share_limits({tp: gpus[tp] for tp in tps}, first, samples)
        else:
            fixed = dict(self.limits)
            limits = {tp: fixed.get(tp, UNBOUNDED) for tp in tps}
        ordered = sorted(limits.items(), key=lambda x: (x[1], x[0]))
        return tuple((tp, limit) for tp, limit in ordered[:-1]) + ((ordered[-1][0], UNBOUNDED),)
