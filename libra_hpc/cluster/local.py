"""The local executor: the same MPI world on this host under ``mpiexec``, each emulated
node a block of ``gpus_per_node`` CPU ranks (see cluster/topology.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from libra_hpc.config import ExperimentConfig


class LocalExecutorError(RuntimeError):
    pass


def mpiexec_command(cfg: ExperimentConfig, config_path: Path, log_dir: Path, python: str = sys.executable) -> list[str]:
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        raise LocalExecutorError("mpiexec is not on PATH: install the MPI wheels with scripts/install.sh")
    world = cfg.cluster.total_gpus + 1
    return [mpiexec, "-n", str(world), python, "-m", "libra_hpc.run", "--config", str(config_path), "--log-dir", str(log_dir)]


def start(command: list[str], log_dir: Path, detach: bool) -> subprocess.Popen:
    """Start the world; its stdout and stderr go to ``<log_dir>/job.out``."""
    log_dir.mkdir(parents=True, exist_ok=True)
    out = (log_dir / "job.out").open("ab")
    return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=detach)
