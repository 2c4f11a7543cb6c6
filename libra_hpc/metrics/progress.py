"""Progress of the job's long phases (the warm start, the engines' start, an evaluation,
the RL steps), from the producer's side and the watcher's.

Rank 0 writes ``progress`` events with ``phase``, ``done`` and ``total`` (the total known
before the phase starts) through :class:`PhaseProgress`, which thins them out: an event
when the phase starts, ends, or moves by a whole percent, at most every
``min_interval_s`` in between. The person watching (``launch.py``, :mod:`libra_hpc.cluster.follow`)
sees them through :class:`ProgressView`: on a terminal one ``tqdm`` bar per phase, with
its rate and ETA; otherwise (a file, a pipe, ``job.out``) one plain line per tenth of the
phase, never a carriage return.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TextIO


class PhaseProgress:
    """``update(done)`` as a phase advances; ``emit(fields)`` gets the ``progress`` event's
    fields (``phase``, ``done``, ``total``, ``line``) when it is worth one."""

    def __init__(self, phase: str, total: int, emit: Callable[[dict], None], *, unit: str = "",
                 min_interval_s: float = 2.0, clock: Callable[[], float] = time.monotonic):
        if total < 1:
            raise ValueError(f"progress of {phase!r}: total must be at least 1, got {total}")
        self.phase, self.total, self.unit, self.emit = phase, total, unit, emit
        self.min_interval_s, self.clock = min_interval_s, clock
        self.last_percent, self.last_t, self.done = -1, -float("inf"), 0
        self.update(0)

    def update(self, done: int, note: str = "") -> None:
        self.done = done = min(done, self.total)
        percent = 100 * done // self.total
        now = self.clock()
        ends = done in (0, self.total)
        if percent == self.last_percent and not (note and ends):
            return
        if not ends and now - self.last_t < self.min_interval_s:
            return
        self.last_percent, self.last_t = percent, now
        unit = f" {self.unit}" if self.unit else ""
        line = f"{self.phase}: {done}/{self.total}{unit}" + (f", {note}" if note else "")
        self.emit({"phase": self.phase, "done": done, "total": self.total, "unit": self.unit, "line": line})


class ProgressView:
    """How a watcher shows ``progress`` events that carry ``phase``/``done``/``total``:
    :meth:`show` returns True when it took the event (a bar moved, or a line was due or
    skipped), False for any other event, which the caller prints with :meth:`print` (above
    the bars on a terminal). An event with ``say`` also has its ``line`` printed (a step's
    numbers under the steps' bar)."""

    def __init__(self, out: TextIO, tty: bool | None = None):
        self.out = out
        self.tty = out.isatty() if tty is None else tty
        self.bars: dict[str, Any] = {}
        self.tenths: dict[str, int] = {}

    def show(self, event: dict, elapsed: str) -> bool:
        if event.get("kind") != "progress" or "total" not in event:
            return False
        phase, done, total = event["phase"], int(event["done"]), max(1, int(event["total"]))
        if event.get("say"):  # a line worth reading in itself (a step's numbers): printed, bar or not
            self.print(f"{elapsed} progress: {event['line']}")
            if not self.tty:
                return True
        if self.tty:
            self._bar(phase, done, total, event.get("unit") or "")
            return True
        tenth = 10 * done // total
        if tenth > self.tenths.get(phase, -1):
            self.tenths[phase] = tenth
            print(f"{elapsed} progress: {phase} {done}/{total} ({100 * done // total}%)", file=self.out, flush=True)
        return True

    def print(self, line: str) -> None:
        if self.bars:
            from tqdm import tqdm

            tqdm.write(line, file=self.out)
        else:
            print(line, file=self.out, flush=True)

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()
        self.bars.clear()

    def _bar(self, phase: str, done: int, total: int, unit: str) -> None:
        from tqdm import tqdm

        bar = self.bars.get(phase)
        if bar is None:
            bar = self.bars[phase] = tqdm(total=total, desc=phase, unit=f" {unit}" if unit else "it",
                                          file=self.out, dynamic_ncols=True, leave=True)
        bar.total = total
        bar.update(done - bar.n)
        if done >= total:
            bar.close()
            del self.bars[phase]
