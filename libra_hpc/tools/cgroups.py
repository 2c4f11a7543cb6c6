"""An aggregate memory and process limit for one sandboxed call, through a cgroup.

``RLIMIT_AS`` bounds each process, not the call: 32 processes of 512 MiB may still take
16 GiB together. When this host lets us create cgroups (root, a writable memory and pids
controller: cgroup v1 hierarchies under /sys/fs/cgroup/{memory,pids} or a v2 unified
tree), every call runs in a fresh cgroup with ``memory`` bytes for all its processes
(tmpfs pages it writes included) and ``pids`` processes; the kernel's OOM killer then acts
inside the call only. The cgroup's member list is also the most reliable list of what
the call left behind. Without cgroups the sandbox keeps its rlimits and says so once.

Tested here on cgroup v1; the v2 path follows the kernel's documented interface
(memory.max, memory.swap.max, pids.max, memory.events, cgroup.kill) but has not been
run on this machine.
"""

from __future__ import annotations

import logging
import os
import signal
import time
import uuid
from pathlib import Path

log = logging.getLogger(__name__)

ROOT = Path("/sys/fs/cgroup")
PARENT = "libra_sandbox"
_JOIN = 'for f in "$@"; do case "$f" in --) shift; break;; esac; echo $$ > "$f" || exit 97; shift; done; exec "$@"'
"""Prefix run as root before the sandbox: moves itself into the call's cgroups, then execs
the sandbox, so every process the call starts is born inside (no race with a fork)."""


class CallCgroup:
    """The cgroup(s) of one call. Create with :meth:`create`; always :meth:`remove`."""

    def __init__(self, dirs: list[Path], version: int, memory_bytes: int):
        self.dirs = dirs
        self.version = version
        self.memory_bytes = memory_bytes
        self._oom_before = self._oom_kills()

    @classmethod
    def create(cls, memory_bytes: int, pids: int) -> CallCgroup | None:
        """A fresh cgroup limited to ``memory_bytes`` and ``pids``, or None when this host
        does not let us make one (the reason is logged at debug level)."""
        name = f"call-{uuid.uuid4().hex[:12]}"
        try:
            if (ROOT / "memory" / "cgroup.procs").exists() and (ROOT / "pids" / "cgroup.procs").exists():
                return cls._create_v1(name, memory_bytes, pids)
            if (ROOT / "cgroup.controllers").exists():
                return cls._create_v2(name, memory_bytes, pids)
        except OSError as err:
            log.debug("no cgroup for sandbox calls: %s", err)
        return None

    @classmethod
    def _create_v1(cls, name: str, memory_bytes: int, pids: int) -> CallCgroup:
        mem, pid = ROOT / "memory" / PARENT / name, ROOT / "pids" / PARENT / name
        made = []
        try:
            for d in (mem, pid):
                d.mkdir(parents=True)
                made.append(d)
            (mem / "memory.limit_in_bytes").write_text(str(memory_bytes))
            swap = mem / "memory.memsw.limit_in_bytes"
            if swap.exists():
                swap.write_text(str(memory_bytes))
            (pid / "pids.max").write_text(str(pids))
        except OSError:
            for d in made:
                d.rmdir()
            raise
        return cls([mem, pid], 1, memory_bytes)

    @classmethod
    def _create_v2(cls, name: str, memory_bytes: int, pids: int) -> CallCgroup:
        parent = ROOT / PARENT
        if not parent.exists():
            parent.mkdir()
            (ROOT / "cgroup.subtree_control").write_text("+memory +pids")
            (parent / "cgroup.subtree_control").write_text("+memory +pids")
        leaf = parent / name
        leaf.mkdir()
        try:
            (leaf / "memory.max").write_text(str(memory_bytes))
            if (leaf / "memory.swap.max").exists():
                (leaf / "memory.swap.max").write_text("0")
            (leaf / "pids.max").write_text(str(pids))
        except OSError:
            leaf.rmdir()
            raise
        return cls([leaf], 2, memory_bytes)

    def join_argv(self) -> list[str]:
        """Prefix for the sandbox command line (runs as root, before any privilege drop)."""
        return ["/bin/sh", "-c", _JOIN, "sh", *(str(d / "cgroup.procs") for d in self.dirs), "--"]

    def pids(self) -> list[int]:
        found: set[int] = set()
        for d in self.dirs:
            try:
                found.update(int(p) for p in (d / "cgroup.procs").read_text().split())
            except OSError:
                pass
        return sorted(found)

    def kill_all(self) -> int:
        """SIGKILL every member; returns how many were signalled."""
        members = self.pids()
        for pid in members:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return len(members)

    def oom_killed(self) -> bool:
        """Whether the kernel killed a process of this call for the memory limit."""
        return self._oom_kills() > self._oom_before

    def _oom_kills(self) -> int:
        if self.version == 1:
            control = self.dirs[0] / "memory.oom_control"
            text = control.read_text() if control.exists() else ""
            for line in text.splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
            failcnt = self.dirs[0] / "memory.failcnt"
            return int(failcnt.read_text()) if failcnt.exists() else 0
        events = self.dirs[0] / "memory.events"
        for line in (events.read_text() if events.exists() else "").splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def remove(self) -> None:
        """Kill what is left and delete the cgroup (retried briefly: exiting tasks linger)."""
        for _ in range(200):
            if not self.kill_all():
                break
            time.sleep(0.01)
        for d in self.dirs:
            try:
                d.rmdir()
            except OSError as err:
                log.warning("could not remove sandbox cgroup %s: %s", d, err)
