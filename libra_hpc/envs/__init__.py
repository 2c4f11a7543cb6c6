"""Agentic tasks: multi-turn environments with tools and verifiers.

Today one: the synthetic agentic workload (:mod:`libra_hpc.envs.synthetic`) that the
simulator, the scheduler's routing benchmark and the tool scheduler's replay share.
Real task environments will live here too."""

from libra_hpc.envs.synthetic import (
    CHARS_PER_TOKEN,
    DriftSpec,
    LogNormal,
    SyntheticWorkload,
    ToolCall,
    ToolSpec,
    Trajectory,
    WorkloadSpec,
    drift,
    summary,
)

__all__ = ["CHARS_PER_TOKEN", "DriftSpec", "LogNormal", "SyntheticWorkload", "ToolCall", "ToolSpec", "Trajectory",
           "WorkloadSpec", "drift", "summary"]
