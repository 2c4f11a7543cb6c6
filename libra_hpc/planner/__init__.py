"""Global resource planner (pure logic: no MPI, no torch).

Hardware and model profiles (configs/hardware, configs/models), the rollout / training
cost models (``costs``) with calibration from measured timings (``calibration``), the plan
search, the replanning gate, the elastic hybrid pool's state machine, and Libra's control
loop over them (:mod:`libra_hpc.planner.control`, with its parts: ``valuation``,
``allocation``, ``lending``, ``reshard``, ``decisions``, ``loop_state``), the one
decision-maker the job and the simulator drive and ``launch.py --plan`` asks.
"""

from libra_hpc.planner.calibration import Calibration, TimingRecord, fit_calibration
from libra_hpc.planner.control import ControlLoop
from libra_hpc.planner.costs import RolloutCost, TrainingCost, TrainShape, rollout_makespan
from libra_hpc.planner.decisions import LayoutChange
from libra_hpc.planner.exhaustive import exhaustive
from libra_hpc.planner.gate import Decision, GateOptions, ReplanGate
from libra_hpc.planner.hybrid import HybridPool, HybridPoolError, HybridReplica, PhaseTimeouts, PoolEvent
from libra_hpc.planner.lengths import LengthProfile, LengthSample
from libra_hpc.planner.options import ControlOptions
from libra_hpc.planner.profiles import HardwareProfile, ModelProfile, load_hardware, load_model
from libra_hpc.planner.search import (
    Plan,
    PlanError,
    PlannerOptions,
    PlanResult,
    RLBatch,
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
