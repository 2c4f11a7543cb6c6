"""rlimit mode: remove what a slot uid left on the host after a call.

A bwrap sandbox only ever writes to its own tmpfs and IPC namespace, which die with it. The
rlimit fallback runs on the host: a snippet can leave files in world-writable directories
(``/tmp``, ``/var/tmp``, ``/dev/shm``, ``/run/lock``, ...) and System V IPC objects (shared
memory, message queues, semaphores) that the next call of the same slot, or of another,
could read. After every call we delete every such file owned by the slot uid (up to
:data:`MAX_DEPTH` levels of world-writable directories below the roots) and every IPC
object the uid owns or created.

Not covered (documented under ``tools.isolation``): data written *into* existing
world-writable files, and files in world-writable directories deeper than MAX_DEPTH or not
below :func:`world_writable_dirs`.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import stat
import subprocess

log = logging.getLogger(__name__)

KNOWN_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/var/lock", "/dev/mqueue")
SCANNED_PARENTS = ("/", "/var", "/run", "/dev", "/var/lib", "/var/cache")
MAX_DEPTH = 3
SYSV_IPC = {"shm": "-m", "msg": "-q", "sem": "-s"}
"""/proc/sysvipc table -> the ipcrm option that removes one of its objects by id."""


@functools.lru_cache(maxsize=1)
def world_writable_dirs() -> tuple[str, ...]:
    """The host's world-writable directories: the usual ones and any world-writable child of
    :data:`SCANNED_PARENTS` (found once per process), without duplicates through links."""
    found: dict[str, str] = {}
    candidates = list(KNOWN_WRITABLE)
    for parent in SCANNED_PARENTS:
        try:
            candidates += [entry.path for entry in os.scandir(parent)]
        except OSError:
            continue
    for path in candidates:
        try:
            info = os.stat(path)
        except OSError:
            continue
        if stat.S_ISDIR(info.st_mode) and info.st_mode & stat.S_IWOTH:
            found.setdefault(os.path.realpath(path), path)
    return tuple(sorted(found))


def remove_files_of(uid: int, roots: tuple[str, ...] | None = None) -> int:
    """Delete every entry owned by ``uid`` in ``roots`` (default: world_writable_dirs()) and
    in the world-writable directories below them (to MAX_DEPTH); returns how many."""
    removed = 0
    for root in roots if roots is not None else world_writable_dirs():
        removed += _remove_in(root, uid, MAX_DEPTH)
    return removed


def _remove_in(folder: str, uid: int, depth: int) -> int:
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return 0
    removed = 0
    for entry in entries:
        try:
            info = entry.stat(follow_symlinks=False)
            if info.st_uid == uid:
                if stat.S_ISDIR(info.st_mode):
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)
                removed += 1
            elif depth > 1 and stat.S_ISDIR(info.st_mode) and info.st_mode & stat.S_IWOTH:
                removed += _remove_in(entry.path, uid, depth - 1)
        except OSError as err:
            log.warning("could not remove %s left by sandbox uid %d: %s", entry.path, uid, err)
    return removed


def sysv_ipc_of(uid: int) -> list[tuple[str, int]]:
    """``(table, id)`` of the System V IPC objects (``shm``, ``msg``, ``sem``) that ``uid``
    owns or created, from /proc/sysvipc (our IPC namespace)."""
    found = []
    for table in SYSV_IPC:
        try:
            with open(f"/proc/sysvipc/{table}", encoding="ascii") as f:
                header, *rows = [line.split() for line in f]
        except (OSError, ValueError):
            continue
        col_id, col_uid, col_cuid = header.index(f"{table}id" if table != "msg" else "msqid"), header.index("uid"), \
            header.index("cuid")
        found += [(table, int(row[col_id])) for row in rows
                  if len(row) > col_cuid and uid in (int(row[col_uid]), int(row[col_cuid]))]
    return found


def remove_sysv_ipc_of(uid: int) -> int:
    """Remove ``uid``'s System V IPC objects (``ipcrm``, util-linux); returns how many."""
    objects = sysv_ipc_of(uid)
    for table, ident in objects:
        done = subprocess.run(["ipcrm", SYSV_IPC[table], str(ident)], capture_output=True, text=True, check=False)
        if done.returncode != 0:
            log.warning("could not remove System V %s %d of sandbox uid %d: %s", table, ident, uid, done.stderr.strip())
    return len(objects)
