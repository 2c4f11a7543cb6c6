"""The cost models' calibration: their efficiencies and overheads (:class:`Calibration`),
and the least-squares fit of those from measured timings (:func:`fit_calibration`; pure:
no torch, no MPI).

Each :class:`TimingRecord` holds the *ideal* components of one measured operation (seconds
at 100% efficiency, counts: what :class:`~libra_hpc.planner.costs.RolloutCost` and
:class:`~libra_hpc.planner.costs.TrainingCost` predict for it), the seconds it took and the
RL step that measured it; :meth:`Calibration.time` turns components into predicted seconds.
Units: seconds, GB.

Kinds of record: ``decode`` (one engine step), ``prefill``, ``train`` (one optimizer pass),
``tail`` (what a streamed step trains after its last group arrived, as its share of the pass
and the fixed seconds that follow it: :attr:`Calibration.stream_tail_s`) and ``chain``: one
trajectory, from its batch's submission to its report, as the sum of its
parts (its decode steps, its prefill, its tool seconds and its turns). The chain kind is
what a rollout makespan is made of, and it is measured in wall seconds as the job lives
them, so its per-term coefficients (wall seconds per decode step, seconds waited per
measured tool second, seconds each turn adds) are the ones that let the
planner predict the job's own steps. A fit for step ``k`` takes only records of steps
before ``k`` (``fit_calibration(..., before=k)``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from itertools import combinations
from dataclasses import dataclass, replace
from typing import Literal, NamedTuple

log = logging.getLogger(__name__)
Kind = Literal["decode", "prefill", "train", "tail", "chain"]


@dataclass(frozen=True)
class Calibration:
    """Efficiencies and overheads of the cost models. Defaults are typical published or
    folklore values for vLLM and Megatron on NVLink nodes, meant to be replaced by
    :func:`fit_calibration` once the run has measured timings."""

    bandwidth_eff: float = 0.7
    """Fraction of peak HBM bandwidth a decode step achieves (vLLM decode: 0.6–0.8)."""
    prefill_mfu: float = 0.5
    """Fraction of peak BF16 FLOP/s achieved by prefill (and by decode when compute-bound)."""
    train_mfu: float = 0.4
    """Fraction of peak BF16 FLOP/s achieved by training matmuls (Megatron: 0.35–0.55)."""
    rollout_comm_eff: float = 0.7
    """Fraction of link bandwidth achieved by the rollout TP all-reduces."""
    train_comm_eff: float = 0.7
    """Fraction of link bandwidth achieved by training collectives (TP, PP, DP)."""
    decode_step_overhead_s: float = 0.002
    """Fixed cost of one decode step, s (scheduler, sampling, kernel launches)."""
    collective_latency_s: float = 10e-6
    """Fixed cost of one collective call, s."""
    train_step_overhead_s: float = 0.2
    """Fixed cost of one optimizer step, s (optimizer kernels, bookkeeping)."""
    train_microbatch_overhead_s: float = 0.0
    """Fixed cost of one micro-batch's forward and backward, s (kernel launches, the
    schedule's Python), whatever its tokens. 0 by default (the simulator's); the job fits
    it. Measured on one H200 (a 49 M-parameter model, bf16, micro-batches of 4): a step took
    6.6 ms a sequence at 256 tokens and 9.4 ms at 2048 (scripts/gpu_calibration.py), so
    compute at any plausible efficiency left most of the step unexplained."""
    kv_memory_fraction: float = 0.9
    """Fraction of GPU memory a rollout engine may use (vLLM ``gpu_memory_utilization``)."""
    rollout_reserve_gb: float = 2.0
    """GB per rollout GPU not available to the KV cache besides weights (activations,
    CUDA graphs, communication buffers)."""
    train_reserve_gb: float = 4.0
    """GB per training GPU for the CUDA context, NCCL buffers and fragmentation."""
    max_num_seqs: int = 256
    """Most sequences one rollout instance runs at once (vLLM ``max_num_seqs``)."""
    turn_latency_s: float = 0.0
    """Seconds each turn adds to a trajectory's serial chain besides its prefill, decode
    steps and tool time: the turn's report to the queue, its routing and its admission to
    an engine. 0 by default (the simulator's queue costs nothing); the job fits it from
    its trajectories (``chain`` records)."""
    tool_latency_scale: float = 1.0
    """Wall seconds a trajectory waits per second of its measured tool time (1: tools cost
    what they measure)."""
    stream_tail_s: float = 0.0
    """Seconds a streamed step (``rl.stream_training``) takes after its last group arrived
    besides that group's share of the pass (the pass over the groups): the optimizer step, the
    gradients' all-reduce, the wait for the DP replica whose groups ended last. 0 by default
    (the simulator's streamed step ends with its last group's share); the job fits it from
    its steps' measured tails (``tail`` records). Measured in three default runs: tails of
    0.2-15 s against shares of 0.2-2.4 s."""
    note: str = "defaults"
    """Where these values come from (logged with every plan)."""
    fit_errors: tuple[tuple[str, float], ...] = ()
    """Relative RMS error of the fit per timing kind (``decode``, ``prefill``, ``train``)
    when fitted from measurements (:func:`fit_calibration`): how far the model's
    predictions are from what the run measured. The replanning gate will not act on a
    predicted gain smaller than that share of the step."""

    def __post_init__(self) -> None:
        for name in ("bandwidth_eff", "prefill_mfu", "train_mfu", "rollout_comm_eff", "train_comm_eff",
                     "kv_memory_fraction"):
            value = getattr(self, name)
            if not 0 < value <= 1:
                raise ValueError(f"Calibration.{name} must lie in (0, 1], got {value}")
        for name in ("decode_step_overhead_s", "collective_latency_s", "train_step_overhead_s",
                     "rollout_reserve_gb", "train_reserve_gb", "turn_latency_s", "tool_latency_scale", "stream_tail_s",
                "train_microbatch_overhead_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"Calibration.{name} must be >= 0, got {getattr(self, name)}")
        if self.max_num_seqs < 1:
            raise ValueError(f"Calibration.max_num_seqs must be >= 1, got {self.max_num_seqs}")

    def time(self, kind: Kind, c: Mapping[str, float]) -> float:
        """Predicted seconds of an operation from its ideal components ``c``."""
        g = c.get
        fixed = g("collectives", 0.0) * self.collective_latency_s
        if kind == "decode":
            return (g("steps", 1.0) * self.decode_step_overhead_s + g("comm_s", 0.0) / self.rollout_comm_eff + fixed
                    + max(g("mem_s", 0.0) / self.bandwidth_eff, g("compute_s", 0.0) / self.prefill_mfu))
        if kind == "prefill":
            return (g("comm_s", 0.0) / self.rollout_comm_eff + fixed
                    + max(g("compute_s", 0.0) / self.prefill_mfu, g("mem_s", 0.0) / self.bandwidth_eff))
        if kind == "train":
            return (g("compute_s", 0.0) / self.train_mfu + g("comm_s", 0.0) / self.train_comm_eff + fixed
                    + g("steps", 1.0) * self.train_step_overhead_s
                    + g("microbatches", 0.0) * self.train_microbatch_overhead_s)
        if kind == "tail":  # a streamed step's last group: its share of the pass, then the fixed part
            return self.time("train", {k: v for k, v in c.items() if k != "tail_steps"}) + g(
                "tail_steps", 0.0) * self.stream_tail_s
        if kind == "chain":  # a trajectory: its decode steps (summed), prefill, tools and turns
            return (g("steps", 0.0) * self.decode_step_overhead_s + g("comm_s", 0.0) / self.rollout_comm_eff + fixed
                    + max(g("mem_s", 0.0) / self.bandwidth_eff, g("compute_s", 0.0) / self.prefill_mfu)
                    + g("prefill_compute_s", 0.0) / self.prefill_mfu + g("tool_s", 0.0) * self.tool_latency_scale
                    + g("turns", 0.0) * self.turn_latency_s)
        raise ValueError(f"unknown timing kind {kind!r}; valid: decode, prefill, train, tail, chain")


DEFAULT = Calibration()


class TimingRecord(NamedTuple):
    """One measurement: what the cost model predicted (ideal components), what it took, and
    the RL step whose work it measured (-1: none given; such records are used by every fit)."""

    kind: Kind
    components: Mapping[str, float]
    measured_s: float
    step: int = -1


# Linear terms fitted per kind: component -> (Calibration field, True when the field is an
# efficiency, i.e. the fitted coefficient is its inverse). Decode is fitted as bandwidth
# bound and prefill as compute bound (the other side of the roofline max() is left out of
# the fit: ``_OFF_ROOFLINE``); components not listed are held at the current values. The
# chain kind comes last: it holds the decode roofline the engine's own steps gave and fits
# what a trajectory's wall time adds to it (the per-step cost as the trajectory sees it,
# tools, turns). It does not fit the prefill efficiency: a trajectory's prefilled tokens
# (its prompt and tool outputs) grow with its turns, so their column takes what each turn
# waits for in the queue and prices it as engine work (seen in the job: prefill_mfu 0.5 ->
# 0.015-0.03, a 500-token prompt at 0.4 s, which the loaded-pool model then counted as
# prefill stalling every decode step and predicted rollouts 2-4x too long); prefill is an
# engine's busy time, fitted from ``prefill`` records where there are any.
_TERMS: dict[str, dict[str, tuple[str, bool]]] = {
    "decode": {"mem_s": ("bandwidth_eff", True), "comm_s": ("rollout_comm_eff", True),
               "steps": ("decode_step_overhead_s", False), "collectives": ("collective_latency_s", False)},
    "prefill": {"compute_s": ("prefill_mfu", True)},
    "train": {"compute_s": ("train_mfu", True), "comm_s": ("train_comm_eff", True),
              "steps": ("train_step_overhead_s", False), "microbatches": ("train_microbatch_overhead_s", False)},
    "tail": {"tail_steps": ("stream_tail_s", False)},
    "chain": {"steps": ("decode_step_overhead_s", False), "turns": ("turn_latency_s", False),
              "tool_s": ("tool_latency_scale", False)},
}
_OFF_ROOFLINE = {"decode": "compute_s", "prefill": "mem_s", "train": "", "tail": "", "chain": ""}
_MIN_EFFICIENCY = 0.01
"""An efficiency fitted below this is not believed: the term is held at its current value
and the rest refitted. Such a value is the fit putting a fixed cost the records cannot
tell apart from it into an efficiency's column (seen in the job on CPU: with two training
records, train_comm_eff 0.7 -> 0.003; engine decode steps, whose time is their fixed cost,
bandwidth_eff -> 0.004), which then prices every other layout wrong."""
_DEFAULT_COLUMN = {"decode": {"steps": 1.0}, "prefill": {}, "train": {"steps": 1.0}, "tail": {"tail_steps": 1.0},
                   "chain": {}}
_EFFICIENCIES = {field for terms in _TERMS.values() for field, eff in terms.values() if eff}


def fit_calibration(history: Sequence[TimingRecord], base: Calibration = DEFAULT,
                    before: int | None = None, half_life: float | None = None) -> Calibration:
    """Least-squares fit of the calibration from measured timings: decode first, then
    prefill, training, streamed steps' tails (on the training just fitted) and trajectory
    chains, each with the other kinds' fields held. A term whose column is all zero or
    dependent, or whose coefficient comes out non-positive,
    keeps its current value (and the rest is refitted without it); efficiencies are clipped
    to (0, 1]. ``before``: only records of steps before it (what predicts step ``before``
    without looking at it). ``half_life``: a record's weight halves every ``half_life``
    steps it is older than the newest record of its kind (None: all weigh the same), so
    that the fit follows a job whose costs move (its layout, its batches' make-up, what
    else runs on the machine) and still has several steps' records to tell its terms
    apart. The result's ``note`` says what was fitted from how many records with which
    relative RMS error; it is also logged."""
    cal, lines, errors = base, [], []
    for kind in ("decode", "prefill", "train", "tail", "chain"):
        records = [r for r in history if r.kind == kind and r.measured_s > 0 and (before is None or r.step < before)]
        if records:
            newest = max(r.step for r in records)
            weights = [1.0 if half_life is None else 0.5 ** ((newest - r.step) / half_life) for r in records]
            cal, line, rms = _fit_kind(cal, kind, records, weights)  # type: ignore[arg-type]
            lines.append(line)
            errors.append((kind, rms))
    note = "fit: " + "; ".join(lines) if lines else base.note
    cal = replace(cal, note=note, fit_errors=tuple(errors))
    log.info("calibration %s", note)
    return cal


def _fit_kind(cal: Calibration, kind: Kind, records: Sequence[TimingRecord],
              weights: Sequence[float]) -> tuple[Calibration, str, float]:
    """One kind's fit, each record weighing ``weights[i]``; its relative RMS error is
    weighted the same way."""
    fitted, values = _fit_pass(cal, kind, records, weights)
    errs = [(fitted.time(kind, r.components) - r.measured_s) / r.measured_s for r in records]
    rms = math.sqrt(sum(w * e * e for w, e in zip(weights, errs)) / sum(weights))
    changed = ", ".join(f"{f} {getattr(cal, f):.4g}->{getattr(fitted, f):.4g}" for f in values) or "nothing fitted"
    return fitted, f"{kind} n={len(records)}: {changed} (rms rel err {rms:.1%})", rms


def _fit_pass(cal: Calibration, kind: Kind, records: Sequence[TimingRecord],
              weights: Sequence[float]) -> tuple[Calibration, dict[str, float]]:
    """The weighted least-squares fit of the kind's terms, over every subset of them: the
    terms left out hold their current values, and a subset counts only when its columns are
    independent and every coefficient it gives is positive and plausible (an efficiency
    not below ``_MIN_EFFICIENCY``). The subset whose fit leaves the smallest residual wins
    (the larger one on a tie). Terms whose columns move together (a training pass's
    compute and its gradients' all-reduce both grow with its sequences) can then not
    throw each other out: dropping the first bad term for good used to leave the job's
    training fit with nothing (compute -54 with the all-reduce in; without it, a positive
    step cost; then the all-reduce alone at 0.1% efficiency) where compute and step cost
    alone fit. A handful of terms: at most 15 subsets."""
    terms = dict(_TERMS[kind])
    root = [math.sqrt(w) for w in weights]  # weighted least squares: rows and targets scaled by sqrt(weight)
    best: tuple[float, int, dict[str, float]] | None = None
    for size in range(len(terms), 0, -1):
        for names in combinations(terms, size):
            rows = [[q * float(r.components.get(n, _DEFAULT_COLUMN[kind].get(n, 0.0))) for n in names]
                    for r, q in zip(records, root)]
            off = {n: 0.0 for n in names} | ({_OFF_ROOFLINE[kind]: 0.0} if _OFF_ROOFLINE[kind] else {})
            rhs = [q * (r.measured_s - cal.time(kind, {**r.components, **off})) for r, q in zip(records, root)]
            coef = _least_squares(rows, rhs)
            if any(x is None or not x > 0 or (terms[n][1] and 1.0 / x < _MIN_EFFICIENCY)  # type: ignore[operator]
                   for n, x in zip(names, coef)):
                continue
            sse = sum((b - sum(a * x for a, x in zip(row, coef))) ** 2 for row, b in zip(rows, rhs))  # type: ignore[operator]
            if best is None or sse < best[0] * (1 - 1e-9):
                best = (sse, size, {terms[n][0]: (1.0 / x if terms[n][1] else x) for n, x in zip(names, coef)})  # type: ignore[operator]
    values = {} if best is None else {f: (min(1.0, v) if f in _EFFICIENCIES else v) for f, v in best[2].items()}
    return replace(cal, **values), values


def _least_squares(rows: list[list[float]], rhs: list[float]) -> list[float | None]:
    """Solve min ||A x - b|| by the normal equations (a handful of unknowns, columns
    scaled to unit norm). An unknown whose column is zero or dependent comes back None."""
    n = len(rows[0])
    ata = [[sum(r[i] * r[j] for r in rows) for j in range(n)] for i in range(n)]
    atb = [sum(r[i] * b for r, b in zip(rows, rhs)) for i in range(n)]
    scale = [math.sqrt(ata[i][i]) or 1.0 for i in range(n)]
    m = [[ata[i][j] / (scale[i] * scale[j]) for j in range(n)] + [atb[i] / scale[i]] for i in range(n)]
    for col in range(n):
        piv = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-9:
            return [None if i == col else math.nan for i in range(n)]
        m[col], m[piv] = m[piv], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [a - f * b for a, b in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] / scale[i] for i in range(n)]

