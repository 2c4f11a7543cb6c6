"""The RL core: the trajectory record, the staleness bound, GRPO advantages and batches,
and the step that hands them to the training engine's clipped policy-gradient loss
(:mod:`libra_hpc.engines.train.loss`). Pure: importing it imports neither torch nor MPI."""

from libra_hpc.rl.grpo import (
    AGGREGATIONS,
    Advantages,
    TrainBatch,
    build_batch,
    compute_advantages,
    group_advantages,
    loss_mask,
)
from libra_hpc.rl.staleness import StalenessReport, drop_stale
from libra_hpc.rl.step import BatchReport, grpo_step, prepare_batch
from libra_hpc.rl.trajectory import NOT_GENERATED, Trajectory

__all__ = ["AGGREGATIONS", "Advantages", "BatchReport", "NOT_GENERATED", "StalenessReport", "TrainBatch",
           "Trajectory", "build_batch", "compute_advantages", "drop_stale", "group_advantages", "grpo_step",
           "loss_mask", "prepare_batch"]
