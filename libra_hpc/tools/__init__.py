"""Tool execution: a hardened sandbox and action-level orchestration of tool resources (ARL-Tangram).

``Sandbox`` runs one untrusted snippet under namespaces and limits and always reaps it;
``SlurmSandboxRunner`` runs them in workers on other nodes (``tools.placement: slurm``);
``make_scheduler`` is the pure action scheduler (``tangram`` or the ``dedicated``
baseline) that the live ``ToolOrchestrator`` and the trace ``replay`` both drive.
Importing this package starts nothing and imports neither MPI nor torch.
"""

from libra_hpc.tools.endpoint import EndpointRunner, serve_scorer
from libra_hpc.tools.isolation import SandboxLimits, SandboxUnavailable
from libra_hpc.tools.orchestrator import (
    SandboxRunner,
    ToolOrchestrator,
    orchestrator_from_config,
)
from libra_hpc.tools.pool import ResourceSpec
from libra_hpc.tools.remote import RemoteToolError, SlurmSandboxRunner
from libra_hpc.tools.replay import TraceShape, make_trace, replay
from libra_hpc.tools.sandbox import ClassifyRules, Sandbox, ToolResult
from libra_hpc.tools.scheduling import Action, DurationEstimator, make_scheduler

__all__ = [
    "Action", "ClassifyRules", "DurationEstimator", "EndpointRunner", "RemoteToolError", "ResourceSpec", "Sandbox",
    "SandboxLimits", "SandboxRunner", "SandboxUnavailable", "SlurmSandboxRunner", "ToolOrchestrator", "ToolResult", "TraceShape",
    "make_scheduler", "make_trace",
    "orchestrator_from_config", "replay", "serve_scorer",
]
