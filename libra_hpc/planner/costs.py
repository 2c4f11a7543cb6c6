"""Cost models of the two sides the planner splits GPUs between (pure: no torch, no MPI).

Rollout (vLLM instances of tensor-parallel size TP):
- KV capacity per instance: memory left on each rank after its 1/TP of the weights and a
  reserve, divided by that rank's share of the KV bytes per token;
- a decode step is a roofline: each rank reads its 1/TP of the weights and of the KV cache
  at its own bandwidth (so time falls like 1/TP, never 1/TP²), plus two all-reduces per
  layer over NVLink, plus a fixed per-step overhead; prefill is FLOP-bound;
- rollout time is the makespan of the batch's length distribution over heterogeneous pools
  of instances (:func:`rollout_makespan`), never below the serial time of the longest
  trajectory (its decode steps one after another, plus its tool time).

Training (Megatron-Core TP×PP×DP with the distributed optimizer):
- step time = 3 × forward FLOPs over GPUs × MFU, with the 1F1B bubble (pp-1)/m, plus TP,
  PP and DP communication; never below FLOPs at peak;
- memory: bf16 weights, fp32 gradients, Adam states sharded over DP, activations, reserve.

Every efficiency and overhead is a :class:`~libra_hpc.planner.calibration.Calibration` field,
fitted from measured timings by :func:`~libra_hpc.planner.calibration.fit_calibration` (each
record: the *ideal* components this module predicts for the measured operation). The
lengths a makespan is priced on are a :class:`~libra_hpc.planner.lengths.LengthProfile`.
Units: seconds, bytes, FLOP, tokens.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

# Re-exported: the calibration and the length profile were defined here before
# (libra_hpc.planner.calibration, libra_hpc.planner.lengths); callers import them from here.
from libra_hpc.planner.calibration import DEFAULT as DEFAULT
from libra_hpc.planner.calibration import Calibration as Calibration
from libra_hpc.planner.calibration import TimingRecord as TimingRecord
from libra_hpc.planner.calibration import fit_calibration as fit_calibration
from libra_hpc.planner.lengths import LengthProfile as LengthProfile
from libra_hpc.planner.lengths import LengthSample as LengthSample
from libra_hpc.planner.migration import MigrationPricing, crossings
from libra_hpc.planner.profiles import HardwareProfile, ModelProfile

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------- rollout


def _allreduce_factor(n: int) -> float:
    """Bytes each rank sends per byte of buffer in a ring all-reduce of ``n`` ranks."""
    return 2.0 * (n - 1) / n if n > 1 else 0.0


class RolloutCost:
    """One rollout instance shape: ``model`` served with tensor parallelism ``tp`` on
    ``hw`` (the TP group stays on one node's NVLink). Everything per instance."""

    def __init__(self, model: ModelProfile, hw: HardwareProfile, tp: int, cal: Calibration = DEFAULT,
                 dtype_bytes: int = 2):
        if tp < 1:
            raise ValueError(f"tp must be >= 1, got {tp}")
        self.model, self.hw, self.tp, self.cal = model, hw, tp, cal
        m, b = model, dtype_bytes
        self.weight_bytes_per_rank = m.weight_bytes(b) / tp
        expert_bytes = m.num_layers * m.num_experts * m.expert_params * b
        self._dense_read = (m.matmul_params(active=False) * b - expert_bytes) / tp  # read every step
        self._expert_read = expert_bytes / tp  # read in the fraction of experts the batch touches
        kv_share = math.ceil(m.num_kv_heads / tp) / m.num_kv_heads  # KV heads replicate when TP > KV heads
        self.kv_bytes_per_token_rank = m.kv_bytes_per_token(b) * kv_share
        free = hw.memory_bytes * cal.kv_memory_fraction - self.weight_bytes_per_rank - cal.rollout_reserve_gb * 1e9
        self.kv_capacity_tokens = max(0, int(free // self.kv_bytes_per_token_rank))
        self._flops_tok = 2.0 * m.matmul_params(active=True) / tp
        self._attn_coef = m.attention_flops_per_token(1.0) / tp
        self._ar_bytes_tok = _allreduce_factor(tp) * m.hidden_size * b  # per token per all-reduce
        self._collectives = 2 * m.num_layers if tp > 1 else 0
        self._link = hw.link_bps(inter_node=False)
        self.infeasible = self._check(free)

    def _check(self, free: float) -> str | None:
        m, hw, tp = self.model, self.hw, self.tp
        where = f"{m.name} TP{tp} on {hw.name}"
        if tp > hw.gpus_per_node:
            return f"{where}: a TP group must stay on one node ({hw.gpus_per_node} GPUs)"
        if m.num_heads % tp:
            return f"{where}: TP must divide the {m.num_heads} attention heads"
        if free <= 0 or self.kv_capacity_tokens < 1:
            return (f"{where}: no memory left for the KV cache (weights {self.weight_bytes_per_rank / 1e9:.1f} GB "
                    f"per GPU + reserve {self.cal.rollout_reserve_gb} GB > "
                    f"{self.cal.kv_memory_fraction:.0%} of {hw.memory_gb} GB)")
        return None

    def decode_components(self, batch: float, context_tokens: float) -> dict[str, float]:
        """Ideal components of one decode step for ``batch`` running sequences holding
        ``context_tokens`` KV tokens in all (for the fit and the logs)."""
        m = self.model
        touched = 1.0 - (1.0 - m.experts_per_token / m.num_experts) ** batch if m.is_moe else 0.0
        read = self._dense_read + self._expert_read * touched + context_tokens * self.kv_bytes_per_token_rank
        return {"mem_s": read / self.hw.bandwidth_bps,
                "compute_s": (batch * self._flops_tok + context_tokens * self._attn_coef) / self.hw.peak_flops,
                "comm_s": self._collectives * batch * self._ar_bytes_tok / self._link,
                "collectives": float(self._collectives), "steps": 1.0}

    def decode_step_s(self, batch: float, context_tokens: float) -> float:
        """Seconds of one decode step (``batch`` sequences, ``context_tokens`` KV tokens)."""
        return self.cal.time("decode", self.decode_components(batch, context_tokens))

    def prefill_components(self, tokens: float) -> dict[str, float]:
        """Ideal components of prefilling ``tokens`` new tokens of one sequence."""
        return {"compute_s": tokens * (self._flops_tok + self._attn_coef * tokens / 2) / self.hw.peak_flops,
                "mem_s": self._dense_read / self.hw.bandwidth_bps,
                "comm_s": self._collectives * tokens * self._ar_bytes_tok / self._link,
                "collectives": float(self._collectives)}

    def prefill_s(self, tokens: float) -> float:
        return self.cal.time("prefill", self.prefill_components(tokens))

    def concurrency(self, mean_seq_tokens: float) -> int:
        """Sequences one instance runs at once: KV capacity over the mean sequence length,
        at most ``max_num_seqs``."""
        return max(0, min(self.cal.max_num_seqs, int(self.kv_capacity_tokens // max(1.0, mean_seq_tokens))))

    def serial_s(self, prompt_len: float, gen_len: float, tool_time_s: float, context: float | None = None,
                 turns: float = 0.0) -> float:
        """One trajectory alone on this instance: prefill, then its decode steps one after
        another (batch 1, its own mean ``context``: by default ``prompt_len + gen_len / 2``),
        then the time it is held between them (:meth:`held_s`)."""
        context = prompt_len + gen_len / 2 if context is None else context
        return self.prefill_s(prompt_len) + gen_len * self.decode_step_s(1, context) + self.held_s(tool_time_s, turns)

    def held_s(self, tool_time_s: float, turns: float) -> float:
        """Seconds a trajectory is out of the running batch: its tool time, and each turn's
        trip through the queue (``Calibration.tool_latency_scale``, ``turn_latency_s``)."""
        return tool_time_s * self.cal.tool_latency_scale + turns * self.cal.turn_latency_s

    def chain_components(self, prompt_len: float, gen_len: float, tool_time_s: float, turns: float,
                         batch: float, context_tokens: float) -> dict[str, float]:
        """Ideal components of one trajectory's wall time (``Calibration.time("chain", ...)``):
        its ``gen_len`` decode steps at a running ``batch`` holding ``context_tokens`` KV
        tokens, the prefill of its ``prompt_len`` tokens, its tool seconds and its turns."""
        step = self.decode_components(batch, context_tokens)
        return {"steps": gen_len, "mem_s": gen_len * step["mem_s"], "compute_s": gen_len * step["compute_s"],
                "comm_s": gen_len * step["comm_s"], "collectives": gen_len * step["collectives"],
                "prefill_compute_s": self.prefill_components(prompt_len)["compute_s"],
                "tool_s": tool_time_s, "turns": turns}


@dataclass(frozen=True)
class RolloutEstimate:
    """Predicted rollout time of one batch over a set of instance pools."""

    makespan_s: float
    """Seconds until the last trajectory finishes (inf when infeasible)."""
    serial_bound_s: float
    """Serial time of the longest trajectory on the fastest pool: a floor of the makespan."""
    reason: str | None = None
    """Why the plan cannot run, or None."""
    pools: tuple[tuple[int, int, int, float, int], ...] = ()
    """Per pool: (tp, instances, concurrency per instance, decode step s, trajectories)."""
    migrations: float = 0.0
    """C-MLFQ migrations priced per batch (:mod:`~libra_hpc.planner.migration`; 0 when none is)."""
    migration_s: float = 0.0
    """Seconds of re-prefill those migrations cost per batch, summed over instances."""

    @property
    def feasible(self) -> bool:
        return self.reason is None


def rollout_makespan(pools: Sequence[tuple[RolloutCost, int]], lengths: LengthProfile,
                     tail_aware: bool = True, in_flight: int = 1, length_aware: bool = False,
                     migration: MigrationPricing | None = None) -> RolloutEstimate:
    """Makespan of the batch over pools of identical instances ``(cost, instances)``.

    Each instance runs a fixed batch of ``b`` sequences: its share of the RL batch in
    proportion to KV concurrency, at most its concurrency (KV capacity over the mean
    sequence, capped by ``max_num_seqs``). A pool is then ``instances × b`` lanes, and
    every trajectory on it decodes at the step time of batch ``b`` — the batch it is
    costed at is the batch it can actually run in. Buckets go longest first, each
    trajectory to the lane where it would finish first (earliest free time + its
    duration there; at time 0 that sends the long tail to the fast large-TP pools);
    lanes of a pool that free together form one group, so a bucket is placed in a few
    chunks. A trajectory lasts its prefill, gen_len decode steps and the time it is held
    between turns (its tools and each turn's trip through the queue,
    :meth:`RolloutCost.held_s`; the lane is held meanwhile). The result is never below the serial time of the
    longest trajectory on its best pool (checked exactly on ``lengths.extremes``).

    That placement assumes the router knows which trajectories will be long
    (``length_aware``: the oracle and the length predictor). A router that cannot tell
    them apart before they run (C-MLFQ where the tool returns say little about the work
    left: ``benchmarks/bench_routing.py`` measures that on every shipped workload) spreads
    the batch over the pools in proportion to their lanes, and the longest trajectories
    may land on the slowest pool: without ``length_aware`` every bucket is shared out that
    way and the extremes' chains are priced on the slowest pool. One pool: no difference.

    ``migration`` (the limits of C-MLFQ's buckets; only with more than one pool and not
    ``length_aware``): the router moves a trajectory between buckets as its remaining
    tokens cross their limits, and each move re-prefills its context on the instance it
    moves to (:func:`~libra_hpc.planner.migration.crossings`, whose docstring states the
    assumptions). A move costs in two places, as in the engine: the moved trajectory waits
    for its re-prefill (its duration grows by the re-prefill seconds on the destination's
    TP), and the destination pool's instances stall for it (the re-prefill seconds landing
    on a pool per batch join its prefill work in the loaded model, :func:`_loaded_s`). The rest of
    the trajectory's decode is priced where the blind placement put it, at that pool's
    loaded step time: the pricing counts what the moves cost, not where they take the
    decode (the blind placement already spreads each bucket over the pools).
    Cost: O(buckets × pools × chunks) arithmetic, ~0.3 ms for 32 buckets and 4 pools
    on a shared 2-core CPU.
    """
    live, reasons = [], []
    for cost, n in pools:
        if n <= 0:
            continue
        conc = cost.concurrency(lengths.mean_seq_tokens)
        if cost.infeasible:
            reasons.append(cost.infeasible)
        elif lengths.max_seq_tokens > cost.kv_capacity_tokens or conc < 1:
            reasons.append(f"{cost.model.name} TP{cost.tp} on {cost.hw.name}: KV capacity {cost.kv_capacity_tokens} "
                           f"tokens < longest sequence {lengths.max_seq_tokens:.0f} (or mean {lengths.mean_seq_tokens:.0f})")
        else:
            live.append((cost, n, conc))
    if not live:
        why = "; ".join(reasons) or "no rollout instances"
        return RolloutEstimate(math.inf, math.inf, why)
    bound = max(min(x.serial_s(c) for c, _, _ in live) for x in lengths.extremes)
    total_lanes = sum(n * conc for _, n, conc in live)
    blind = not length_aware and len(live) > 1
    moves = _Moves(live, lengths, migration) if blind and migration is not None else None
    wait = moves.wait_s if moves is not None else [0.0] * len(lengths.count)
    per_pool = []
    for cost, n, conc in live:
        batch = max(1, min(conc, math.ceil(lengths.batch_size * conc / total_lanes)))
        base = (batch - 1) * lengths.mean_context
        durations = [cost.prefill_s(p) + w + g * cost.decode_step_s(batch, base + c) + cost.held_s(t, n)
                     for p, w, g, t, c, n in zip(lengths.prompt, wait, lengths.gen, lengths.tool_s, lengths.context,
                                                 lengths.bucket_turns())]
        per_pool.append((cost, n, conc, batch, durations))
    lanes = [(n * batch, d) for _, n, _, batch, d in per_pool]
    makespan, assigned, per_bucket = _spread(lengths.count, lanes) if blind else _assign(lengths.count, lanes)
    info = tuple((c.tp, n, conc, c.decode_step_s(b, b * lengths.mean_context), a)
                 for (c, n, conc, b, _), a in zip(per_pool, assigned))
    if tail_aware:
        loaded = [(c, *_loaded_s(c, n, conc, shares, lengths, in_flight, wait,
                                 moves.landing_s(c.tp) if moves is not None else 0.0))
                  for (c, n, conc, _, _), shares in zip(per_pool, per_bucket)]
        # the extreme trajectories (longest generation, longest tools) on their best pool, loaded
        pick = max if blind else min  # blind: an extreme may land on the slowest pool
        used = [(c, sigma) for (c, _, sigma), n in zip(loaded, assigned) if n > 0]  # a pool given nothing runs no extreme
        chain = max(pick(c.prefill_s(x.prompt_len) + x.gen_len * sigma + c.held_s(x.tool_time_s, x.turns)
                         for c, sigma in used) + (moves.of(x) if moves is not None else 0.0)
                    for x in lengths.extremes)
        makespan = max(chain, *(m for _, m, _ in loaded))
    if moves is None:
        return RolloutEstimate(max(makespan, bound), bound, None, info)
    return RolloutEstimate(max(makespan, bound), bound, None, info, moves.count, moves.total_s)


class _Moves:
    """C-MLFQ's migrations over the pools ``live`` ((cost, instances, concurrency)) for the
    buckets of ``lengths`` (:func:`~libra_hpc.planner.migration.crossings` on each bucket's
    mean trajectory): ``wait_s`` per bucket, the re-prefill seconds a trajectory of it
    waits (each move priced on its destination's TP); per batch, ``count`` moves and
    ``total_s`` re-prefill seconds; :meth:`landing_s`, the seconds landing on one pool's
    instances. A bucket's tool-output tokens are what its mean prompt holds beyond the
    first prompt: ``2 × (prompt + gen / 2 - context)`` (:attr:`LengthSample.decode_context`
    is linear in them), none for a profile built without contexts."""

    def __init__(self, live: Sequence[tuple[RolloutCost, int, int]], lengths: LengthProfile,
                 migration: MigrationPricing):
        self.cost: dict[int, RolloutCost] = {}
        self.instances: dict[int, int] = {}
        for cost, n, _ in live:
            self.cost.setdefault(cost.tp, cost)
            self.instances[cost.tp] = self.instances.get(cost.tp, 0) + n
        gpus = {tp: n * tp for tp, n in self.instances.items()}
        turns = lengths.bucket_turns()
        self.buckets = migration.buckets(gpus, lengths.prompt, lengths.gen, turns, lengths.count)
        has_context = len(lengths.context) == len(lengths.count)
        self.wait_s, landed = [], dict.fromkeys(gpus, 0.0)
        self.count = 0.0
        for k, (p, g, t, m) in enumerate(zip(lengths.prompt, lengths.gen, turns, lengths.count)):
            tool_tokens = min(p, max(0.0, 2.0 * (p + g / 2 - lengths.context[k]))) if has_context else 0.0
            moves = crossings(self.buckets, p, g, t, tool_tokens)
            seconds = [(tp, self.cost[tp].prefill_s(ctx)) for tp, ctx in moves]
            self.wait_s.append(sum(s for _, s in seconds))
            for tp, s in seconds:
                landed[tp] += m * s
            self.count += m * len(moves)
        self._landed = landed
        self.total_s = sum(landed.values())

    def landing_s(self, tp: int) -> float:
        """Re-prefill seconds per batch landing on each instance of TP ``tp`` (the moves to a
        TP size spread evenly over its instances)."""
        return self._landed.get(tp, 0.0) / self.instances[tp]

    def of(self, x: LengthSample) -> float:
        """Re-prefill seconds one observed trajectory ``x`` waits for (its own turns and
        tool tokens)."""
        return sum(self.cost[tp].prefill_s(ctx)
                   for tp, ctx in crossings(self.buckets, x.prompt_len, x.gen_len, x.turns, x.tool_tokens))


def _loaded_s(cost: RolloutCost, instances: int, conc: int, counts: Sequence[int], lengths: LengthProfile,
              in_flight: int, wait: Sequence[float] | None = None, landing_s: float = 0.0) -> tuple[float, float]:
    """Seconds until one pool's trajectories (``counts`` per bucket of ``lengths``, spread
    evenly over ``instances``) are all done, each at the decode step time of the load it
    actually runs beside. The load follows Little's law: ``in_flight`` batches share the
    instances (a pipeline with staleness k keeps k + 1 in flight, so the next batch's work
    runs beside this one's tail), so an instance holds on average in_flight × (its
    trajectory-seconds per batch) / makespan trajectories, of which the ones not in a
    tool call decode, with their decode-time-weighted KV context (a sequence waiting for a
    tool is not in the running batch, so its KV is not read); above its concurrency they
    queue for seats; decoding stalls while the instance prefills joining sequences (the
    share of its time the batches' prefills take). The longest chain (prefill + decode steps + tool time) at that step
    time, or the seats' throughput, sets the makespan. C-MLFQ's migrations
    (:func:`rollout_makespan`): ``wait`` per bucket, re-prefill seconds a trajectory
    waits (added to its chain); ``landing_s``, re-prefill seconds per batch landing on each
    instance of this pool (added to its prefill work, so to the stall).

    The step time is the fixed point of "the load a step time implies gives that step
    time back". Iterating that map can oscillate (a prefill-heavy pool: a short makespan
    implies a high prefill stall, a slow step, a long makespan, a low stall, ...), so the
    fixed point is found by bisection, in log space, between the lone sequence's step time
    and the step time that load gives. O(buckets) per pass, 16 passes.
    Returns the makespan and the loaded decode step time."""
    n = [c / instances for c in counts]
    live = [k for k, x in enumerate(n) if x > 0]
    if not live:
        return 0.0, math.inf
    gen, ctx = lengths.gen, lengths.context
    tool = [cost.held_s(t, n) for t, n in zip(lengths.tool_s, lengths.bucket_turns())]  # out of the running batch
    pre = {k: cost.prefill_s(lengths.prompt[k]) for k in live}
    prefill_work = sum(n[k] * pre[k] for k in live) + landing_s
    if wait is not None:  # a moved trajectory also waits for its re-prefills
        pre = {k: pre[k] + wait[k] for k in live}
    others = max(0.0, 1.0 - 1.0 / (in_flight * sum(n[k] for k in live)))  # a lone sequence waits for no one

    def loaded(sigma: float) -> tuple[float, float]:
        """(makespan at step time ``sigma``, the step time the load of that makespan gives)."""
        dur = [pre[k] + gen[k] * sigma + tool[k] for k in live]
        work = sum(n[k] * d for k, d in zip(live, dur))  # trajectory-seconds per batch per instance
        makespan = max(max(dur), in_flight * work / conc)
        seated = min(in_flight * work / makespan, conc)  # trajectories held at once, on average (Little)
        decoding = seated * sum(n[k] * gen[k] * sigma for k in live) / work
        kv = seated * sum(n[k] * gen[k] * sigma * ctx[k] for k in live) / work  # decoding ones only: tools hold no seat in the batch
        stall = min(0.9, others * in_flight * prefill_work / makespan)  # time spent prefilling
        return makespan, cost.decode_step_s(max(1.0, decoding), kv) / (1.0 - stall)

    lo = cost.decode_step_s(1, ctx[max(live, key=lambda k: gen[k])])
    hi = max(lo, loaded(lo)[1])
    for _ in range(16):
        mid = math.sqrt(lo * hi)
        if loaded(mid)[1] > mid:
            lo = mid
        else:
            hi = mid
    sigma = math.sqrt(lo * hi)
    return loaded(sigma)[0], sigma


def _spread(counts: Sequence[int], pools: Sequence[tuple[int, Sequence[float]]]) -> tuple[float, list[int], list[list[int]]]:
    """Placement blind to length: the trajectories, in bucket order, dealt to the pools in
    proportion to their lanes (each to the pool furthest behind its share so far, a
    weighted round robin: a router that cannot tell them apart), so every bucket is
    shared out and the totals follow the lanes even when each bucket has fewer
    trajectories than there are pools; each pool's makespan is its longest bucket's
    duration or its lanes' throughput. Returns what :func:`_assign` does."""
    per_bucket = [[0] * len(counts) for _ in pools]
    total = sum(lanes for lanes, _ in pools)
    given = [0] * len(pools)
    dealt = 0
    for k, m in enumerate(counts):
        for _ in range(m):
            dealt += 1
            p = max(range(len(pools)), key=lambda q: (dealt * pools[q][0] / total - given[q], pools[q][0], -q))
            given[p] += 1
            per_bucket[p][k] += 1
    makespan = 0.0
    for p, (lanes, dur) in enumerate(pools):
        present = [k for k, x in enumerate(per_bucket[p]) if x]
        if present:
            work = sum(per_bucket[p][k] * dur[k] for k in present)
            makespan = max(makespan, max(dur[k] for k in present), work / lanes)
    return makespan, [sum(row) for row in per_bucket], per_bucket


def _assign(counts: Sequence[int], pools: Sequence[tuple[int, Sequence[float]]]) -> tuple[float, list[int], list[list[int]]]:
    """Greedy earliest-finish placement of bucketed trajectories (longest bucket first) on
    pools of lanes; returns the makespan, trajectories per pool and per pool per bucket."""
    heaps = [[(0.0, lanes)] for lanes, _ in pools]
    assigned = [0] * len(pools)
    per_bucket = [[0] * len(counts) for _ in pools]
    makespan = 0.0
    for k, m in enumerate(counts):
        while m > 0:
            best, finish = 0, math.inf
            for p, (_, dur) in enumerate(pools):
                f = heaps[p][0][0] + dur[k]
                if f < finish:
                    best, finish = p, f
            free_at, lanes = heapq.heappop(heaps[best])
            take = min(m, lanes)
            if lanes > take:
                heapq.heappush(heaps[best], (free_at, lanes - take))
            heapq.heappush(heaps[best], (finish, take))
            assigned[best] += take
            per_bucket[best][k] += take
            makespan = max(makespan, finish)
            m -= take
    return makespan, assigned, per_bucket


# --------------------------------------------------------------------------- training


@dataclass(frozen=True)
class TrainShape:
    """Megatron-Core parallel layout and batch of one training step."""

    tp: int
    pp: int
    dp: int
    micro_batch: int
    """Sequences per micro-batch per DP replica."""
    global_batch: int
    """Sequences per optimizer step across all replicas."""
    seq_len: int
    """Tokens per sequence (prompt + response, padded or packed)."""
    recompute: bool = False
    """Full activation recomputation (one more forward, activations kept only at layer inputs)."""
    uneven: bool = False
    """Replicas may hold unequal shares of the batch (the job routes whole GRPO groups to
    replicas by tokens, so nothing needs DP × micro-batch to divide it): the step waits for
    the largest share. Set for the shapes the hybrid pool grows to; plan searches keep DP
    sizes that divide the batch."""
    shares: tuple[tuple[int, ...], ...] = ()
    """The tokens of each sequence each DP replica trains, when the step's placement is
    known (the job's steps: whole GRPO groups placed by :mod:`libra_hpc.parallel.dispatch`):
    the step then waits for the replica with the most work, attention is priced at each
    sequence's own length, and that replica's micro-batches are counted. Empty: the
    plan's view, ``global_batch`` sequences of ``seq_len`` tokens (the memory check uses
    ``seq_len`` either way)."""

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp", "micro_batch", "global_batch", "seq_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"TrainShape.{name} must be >= 1, got {getattr(self, name)}")
        if self.shares and len(self.shares) != self.dp:
            raise ValueError(f"TrainShape.shares has {len(self.shares)} replicas' sequences for DP {self.dp}")

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp


class TrainingCost:
    """Step time and per-GPU memory of ``model`` trained with ``shape`` on ``hw``, with
    the distributed optimizer (Adam states sharded over DP), bf16 weights and fp32
    gradients. Expert parallelism is not modelled (MoE experts shard over TP)."""

    def __init__(self, model: ModelProfile, hw: HardwareProfile, shape: TrainShape, cal: Calibration = DEFAULT):
        self.model, self.hw, self.shape, self.cal = model, hw, shape, cal
        s = shape
        passes = 4 if s.recompute else 3  # forward + backward (2×) [+ recomputed forward]
        if s.shares:  # the placed sequences: the replica with the most work sets the step
            work = [sum(map(model.sequence_train_flops, share)) for share in s.shares]
            self.tokens = sum(map(sum, s.shares))
            self.model_flops = sum(work)
            heaviest = max(range(s.dp), key=lambda d: (work[d], len(s.shares[d])))
            self.microbatches = max(1, -(-len(s.shares[heaviest]) // s.micro_batch))
            self.straggle = work[heaviest] * s.dp / self.model_flops if self.model_flops else 1.0
        else:
            self.microbatches = -(-s.global_batch // (s.dp * s.micro_batch))  # the largest share (uneven)
            # the step waits for the replica with the most sequences: its share over an even one
            self.straggle = self.microbatches * s.dp * s.micro_batch / s.global_batch if s.uneven else 1.0
            self.tokens = s.global_batch * s.seq_len
            self.model_flops = 3.0 * self.tokens * model.flops_per_token(s.seq_len / 2)
        self.hardware_flops = self.model_flops * passes / 3
        self.memory = self._memory()
        self.infeasible = self._check()

    @property
    def peak_bound_s(self) -> float:
        """Model FLOPs at peak on all GPUs: no step is faster."""
        return self.model_flops / (self.shape.gpus * self.hw.peak_flops)

    def _check(self) -> str | None:
        s, m, hw = self.shape, self.model, self.hw
        where = f"training {m.name} TP{s.tp} PP{s.pp} DP{s.dp} mbs{s.micro_batch} on {hw.name}"
        if s.tp > hw.gpus_per_node:
            return f"{where}: a TP group must stay on one node ({hw.gpus_per_node} GPUs)"
        if m.num_heads % s.tp or m.num_kv_heads % s.tp:
            return f"{where}: TP must divide {m.num_heads} heads and {m.num_kv_heads} KV heads"
        if m.num_layers % s.pp:
            return f"{where}: PP must divide the {m.num_layers} layers"
        if s.global_batch % (s.dp * s.micro_batch) and not s.uneven:
            return f"{where}: global batch {s.global_batch} is not a multiple of DP × micro-batch"
        total = sum(self.memory.values())
        if total > hw.memory_bytes:
            parts = ", ".join(f"{k} {v / 1e9:.1f}" for k, v in self.memory.items())
            return f"{where}: needs {total / 1e9:.1f} GB per GPU ({parts}) > {hw.memory_gb} GB"
        return None

    def _memory(self) -> dict[str, float]:
        """Bytes per GPU on the fullest pipeline stage."""
        m, s = self.model, self.shape
        layers = m.num_layers // s.pp
        embed = m.embedding_params if s.pp == 1 else m.vocab_size * m.hidden_size
        params = (layers * m.layer_params() + embed) / s.tp
        sbh = s.seq_len * s.micro_batch * m.hidden_size
        if s.recompute:  # layer inputs kept, one layer recomputed at a time
            act_layer, act_full = 2.0 * sbh, sbh * (10 + 24 / s.tp)
            acts = act_layer * layers * min(s.pp, max(1, self.microbatches)) + act_full
        else:  # Korthikanti et al. 2022, flash attention (no s² term), no sequence parallelism
            acts = sbh * (10 + 24 / s.tp) * layers * min(s.pp, max(1, self.microbatches))
        logits = 4.0 * s.seq_len * s.micro_batch * m.vocab_size / s.tp  # fp32 logits on the last stage
        return {"weights": 2.0 * params, "grads": 4.0 * params, "optimizer": 12.0 * params / s.dp,
                "activations": acts + logits, "reserve": self.cal.train_reserve_gb * 1e9}

    def components(self) -> dict[str, float]:
        """Ideal components of one step: compute (with the 1F1B bubble), TP + PP + DP
        communication, collective count, the step itself and its micro-batch slots (each
        pays a fixed cost: ``Calibration.train_microbatch_overhead_s``)."""
        m, s, hw = self.model, self.shape, self.hw
        mb = max(1, self.microbatches)
        bubble = 1.0 + (s.pp - 1) / mb
        compute = self.hardware_flops / (s.gpus * hw.peak_flops) * bubble * self.straggle
        act_bytes = 2.0 * s.micro_batch * s.seq_len * m.hidden_size
        layers = m.num_layers // s.pp
        tp_calls = (6 if s.recompute else 4) * layers * mb if s.tp > 1 else 0
        tp_s = tp_calls * _allreduce_factor(s.tp) * act_bytes / hw.link_bps(False)
        # Megatron rank order (TP fastest, then DP, then PP): stages sit on different nodes
        # as soon as the whole group spans more than one node; DP peers as soon as TP×DP does.
        pp_s = 2 * mb * act_bytes / hw.link_bps(s.gpus > hw.gpus_per_node) if s.pp > 1 else 0.0
        params = m.param_count() / (s.tp * s.pp)
        dp_bytes = (s.dp - 1) / s.dp * params * (4 + 2)  # reduce-scatter fp32 grads, all-gather bf16 params
        dp_s = dp_bytes / hw.link_bps(s.tp * s.dp > hw.gpus_per_node)
        return {"compute_s": compute, "comm_s": tp_s + pp_s + dp_s,
                "collectives": float(tp_calls + (2 * mb if s.pp > 1 else 0) + (2 if s.dp > 1 else 0)), "steps": 1.0,
                "microbatches": float(mb + s.pp - 1)}  # the 1F1B schedule's slots per stage

    @property
    def step_s(self) -> float:
        """Predicted seconds per optimizer step; inf when the layout cannot run."""
        return math.inf if self.infeasible else self.cal.time("train", self.components())
