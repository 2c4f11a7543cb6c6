"""How the controller learns of Slurm's warning before the time limit.

**The warning goes to the batch shell, not to the ranks.** ``sbatch/libra.sh`` and the
submitit step ask for ``--signal=B:USR2@N``: Slurm signals the batch shell only, which
writes ``<log folder>/STOP`` (:data:`STOP_FILE`, one line: what and when) and goes on
waiting for the job step. Rank 0, which may run on another node, reads the file (the log
folder is on a shared file system, as the heartbeats are) at most every
:data:`POLL_S` and stops the run at the next step boundary. No process of the job step
is signalled: a vLLM instance's TP workers, a tool's sandbox, a compile worker would
otherwise die of USR2 (its default action) mid-generation.

A plain ``--signal=USR2@N`` (a user's own script, ``scancel --signal=USR2``) still works:
every rank notes the signal instead of dying, rank 0 stops the run, and the TP workers of
vLLM instances ignore it (:mod:`libra_hpc.engines.rollout.reaping`).
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

WARNING_SIGNALS = (signal.SIGUSR2,)
STOP_FILE = "STOP"
POLL_S = 0.5


class StopRequest:
    """Set by a signal handler or by the ``STOP`` file in the log folder (:meth:`watch`);
    read by the controller between steps. ``signal``: what asked (``SIGUSR2``, or the
    file's line); ``at``: when it was first seen (``clock``)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.signal: str | None = None
        self.at: float | None = None
        self.clock = clock
        self.file: Path | None = None
        self._next_look = 0.0

    def install(self) -> StopRequest:
        for signum in WARNING_SIGNALS:
            signal.signal(signum, self._note)
        return self

    def watch(self, folder: Path | str, batch_shell: bool) -> StopRequest:
        """Also stop when ``<folder>/STOP`` appears (the batch shell's note of the warning).
        ``batch_shell``: a Slurm batch step started this run and removed an earlier run's
        file before it (it may write this run's any time now); else one an earlier run
        left is removed here (a local ``--resume`` of a Slurm run's folder)."""
        self.file = Path(folder) / STOP_FILE
        if not batch_shell:
            self.file.unlink(missing_ok=True)
        return self

    def _note(self, signum: int, _frame) -> None:
        self._set(signal.Signals(signum).name)

    def _set(self, what: str) -> None:
        if self.signal is None:
            self.signal, self.at = what, self.clock()
            log.warning("stop requested (%s): stopping at the next step boundary", what)

    def _look(self) -> None:
        now = self.clock()
        if self.file is None or now < self._next_look:
            return
        self._next_look = now + POLL_S
        try:
            said = self.file.read_text(errors="replace").strip()
        except OSError:
            return
        self._set(said.splitlines()[0] if said else "STOP file")

    def __bool__(self) -> bool:
        if self.signal is None:
            self._look()
        return self.signal is not None


HANG_SIGNAL = signal.SIGRTMIN
FAULTS_ENV = "LIBRA_FAULTS"


def install_fault_signals(environ: dict = os.environ) -> bool:
    """Fault injection for soak runs (``benchmarks/bench_resilience.py``), only when the
    environment says ``LIBRA_FAULTS=1``: :data:`HANG_SIGNAL` (SIGRTMIN) makes this rank's
    main thread hang in Python for good, while its heartbeat thread beats on: the fault
    the progress watchdog (``job.progress_timeout_s``) is there to name. Whether it was
    installed."""
    if environ.get(FAULTS_ENV) != "1":
        return False

    def _hang(signum, _frame) -> None:
        log.error("fault injected (%s): this rank's main thread hangs now", signal.Signals(signum).name)
        while True:
            time.sleep(3600)

    signal.signal(HANG_SIGNAL, _hang)
    return True
