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
from libra_hpc.config_checks import slurm_time_s

log = logging.getLogger(__name__)

# MPICH's transport for a world started by ``srun --mpi=pmi2``, where the environment
# names none. MPICH speaks PMI-1 to Slurm's pmi2 plugin, which reads each request with a
# single read() of at most 1024 bytes. Over UCX (the wheel's default) MPICH publishes each
# rank's 4 KiB address card in 511-byte segments, hex-encoded with runs of zeros shortened;
# the card's bytes past the real address are whatever the heap held, and a segment with few
# zeros makes a `put` line of about 1080 bytes, which the plugin reads in two pieces and
# refuses ("value not properly terminated"): the world dies or hangs in MPI_Init, now and
# then. An OFI address card is a few dozen bytes. libfabric's own first choice on a host
# without a fabric, the deprecated `sockets` provider, hangs in collectives; `tcp` does
# not. On a fabric (verbs, efa, cxi) set FI_PROVIDER for the job; other MPIs ignore both.
WORLD_STEP_DEFAULTS = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}


def world_step_env(environ: dict[str, str]) -> dict[str, str]:
    """The environment of the ``srun`` that starts the world: ``environ``, with each of
    :data:`WORLD_STEP_DEFAULTS` that it does not set."""
    return {**WORLD_STEP_DEFAULTS, **environ}


def world_step_transport(environ: dict[str, str]) -> dict[str, str]:
    """The variables of :data:`WORLD_STEP_DEFAULTS` as the world step will see them."""
    return {name: environ.get(name, value) for name, value in WORLD_STEP_DEFAULTS.items()}


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
            "use_srun": False,
            "stderr_to_stdout": True,
            # the time-limit warning to the batch step only (submitit's own --signal would
            # reach every rank); its shell ignores it, its Python process relays it
            # (run_world_step)
            "setup": ["trap '' USR2"],
            "additional_parameters": {"signal": f"B:USR2@{self.signal_before_limit_s}"},
        }
        for key in ("partition", "account", "qos", "constraint"):
            if getattr(self, key) is not None:
                params[key] = getattr(self, key)
        if self.requeue:
            params["additional_parameters"]["requeue"] = True
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
            f"--signal=B:USR2@{self.signal_before_limit_s}",
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


class TimeLimitRelay:
    """In the batch step: tells rank 0 that the time limit is near by writing ``STOP`` in
    the log folder (:mod:`libra_hpc.runtime.signals`), when Slurm's warning reaches this
    process (SIGUSR2) or, in case it reaches only the batch shell, when ``squeue`` says
    less than ``before_s`` is left (asked every ``every_s``; a limit an admin cut with
    ``scontrol update`` counts from then on)."""

    def __init__(self, folder: Path, job_id: str, before_s: float, every_s: float = 15.0,
                 time_left: Callable[[str], float | None] | None = None):
        import threading

        self.file, self.job_id, self.before_s, self.every_s = Path(folder) / "STOP", job_id, before_s, every_s
        self.time_left = time_left or _time_left
        self.said: str | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="time-limit", daemon=True)

    def start(self) -> TimeLimitRelay:
        import signal

        self.file.unlink(missing_ok=True)  # an earlier run's: this run is new
        signal.signal(signal.SIGUSR2, lambda *_: self.tell("SIGUSR2 (the time-limit warning, to the batch step)"))
        self._thread.start()
        return self

    def close(self) -> None:
        self._done.set()

    def tell(self, what: str) -> None:
        if self.said is None:
            self.said = what
            self.file.write_text(what + "\n")
            log.info("told rank 0 to stop: %s", what)

    def look(self) -> None:
        left = self.time_left(self.job_id)
        if left is not None and left <= self.before_s:
            self.tell(f"time limit in {left:.0f} s (squeue; cluster.signal_before_limit_s={self.before_s:g})")

    def _run(self) -> None:
        while self.said is None and not self._done.wait(self.every_s):
            try:
                self.look()
            except (OSError, subprocess.SubprocessError) as exc:
                log.warning("time left of job %s not known: %s", self.job_id, exc)


def _time_left(job_id: str) -> float | None:
    said = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%L"], capture_output=True, text=True, timeout=30)
    return slurm_time_s(said.stdout) if said.returncode == 0 else None


def run_world_step(command: list[str], logs_root: str | None = None,
                   post_mortem: Callable[[Path, str], str | None] | None = None, warn_before_s: float = 120) -> int:
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
    relay = None
    if folder is not None:  # this run's to write: an earlier run's would requeue a finished job
        (folder / "REQUEUE").unlink(missing_ok=True)
        folder.mkdir(parents=True, exist_ok=True)
        relay = TimeLimitRelay(folder, job, warn_before_s).start()
    log.info("starting the MPI world: %s", " ".join(command))
    process = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, errors="replace", env=world_step_env(dict(os.environ)))
    said = []
    for line in process.stderr:  # passed through, and kept for the post-mortem (srun names a dead task)
        sys.stderr.write(line)
        said.append(line)
    code = process.wait()
    if relay is not None:
        relay.close()
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
        job = executor.submit(run_world_step, request.srun_command(config_path), logs_root, post_mortem,
                              request.signal_before_limit_s)
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
