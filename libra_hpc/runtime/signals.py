"""Slurm's warning before the time limit (``--signal=USR2@N``) reaches every rank of the
job step. Python's default action for SIGUSR2 is to die, which would kill the world N
seconds early; instead every rank notes it, and the controller stops the run at the next
step boundary (where checkpointing hooks in)."""

from __future__ import annotations

import logging
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
