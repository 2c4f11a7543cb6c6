"""C-MLFQ: causal tool-return routing of multi-turn trajectories, and its queue service.

Pure logic (no MPI, no torch): tool-return states, the causal prefix tree, the routers and
the leased queue service (its protocol in ``protocol``, its books in ``records``).
``mpi_service`` is the thin MPI transport (imported on its own).
The hot-path modules run compiled when the install built them (``libra_hpc._compiled``).
"""

from libra_hpc import _compiled

_compiled.prefer_current()  # before the first compiled module is imported


from libra_hpc.scheduler.routers import (
    buckets_from_instances,
    make_router,
    router_from_config,
)
from libra_hpc.scheduler.service import QueueService
from libra_hpc.scheduler.state import classify
from libra_hpc.scheduler.tree import CausalIndex
from libra_hpc.scheduler.types import (
    BucketSpec,
    CompletedTrajectory,
    FinishedTrajectory,
    Placement,
    ToolState,
    TrajectoryView,
)

__all__ = [
    "BucketSpec", "CausalIndex", "CompletedTrajectory", "FinishedTrajectory", "Placement", "QueueService",
    "ToolState", "TrajectoryView", "buckets_from_instances", "classify", "make_router", "router_from_config",
]
