"""SIGTERM to a rank (``scancel``, ``scontrol requeue``): no process the rank started may
outlive it (vLLM's TP workers shut down slowly on SIGTERM, and once orphaned, Slurm's
``proctrack/linuxproc`` no longer finds them to send SIGKILL)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

RANK = """
import signal, subprocess, sys, time
from libra_hpc.runtime.signals import end_children_with_this_rank
end_children_with_this_rank()
# a child that ignores SIGTERM, with a grandchild of its own (a TP worker's helper)
child = subprocess.Popen([sys.executable, "-c",
    "import signal, subprocess, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    "g = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
    "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(120)']); "
    "print(g.pid, flush=True); time.sleep(120)"], stdout=subprocess.PIPE, text=True)
grandchild = int(child.stdout.readline())
print(child.pid, grandchild, flush=True)
while True:
    time.sleep(0.05)  # the rank's main loop
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] != "Z"
    except OSError:
        return False


def test_sigterm_kills_the_ranks_descendants_and_the_rank_dies_of_it():
    rank = subprocess.Popen([sys.executable, "-c", RANK], stdout=subprocess.PIPE, text=True)
    child, grandchild = map(int, rank.stdout.readline().split())
    try:
        assert _alive(child) and _alive(grandchild)
        rank.send_signal(signal.SIGTERM)
        assert rank.wait(timeout=10) == -signal.SIGTERM  # the launcher still sees "terminated"
        deadline = time.monotonic() + 5
        while (_alive(child) or _alive(grandchild)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child) and not _alive(grandchild)
    finally:
        for pid in (child, grandchild):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

