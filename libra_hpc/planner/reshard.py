"""Training re-sharded to another TP size on the same GPUs (EARL's answer to growing
contexts), priced with the training cost model for :mod:`libra_hpc.parallel.selector` to
choose from (:class:`TrainingResharder`). The rollout side is left as it is: a re-shard
moves no GPU between roles, so rollout goes on while training reloads its checkpoint at
the new shape. Also what a training shape must hold (:func:`memory_need`) and why the
running one cannot (:func:`memory_short`), which the control loop checks after every batch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from libra_hpc.parallel.selector import TpSelector, TpTable, choose_by_cost, context_percentile
from libra_hpc.planner.costs import Calibration, LengthProfile, LengthSample, TrainingCost, TrainShape
from libra_hpc.planner.profiles import HardwareProfile, ModelProfile
from libra_hpc.planner.search import Plan, fitting_training_cost, objective


def tp_options(model: ModelProfile, hw: HardwareProfile, shape: TrainShape, need_tokens: int, mean_tokens: int,
               cal: Calibration) -> dict[int, tuple[float, TrainShape | None]]:
    """Each TP size the same GPUs can take (TP × PP × DP unchanged, a TP group inside a
    node): predicted seconds per step at ``mean_tokens`` per sequence (``inf`` when the
    shape cannot hold sequences of ``need_tokens``), and the shape (recomputation switched
    on where it needs it to fit; None when it cannot run)."""
    out: dict[int, tuple[float, TrainShape | None]] = {}
    tp = 1
    while tp <= hw.gpus_per_node:
        if shape.gpus % (tp * shape.pp) == 0:
            dp = shape.gpus // (tp * shape.pp)
            mbs = shape.micro_batch if shape.global_batch % (dp * shape.micro_batch) == 0 else 1
            candidate = replace(shape, tp=tp, dp=dp, micro_batch=mbs, seq_len=need_tokens, recompute=False)
            fits = fitting_training_cost(model, hw, candidate, cal)
            if fits.infeasible:
                out[tp] = (math.inf, None)
            else:
                priced = replace(fits.shape, seq_len=max(1, mean_tokens))
                out[tp] = (TrainingCost(model, hw, priced, cal).step_s, replace(fits.shape, seq_len=shape.seq_len))
        tp *= 2
    return out


def resharded(p: Plan, train: TrainShape, t_train: float) -> Plan:
    """``p`` with training on ``train`` (the same slots) and its step repriced."""
    if train.gpus != p.train.gpus:
        raise ValueError(f"a re-shard keeps the training GPUs: {p.train.gpus} → {train.gpus}")
    return replace(p, train=train, t_train=t_train, objective=objective(t_train, p.t_rollout, p.mode))


def memory_need(lengths: LengthProfile, seq_len: int, headroom: float, floor: float | None = None) -> int:
    """Tokens per (packed) training sequence a plan must fit: ``headroom`` × the observed
    mean (at least ``floor``: the last batch's mean, when the window spans batches that
    were shorter), at most ``seq_len`` (what the batch can still reach)."""
    return min(seq_len, math.ceil(headroom * max(lengths.mean_seq_tokens, floor or 0.0)))


def memory_short(model: ModelProfile, hw: HardwareProfile, shape: TrainShape, lengths: LengthProfile, seq_len: int,
                 headroom: float, cal: Calibration, floor: float | None = None) -> str | None:
    """Why the running training ``shape`` (hybrid replicas included) cannot run the
    sequences ``lengths`` may reach next (:func:`memory_need`, ``floor`` as there), or None
    when it can."""
    shape = replace(shape, seq_len=memory_need(lengths, seq_len, headroom, floor))
    cost = fitting_training_cost(model, hw, replace(shape, recompute=False), cal)
    if not cost.infeasible:
        return None
    return (f"memory: training TP{shape.tp} PP{shape.pp} DP{shape.dp} cannot run sequences of {shape.seq_len} "
            f"tokens ({headroom:g} × the observed mean {lengths.mean_seq_tokens:.0f}"
            + (f", the last batch's {floor:.0f}" if floor and floor > lengths.mean_seq_tokens else "") + "): "
            f"{cost.infeasible.split(': ', 1)[-1]}")


@dataclass(frozen=True)
class Reshard:
    """A re-shard to make: training to ``shape`` (same GPUs), ``seconds`` per step."""

    trigger: str
    """``memory`` (the running shape cannot hold the next sequences) or ``table``."""
    reason: str
    shape: TrainShape
    seconds: float


class TrainingResharder:
    """EARL's selector on training: a move to another TP size on the same GPUs, when the
    running one cannot hold the sequences the batch may reach (``short``, with
    ``on_memory: reshard``), or when the measured table says so (``confirm`` checks in a
    row agreeing, :class:`~libra_hpc.parallel.selector.TpSelector`). It proposes; the
    control loop allocates the plan and applies it (and reports the size it applied)."""

    def __init__(self, model: ModelProfile, hw: HardwareProfile, *, gpus_per_node: int, on_memory: str,
                 hysteresis: float, confirm: int, table: tuple[tuple[int, int], ...] | None):
        self.model, self.hw, self.gpus_per_node = model, hw, gpus_per_node
        self.on_memory, self.hysteresis = on_memory, hysteresis
        self.selector = TpSelector(current=0, confirm=confirm)
        """Training's TP size over time (set by :meth:`applied`)."""
        self.table = TpTable(table) if table else None

    def applied(self, tp: int) -> None:
        """Training now runs at TP ``tp`` (any layout change)."""
        self.selector.applied(tp)

    def propose(self, step: int, base: TrainShape, lengths: LengthProfile, need_tokens: int, short: str | None,
                samples: Sequence[LengthSample], cal: Calibration) -> tuple[Reshard | None, dict | None]:
        """The re-shard of the running training shape ``base`` to make now, or None; and a
        note for the loop's ``considered`` record when a table's choice cannot run here.
        ``short``: why ``base`` cannot hold the next sequences (:func:`memory_short`), or
        None; ``need_tokens``: the sequence length a shape must fit; ``samples``: the
        observed window (the table reads their context p90). None also when no TP size
        fits (a re-plan's turn)."""
        if short is not None and self.on_memory != "reshard":
            return None, None
        if short is None and self.table is None:
            return None, None
        if short is None:  # the table's answer first: most checks keep the running size, with nothing to price
            context = context_percentile([s.prompt_len + s.gen_len for s in samples])
            choice = self.table.choose(context, base.tp, self.hysteresis)
            if choice.tp == base.tp:
                self.selector.consider(choice)
                return None, None
        options = tp_options(self.model, self.hw, base, need_tokens, math.ceil(lengths.mean_seq_tokens), cal)
        if short is not None:
            choice = choose_by_cost({tp: s for tp, (s, _) in options.items()}, base.tp, self.hysteresis)
            trigger = "memory"
        else:
            trigger = "table"
            if choice.tp not in options or options[choice.tp][1] is None:
                return None, {"step": step, "kind": "reshard_check", "trigger": trigger, "apply": False,
                              "reason": f"{choice.reason}, but TP{choice.tp} cannot run here "
                                        f"({self.gpus_per_node} GPUs per node, {base.gpus} training GPUs)"}
        if not choice.fits or self.selector.consider(choice, must=short is not None) is None:
            return None, None
        seconds, shape = options[choice.tp]
        reason = f"{short or choice.reason}; re-shard training TP{base.tp} → TP{choice.tp} (DP{shape.dp}, same GPUs)"
        return Reshard(trigger, reason, shape, seconds), None

    def state_dict(self) -> dict:
        """The selector's state as plain data."""
        return {"current": self.selector.current, "streak": list(self.selector.streak)}

    def load_state_dict(self, state: dict) -> None:
        self.selector.current, self.selector.streak = state["current"], list(state["streak"])
