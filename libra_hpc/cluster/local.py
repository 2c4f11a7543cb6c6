"""The local executor: the same MPI world on this host under ``mpiexec``, each emulated
node a block of ``gpus_per_node`` CPU ranks (see cluster/topology.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

SHM = Path("/dev/shm")

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


def remove_stale_shm(since: float) -> list[Path]:
    """Remove MPICH shared-memory files that a killed world left behind: created at or
    after ``since`` (Unix seconds) and mapped by no live process. Returns what went."""
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(line.split(None, 5)[-1].strip() for line in maps.read_text().splitlines() if "/dev/shm/" in line)
        except OSError:
            continue  # the process ended while we looked
    removed = []
    for path in SHM.glob("mpich_shm_*"):
        try:
            if path.stat().st_mtime >= since and str(path) not in mapped:
                path.unlink()
                removed.append(path)
        except OSError:
            continue
    return removed
