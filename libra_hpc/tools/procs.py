"""Find and kill what a sandboxed tool left running, by scanning ``/proc``.

A sandbox run is *owned* by processes that either run under its dedicated uid (when the
sandbox dropped to one: the uid cannot be changed back without privileges) or carry its
marker in their initial environment (weaker: a hostile process may overwrite its own
environment block, which is why the uid is used whenever we can set one). Zombies count as
dead: they hold a pid entry only, no CPU, memory or files, and their parent reaps them.

Linux only; on a system without ``/proc`` every scan finds nothing.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterable

log = logging.getLogger(__name__)

PROC = "/proc"


class SlotLeak(RuntimeError):
    """Processes of a sandbox slot survive SIGKILL: the slot must not run another call."""


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:  # the process ended meanwhile, or we may not read it
        return None


def _pids() -> Iterable[int]:
    try:
        names = os.listdir(PROC)
    except OSError:
        return ()
    return (int(name) for name in names if name.isdigit())


def _live_real_uid(pid: int) -> int | None:
    """Real uid of a live (non-zombie) process, None when gone, a zombie or unreadable."""
    status = _read(f"{PROC}/{pid}/status")
    if status is None:
        return None
    uid = None
    for line in status.splitlines():
        if line.startswith(b"State:") and b"Z" in line.split()[1]:
            return None
        if line.startswith(b"Uid:"):
            uid = int(line.split()[1])
    return uid


def owned_pids(uid: int | None = None, marker: str | None = None, exclude: Iterable[int] = ()) -> list[int]:
    """Live processes running under real ``uid`` or whose initial environment holds
    ``marker`` (an exact ``NAME=value`` entry), except ``exclude`` and ourselves."""
    if uid is None and marker is None:
        return []
    skip = {os.getpid(), *exclude}
    token = marker.encode() if marker else None
    found = []
    for pid in _pids():
        if pid in skip:
            continue
        real_uid = _live_real_uid(pid)
        if real_uid is None:
            continue
        if uid is not None and real_uid == uid:
            found.append(pid)
        elif token is not None:
            environ = _read(f"{PROC}/{pid}/environ")
            if environ is not None and token in environ.split(b"\0"):
                found.append(pid)
    return found


def kill_owned(uid: int | None, marker: str | None, settle_s: float = 2.0) -> int:
    """SIGKILL every process owned by the run (see :func:`owned_pids`) until none is left
    alive; returns how many were killed. Repeats because a process may fork between the
    scan and the kill (its children inherit the uid and the marker).

    Raises :class:`SlotLeak` naming the pids when some survive ``settle_s`` seconds of killing:
    the caller must not reuse that uid for another run."""
    killed: set[int] = set()
    deadline = time.monotonic() + settle_s
    while True:
        pids = owned_pids(uid, marker)
        if not pids:
            return len(killed)
        if time.monotonic() > deadline:
            raise SlotLeak(f"sandbox processes survive SIGKILL for {settle_s} s: pids {sorted(pids)} "
                               f"(uid {uid}, marker {marker}); this sandbox slot must not be reused")
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.add(pid)
            except ProcessLookupError:
                pass
            except PermissionError:
                log.warning("may not kill leftover sandbox process %d (uid %s)", pid, uid)
        time.sleep(0.01)
