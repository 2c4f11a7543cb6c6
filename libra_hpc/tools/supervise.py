"""Watch one started sandbox process: read its pipes incrementally, enforce the wall-time
and output limits, notice its exit, and hand back what it produced.

The kill and leftover-scan actions are the caller's (``kill_tree``, ``kill_leftovers``), so
this loop is the same for every isolation mode.
"""

from __future__ import annotations

import logging
import os
import selectors
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

READ_CHUNK = 1 << 16
DRAIN_GRACE_S = 2.0
"""After the tree is dead, how long to wait for the pipes' EOF before closing them."""


@dataclass
class Outcome:
    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    status: int | None = None  # raw wait status of the main process
    rusage: object | None = None
    timed_out: bool = False
    truncated: bool = False
    leftovers: int = 0


class Supervisor:
    """``kill_tree(proc) -> (status, rusage)`` kills everything and reaps the main process;
    ``kill_leftovers() -> int`` kills what is left of the run and says how many."""

    def __init__(self, proc: subprocess.Popen, wall_time_s: float, output_limit_bytes: int,
                 kill_tree: Callable, kill_leftovers: Callable[[], int]):
        self.proc = proc
        self.limit = output_limit_bytes
        self.kill_tree = kill_tree
        self.kill_leftovers = kill_leftovers
        self.deadline = time.monotonic() + wall_time_s
        self.out = Outcome()

    def run(self) -> Outcome:
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ, self.out.stdout)
        sel.register(self.proc.stderr, selectors.EVENT_READ, self.out.stderr)
        try:
            while sel.get_map() and self._tick(sel):
                pass
        finally:
            sel.close()
            self.proc.stdout.close()
            self.proc.stderr.close()
        if self.out.status is None:  # the snippet closed its pipes but runs on
            self._wait_until_deadline()
        self.out.leftovers += self.kill_leftovers()  # verify: nothing of this run is alive
        return self.out

    def _tick(self, sel) -> bool:
        """One round: limits, reads, exit check. False: stop reading."""
        now = time.monotonic()
        if now >= self.deadline:
            if self.out.status is not None:
                log.warning("sandbox pipes still open %.1f s after the tree died; closing them", DRAIN_GRACE_S)
                return False
            self.out.timed_out = True
            self._kill()
        for key, _ in sel.select(timeout=min(0.05, max(0.0, self.deadline - time.monotonic()))):
            self._read(sel, key)
        if self.out.status is None:
            pid, status, rusage = os.wait4(self.proc.pid, os.WNOHANG)
            if pid:  # main process ended: kill what it left, so the pipes reach EOF
                self.out.status, self.out.rusage = status, rusage
                self.out.leftovers += self.kill_leftovers()
                self.deadline = time.monotonic() + DRAIN_GRACE_S
        return True

    def _read(self, sel, key) -> None:
        chunk = os.read(key.fd, READ_CHUNK)
        if not chunk:
            sel.unregister(key.fileobj)
            return
        room = self.limit - len(self.out.stdout) - len(self.out.stderr)
        key.data.extend(chunk[:max(room, 0)])
        if len(chunk) > room and not self.out.truncated:
            self.out.truncated = True
            if self.out.status is None:
                self._kill()

    def _kill(self) -> None:
        self.out.status, self.out.rusage = self.kill_tree(self.proc)
        self.deadline = time.monotonic() + DRAIN_GRACE_S

    def _wait_until_deadline(self) -> None:
        while time.monotonic() < self.deadline:
            pid, status, rusage = os.wait4(self.proc.pid, os.WNOHANG)
            if pid:
                self.out.status, self.out.rusage = status, rusage
                return
            time.sleep(0.01)
        self.out.timed_out = True
        self._kill()
