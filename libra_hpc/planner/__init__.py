"""Global resource planner (pure logic: no MPI, no torch).

Built so far: hardware and model profiles (configs/hardware, configs/models), the
rollout / training cost models with calibration from measured timings, and the elastic
hybrid pool's state machine. The search over plans and the replanning gate come next;
the runtime still follows the scripted borrow/return of the config.
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
from libra_hpc.planner.hybrid import HybridPool, HybridPoolError, HybridReplica, PhaseTimeouts, PoolEvent
from libra_hpc.planner.profiles import HardwareProfile, ModelProfile, load_hardware, load_model

__all__ = [
    "Calibration", "HardwareProfile", "HybridPool", "HybridPoolError", "HybridReplica", "PhaseTimeouts", "PoolEvent", "LengthProfile", "LengthSample", "ModelProfile", "RolloutCost", "TimingRecord",
    "TrainShape", "TrainingCost", "fit_calibration", "load_hardware", "load_model", "rollout_makespan",
]
