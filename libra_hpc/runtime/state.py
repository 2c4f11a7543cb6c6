"""What rank 0 knows of the job, as its helpers see it (:class:`JobState`).

The controller (:mod:`.controller`) owns one :class:`JobState`; nothing else holds the
controller, and it is the only object that sends. Its helpers (the batch tracker, the relayouts, the planner's driver,
the checkpoints) get this state, read it, and answer with what to do: the commands to send
(:data:`Sends`) and outcomes the controller acts on. None of them sends a message or calls
back into the controller.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

Send = tuple[int, dict]
"""A command for one rank: (world rank, message) on the ``COMMAND`` tag."""
Sends = list[Send]


@dataclass
class JobState:
    """The job's shared state on rank 0: the layout in force and who plays which role, the
    policy version, whether a training step runs, the queue service in use, the leaders'
    load reports."""

    cfg: Any
    runlog: Any
    rank_of: Callable[[Any], int]
    """A GPU slot's world rank (the topology's)."""
    layout: Any = None
    initial: Any = None
    """The layout the hybrid pool returns to (the config's, or the last replan's)."""
    ids: dict = field(default_factory=dict)
    """Rollout instance id by its slots: an instance keeps its id across layouts."""
    roles: Any = None
    service: Any = None
    """The C-MLFQ queue service in use (a replan builds another)."""
    version: int = 0
    """The newest policy: steps ``0 .. version - 1`` are trained."""
    training: bool = False
    """A training step runs (its ``train`` sent, its ``trained`` reports not all in)."""
    stop: Any = None
    """The stop signal's holder (:mod:`.signals`): true once Slurm's signal came."""
    leader_version: dict = field(default_factory=dict)
    """Leader rank → the policy version it runs."""
    leader_load: dict = field(default_factory=dict)
    """Rollout instance id → its leader's last load report."""
    load_history: list = field(default_factory=list)
    """(time, {instance: tokens generated so far}) of recent load reports."""
    last_rollout_s: float = 0.0
    last_step_s: float = 0.0

    @property
    def stopping(self) -> bool:
        """Slurm's stop signal came: no new step starts, nothing new streams."""
        return bool(self.stop)

    def next_step(self) -> int:
        """The step the trainers take next (the one they train now, if any, is before it)."""
        return self.version + (1 if self.training else 0)

    def gpus(self) -> dict:
        """GPUs per role now; hybrid slots counted on the side they serve."""
        hybrid = self.layout.hybrid
        train = set(self.layout.training.slots)
        roll = set(self.layout.slots_of("rollout"))
        return {"training": len(train - hybrid), "rollout": len(roll - hybrid),
                "hybrid_training": len(train & hybrid), "hybrid_rollout": len(roll & hybrid)}


class JobFailed(RuntimeError):
    """A rank reported an error, or something the job cannot go on from; the message names
    the rank and its role."""


@dataclass
class StepStart:
    """What a training step trains: each DP replica's groups, and the groups the trainers
    throw away (regenerated); ``abort``: trajectory ids the leaders stop at their next turn
    boundary; ``nowhere``: (leader, trajectory id) of finished members of those groups that
    still wait at their leaders for a route (their group was never placed)."""

    groups: dict[int, list[str]]
    discard: list[str] = field(default_factory=list)
    abort: list[str] = field(default_factory=list)
    nowhere: list[tuple[int, str]] = field(default_factory=list)
