"""Sandbox slot uids: refuse uids of real accounts, and hold each slot exclusively.

A slot's uid is killed wholesale (every live process of it) when a Sandbox starts and
after each call, so it must belong to nobody on the host and be used by one Sandbox at a
time, across every process of the host. Exclusivity is an ``flock`` on
``<lock_dir>/uid-<uid>.lock`` held for the Sandbox's life; the kernel drops it when the
holder exits, however it exits, so a crashed run never blocks a slot.
"""

from __future__ import annotations

import fcntl
import logging
import os
import pwd

log = logging.getLogger(__name__)

DEFAULT_LOCK_DIR = "/run/libra_sandbox"


class SlotBusy(RuntimeError):
    """Another Sandbox (in this or another process) holds the slot uid."""


def check_unassigned(uid: int) -> None:
    """ValueError when ``uid`` is in the password database (a real account, or a system one)."""
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        return
    raise ValueError(f"sandbox slot uid {uid} belongs to the account {entry.pw_name!r} (password database); every "
                     "process of a slot uid is killed after each call: set tools.uid_base so that uid_base .. "
                     "uid_base + max_workers - 1 are unassigned")


class SlotLock:
    """An exclusive, non-blocking ``flock`` on slot ``uid`` under ``lock_dir`` (made 0700)."""

    def __init__(self, uid: int, lock_dir: str = DEFAULT_LOCK_DIR):
        try:
            os.makedirs(lock_dir, mode=0o700, exist_ok=True)
        except OSError as err:
            raise RuntimeError(f"tools.lock_dir: cannot create {lock_dir}: {err}") from err
        self.path = os.path.join(lock_dir, f"uid-{uid}.lock")
        self.uid = uid
        self._fd: int | None = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(self._fd)
            self._fd = None
            raise SlotBusy(f"sandbox slot uid {uid} is in use by another Sandbox (lock {self.path} held); "
                           "use another tools.uid_base or unit, or wait for that run to end") from None
        os.ftruncate(self._fd, 0)
        os.write(self._fd, f"{os.getpid()}\n".encode())

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor drops the flock
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def __del__(self):
        self.release()
