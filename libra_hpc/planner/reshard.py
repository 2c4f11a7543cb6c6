"""Training re-sharded to another TP size on the same GPUs (EARL's answer to growing
contexts), priced with the training cost model for :mod:`libra_hpc.parallel.selector` to
choose from. The rollout side is left as it is: a re-shard moves no GPU between roles, so
rollout goes on while training reloads its checkpoint at the new shape.
"""

from __future__ import annotations

import math
from dataclasses import replace

from libra_hpc.planner.costs import Calibration, TrainingCost, TrainShape
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
