"""Shared-memory segments a killed job left in ``/dev/shm``, removed at the next start.

A rank killed with ``kill -9`` (a fault, ``scancel``, a requeue) cannot unlink what it
created in ``/dev/shm``: vLLM's message queues between an instance's TP workers
(Python ``SharedMemory``: ``psm_*``) and the semaphores of its worker processes
(``sem.mp-*``), MPICH's intra-node channels (``mpich_shm_*``) and
torch's tensors passed between processes (``torch_*``). They hold RAM until the node
reboots; 234 of them were seen after a day of tests (444 on this machine after another,
most of them sparse: 0.6 GB of RAM, 16 GB apparent), and a later job's TP-2 instance
hung once. Nodes are shared, so a segment is removed only when it is

- owned by this user (another user's files are never touched),
- named as one of the kinds above (:data:`PATTERNS`),
- older than ``min_age_s`` (a segment being created is not mapped yet), and
- neither mapped nor held open by any live process this user can see (its creator and
  every process that attached are gone: a live job of this user on the node, or a test
  beside it, keeps its segments; another user's process cannot open a ``0600`` file of
  ours).

Pure file handling: no MPI, no torch. :func:`remove_stale` is called once per node at the
start of every job (``libra_hpc.run``), and by ``scripts/site_check.py``.
"""

from __future__ import annotations

import fnmatch
import os
import time
from collections.abc import Callable, Iterable
from pathlib import Path

SHM = Path("/dev/shm")
PATTERNS = ("psm_*", "sem.mp-*", "mpich_shm_*", "torch_*", "vllm*")
MIN_AGE_S = 60.0


def in_use(proc: Path = Path("/proc"), shm: Path = SHM) -> set[str]:
    """Names under ``shm`` that a live process maps (``/proc/<pid>/maps``) or holds open
    (``/proc/<pid>/fd``); processes this user cannot read are skipped (they cannot hold
    this user's ``0600`` segments)."""
    prefix = str(shm).rstrip("/") + "/"
    used: set[str] = set()
    for pid_dir in proc.iterdir():
        if not pid_dir.name.isdigit():
            continue
        try:
            for line in (pid_dir / "maps").read_text(errors="replace").splitlines():
                parts = line.split(maxsplit=5)  # address perms offset device inode [path]
                path = parts[5] if len(parts) == 6 else ""
                if path.startswith(prefix):
                    used.add(path[len(prefix):].split(" ")[0])
            for fd in (pid_dir / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith(prefix):
                    used.add(target[len(prefix):].split(" ")[0])
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return used


def stale(entries: Iterable[tuple[str, int, float]], *, uid: int, used: set[str], now: float,
          min_age_s: float = MIN_AGE_S, patterns: Iterable[str] = PATTERNS) -> list[str]:
    """Which of ``entries`` (name, owner uid, modification time) are stale by the rules in
    the module docstring."""
    patterns = tuple(patterns)
    return sorted(name for name, owner, mtime in entries
                  if owner == uid and name not in used and now - mtime >= min_age_s
                  and any(fnmatch.fnmatchcase(name, p) for p in patterns))


def remove_stale(shm: Path = SHM, *, uid: int | None = None, min_age_s: float = MIN_AGE_S,
                 clock: Callable[[], float] = time.time, proc: Path = Path("/proc"),
                 dry_run: bool = False) -> tuple[list[str], int]:
    """Remove the stale segments under ``shm``: their names, and the bytes of RAM freed."""
    uid = os.getuid() if uid is None else uid
    entries, sizes = [], {}
    try:
        listing = list(shm.iterdir())
    except OSError:
        return [], 0
    for path in listing:
        try:
            st = path.lstat()
        except OSError:
            continue
        if path.is_file() and not path.is_symlink():
            entries.append((path.name, st.st_uid, st.st_mtime))
            sizes[path.name] = st.st_blocks * 512  # the RAM it holds (segments are sparse)
    gone = stale(entries, uid=uid, used=in_use(proc, shm), now=clock(), min_age_s=min_age_s)
    removed = []
    for name in gone:
        if not dry_run:
            try:
                (shm / name).unlink()
            except OSError:  # another rank of this node removed it first
                continue
        removed.append(name)
    return removed, sum(sizes[n] for n in removed)
