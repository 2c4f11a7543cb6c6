"""The one place that reads the process environment.

Only variables that Slurm, the MPI launcher or the CUDA runtime set are read, once, into a
frozen :class:`ProcessEnv` that the rest of the package receives as a value. Nothing in
libra_hpc configures itself from other environment variables: experiments are YAML. The
one variable a rank sets for the libraries it loads is :data:`RANK_DEFAULTS`.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from collections.abc import Mapping, MutableMapping


RANK_DEFAULTS = {"OMP_WAIT_POLICY": "PASSIVE"}
"""Set in every rank's environment before torch loads, unless the user set them. Ranks share
cores (the controller beside a GPU slot; every emulated node of a laptop or CI machine on
the same cores): OpenMP threads that spin while a sibling thread waits for a core stall
torch's parallel regions. The small test job's warm start built in 36 s alone, 218 s beside
one busy 2-thread torch process, and 59 s there with passive waiting (38 s alone)."""


def set_rank_defaults(environ: MutableMapping[str, str] = os.environ) -> dict[str, str]:
    """:data:`RANK_DEFAULTS` into ``environ`` where unset (a user's own value wins); what it
    set. Call it before anything loads torch: libgomp reads its policy once, at load."""
    added = {k: v for k, v in RANK_DEFAULTS.items() if k not in environ}
    environ.update(added)
    return added


@dataclass(frozen=True)
class ProcessEnv:
    """What the scheduler told this process about where it runs."""

    hostname: str
    job_id: str | None = None
    """SLURM_JOB_ID; None outside Slurm."""
    job_name: str | None = None
    """SLURM_JOB_NAME (``%x``)."""
    node_name: str | None = None
    """SLURMD_NODENAME: the Slurm name of this node (several emulated nodes share a hostname)."""
    node_id: int | None = None
    """SLURM_NODEID: index of this task's node inside the job's allocation."""
    local_id: int | None = None
    """SLURM_LOCALID: index of this task among the job step's tasks on its node."""
    visible_gpus: tuple[str, ...] | None = None
    """CUDA_VISIBLE_DEVICES as a tuple; None when unset (all GPUs visible, or no CUDA)."""
    step_gpus: tuple[str, ...] | None = None
    """SLURM_STEP_GPUS / SLURM_JOB_GPUS: physical GPU ids Slurm bound to this step."""

    @classmethod
    def read(cls, environ: Mapping[str, str] = os.environ) -> ProcessEnv:
        return cls(
            hostname=socket.gethostname(),
            job_id=environ.get("SLURM_JOB_ID"),
            job_name=environ.get("SLURM_JOB_NAME"),
            node_name=environ.get("SLURMD_NODENAME"),
            node_id=_int(environ.get("SLURM_NODEID")),
            local_id=_int(environ.get("SLURM_LOCALID")),
            visible_gpus=_ids(environ.get("CUDA_VISIBLE_DEVICES")),
            step_gpus=_ids(environ.get("SLURM_STEP_GPUS") or environ.get("SLURM_JOB_GPUS")),
        )

    @property
    def under_slurm(self) -> bool:
        return self.job_id is not None


def _int(text: str | None) -> int | None:
    return int(text) if text not in (None, "") else None


def _ids(text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    return tuple(part for part in text.split(",") if part)
