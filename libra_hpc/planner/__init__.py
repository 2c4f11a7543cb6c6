"""Global resource planner (pure logic: no MPI, no torch).

Hardware and model profiles (configs/hardware, configs/models), the rollout / training
cost models with calibration from measured timings, the plan search, the replanning gate
and the elastic hybrid pool's state machine. The runtime still follows the scripted
borrow/return of the config until the controller is wired to the gate and the pool.
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
from libra_hpc.planner.gate import Decision, GateOptions, ReplanGate
from libra_hpc.planner.hybrid import HybridPool, HybridPoolError, HybridReplica, PhaseTimeouts, PoolEvent
from libra_hpc.planner.profiles import HardwareProfile, ModelProfile, load_hardware, load_model
from libra_hpc.planner.search import (
    Plan,
    PlanError,
    PlannerOptions,
    PlanResult,
    RLBatch,
    exhaustive,
    plan,
    plan_to_layout,
    reprice,
)

__all__ = [
    "Decision", "GateOptions", "Plan", "PlanError", "PlanResult", "PlannerOptions", "RLBatch", "ReplanGate",
    "exhaustive", "plan", "plan_to_layout", "reprice",
    "Calibration", "HardwareProfile", "HybridPool", "HybridPoolError", "HybridReplica", "PhaseTimeouts", "PoolEvent", "LengthProfile", "LengthSample", "ModelProfile", "RolloutCost", "TimingRecord",
    "TrainShape", "TrainingCost", "fit_calibration", "load_hardware", "load_model", "rollout_makespan",
]
