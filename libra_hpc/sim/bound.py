"""The physical bound of a scenario: how fast could any policy run its batches?

Two floors, each a lower bound on the simulated time of every policy:

- **Work.** A perfect packing of each step's work on all GPUs: every trajectory's tokens
  decoded at the TP size that costs the fewest GPU-seconds per token (each instance full:
  as many sequences as its KV cache holds at the batch's mean length, at most
  ``max_num_seqs``), every prompt and tool-output token prefilled exactly once (compute
  only: perfect prefix caching, weights read for free), and the training step on the shape
  that costs the fewest GPU-seconds. Nothing waits, nothing idles: ``work_s`` = (rollout
  GPU-s + training GPU-s) / GPUs.
- **Chain.** A batch cannot finish before its longest trajectory, alone on the fastest
  instance shape (``critical_path_s``). With staleness k at most k + 1 batches are in flight
  at once, so the batches' chains add up to at most (k + 1) × the run's time:
  ``chain_s`` = critical path / (k + 1).

The run's bound is max(Σ work_s, Σ chain_s) over the steps (each sum alone is a valid
floor; the per-step maximum is shown for the table but is not itself a floor, because a
long chain can overlap another step's work). A policy's distance to it is ``bound time /
policy time`` (1.0: as fast as physics allows on this cost model; it is a ratio of
throughputs too, since every policy generates the same tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from libra_hpc.envs.synthetic import Trajectory
from libra_hpc.sim.context import Context, critical_path_s
from libra_hpc.sim.training import best_shape, step_s


@dataclass(frozen=True)
class StepBound:
    """One step's floors, s (``work_s`` and ``chain_s``) and what they are made of."""

    step: int
    rollout_gpu_s: float
    train_gpu_s: float
    work_s: float
    critical_path_s: float
    chain_s: float
    best_decode_tp: int

    @property
    def floor_s(self) -> float:
        return max(self.work_s, self.chain_s)


def decode_gpu_s_per_token(ctx: Context, mean_seq: float, mean_context: float) -> tuple[float, int]:
    """Fewest GPU-seconds per decoded token over the scenario's rollout TP sizes, each
    instance running its full batch (KV capacity over ``mean_seq``, at most
    ``max_num_seqs``) at ``mean_context`` tokens per sequence; and that TP size."""
    best = (math.inf, 0)
    for tp, cost in ctx.rollout_costs.items():
        batch = cost.concurrency(mean_seq)
        if batch < 1:
            continue
        per_token = tp * cost.decode_step_s(batch, batch * mean_context) / batch
        best = min(best, (per_token, tp))
    return best


def prefill_gpu_s(ctx: Context, tokens: float) -> float:
    """Fewest GPU-seconds to prefill ``tokens`` tokens of one sequence: compute and
    all-reduce only (the weight read is shared by a perfect batch)."""
    best = math.inf
    for tp, cost in ctx.rollout_costs.items():
        c = cost.prefill_components(tokens)
        best = min(best, tp * cost.cal.time("prefill", {**c, "mem_s": 0.0, "collectives": 0.0}))
    return best


def train_gpu_s(ctx: Context, batch: list[Trajectory]) -> float:
    """Fewest GPU-seconds of the batch's training step over the shapes that fit (any GPU
    count up to the whole cluster), at the batch's mean sequence length (as the simulator
    prices it)."""
    cfg = ctx.cfg
    mean_tokens = sum(t.total_tokens for t in batch) / len(batch)
    seq = max(1, round(mean_tokens))
    best = math.inf
    gpus = 1
    while gpus <= ctx.gpus:
        shape = best_shape(ctx.model, ctx.hw, gpus, cfg.batch_size, seq, ctx.cal)
        if shape is not None:
            best = min(best, gpus * step_s(ctx.model, ctx.hw, shape, mean_tokens, ctx.cal))
        gpus *= 2
    return best


def step_bound(ctx: Context, step: int) -> StepBound:
    """The floors of step ``step``'s batch (see the module docstring)."""
    batch = ctx.batch(step)
    gen = sum(t.gen_tokens for t in batch)
    seqs = [t.total_tokens for t in batch]
    mean_seq = sum(seqs) / len(seqs)
    # Token-weighted mean context a decoded token sees: a turn of n tokens starting at
    # context c sees c + n/2 on average.
    ctx_tokens = 0.0
    prefill = 0.0
    for t in batch:
        context = t.prompt_tokens
        prefill += prefill_gpu_s(ctx, t.prompt_tokens)
        for i, n in enumerate(t.turns):
            ctx_tokens += n * (context + n / 2)
            context += n
            if i < len(t.calls):
                out = t.calls[i].output_tokens
                if out:
                    prefill += prefill_gpu_s(ctx, out)
                context += out
    per_token, tp = decode_gpu_s_per_token(ctx, mean_seq, ctx_tokens / gen if gen else 0.0)
    rollout = gen * per_token + prefill
    train = train_gpu_s(ctx, batch)
    cp = critical_path_s(ctx, batch)
    k = ctx.cfg.rl.max_staleness
    return StepBound(step, rollout, train, (rollout + train) / ctx.gpus, cp, cp / (k + 1), tp)


def run_bound(ctx: Context, steps: int | None = None) -> dict:
    """The bound of the whole run: per step floors, the totals, the bound's time and the
    mean step it allows (``bound_step_s``), and which floor binds."""
    rows = [step_bound(ctx, j) for j in range(steps or ctx.cfg.rl.steps)]
    work = sum(r.work_s for r in rows)
    chain = sum(r.chain_s for r in rows)
    total = max(work, chain)
    return {"bound_s": total, "bound_step_s": total / len(rows), "work_s": work, "chain_s": chain,
            "binding": "work" if work >= chain else "chain",
            "steps": [r.__dict__ | {"floor_s": r.floor_s} for r in rows]}
