"""Slurm: what to ask for (pure), how to submit it (submitit), how to follow it (scontrol/sacct).

The job: ``--nodes=N --ntasks-per-node=G --gpus-per-node=G``. Its batch step runs one
Python process (submitit with ``use_srun=False``) that starts the MPI world as a job step,
``srun --mpi=pmi2 --overcommit --ntasks=N·G+1``: one rank per GPU slot plus the controller,
which shares the first node (``--overcommit`` lets that one extra, mostly idle task in).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from libra_hpc.config import ExperimentConfig

log = logging.getLogger(__name__)

TERMINAL_STATES = frozenset(
    {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"}
)


@dataclass(frozen=True)
class SlurmRequest:
    """The allocation one experiment needs."""

    job_name: str
    nodes: int
    gpus_per_node: int
    cpus_per_task: int
    time_minutes: int
    signal_before_limit_s: int
    requeue: bool
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None

    @classmethod
    def from_config(cls, cfg: ExperimentConfig) -> SlurmRequest:
        c = cfg.cluster
        return cls(
            job_name=c.job_name, nodes=c.nodes, gpus_per_node=c.gpus_per_node, cpus_per_task=c.cpus_per_task,
            time_minutes=c.time_limit_minutes, signal_before_limit_s=c.signal_before_limit_s, requeue=c.requeue,
            partition=c.partition, account=c.account, qos=c.qos, constraint=c.constraint,
        )

    @property
    def world_size(self) -> int:
        """MPI ranks: one per GPU slot and the controller."""
        return self.nodes * self.gpus_per_node + 1

    def submitit_parameters(self) -> dict:
        """Keyword arguments for ``submitit.SlurmExecutor.update_parameters``."""
        params = {
            "job_name": self.job_name,
            "nodes": self.nodes,
            "ntasks_per_node": self.gpus_per_node,
            "gpus_per_node": self.gpus_per_node,
            "cpus_per_task": self.cpus_per_task,
            "time": self.time_minutes,
            "signal_delay_s": self.signal_before_limit_s,
            "use_srun": False,
            "stderr_to_stdout": True,
        }
        for key in ("partition", "account", "qos", "constraint"):
            if getattr(self, key) is not None:
                params[key] = getattr(self, key)
        if self.requeue:
            params["additional_parameters"] = {"requeue": True}
        return params

    def sbatch_directives(self) -> list[str]:
        """The #SBATCH lines of this request (as submitit writes them; for --dry-run)."""
        lines = [
            f"--job-name={self.job_name}",
            f"--nodes={self.nodes}",
            f"--ntasks-per-node={self.gpus_per_node}",
            f"--gpus-per-node={self.gpus_per_node}",
            f"--cpus-per-task={self.cpus_per_task}",
            f"--time={self.time_minutes}",
            f"--signal=USR2@{self.signal_before_limit_s}",
        ]
        lines += [f"--{key}={getattr(self, key)}" for key in ("partition", "account", "qos", "constraint") if getattr(self, key)]
        if self.requeue:
            lines.append("--requeue")
        return [f"#SBATCH {line}" for line in lines]

    def srun_command(self, config_path: Path, python: str = sys.executable) -> list[str]:
        """The job step that starts the MPI world inside the allocation."""
        return [
            "srun", "--mpi=pmi2", "--overcommit", "--kill-on-bad-exit=1",
            f"--nodes={self.nodes}", f"--ntasks={self.world_size}",
            python, "-m", "libra_hpc.run", "--config", str(config_path),
        ]


def slurm_reachable() -> tuple[bool, str]:
    """Whether ``sbatch`` is on PATH and a slurmctld answers; the reason either way."""
    if shutil.which("sbatch") is None:
        return False, "sbatch is not on PATH"
    try:
        ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"scontrol ping failed: {exc}"
    if ping.returncode != 0 or "UP" not in ping.stdout:
        said = (ping.stdout + ping.stderr).strip().splitlines()
        return False, f"no Slurm controller answers (scontrol ping: {said[-1] if said else 'no output'})"
    return True, ping.stdout.strip()


def run_world_step(command: list[str], logs_root: str | None = None,
                   post_mortem: Callable[[Path, str], str | None] | None = None) -> int:
    """Runs in the job's batch step (submitted by submitit): the MPI world as a job step.
    When the world ended badly, ``post_mortem(log folder, srun's last output)`` names the
    rank whose death ended it (the submitter passes the job's own:
    ``libra_hpc.runtime.heartbeat.post_mortem_of``; it may ask for a requeue). When the world
    stopped on the time-limit warning with a checkpoint and asked for a requeue
    (``REQUEUE`` in its log folder, as ``sbatch/libra.sh`` reads it), requeue this job: it
    comes back with the same id and log folder and resumes."""
    logging.basicConfig(level=logging.INFO)
    job, name = os.environ.get("SLURM_JOB_ID"), os.environ.get("SLURM_JOB_NAME")
    folder = Path(logs_root) / f"{name}-{job}" if logs_root and job and name else None
    if folder is not None:  # this run's to write: an earlier run's would requeue a finished job
        (folder / "REQUEUE").unlink(missing_ok=True)
    log.info("starting the MPI world: %s", " ".join(command))
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, errors="replace")
    said = []
    for line in process.stderr:  # passed through, and kept for the post-mortem (srun names a dead task)
        sys.stderr.write(line)
        said.append(line)
    code = process.wait()
    if folder is not None:
        if code != 0 and post_mortem is not None and (folder / "config.yaml").is_file():
            lost = post_mortem(folder, "".join(said[-200:]))
            if lost:
                log.error("%s", lost)
        marker = folder / "REQUEUE"
        if marker.is_file():
            log.info("%s; requeueing job %s", marker.read_text().strip(), job)
            marker.unlink()
            subprocess.run(["scontrol", "requeue", job], check=True)
    if code != 0:
        raise RuntimeError(f"the MPI world step exited with status {code}: {' '.join(command)}")
    return code


def submit(request: SlurmRequest, config_path: Path, folder: Path, logs_root: str | None = None,
           post_mortem: Callable[[Path, str], str | None] | None = None) -> str:
    """Submit the job with submitit; returns the Slurm job id. ``post_mortem``: see
    :func:`run_world_step` (a module-level function: submitit pickles it by name)."""
    import submitit
    from submitit.core.utils import FailedJobError

    executor = submitit.SlurmExecutor(folder=folder, max_num_timeout=3)
    executor.update_parameters(**request.submitit_parameters())
    try:
        job = executor.submit(run_world_step, request.srun_command(config_path), logs_root, post_mortem)
    except FailedJobError as exc:
        said = [line for line in str(exc).splitlines() if line.strip()]
        raise SubmissionError(
            f"sbatch refused {request.nodes} nodes × {request.gpus_per_node} GPUs"
            f"{f' on partition {request.partition}' if request.partition else ''}: {said[-1] if said else exc} "
            "(check cluster.nodes, cluster.gpus_per_node, cluster.partition against `sinfo -o '%P %D %G'`)"
        ) from None
    return str(job.job_id)


class SubmissionError(RuntimeError):
    """Slurm refused the job; the message carries sbatch's reason and the request."""


def job_state(job_id: str) -> str | None:
    """The job's state (PENDING, RUNNING, COMPLETED, ...), or None if Slurm no longer knows it."""
    try:
        show = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, timeout=30)
        match = re.search(r"\bJobState=(\S+)", show.stdout)
        if show.returncode == 0 and match:
            return match.group(1)
        if shutil.which("sacct"):
            acct = subprocess.run(["sacct", "-j", job_id, "-X", "-n", "-P", "-o", "State"],
                                  capture_output=True, text=True, timeout=30)
            states = acct.stdout.split()
            if acct.returncode == 0 and states:
                return states[0].split()[0]
    except subprocess.TimeoutExpired:
        log.warning("Slurm did not answer about job %s within 30 s", job_id)
        return "UNKNOWN"
    return None
