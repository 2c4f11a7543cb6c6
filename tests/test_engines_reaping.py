"""vLLM's TP workers die with their rank (libra_hpc/engines/rollout/reaping.py): a killed
rank must not leave a worker spinning on a core or holding the job step's output."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from libra_hpc.engines.rollout import reaping

CHILD = textwrap.dedent("""
    import multiprocessing, os, sys, time
    from libra_hpc.engines.rollout.reaping import die_with_parent

    def work(bound):
        if bound:
            die_with_parent()
        time.sleep(600)

    if __name__ == "__main__":
        ctx = multiprocessing.get_context(sys.argv[1])
        child = ctx.Process(target=work, args=(sys.argv[2] == "bound",))
        child.start()
        with open(sys.argv[3], "w") as f:
            f.write(str(child.pid))
        time.sleep(1.0)  # the child has called die_with_parent by now (or is about to: then it dies at once)
        os.kill(os.getpid(), 9)  # the rank is killed: no Python exit path runs
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _orphan_of_killed_parent(tmp_path, method: str, bound: bool) -> int:
    script = tmp_path / "parent.py"
    script.write_text(CHILD)
    pid_file = tmp_path / "child.pid"
    # no pipe to the parent: an orphan would hold it open (what held Slurm's step output)
    done = subprocess.run([sys.executable, str(script), method, "bound" if bound else "free", str(pid_file)],
                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=120)
    assert done.returncode == -signal.SIGKILL
    return int(pid_file.read_text())


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_bound_child_dies_with_its_killed_parent(tmp_path, method):
    pid = _orphan_of_killed_parent(tmp_path, method, bound=True)
    for _ in range(300):  # the kernel sends the signal as the parent exits; allow a slow reap
        if not _alive(pid):
            break
        time.sleep(0.1)
    else:
        os.kill(pid, signal.SIGKILL)
        pytest.fail(f"child {pid} outlived its killed parent")


def test_an_unbound_child_outlives_its_killed_parent(tmp_path):
    """The control: without the request the orphan lives on (what vLLM's workers did)."""
    pid = _orphan_of_killed_parent(tmp_path, "fork", bound=False)
    try:
        assert _alive(pid)
    finally:
        os.kill(pid, signal.SIGKILL)


def test_vllms_worker_entry_is_wrapped_once_and_reaches_the_worker_by_name(monkeypatch):
    from vllm.v1.executor.multiproc_executor import WorkerProc

    original = WorkerProc.__dict__["worker_main"]
    monkeypatch.setattr(WorkerProc, "worker_main", original)  # restored after the test
    monkeypatch.setattr(reaping, "_original", None)
    assert reaping.bind_workers_to_parent() and reaping.bind_workers_to_parent()
    assert WorkerProc.worker_main is reaping.worker_main
    assert reaping._original is original.__func__  # wrapped once, not around itself
    # multiprocessing pickles the target by name: a spawned worker imports the wrapper
    assert pickle.loads(pickle.dumps(WorkerProc.worker_main)) is reaping.worker_main

    calls = []
    monkeypatch.setattr(reaping, "_original", lambda *a, **k: calls.append((a, k)) or "ran")
    monkeypatch.setattr(reaping, "die_with_parent", lambda: calls.append("bound"))
    before = signal.getsignal(signal.SIGUSR2)
    try:
        assert reaping.worker_main(1, vllm_config=None) == "ran"
        # Slurm's time-limit warning no longer kills a TP worker (the rank handles it)
        assert signal.getsignal(signal.SIGUSR2) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGUSR2, before)
    assert calls == ["bound", ((1,), {"vllm_config": None})]  # bound before vLLM's code runs
