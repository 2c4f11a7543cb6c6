"""The training group: its best Megatron shape on a given number of GPUs, and step times.

Step times come from the planner's training cost model (libra_hpc.planner.costs.TrainingCost)
at the batch's mean sequence length (sequences packed to the mean: the planner's
``RLBatch.seq_len`` is the same packed length), so that longer trajectories make training
slower as they do on the real cluster. A step whose sequences no longer fit the shape's
memory without recomputation is costed with full recomputation.
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import lru_cache

from libra_hpc.planner.costs import Calibration, TrainingCost, TrainShape
from libra_hpc.planner.profiles import HardwareProfile, ModelProfile
from libra_hpc.planner.search import fitting_training_cost

TRAIN_TPS = (1, 2, 4, 8)
MICRO_BATCHES = (1, 2, 4)
MAX_PP = 8


def best_shape(model: ModelProfile, hw: HardwareProfile, gpus: int, global_batch: int, seq_len: int,
               cal: Calibration) -> TrainShape | None:
    """The fastest feasible TP×PP×DP×micro-batch shape on exactly ``gpus`` GPUs (with full
    recomputation when nothing fits otherwise), or None when no shape fits."""
    return _best(model, hw, gpus, global_batch, seq_len, cal)


@lru_cache(maxsize=4096)
def _best(model: ModelProfile, hw: HardwareProfile, gpus: int, global_batch: int, seq_len: int,
          cal: Calibration) -> TrainShape | None:
    best, best_s = None, math.inf
    for tp in TRAIN_TPS:
        if hw.gpus_per_node % tp or gpus % tp:
            continue
        for pp in range(1, MAX_PP + 1):
            if model.num_layers % pp or gpus % (tp * pp):
                continue
            dp = gpus // (tp * pp)
            for mb in MICRO_BATCHES:
                if global_batch % (dp * mb):
                    continue
                for recompute in (False, True):
                    cost = TrainingCost(model, hw, TrainShape(tp, pp, dp, mb, global_batch, seq_len, recompute), cal)
                    if not cost.infeasible:
                        if cost.step_s < best_s:
                            best, best_s = cost.shape, cost.step_s
                        break
    return best


def for_batch(shape: TrainShape, trained: int, batch_size: int) -> TrainShape:
    """``shape`` on a step that trains ``trained`` of its batch's ``batch_size`` sequences
    (the others' GRPO groups were left out, ``rl.filter_zero_variance``): the replicas
    share them unevenly, whole groups each, as the job does; ``shape`` itself when all are."""
    if trained == batch_size:
        return shape
    return replace(shape, global_batch=max(1, round(shape.global_batch * trained / batch_size)), uneven=True)


def step_s(model: ModelProfile, hw: HardwareProfile, shape: TrainShape, mean_tokens: float, cal: Calibration) -> float:
    """Seconds of one optimizer step of ``shape`` on sequences of ``mean_tokens`` tokens."""
    seq = max(1, round(mean_tokens))
    cost = fitting_training_cost(model, hw, replace(shape, seq_len=seq), cal)  # longer ones may need recomputation
    if cost.infeasible:
        raise ValueError(f"training shape {shape} cannot run sequences of {seq} tokens: {cost.infeasible}")
    return cost.step_s
