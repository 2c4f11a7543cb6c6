"""Heartbeats, the watchdog and the post-mortem (libra_hpc/runtime/heartbeat.py), the
requeue decision, and tool fault injection: on files and processes of this host, no MPI."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from libra_hpc.metrics.runlog import read_jsonl
from libra_hpc.runtime import heartbeat as hb
from libra_hpc.runtime.resume import requeue_refusal


def _beat(folder, rank, **fields):
    folder.mkdir(parents=True, exist_ok=True)
    record = {"rank": rank, "slot": f"n{rank}g0", "t": time.time(), "pid": 1, "host": "h", "role": "trainer",
              "activity": "training batch 3", "since": time.time() - 4, **fields}
    hb.beat_path(folder, rank).write_text(json.dumps(record))


def test_a_rank_beats_with_its_role_and_last_activity(tmp_path):
    hb.note("trainer: training batch 7", role="trainer")
    beat = hb.Heartbeat(tmp_path, 3, interval_s=0.05, timeout_s=0, slot="n1g1").start()
    try:
        time.sleep(0.2)
        got = hb.read_beat(tmp_path, 3)
    finally:
        beat.close()
    assert got["role"] == "trainer" and got["slot"] == "n1g1" and got["activity"] == "trainer: training batch 7"
    assert time.time() - got["t"] < 1.0


def test_the_watchdog_names_the_worker_that_fell_silent(tmp_path):
    dog = hb.Watchdog(tmp_path, [1, 2], lambda r: {"slot": f"n{r}g0", "node": r}, interval_s=1, timeout_s=5,
                      on_lost=lambda lost: None)
    _beat(tmp_path, 1)
    _beat(tmp_path, 2)
    assert dog.check(5) is None
    dog.started -= 60  # as if the watchdog had been up for a minute
    _beat(tmp_path, 2, t=time.time() - 20)
    lost = dog.check(5)
    assert lost["rank"] == 2 and lost["role"] == "trainer" and lost["how"] == "stopped answering"
    line = hb.describe_lost(lost)
    assert line.startswith("rank 2 (trainer on slot n2g0, node 2") and "no heartbeat for 20 s" in line
    assert "its last activity: training batch 3 (for 4 s)" in line


def test_a_beat_left_by_an_earlier_run_counts_for_nothing(tmp_path):
    _beat(tmp_path, 1, t=time.time() - 3600)
    dog = hb.Watchdog(tmp_path, [1], lambda r: {}, interval_s=1, timeout_s=5, on_lost=lambda lost: None)
    assert dog.check(5) is None  # silent for an hour, but only seconds since this watchdog started


def test_the_watchdog_names_a_dead_local_process_at_once(tmp_path):
    import socket

    hb.standing_down.clear()  # another test of this process may have shut a world down
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    seen = []
    dog = hb.Watchdog(tmp_path, [4], lambda r: {"slot": "n2g0", "node": 2}, interval_s=0.2, timeout_s=30,
                      on_lost=seen.append)
    _beat(tmp_path, 4, pid=child.pid, host=socket.gethostname(), role="leader")
    dog.check(30)  # notes the local worker's pid
    dog.start()
    try:
        child.kill()
        child.wait()
        deadline = time.monotonic() + 5
        while not seen and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        dog.close()
    assert seen and seen[0]["rank"] == 4 and seen[0]["role"] == "leader" and "died" in seen[0]["how"]


def test_the_post_mortem_names_the_task_srun_reports_dead(tmp_path):
    beats = tmp_path / "heartbeats"
    for r in range(4):
        _beat(beats, r, role="leader" if r == 3 else "trainer", activity=f"rank {r} busy")
    (tmp_path / "events.jsonl").write_text(json.dumps({"kind": "world_started"}) + "\n")
    output = "srun: error: node-2: task 3: Killed\nsrun: error: node-0: tasks 0-2: Terminated\n"
    line = hb.post_mortem(tmp_path, output, {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1"}, True, 3)
    assert line.startswith("rank 3 (leader on slot n3g0") and "reported by srun on node-2" in line
    assert "its last activity: rank 3 busy" in line
    events = read_jsonl(tmp_path / "events.jsonl")
    assert [e["kind"] for e in events] == ["world_started", "rank_lost", "failure"] and events[1]["requeue"]
    assert "job 77: rank 3" in (tmp_path / "REQUEUE").read_text()
    # said once: a second post-mortem of the same run repeats the line and writes nothing
    assert hb.post_mortem(tmp_path, output, {}, True, 3) == line and len(read_jsonl(tmp_path / "events.jsonl")) == 3


def test_the_post_mortem_asks_no_requeue_when_slurm_itself_ended_the_world(tmp_path):
    """``scontrol requeue`` (or the time limit, or scancel) kills every task: srun then
    reports them as Terminated. Naming one as lost and asking for a requeue would requeue
    the job a second time, after its next run finished (CI saw a job run four times)."""
    for r in range(3):
        _beat(tmp_path / "heartbeats", r)
    (tmp_path / "events.jsonl").write_text(json.dumps({"kind": "world_started"}) + "\n")
    output = ("srun: Job step aborted: Waiting up to 7 seconds for job step to finish.\n"
              "slurmstepd-node1: error: *** JOB 17 ON node1 CANCELLED AT 2026-11-26T04:49:12 DUE TO JOB REQUEUE ***\n"
              "srun: error: node1: task 2: Terminated\n")
    line = hb.post_mortem(tmp_path, output, {"SLURM_JOB_ID": "17", "SLURM_RESTART_COUNT": "1"}, True, 3)
    assert line.startswith("Slurm ended the world (JOB REQUEUE)")
    assert not (tmp_path / "REQUEUE").exists()
    assert [e["kind"] for e in read_jsonl(tmp_path / "events.jsonl")] == ["world_started", "stopped_by_slurm"]
    assert hb.slurm_ended("*** STEP 5.0 ON n1 CANCELLED AT 2026-11-26T04:49:12 ***") == "cancelled"
    assert hb.slurm_ended("*** JOB 5 ON n1 CANCELLED AT 2026-11-26T04:49:12 DUE TO TIME LIMIT ***") == "TIME LIMIT"
    assert hb.slurm_ended("srun: error: node1: task 2: Killed") is None


def test_the_post_mortem_adds_nothing_when_the_run_said_why(tmp_path):
    _beat(tmp_path / "heartbeats", 1)
    (tmp_path / "events.jsonl").write_text(
        "\n".join(json.dumps(e) for e in ({"kind": "world_started"}, {"kind": "failure", "error": "x"})) + "\n")
    assert hb.post_mortem(tmp_path, "srun: error: n: task 1: Killed\n", {}, True, 3) is None
    assert hb.post_mortem(tmp_path.parent, "no srun here", {}, True, 3) is None


@pytest.mark.parametrize("environ, requeue, limit, why", [
    ({}, True, 3, "not under Slurm"),
    ({"SLURM_JOB_ID": "5"}, False, 3, "cluster.requeue is off"),
    ({"SLURM_JOB_ID": "5", "SLURM_RESTART_COUNT": "3"}, True, 3, "requeued 3 times already"),
    ({"SLURM_JOB_ID": "5", "SLURM_RESTART_COUNT": "2"}, True, 3, None),
])
def test_a_job_requeues_itself_at_most_max_requeues_times(environ, requeue, limit, why):
    said = requeue_refusal(environ, requeue, limit)
    assert said == why or (why is not None and said.startswith(why))


def test_injected_tool_faults_follow_their_rates_and_the_rest_run():
    from libra_hpc.tools.orchestrator import ChaosRunner, InjectedFault

    class Echo:
        def run(self, unit, payload):
            return payload

    chaos = ChaosRunner(Echo(), fail_rate=0.1, hang_rate=0.05, hang_s=0.0, seed=1)
    outcomes = {"ok": 0, "fault": 0}
    for k in range(2000):
        try:
            assert chaos.run(0, k) == k
            outcomes["ok"] += 1
        except InjectedFault:
            outcomes["fault"] += 1
    assert chaos.injected["fail"] + chaos.injected["hang"] == outcomes["fault"]
    assert 150 < chaos.injected["fail"] < 250 and 60 < chaos.injected["hang"] < 140
    with pytest.raises(ValueError, match="> 1"):
        ChaosRunner(Echo(), 0.7, 0.4, 0.0)
