"""Global resource planner (pure logic: no MPI, no torch).

Hardware and model profiles (configs/hardware, configs/models), the rollout / training
cost models with calibration from measured timings, the plan search, the replanning gate,
the elastic hybrid pool's state machine, and Libra's control loop over them
(:mod:`libra_hpc.planner.control`), the one decision-maker the simulator drives and
``launch.py --plan`` asks. The job's controller still follows the config's scripted
borrow/return until it is wired to the control loop.
"""

from libra_hpc.planner.control import ControlLoop, ControlOptions, LayoutChange
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
    "ControlLoop", "ControlOptions", "LayoutChange",
    "Decision", "GateOptions", "Plan", "PlanError", "PlanResult", "PlannerOptions", "RLBatch", "ReplanGate",
    "exhaustive", "plan", "plan_to_layout", "reprice",
    "Calibration", "HardwareProfile", "HybridPool", "HybridPoolError", "HybridReplica", "PhaseTimeouts", "PoolEvent", "LengthProfile", "LengthSample", "ModelProfile", "RolloutCost", "TimingRecord",
    "TrainShape", "TrainingCost", "fit_calibration", "load_hardware", "load_model", "rollout_makespan",
]
