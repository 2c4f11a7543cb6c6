"""Running a test's MPI world: ``mpiexec -n N python -m mpi4py SCRIPT ARGS`` in a session
of its own. On timeout the whole session (mpiexec and every rank) is killed and MPICH's
shared-memory files it left are removed, so that a hung world cannot starve the tests
that follow; the failure shows the world's output and the busiest processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurm_cluster import busiest_processes

from libra_hpc.cluster.local import remove_stale_shm

HERE = Path(__file__).resolve().parent


def run_world(script: str, ranks: int, *args: str, timeout: float, what: str) -> str:
    """Run ``tests/<script>`` on ``ranks`` ranks; its combined output. Fails the test
    (naming ``what``) when the world hangs past ``timeout`` s or exits non-zero."""
    started = time.time()
    process = subprocess.Popen(["mpiexec", "-n", str(ranks), sys.executable, "-m", "mpi4py", str(HERE / script),
                                *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               cwd=HERE.parent, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        busiest = busiest_processes()
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        remove_stale_shm(started - 1)
        pytest.fail(f"{what} hung after {timeout} s:\n{output[-4000:]}\n{busiest}")
    assert process.returncode == 0, f"{what} failed (exit {process.returncode}):\n{output[-6000:]}"
    return output
