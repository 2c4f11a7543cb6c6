"""Plan search: how many GPUs train (and with which TP×PP×DP and micro-batch), and how the
rest split into rollout instances of TP in {1, 2, 4, 8} (pure: no torch, no MPI).

Placement is fixed so that a plan is a set of counts, not of slots: training takes the
first ``TP×PP×DP`` slots node-major from node 0 (whole nodes first; TP divides the node,
so every TP group stays on one node); rollout instances fill the rest, the node training
fills only partly first, each node largest TP first. With identical nodes the rollout
time depends only on how many instances of each TP there are, so the search is over

    training shapes (per GPU count, the fastest that fits in memory)
  × rollout count vectors (n1, n2, n4, n8) that pack exactly into the free slots.

Search (:func:`plan`):
1. every training shape is costed (~8 µs each); memory-infeasible ones are dropped with
   their reason, and per training GPU count only the fastest shape survives (the others are
   dominated: same GPUs left for rollout, slower training);
2. screen: per training GPU count, the rollout made of one TP only (plus the partial node)
   — a few makespans, memoised per free-slot shape;
3. refine, in order of screened objective: candidates whose training time alone (async) or
   training time + the serial floor of rollout (sync) reaches the best objective are pruned;
   the others get the full rollout search — every packable count vector when there are at
   most ``exact_rollout_limit`` of them, else a hill climb over moves of GPUs between TP
   sizes (step sizes halving) from the best screened start. At most ``refine_top``
   candidates are refined; the rest keep their screened objective and lose as
   "not refined".
On clusters of up to 16 GPUs this is exact (checked against
:func:`~libra_hpc.planner.exhaustive.exhaustive`, which
enumerates every training shape × every per-node partition without pruning).

Objective: ``max(T_train, T_rollout)`` for asynchronous training with rollout and training
overlapping perfectly (``async``), ``T_train + T_rollout`` for synchronous (``sync``), and
the bounded-staleness pipeline's own step (``pipelined``: ``max(T_train, (T_rollout +
T_train) / (k + 1))`` with ``k = in_flight - 1``, training streamed over ``stream_groups``
groups; libra_hpc/planner/pipeline.py), which the control loop values plans by. Units: seconds.
"""

from __future__ import annotations

import itertools
import logging
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal

from libra_hpc.cluster.layout import Group, Layout, LayoutError, Slot, check_layout
from libra_hpc.planner.costs import (
    DEFAULT,
    Calibration,
    LengthProfile,
    RolloutCost,
    TrainingCost,
    TrainShape,
    rollout_makespan,
)
from libra_hpc.planner.migration import MigrationPricing
from libra_hpc.planner.pipeline import pipelined_step_s
from libra_hpc.planner.profiles import HardwareProfile, ModelProfile

log = logging.getLogger(__name__)
Mode = Literal["async", "sync", "pipelined"]
Counts = tuple[int, ...]  # instances per TP, in the order of PlannerOptions.rollout_tps (descending)


@dataclass(frozen=True)
class RLBatch:
    """What one RL step trains on."""

    global_batch: int
    """Trajectories (sequences) per optimizer step."""
    seq_len: int
    """Tokens per training sequence (prompt + response, padded or packed)."""
    trained: int | None = None
    """Sequences the step trains when fewer than ``global_batch`` (GRPO groups left out,
    ``rl.filter_zero_variance``); None: all. Training shapes are still searched for
    ``global_batch`` (their DP divides it) and priced on ``trained`` sequences, unevenly
    shared as the job shares whole groups."""
    shares: tuple[tuple[int, ...], ...] = ()
    """The tokens of each sequence each DP replica trains, when the step's placement is
    known (:attr:`~libra_hpc.planner.costs.TrainShape.shares`); used for a shape of as many
    replicas."""

    def __post_init__(self) -> None:
        if self.global_batch < 1 or self.seq_len < 1 or (self.trained is not None and self.trained < 1):
            raise ValueError(f"RLBatch needs global_batch >= 1, seq_len >= 1 and trained >= 1, got {self}")

    @classmethod
    def of(cls, global_batch: int, lengths: LengthProfile) -> RLBatch:
        """The batch of ``global_batch`` sequences ``lengths`` describes: training packs to
        its trained samples' mean length and trains their share of the batch."""
        share = lengths.trained_share
        trained = None if share >= 1.0 else max(1, round(global_batch * share))
        return cls(global_batch, math.ceil(lengths.train_seq_tokens), trained)

    def shape(self, shape: TrainShape) -> TrainShape:
        """``shape`` priced on this batch: its sequence length, the trained sequences, and
        their placement on the replicas when known for a shape of as many."""
        shares = self.shares if len(self.shares) == shape.dp else ()
        if self.trained is None:
            return replace(shape, global_batch=self.global_batch, seq_len=self.seq_len, shares=shares)
        return replace(shape, global_batch=self.trained, seq_len=self.seq_len, uneven=True, shares=shares)

    def whole(self, shape: TrainShape) -> TrainShape:
        """A shape priced by :meth:`shape` as a plan keeps it: for the whole batch."""
        return shape if self.trained is None else replace(shape, global_batch=self.global_batch, uneven=False)


@dataclass(frozen=True)
class PlannerOptions:
    """Search space and budget. Candidates for ``PlannerConfig`` fields (see the report)."""

    rollout_tps: tuple[int, ...] = (8, 4, 2, 1)
    """TP sizes a rollout instance may have (each <= GPUs per node)."""
    train_tps: tuple[int, ...] = (1, 2, 4, 8)
    """Training TP sizes tried (each must divide the GPUs per node)."""
    max_pp: int = 8
    """Largest pipeline size tried (divisors of the layer count up to this)."""
    micro_batches: tuple[int, ...] = (1, 2, 4)
    """Micro-batch sizes (sequences per DP replica per micro-batch) tried."""
    min_train_gpus: int = 1
    """Training never gets fewer GPUs."""
    min_rollout_gpus: int = 1
    """Rollout never gets fewer GPUs (``planner.min_rollout_gpus``)."""
    exact_rollout_limit: int = 64
    """Enumerate every rollout count vector when there are at most this many; else hill-climb."""
    climb_starts: int = 2
    """Past ``exact_rollout_limit``: hill climbs from this many of the best single-TP rollouts."""
    refine_top: int = 12
    """Most training GPU counts that get the full rollout search (the rest are screened only)."""
    runners_up: int = 8
    """Losing candidates reported with the plan."""
    fit_seq_len: int = 0
    """Training shapes must also run sequences of this many tokens (with activation
    recomputation if they need it, which then prices their time): the length the next
    batches can still reach, so that a plan made on shorter lengths does not run out of
    memory when contexts grow. 0: only the batch's own length."""
    in_flight: int = 1
    """Batches whose trajectories share the rollout instances at once: ``rl.max_staleness
    + 1`` in the asynchronous pipeline (the next batch runs beside this one's tail), 1
    synchronously. The rollout makespan prices the decode step at that load
    (``rollout_makespan``)."""

    length_aware: bool = False
    """The router places turns by their true or predicted length (``oracle``,
    ``length_aware``): the rollout makespan may send the long trajectories to the fast
    pools. Otherwise (C-MLFQ) a mixed plan is priced with the batch spread over its pools
    blind to length (``rollout_makespan``)."""
    migration: MigrationPricing | None = None
    """C-MLFQ's bucket limits: a mixed plan under a router that is not length-aware pays
    the re-prefills of the trajectories it moves between buckets (``rollout_makespan``);
    None: no migration is priced."""
    stream_groups: int = 0
    """``pipelined`` objective: GRPO groups a step's training is streamed over
    (``rl.stream_training``; 0: the batch trains whole)."""

    def __post_init__(self) -> None:
        bad = [t for t in (*self.rollout_tps, *self.train_tps) if t < 1 or t & (t - 1)]
        if bad or not self.rollout_tps or not self.train_tps:
            raise ValueError(f"PlannerOptions: TP sizes must be powers of two, got {bad or 'an empty list'}")
        if min(self.min_train_gpus, self.min_rollout_gpus, self.max_pp, self.refine_top, self.exact_rollout_limit,
               self.climb_starts, self.in_flight) < 1:
            raise ValueError(f"PlannerOptions: minimums, max_pp, refine_top, exact_rollout_limit, climb_starts, "
                             f"in_flight must be >= 1: {self}")
        object.__setattr__(self, "rollout_tps", tuple(sorted(set(self.rollout_tps), reverse=True)))


@dataclass(frozen=True)
class RolloutInstance:
    tp: int
    slots: tuple[Slot, ...]


@dataclass(frozen=True)
class Plan:
    """A whole-cluster assignment with its predicted step times (s)."""

    train: TrainShape
    train_slots: tuple[Slot, ...]
    rollout: tuple[RolloutInstance, ...]
    t_train: float
    t_rollout: float
    objective: float
    mode: Mode

    @property
    def train_gpus(self) -> int:
        return len(self.train_slots)

    @property
    def rollout_gpus(self) -> int:
        return sum(i.tp for i in self.rollout)

    @property
    def rollout_counts(self) -> dict[int, int]:
        """Instances per TP size."""
        out: dict[int, int] = {}
        for inst in self.rollout:
            out[inst.tp] = out.get(inst.tp, 0) + 1
        return dict(sorted(out.items()))

    def describe(self) -> str:
        s = self.train
        roll = " ".join(f"{n}×TP{tp}" for tp, n in self.rollout_counts.items())
        return (f"train TP{s.tp} PP{s.pp} DP{s.dp} mbs{s.micro_batch}{' recompute' if s.recompute else ''} "
                f"({self.train_gpus} GPUs) | rollout {roll} ({self.rollout_gpus} GPUs)")


@dataclass(frozen=True)
class Candidate:
    """A candidate that lost, and why."""

    description: str
    objective: float
    """Its objective, s: exact when refined, the screened (single-TP rollout) value — an
    upper bound — when pruned or not refined, inf when infeasible."""
    reason: str


@dataclass(frozen=True)
class PlanResult:
    plan: Plan
    runners_up: tuple[Candidate, ...]
    evaluated: int
    """Rollout makespans computed."""
    elapsed_s: float
    stats: dict = field(default_factory=dict)
    """Counts of shapes costed, infeasible, dominated, pruned, refined."""


class PlanError(ValueError):
    """No plan fits; the message lists why each kind of candidate failed."""


def objective(t_train: float, t_rollout: float, mode: Mode, in_flight: int = 1, stream_groups: int = 0,
              tail_s: float = 0.0) -> float:
    """A plan's step, s, under ``mode`` (the module docstring); ``in_flight`` and
    ``stream_groups`` as :class:`PlannerOptions`', ``tail_s`` the calibration's
    ``stream_tail_s`` (``pipelined`` only)."""
    if mode == "async":
        return max(t_train, t_rollout)
    if mode == "sync":
        return t_train + t_rollout
    if mode == "pipelined":
        return pipelined_step_s(t_train, t_rollout, in_flight - 1, stream_groups, tail_s)
    raise ValueError(f"mode must be 'async', 'sync' or 'pipelined', got {mode!r}")


# ------------------------------------------------------------------------- geometry


def _free_shape(train_gpus: int, nodes: int, g: int) -> tuple[int, int]:
    """(whole free nodes, free slots on the node training fills partly) after training."""
    full_train, part = divmod(train_gpus, g)
    partial = g - part if part else 0
    return nodes - full_train - (1 if part else 0), partial


def _fill(size: int, counts: dict[int, int]) -> list[int] | None:
    """Largest-first exact fill of one node's ``size`` free slots from ``counts`` (mutated);
    exact for power-of-two sizes (a divisible system: greedy never strands a remainder)."""
    out = []
    for tp in sorted(counts, reverse=True):
        take = min(counts[tp], size // tp)
        out += [tp] * take
        counts[tp] -= take
        size -= take * tp
    return out if size == 0 else None


def _pack(counts: dict[int, int], whole: int, partial: int, g: int) -> list[list[int]] | None:
    """Per node (partial node first), the TP sizes of its instances; None if they do not
    fill the free slots exactly."""
    left = dict(counts)
    nodes = []
    for size in ([partial] if partial else []) + [g] * whole:
        pattern = _fill(size, left)
        if pattern is None:
            return None
        nodes.append(pattern)
    return nodes if not any(left.values()) else None


def _vectors(total: int, tps: Sequence[int], limit: int) -> list[Counts] | None:
    """Every count vector over ``tps`` with sum(tp × n) == total, or None past ``limit``."""
    out: list[Counts] = []

    def rec(i: int, left: int, acc: tuple[int, ...]) -> bool:
        if i == len(tps) - 1:
            if left % tps[i] == 0:
                out.append(acc + (left // tps[i],))
                return len(out) <= limit
            return True
        return all(rec(i + 1, left - n * tps[i], acc + (n,)) for n in range(left // tps[i], -1, -1))

    return out if rec(0, total, ()) else None


# --------------------------------------------------------------------------- search


class _Search:
    def __init__(self, model: ModelProfile, hw: HardwareProfile, nodes: int, g: int, lengths: LengthProfile,
                 batch: RLBatch, mode: Mode, opt: PlannerOptions, cal: Calibration):
        self.model, self.hw, self.nodes, self.g, self.lengths = model, hw, nodes, g, lengths
        self.batch, self.mode, self.opt, self.cal = batch, mode, opt, cal
        costs = {tp: RolloutCost(model, hw, tp, cal) for tp in opt.rollout_tps if tp <= g}
        self.roll_reasons = {tp: c.infeasible for tp, c in costs.items() if c.infeasible}
        for tp, c in costs.items():
            if not c.infeasible and lengths.max_seq_tokens > c.kv_capacity_tokens:
                self.roll_reasons[tp] = (f"{model.name} TP{tp}: KV capacity {c.kv_capacity_tokens} tokens < longest "
                                         f"sequence {lengths.max_seq_tokens:.0f}")
        self.costs = {tp: c for tp, c in costs.items() if tp not in self.roll_reasons}
        self.tps = tuple(sorted(self.costs, reverse=True))
        self.memo: dict[Counts, float] = {}
        self.starts: dict[tuple[int, int], list[tuple[float, Counts]]] = {}
        self.best_roll: dict[tuple[int, int], tuple[float, Counts | None]] = {}
        self.evaluated = 0

    # rollout -------------------------------------------------------------------------
    def rollout_time(self, counts: Counts) -> float:
        if counts not in self.memo:
            pools = [(self.costs[tp], n) for tp, n in zip(self.tps, counts) if n]
            self.memo[counts] = (rollout_makespan(pools, self.lengths, in_flight=self.opt.in_flight,
                                                  length_aware=self.opt.length_aware,
                                                  migration=self.opt.migration).makespan_s
                                 if pools else math.inf)
            self.evaluated += 1
        return self.memo[counts]

    def _packs(self, counts: Counts, whole: int, partial: int) -> bool:
        return _pack(dict(zip(self.tps, counts)), whole, partial, self.g) is not None

    def screen(self, whole: int, partial: int) -> tuple[float, Counts | None]:
        """Best single-TP rollout (the partial node filled largest-first)."""
        best: tuple[float, Counts | None] = (math.inf, None)
        head = _fill(partial, {tp: partial // tp for tp in self.tps}) if partial else []
        if head is None:
            return best
        starts: list[tuple[float, Counts]] = []
        for tp in self.tps:
            if tp > self.g or self.g % tp:
                continue
            c = {t: head.count(t) for t in self.tps}
            c[tp] += whole * (self.g // tp)
            counts = tuple(c[t] for t in self.tps)
            if sum(counts):
                starts.append((self.rollout_time(counts), counts))
        self.starts[(whole, partial)] = sorted(starts)
        return min(starts, default=best)

    def refine(self, whole: int, partial: int, start: tuple[float, Counts | None]) -> tuple[float, Counts | None]:
        key = (whole, partial)
        if key in self.best_roll:
            return self.best_roll[key]
        total = whole * self.g + partial
        vectors = _vectors(total, self.tps, self.opt.exact_rollout_limit) if self.tps else []
        best = start
        if vectors is not None:
            for counts in vectors:
                if sum(counts) and self._packs(counts, whole, partial):
                    best = min(best, (self.rollout_time(counts), counts))
        else:  # hill climbs from the best single-TP starts
            for begin in self.starts.get(key, [])[: self.opt.climb_starts]:
                best = min(best, self._climb(begin, whole, partial))
        self.best_roll[key] = best
        return best

    def _climb(self, start: tuple[float, Counts], whole: int, partial: int) -> tuple[float, Counts]:
        """Best-improvement hill climb: move ``m`` GPUs from TP a instances to TP b ones,
        m a multiple of max(a, b), step sizes halving down to one instance."""
        best = start
        step = max(1, (whole * self.g + partial) // 4)
        while True:
            improved = False
            for a, b in itertools.permutations(range(len(self.tps)), 2):
                unit = max(self.tps[a], self.tps[b])
                m = max(unit, step // unit * unit)
                c = list(best[1])
                if c[a] * self.tps[a] < m:
                    continue
                c[a] -= m // self.tps[a]
                c[b] += m // self.tps[b]
                counts = tuple(c)
                if self._packs(counts, whole, partial):
                    t = self.rollout_time(counts)
                    if t < best[0] - 1e-12:
                        best, improved = (t, counts), True
            if not improved:
                if step <= 1:
                    return best
                step //= 2

    def serial_floor(self) -> float:
        ext = self.lengths.extremes
        return max(min(x.serial_s(c) for c in self.costs.values()) for x in ext)

    # training ------------------------------------------------------------------------
    def train_shapes(self) -> Iterator[TrainShape]:
        m, o, b = self.model, self.opt, self.batch
        cap = self.nodes * self.g - o.min_rollout_gpus
        for tp in o.train_tps:
            if self.g % tp:
                continue
            for pp in (p for p in range(1, o.max_pp + 1) if m.num_layers % p == 0):
                for mb in o.micro_batches:
                    if b.global_batch % mb:
                        continue
                    per = b.global_batch // mb
                    for dp in (d for d in range(1, per + 1) if per % d == 0):
                        gpus = tp * pp * dp
                        if gpus > cap:
                            break
                        if gpus >= o.min_train_gpus:
                            yield b.shape(TrainShape(tp, pp, dp, mb, b.global_batch, b.seq_len))

    def best_training(self) -> tuple[dict[int, TrainingCost], list[Candidate], dict]:
        best: dict[int, TrainingCost] = {}
        infeasible: dict[str, str] = {}
        n = dominated = 0
        fit = self.opt.fit_seq_len
        for shape in self.train_shapes():
            cost = fitting_training_cost(self.model, self.hw, shape, self.cal)
            n += 2 if cost.shape.recompute else 1  # a second pricing with recomputation
            if cost.infeasible:
                infeasible.setdefault(cost.infeasible.split(":")[0], cost.infeasible)
                continue
            if fit > shape.seq_len:
                peak = fitting_training_cost(self.model, self.hw, replace(shape, seq_len=fit), self.cal)
                if peak.infeasible:
                    key = peak.infeasible.split(":")[0]
                    infeasible.setdefault(key, f"{key}: sequences of {fit} tokens (planner.memory_headroom)"
                                               f"{peak.infeasible.removeprefix(key)}")
                    continue
                if peak.shape.recompute and not cost.shape.recompute:  # it will need recomputation: priced so
                    cost = TrainingCost(self.model, self.hw, replace(shape, recompute=True), self.cal)
            prev = best.get(shape.gpus)
            if prev is None or cost.step_s < prev.step_s:
                best[shape.gpus] = cost
            dominated += 1
        dominated -= len(best)
        # The reason starts with the shape it is about (the key): say it once.
        losers = [Candidate(k, math.inf, f"infeasible: {v.removeprefix(k).lstrip(': ')}") for k, v in infeasible.items()]
        return best, losers, {"train_shapes": n, "train_infeasible": len(infeasible), "train_dominated": dominated}

    # whole search --------------------------------------------------------------------
    def run(self) -> PlanResult:
        t0 = time.perf_counter()
        if not self.costs:
            raise PlanError("no rollout TP size fits: " + "; ".join(self.roll_reasons.values()))
        trains, losers, stats = self.best_training()
        if not trains:
            raise PlanError("no training shape fits in memory with at least "
                            f"{self.opt.min_rollout_gpus} GPUs left for rollout: "
                            + "; ".join(c.reason for c in losers[:5]))
        rows = []  # (screened objective, gpus, t_train, whole, partial, (t_roll, counts))
        for gpus, cost in trains.items():
            whole, partial = _free_shape(gpus, self.nodes, self.g)
            scr = self.screen(whole, partial)
            rows.append((self.objective(cost.step_s, scr[0]), gpus, cost.step_s, whole, partial, scr))
        rows.sort()
        floor = self.serial_floor() if self.mode == "sync" else 0.0
        best_obj, best_key, best_row, refined, results = math.inf, (math.inf, math.inf), None, 0, []
        for obj, gpus, tt, whole, partial, scr in rows:
            if tt + floor >= best_obj:
                what = "training alone" if self.mode != "sync" else "training + rollout serial floor"
                results.append((obj, gpus, f"pruned: {what} {tt + floor:.3g} s >= best {best_obj:.3g} s"))
                continue
            if refined >= self.opt.refine_top:
                results.append((obj, gpus, f"not refined (refine_top={self.opt.refine_top}): screened objective {obj:.3g} s"))
                continue
            refined += 1
            tr, counts = self.refine(whole, partial, scr)
            o = self.objective(tt, tr)
            results.append((o, gpus, None))
            if counts is not None and (o, tt + tr) < best_key:
                best_key, best_row = (o, tt + tr), (gpus, tt, tr, whole, partial, counts)
                best_obj = o
        if best_row is None:
            raise PlanError(f"no rollout split fits the free slots of any training size; rollout TP sizes "
                            f"{self.tps}, skipped: {self.roll_reasons}")
        plan = self.build(*best_row, self.batch.whole(trains[best_row[0]].shape))
        for o, gpus, why in sorted(results, key=lambda r: r[0]):
            if gpus == plan.train_gpus:
                continue
            s = trains[gpus].shape
            desc = f"train TP{s.tp} PP{s.pp} DP{s.dp} mbs{s.micro_batch} ({gpus} GPUs) + best rollout of the rest"
            losers.append(Candidate(desc, o, why or _lost(o, plan)))
        ranked = sorted((c for c in losers if c.reason.startswith("objective")), key=lambda c: c.objective)
        others = sorted((c for c in losers if not c.reason.startswith("objective")),
                        key=lambda c: (c.reason.startswith("infeasible"), c.objective))
        k = self.opt.runners_up
        stats |= {"train_gpu_counts": len(trains), "refined": refined, "rollout_evaluations": self.evaluated}
        elapsed = time.perf_counter() - t0
        log.info("plan %s: objective %.3g s (%s), %d makespans, %.1f ms", plan.describe(), plan.objective,
                 self.mode, self.evaluated, elapsed * 1e3)
        return PlanResult(plan, tuple(ranked[: max(1, k // 2)] + others[: k - min(len(ranked), max(1, k // 2))]),
                          self.evaluated, elapsed, stats)

    def build(self, gpus: int, tt: float, tr: float, whole: int, partial: int, counts: Counts,
              shape: TrainShape) -> Plan:
        slots = [Slot(n, i) for n in range(self.nodes) for i in range(self.g)]
        patterns = _pack(dict(zip(self.tps, counts)), whole, partial, self.g)
        assert patterns is not None, "chosen rollout counts must pack"
        free = slots[gpus:]
        inst, pos = [], 0
        for pattern in patterns:
            for tp in pattern:
                inst.append(RolloutInstance(tp, tuple(free[pos : pos + tp])))
                pos += tp
        return Plan(shape, tuple(slots[:gpus]), tuple(inst), tt, tr, self.objective(tt, tr), self.mode)

    def objective(self, t_train: float, t_rollout: float) -> float:
        return objective(t_train, t_rollout, self.mode, self.opt.in_flight, self.opt.stream_groups,
                         self.cal.stream_tail_s)


def _lost(o: float, best: Plan) -> str:
    if o > best.objective * (1 + 1e-9):
        return f"objective {o:.4g} s > best {best.objective:.4g} s"
    return (f"objective {o:.4g} s ties the best; it loses on t_train + t_rollout "
            f"(best {best.t_train + best.t_rollout:.4g} s)")


def _check_args(nodes: int, gpus_per_node: int, mode: str, opt: PlannerOptions) -> None:
    if nodes < 1 or gpus_per_node < 1:
        raise PlanError(f"need nodes >= 1 and gpus_per_node >= 1, got {nodes} × {gpus_per_node}")
    if mode not in ("async", "sync", "pipelined"):
        raise PlanError(f"mode must be 'async', 'sync' or 'pipelined', got {mode!r}")
    if opt.min_train_gpus + opt.min_rollout_gpus > nodes * gpus_per_node:
        raise PlanError(f"min_train_gpus {opt.min_train_gpus} + min_rollout_gpus {opt.min_rollout_gpus} exceed the "
                        f"{nodes * gpus_per_node} GPUs of the cluster")


def plan(model: ModelProfile, hardware: HardwareProfile, nodes: int, gpus_per_node: int, lengths: LengthProfile,
         batch: RLBatch, *, mode: Mode = "async", options: PlannerOptions = PlannerOptions(),
         calibration: Calibration = DEFAULT) -> PlanResult:
    """The best plan for ``nodes`` × ``gpus_per_node`` GPUs of ``hardware`` (its own
    ``gpus_per_node`` is overridden by the argument). Raises PlanError when nothing fits."""
    _check_args(nodes, gpus_per_node, mode, options)
    hw = hardware.model_copy(update={"gpus_per_node": gpus_per_node})
    return _Search(model, hw, nodes, gpus_per_node, lengths, batch, mode, options, calibration).run()


def fitting_training_cost(model: ModelProfile, hw: HardwareProfile, shape: TrainShape,
                          calibration: Calibration = DEFAULT) -> TrainingCost:
    """The cost of ``shape``, with activation recomputation switched on when it does not
    fit in memory otherwise (a switch of the same GPUs, not a reconfiguration): the rule
    of the plan search, for repricing too."""
    cost = TrainingCost(model, hw, shape, calibration)
    if cost.infeasible and "GB per GPU" in cost.infeasible and not shape.recompute:
        cost = TrainingCost(model, hw, replace(shape, recompute=True), calibration)
    return cost


def reprice(p: Plan, model: ModelProfile, hardware: HardwareProfile, gpus_per_node: int, lengths: LengthProfile,
            calibration: Calibration = DEFAULT, batch: RLBatch | None = None, in_flight: int = 1,
            length_aware: bool = False, migration: MigrationPricing | None = None, stream_groups: int = 0) -> Plan:
    """``p`` with its times predicted again on new observations (``lengths``), for the
    replanning gate to compare the current plan with a fresh candidate. ``batch``: the
    RL batch the candidate was searched for (its sequence length follows the
    observations); give it so that both are priced on the same batch, else ``p``'s own.
    ``in_flight``, ``length_aware``, ``migration``, ``stream_groups``: as :class:`PlannerOptions`'."""
    hw = hardware.model_copy(update={"gpus_per_node": gpus_per_node})
    shape = p.train if batch is None else batch.shape(p.train)
    tt = fitting_training_cost(model, hw, replace(shape, recompute=False), calibration).step_s
    pools = [(RolloutCost(model, hw, tp, calibration), n) for tp, n in p.rollout_counts.items()]
    tr = rollout_makespan(pools, lengths, in_flight=in_flight, length_aware=length_aware,
                          migration=migration).makespan_s
    return replace(p, t_train=tt, t_rollout=tr,
                   objective=objective(tt, tr, p.mode, in_flight, stream_groups, calibration.stream_tail_s))


# ------------------------------------------------------------------------- layout


def plan_to_layout(plan: Plan, nodes: int, gpus_per_node: int, hybrid_nodes: int = 0, version: int = 0,
                   reason: str = "plan") -> Layout:
    """The layout of ``plan``: group 0 training (Megatron rank order: the slots are
    node-major, so TP chunks are consecutive and on one node), then one group per rollout
    instance. The last ``hybrid_nodes`` nodes form the hybrid pool; they must hold rollout
    instances only. Raises LayoutError on a broken invariant."""
    s = plan.train
    hybrid = frozenset(Slot(n, g) for n in range(nodes - hybrid_nodes, nodes) for g in range(gpus_per_node))
    if hybrid & set(plan.train_slots):
        raise LayoutError(f"hybrid_nodes={hybrid_nodes} reaches into the training slots "
                          f"(training ends at {plan.train_slots[-1]})")
    groups = [Group(0, "training", plan.train_slots, s.tp, s.pp, s.dp)]
    for inst in plan.rollout:
        groups.append(Group(len(groups), "rollout", inst.slots, inst.tp, hybrid=inst.slots[0] in hybrid))
    layout = Layout(nodes, gpus_per_node, tuple(groups), hybrid, version, reason)
    check_layout(layout)
    return layout
