"""Global resource planner (pure logic: no MPI, no torch).

Built so far: hardware and model profiles (configs/hardware, configs/models) and the
rollout / training cost models with calibration from measured timings. The search over
plans, the replanning gate and the elastic hybrid pool come next.
"""

from libra_hpc.planner.costs import (
    Calibration,
    LengthProfile,
    LengthSample,
    RolloutCost,
    TimingRecord,
    TrainingCost,
    TrainShape,
    fit_calibration,
    rollout_makespan,
)
from libra_hpc.planner.profiles import HardwareProfile, ModelProfile, load_hardware, load_model

__all__ = [
    "Calibration", "HardwareProfile", "LengthProfile", "LengthSample", "ModelProfile", "RolloutCost", "TimingRecord",
    "TrainShape", "TrainingCost", "fit_calibration", "load_hardware", "load_model", "rollout_makespan",
]
