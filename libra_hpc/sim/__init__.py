"""Discrete-event cluster simulator driving the same planner, hybrid pool and C-MLFQ objects
as the live runtime (libra_hpc.planner, libra_hpc.scheduler).

engine (the simulated clock and its events) · instance (continuous batching) · rollout (instances + queue service
+ tools) · controller (RL pipeline, replanning, hybrid pool) · policies · search (best
static baselines) · trace (a recorded workload; the synthetic one is libra_hpc.envs.synthetic)
· report (outputs).
``python -m libra_hpc.sim --config configs/sim/<scenario>.yaml --out logs/sim-<name>``.
"""

from libra_hpc.sim.config import (
           SimConfig,
           load_sim_config,
           validate_sim_config,
)
from libra_hpc.sim.run import ScenarioResult, run_policy, run_scenario

__all__ = ["ScenarioResult", "SimConfig", "load_sim_config", "run_policy", "run_scenario",
           "validate_sim_config"]
