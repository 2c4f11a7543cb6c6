"""vLLM's TP worker processes die with the rank that started them.

A TP > 1 rollout instance runs its TP workers as child processes of the leader rank
(vLLM's multiprocessing executor). When the rank is killed (``scancel``, ``scontrol
requeue``, Slurm's time limit, ``kill -9``), the workers are re-parented to init and
are no longer in the job step's process tree, so Slurm's SIGKILL after ``KillWait``
misses them. vLLM's own exit path (a thread that notices the parent is gone and shuts
the worker's queues) does not always end them: on the private test cluster a worker left
by a requeued job spun at 100 % of a core for more than ten minutes, and another kept the
step's output open for 60 s, so Slurm took 65 s to requeue the job.

The fix is the kernel's: every worker asks for SIGKILL when its parent dies
(``PR_SET_PDEATHSIG``), before vLLM's worker code runs. :func:`bind_workers_to_parent`
wraps vLLM's worker entry point once per process; the wrapper is a module-level
function, so it reaches the worker under ``fork`` and ``spawn`` alike.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from typing import Any, Callable

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

_original: Callable[..., Any] | None = None  # vLLM's worker entry point, where this process wrapped it


def die_with_parent(sig: int = signal.SIGKILL) -> bool:
    """Ask the kernel to send ``sig`` to this process when its parent exits; if the parent
    is already gone (it died between the fork and this call), die now. False where the
    kernel has no such request (not Linux)."""
    if not sys.platform.startswith("linux"):
        return False
    parent = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    if parent == 1 or os.getppid() != parent:
        os.kill(os.getpid(), sig)
    return True


def worker_main(*args: Any, **kwargs: Any) -> Any:
    """vLLM's worker entry point, after :func:`die_with_parent`, with Slurm's time-limit
    warning (SIGUSR2, sent to every process of the step) ignored: its default action killed
    the workers of a TP > 1 instance and failed the job instead of checkpointing it (the
    rank itself handles the warning: libra_hpc/runtime/signals.py)."""
    die_with_parent()
    signal.signal(signal.SIGUSR2, signal.SIG_IGN)
    target = _original
    if target is None:  # spawned: this interpreter imported vLLM afresh, unwrapped
        from vllm.v1.executor.multiproc_executor import WorkerProc

        target = WorkerProc.worker_main
    return target(*args, **kwargs)


def bind_workers_to_parent() -> bool:
    """Make the TP workers vLLM starts from now on in this process die with it. False
    (and a warning) where the installed vLLM has no such entry point to wrap."""
    global _original
    try:
        from vllm.v1.executor.multiproc_executor import WorkerProc
    except ImportError as exc:
        log.warning("vLLM's TP workers cannot be bound to their rank (%s): a killed rank may leave them running", exc)
        return False
    current = WorkerProc.__dict__.get("worker_main")
    if isinstance(current, staticmethod) and current.__func__ is worker_main:
        return True
    if current is None:
        log.warning("vLLM's WorkerProc has no worker_main: a killed rank may leave its TP workers running")
        return False
    _original = current.__func__ if isinstance(current, staticmethod) else current
    WorkerProc.worker_main = staticmethod(worker_main)
    return True
