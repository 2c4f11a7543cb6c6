"""The local executor: the same MPI world on this host under ``mpiexec``, each emulated
node a block of ``gpus_per_node`` CPU ranks (see cluster/topology.py)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
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
    # -disable-auto-cleanup: a rank that dies does not take the others with it at once, so
    # rank 0's watchdog can name it before it ends the world (libra_hpc/runtime/heartbeat.py)
    return [mpiexec, "-disable-auto-cleanup", "-n", str(world), python, "-m", "libra_hpc.run", "--config",
            str(config_path), "--log-dir", str(log_dir)]


def start(command: list[str], log_dir: Path, detach: bool) -> subprocess.Popen:
    """Start the world; its stdout and stderr go to ``<log_dir>/job.out``."""
    log_dir.mkdir(parents=True, exist_ok=True)
    out = (log_dir / "job.out").open("ab")
    return subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=detach)


def remove_stale_shm(since: float, settle_s: float = 5.0) -> list[Path]:
    """Remove MPICH shared-memory files that a killed world left behind: created at or
    after ``since`` (Unix seconds) and mapped by no live process. Ranks of an aborted world
    may still be exiting when mpiexec returns, so files still mapped are retried for up to
    ``settle_s`` seconds. Returns what was removed."""
    removed: list[Path] = []
    deadline = time.monotonic() + settle_s
    while True:
        mapped = _mapped_shm()
        busy = False
        for path in SHM.glob("mpich_shm_*"):
            try:
                if path.stat().st_mtime < since:
                    continue
                if str(path) in mapped:
                    busy = True
                    continue
                path.unlink()
                removed.append(path)
            except OSError:
                continue  # gone meanwhile
        if not busy or time.monotonic() >= deadline:
            return removed
        time.sleep(0.2)


def _mapped_shm() -> set[str]:
    mapped: set[str] = set()
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            mapped.update(line.split(None, 5)[-1].strip() for line in maps.read_text().splitlines() if "/dev/shm/" in line)
        except OSError:
            continue  # the process ended while we looked
    return mapped
