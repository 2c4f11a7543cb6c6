"""A lower bound on the time any simulated policy takes to complete RL steps 0..k, for
every k (cumulative: with asynchronous training steps overlap, so a per-step floor summed
is not one).

What the simulator charges, and so what every policy pays at least (each assumption is
one the simulator's own mechanics make true; libra_hpc/sim/instance.py, controller.py):

1. **Decode.** A decode step of ``b`` sequences holding ``K`` KV tokens on a TP-``t``
   instance takes ``P + c·b + max(M + m·K, f·b + a·K)`` seconds on ``t`` GPUs (the
   planner's roofline, libra_hpc/planner/costs.py: per-step overhead and collective
   latency ``P``, all-reduce bytes ``c`` per sequence, the weight read ``M``, KV bytes
   ``m`` per token, matmul FLOPs ``f`` per sequence, attention FLOPs ``a`` per KV token;
   the MoE expert read, which grows with ``b``, is left out). A step decodes at most
   ``costs.max_num_seqs`` tokens (``B``), so decoding ``N`` tokens takes at least ``N/B``
   steps; ``max`` of sums is at most the sum of ``max``, and ``max(x, y) >= λx + (1-λ)y``
   for every λ in [0, 1]: the GPU-seconds of decoding ``N`` tokens that read ``K`` KV
   tokens in all are at least ``min_t a_t(λ)·N + min_t b_t(λ)·K`` whatever TP sizes the
   tokens ran on; the bound takes the best λ of a grid. This is decode at the best batch
   efficiency any policy could reach (every step full, the weight read shared by ``B``).
2. **What a decoded token reads.** A token generated at position ``i`` of a turn that starts
   at context ``c`` reads ``c + i`` KV tokens. The simulator prices a step at the context of
   its last re-pricing (at most ``costs.resync_steps`` tokens per sequence behind) rounded
   to a 256-token cell (at most 128 below), so the bound counts ``max(0, c + i -
   resync_steps - 128)``.
3. **Prefill.** Every prompt and every tool output is prefilled at least once (a turn after
   a tool return where its prefix is cached prefills only the tool output), at the
   cheapest TP size's compute and all-reduce only (the weight read of a batched prefill is
   shared; attention over the sequence's own tokens only, as the simulator prices it).
4. **Training.** A training step on ``n`` GPUs with any shape the planner or the search can
   pick (TP in 1, 2, 4, 8 within a node, PP up to 8 dividing the layers, micro-batch 1, 2
   or 4, DP any, the batch split unevenly as a lent hybrid replica does), at the trained
   sequences' mean length (a step trains its batch less the GRPO groups left out,
   ``rl.filter_zero_variance``: the simulator's trainer does the same; a step that trains
   none costs nothing), with recomputation where nothing fits otherwise: its
   GPU-seconds ``n × step_s`` are at least the least over every shape on up to
   ``EXACT_TRAIN_GPUS`` GPUs and the FLOP floor beyond (model FLOPs at peak × ``train_mfu``
   plus one step overhead per GPU); its wall time at least the least over shapes on up to
   all GPUs (the FLOP floor on all GPUs beyond ``EXACT_TRAIN_GPUS``). Training steps run
   one after another.
5. **Work.** No GPU does two things at once (rollout instances, training, lent replicas
   are disjoint; colocated switches): completing steps 0..k takes at least the GPU-seconds
   above for the trajectories they train, over all GPUs.
6. **Chains.** A trajectory alone is the fastest it can be: its prefills, each decode step
   at batch 1 at its own context (2.), its tool calls' latency, each turn on the TP size
   fastest for it. Batch ``s`` is submitted no earlier than training step ``s - k - 1``
   ends (``k = rl.max_staleness``; synchronous policies wait longer). Without partial
   rollout step ``j`` trains batch ``j``: it ends no earlier than its longest chain after
   that submission, plus its training (streamed training: plus nothing), and no earlier
   than step ``j - 1`` ends plus its training. With partial rollout step ``j`` trains
   ``(j + 1)·batch`` trajectories by its end, each of a batch at most ``k`` ahead of it:
   the chains are counted per trained segment, the ``(j + 1)·batch``-th earliest possible
   finish among them (each trajectory's chain after its batch's earliest submission), and
   the work floor takes the cheapest ``(j + 1)·batch`` of them.
7. Left out (each only adds time): weight syncs, relayout pauses, switches, queueing,
   stragglers, regenerated partial-rollout tokens.

The bound of steps 0..k is the larger of the work and the chain floors there; the run's is
that of its last step. ``bound_violations`` (libra_hpc/sim/report.py) counts the steps at
which a policy finished before it: a failed bound, never a fast policy.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from functools import lru_cache

from libra_hpc.envs.synthetic import Trajectory
from libra_hpc.planner.calibration import Calibration
from libra_hpc.planner.costs import RolloutCost, TrainShape
from libra_hpc.planner.profiles import HardwareProfile, ModelProfile
from libra_hpc.planner.search import fitting_training_cost
from libra_hpc.sim.context import Context, critical_path_s

LAMBDAS = tuple(i / 20 for i in range(21))
"""The λ grid of assumption 1 (each value gives a valid floor; the best is taken)."""
EXACT_TRAIN_GPUS = 256
"""Training shapes are enumerated on up to this many GPUs (assumption 4)."""
TRAIN_TPS, MICRO_BATCHES, MAX_PP = (1, 2, 4, 8), (1, 2, 4), 8
QUANTUM_SLACK = 128
"""KV tokens a step's context may be priced below its own (the simulator's 256-token cell)."""


@dataclass(frozen=True)
class DecodeTerms:
    """One TP size's decode step as ``P + c·b + max(M + m·K, f·b + a·K)`` s (assumption 1)."""

    tp: int
    per_step: float
    per_seq: float
    weights: float
    per_kv_mem: float
    per_seq_flops: float
    per_kv_flops: float

    @classmethod
    def of(cls, cost: RolloutCost) -> DecodeTerms:
        cal = cost.cal
        base, one, kv = cost.decode_components(0, 0), cost.decode_components(1, 0), cost.decode_components(0, 1)
        return cls(cost.tp, cal.decode_step_overhead_s + base["collectives"] * cal.collective_latency_s,
                   (one["comm_s"] - base["comm_s"]) / cal.rollout_comm_eff, base["mem_s"] / cal.bandwidth_eff,
                   (kv["mem_s"] - base["mem_s"]) / cal.bandwidth_eff,
                   (one["compute_s"] - base["compute_s"]) / cal.prefill_mfu,
                   (kv["compute_s"] - base["compute_s"]) / cal.prefill_mfu)

    def coefficients(self, lam: float, seats: int) -> tuple[float, float]:
        """GPU-seconds per decoded token and per KV token read, at full steps of ``seats``."""
        per_token = self.per_step / seats + self.per_seq + lam * self.weights / seats + (1 - lam) * self.per_seq_flops
        return self.tp * per_token, self.tp * (lam * self.per_kv_mem + (1 - lam) * self.per_kv_flops)

    def alone_s(self, tokens: int, kv: float) -> float:
        """Seconds to decode ``tokens`` tokens of one sequence alone, reading ``kv`` KV tokens in all."""
        return tokens * (self.per_step + self.per_seq) + max(tokens * self.weights + self.per_kv_mem * kv,
                                                             tokens * self.per_seq_flops + self.per_kv_flops * kv)


def kv_read(context: int, tokens: int, slack: int) -> float:
    """Σ over a turn's tokens of what each reads (assumption 2): ``Σ_i max(0, context + i - slack)``."""
    start = context - slack
    if start >= 0:
        return tokens * start + tokens * (tokens - 1) / 2
    n = tokens + start  # tokens past the slack
    return n * (n - 1) / 2 if n > 1 else 0.0


@dataclass(frozen=True)
class TrajectoryFloor:
    """One trajectory's floors: decoded tokens, KV tokens they read, prefill GPU-seconds,
    and its chain (assumption 6), s."""

    tokens: int
    kv: float
    prefill_gpu_s: float
    chain_s: float
    total_tokens: int
    trained: bool = True


class Floors:
    """The per-trajectory and per-step floors of one scenario (the module docstring)."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.terms = [DecodeTerms.of(c) for c in ctx.rollout_costs.values()]
        self.costs = list(ctx.rollout_costs.values())
        self.seats = ctx.cfg.costs.max_num_seqs
        self.slack = ctx.cfg.costs.resync_steps + QUANTUM_SLACK
        self.coef = [(min(t.coefficients(lam, self.seats)[0] for t in self.terms),
                      min(t.coefficients(lam, self.seats)[1] for t in self.terms)) for lam in LAMBDAS]

    def prefill(self, tokens: int) -> tuple[float, float]:
        """(GPU-seconds, seconds alone) of prefilling ``tokens`` tokens, least over TP sizes."""
        if not tokens:
            return 0.0, 0.0
        gpu_s = min(c.tp * c.cal.time("prefill", {**c.prefill_components(tokens), "mem_s": 0.0, "collectives": 0.0})
                    for c in self.costs)
        return gpu_s, min(c.prefill_s(tokens) for c in self.costs)

    def trajectory(self, t: Trajectory) -> TrajectoryFloor:
        gpu_s, chain = self.prefill(t.prompt_tokens)
        context, kv = t.prompt_tokens, 0.0
        for i, n in enumerate(t.turns):
            turn_kv = kv_read(context, n, self.slack)
            kv += turn_kv
            chain += min(term.alone_s(n, turn_kv) for term in self.terms)
            context += n
            if i < len(t.calls):
                out = t.calls[i].output_tokens
                g, s = self.prefill(out)
                gpu_s, chain = gpu_s + g, chain + s + t.calls[i].latency_s
                context += out
        return TrajectoryFloor(t.gen_tokens, kv, gpu_s, chain, t.total_tokens, t.trained)

    def decode_gpu_s(self, tokens: float, kv: float) -> float:
        """Assumption 1 over a set of trajectories: the best λ's floor."""
        return max(a * tokens + b * kv for a, b in self.coef)

    def train(self, mean_tokens: float, sequences: int | None = None) -> tuple[float, float]:
        """(GPU-seconds, seconds) floors of a training step of ``sequences`` (the batch size
        by default; 0: nothing trained, free) at ``mean_tokens`` per sequence."""
        c = self.ctx
        n = c.cfg.batch_size if sequences is None else sequences
        if n == 0:
            return 0.0, 0.0
        return train_floor(c.model, c.hw, c.cal, n, coarse(mean_tokens), c.gpus)


def coarse(tokens: float) -> int:
    """``tokens`` rounded down to 6 significant bits (within 1.6% below): a step is no
    cheaper on longer sequences, and close lengths share one enumeration of shapes."""
    n = max(1, math.floor(tokens))
    step = 1 << max(0, n.bit_length() - 6)
    return n // step * step


@lru_cache(maxsize=1024)
def train_floor(model: ModelProfile, hw: HardwareProfile, cal: Calibration, batch: int, seq: int,
                gpus: int) -> tuple[float, float]:
    """Assumption 4: (least GPU-seconds, least seconds) of a training step of ``batch``
    sequences of ``seq`` tokens on up to ``gpus`` GPUs."""
    gpu_s = wall = math.inf
    exact = min(gpus, EXACT_TRAIN_GPUS)
    for tp in TRAIN_TPS:
        if hw.gpus_per_node % tp:
            continue
        for pp in (p for p in range(1, MAX_PP + 1) if model.num_layers % p == 0):
            for dp in range(1, exact // (tp * pp) + 1):
                for mb in MICRO_BATCHES:
                    if dp * mb > batch:
                        continue
                    shape = TrainShape(tp, pp, dp, mb, batch, seq, uneven=bool(batch % (dp * mb)))
                    cost = fitting_training_cost(model, hw, shape, cal)
                    if not cost.infeasible:
                        gpu_s, wall = min(gpu_s, shape.gpus * cost.step_s), min(wall, cost.step_s)
    if gpus > exact:
        flops = fitting_training_cost(model, hw, TrainShape(1, 1, 1, 1, batch, seq), cal).model_flops
        ideal = flops / (hw.peak_flops * cal.train_mfu)
        gpu_s = min(gpu_s, ideal + (exact + 1) * cal.train_step_overhead_s)
        wall = min(wall, ideal / gpus + cal.train_step_overhead_s)
    return gpu_s, wall


def _shapes_note() -> str:
    return f"TP {TRAIN_TPS}, PP <= {MAX_PP}, micro-batch {MICRO_BATCHES}, any DP, uneven splits allowed"


def run_bound(ctx: Context, steps: int | None = None) -> dict:
    """The cumulative bound of steps 0..k for every k (``cumulative_s``), its two floors per
    step (``work_s``, ``chain_s``: cumulative), the run's bound (``bound_s``: the last
    step's), the mean step it allows, which floor binds at the end, and per step what the
    floors are made of."""
    cfg = ctx.cfg
    n = steps or cfg.rl.steps
    k, B = cfg.rl.max_staleness, cfg.batch_size
    floors = Floors(ctx)
    batches = [[floors.trajectory(t) for t in ctx.batch(j)] for j in range(min(cfg.rl.steps, n + k))]
    partial = cfg.rl.partial_rollout
    stream = cfg.rl.stream_training and not partial
    done: list[float] = []  # chain floor: when step j can end at the earliest
    rows, work = [], 0.0
    for j in range(n):
        batch = batches[j]
        if partial:  # the cheapest (j + 1)·B trajectories of the batches step j may train
            pool = [t for s in range(min(len(batches), j + k + 1)) for t in batches[s]]
            m = min(len(pool), (j + 1) * B)
            cheapest = [heapq.nsmallest(m, pool, key=lambda t: a * t.tokens + b * t.kv + t.prefill_gpu_s)
                        for a, b in floors.coef]
            rollout_cum = max(sum(a * t.tokens + b * t.kv + t.prefill_gpu_s for t in sel)
                              for (a, b), sel in zip(floors.coef, cheapest))
            # B of the pool train, at least B less its untrained ones (filtered groups): the shortest
            trained = [t for t in pool if t.trained]
            shortest = heapq.nsmallest(max(0, B - (len(pool) - len(trained))), trained, key=lambda t: t.total_tokens)
            train_gpu_s, train_s = floors.train(sum(t.total_tokens for t in shortest) / max(1, len(shortest)),
                                                None if len(trained) == len(pool) else len(shortest))
            finish = sorted((done[s - k - 1] if s - k - 1 >= 0 else 0.0) + t.chain_s
                            for s in range(min(len(batches), j + k + 1)) for t in batches[s])[m - 1]
            end = max(done[-1] if done else 0.0, finish) + train_s
            rollout = rollout_cum - (rows[-1]["rollout_cum_gpu_s"] if rows else 0.0)
        else:
            rollout = (floors.decode_gpu_s(sum(t.tokens for t in batch), sum(t.kv for t in batch))
                       + sum(t.prefill_gpu_s for t in batch))
            kept = [t for t in batch if t.trained]
            train_gpu_s, train_s = floors.train(sum(t.total_tokens for t in kept) / max(1, len(kept)), len(kept))
            chain = max(t.chain_s for t in batch)
            rolled = (done[j - k - 1] if j - k - 1 >= 0 else 0.0) + chain
            end = max((done[-1] if done else 0.0) + train_s, rolled + (0.0 if stream else train_s))
        done.append(end)
        work += (rollout + train_gpu_s) / ctx.gpus
        rows.append({"step": j, "rollout_gpu_s": rollout, "train_gpu_s": train_gpu_s, "train_s": train_s,
                     "work_s": work, "chain_s": end, "cumulative_s": max(work, end),
                     "rollout_cum_gpu_s": (rows[-1]["rollout_cum_gpu_s"] if rows else 0.0) + rollout,
                     "chain_floor_s": max(t.chain_s for t in batch),
                     "critical_path_s": critical_path_s(ctx, ctx.batch(j))})
    last = rows[-1]
    return {"bound_s": last["cumulative_s"], "bound_step_s": last["cumulative_s"] / n, "work_s": last["work_s"],
            "chain_s": last["chain_s"], "binding": "work" if last["work_s"] >= last["chain_s"] else "chain",
            "cumulative_s": [r["cumulative_s"] for r in rows], "shapes": _shapes_note(), "steps": rows}


def violations(bound: dict, rows: list[dict], tolerance: float = 1e-9) -> list[int]:
    """The steps at which a policy's run (its per-step rows) finished steps 0..k before the
    bound's cumulative time: each one a failure of the bound."""
    cum = bound["cumulative_s"]
    return [r["step"] for r in rows if r["step"] < len(cum) and r["t_end"] < cum[r["step"]] * (1 - tolerance)]
