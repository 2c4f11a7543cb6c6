"""Slurm's warning before the time limit (``--signal=USR2@N``) reaches every rank of the
job step. Python's default action for SIGUSR2 is to die, which would kill the world N
seconds early; instead every rank notes it, and the controller stops the run at the next
step boundary (where checkpointing hooks in)."""

from __future__ import annotations

import logging
import os
import signal

log = logging.getLogger(__name__)

WARNING_SIGNALS = (signal.SIGUSR2,)


class StopRequest:
    """Set by a signal handler; read by the controller between steps."""

    def __init__(self) -> None:
        self.signal: str | None = None

    def install(self) -> StopRequest:
        for signum in WARNING_SIGNALS:
            signal.signal(signum, self._note)
        return self

    def _note(self, signum: int, _frame) -> None:
        self.signal = signal.Signals(signum).name
        log.warning("received %s: stopping at the next step boundary", self.signal)

    def __bool__(self) -> bool:
        return self.signal is not None


def end_children_with_this_rank() -> None:
    """On SIGTERM (``scancel``, ``scontrol requeue``, the time limit itself), kill this
    rank's descendants before the rank dies of the signal. Slurm signals every process of
    the step, but vLLM's worker processes handle SIGTERM by shutting down, which can block;
    once their rank has died they are orphans, and Slurm's ``proctrack/linuxproc`` (which
    finds a step's processes through their parents) no longer sees them when it sends
    SIGKILL. They then hold the step's output open and the node for a minute (Slurm's
    "Abandoning IO 60 secs after job shutdown initiated"), which delays a requeued job."""
    signal.signal(signal.SIGTERM, _terminated)


def _terminated(signum: int, _frame) -> None:
    for pid in descendants(os.getpid()):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)  # die of the signal, as Slurm and the launcher expect


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children first), from ``/proc``'s parent links."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # gone meanwhile
        parent = int(stat[stat.rindex(")") + 2:].split()[1])  # the name may hold spaces and ")"
        children.setdefault(parent, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(0), [])
        found += kids
        todo += kids
    return found
