"""Heartbeats, the watchdog and the post-mortem (libra_hpc/runtime/heartbeat.py), the
requeue decision, and tool fault injection: on files and processes of this host, no MPI.

No assertion depends on how fast the machine is: the heartbeat module's wall clock is
frozen (``clock``) where a test reads ages, and the beating and watching threads run
their real loops with a stand-in for the event they wait on (:class:`Waits`: each wait
returns at once, and the test says when the loop stops), so "every interval" and "at
once" are asserted as "at each wait" and "at the first look"."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import types

import pytest

from libra_hpc.metrics.runlog import read_jsonl
from libra_hpc.runtime import heartbeat as hb
from libra_hpc.runtime.resume import requeue_refusal

NOW = 1_800_000_000.0
"""The frozen wall clock of :func:`clock` (seconds since the epoch)."""


class Clock:
    def __init__(self):
        self.now = NOW

    def time(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    """``time.time()`` as the heartbeat module sees it, frozen at :data:`NOW` (and moved
    by hand); the rest of ``time`` is the real one."""
    frozen = Clock()
    patched = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if not k.startswith("_")})
    patched.time = frozen.time
    monkeypatch.setattr(hb, "time", patched)
    return frozen


class Waits:
    """Stands in for the ``threading.Event`` a heartbeat or watchdog loop waits on:
    ``wait(timeout)`` notes the timeout, calls ``between(k)`` (k: the waits before this
    one) and returns at once, ``True`` (stop) from the ``stop_at``-th wait on, else
    ``False`` (go on); ``is_set`` says whether that point was reached."""

    def __init__(self, stop_at: int, between=lambda k: None):
        self.stop_at, self.between, self.timeouts = stop_at, between, []

    def wait(self, timeout=None) -> bool:
        self.between(len(self.timeouts))
        self.timeouts.append(timeout)
        return self.is_set()

    def is_set(self) -> bool:
        return len(self.timeouts) > self.stop_at

    def set(self) -> None:
        self.stop_at = -1


def _beat(folder, rank, now=NOW, **fields):
    folder.mkdir(parents=True, exist_ok=True)
    record = {"rank": rank, "slot": f"n{rank}g0", "t": now, "pid": 1, "host": "h", "role": "trainer",
              "activity": "training batch 3", "since": now - 4, **fields}
    hb.beat_path(folder, rank).write_text(json.dumps(record))


def test_a_rank_beats_with_its_role_and_last_activity_at_every_interval(tmp_path):
    before = time.time()
    hb.note("trainer: training batch 7", role="trainer")
    seen = []

    def between(k):  # the thread, waiting: what the last beat said; then the rank moves on
        seen.append(hb.read_beat(tmp_path, 3))
        hb.note(f"trainer: training batch {8 + k}")

    beat = hb.Heartbeat(tmp_path, 3, interval_s=30, timeout_s=0, slot="n1g1")
    beat._stop = Waits(stop_at=3, between=between)
    beat.start()  # the first beat is written before start() returns, then the thread beats 3 times
    beat._thread.join()
    assert beat._stop.timeouts == [30] * 4  # one interval's wait before each beat, and before stopping
    assert [b["activity"] for b in seen] == [f"trainer: training batch {n}" for n in (7, 8, 9, 10)]
    assert all(b["role"] == "trainer" and b["slot"] == "n1g1" and b["rank"] == 3 for b in seen)
    assert all(before <= b["since"] <= b["t"] <= time.time() for b in seen)


def test_a_worker_whose_controller_fell_silent_gives_up_at_its_first_beat_past_the_timeout(tmp_path, clock):
    lost = []
    beat = hb.Heartbeat(tmp_path, 2, interval_s=1, timeout_s=5, slot="n0g2", on_controller_lost=lost.append)
    beat.started = NOW - 60  # as if the worker had been up for a minute
    _beat(tmp_path, 0)  # the controller beat just now

    def between(k):  # rank 0 beats at first, then is silent: 3 s, then 6 s since its last beat
        clock.now = NOW + (0, 3, 6, 9)[k]

    beat._stop = Waits(stop_at=10, between=between)
    beat.start()
    beat._thread.join()
    assert len(beat._stop.timeouts) == 3 and len(lost) == 1  # silent 0 s, 3 s: beats on; 6 s > 5 s: gives up
    assert lost[0] == ("rank 2: the controller (rank 0) has not beaten for 6 s (job.heartbeat_timeout_s=5); "
                       "exiting")


def test_the_watchdog_names_the_worker_that_fell_silent(tmp_path, clock):
    dog = hb.Watchdog(tmp_path, [1, 2], lambda r: {"slot": f"n{r}g0", "node": r}, interval_s=1, timeout_s=5,
                      on_lost=lambda lost: None)
    _beat(tmp_path, 1)
    _beat(tmp_path, 2)
    assert dog.check(5) is None
    dog.started -= 60  # as if the watchdog had been up for a minute
    _beat(tmp_path, 2, now=NOW - 20)
    assert dog.check(20) is None  # silent exactly 20 s: not past a 20 s timeout
    lost = dog.check(5)
    assert lost["rank"] == 2 and lost["role"] == "trainer" and lost["how"] == "stopped answering"
    assert lost["silent_s"] == 20 and lost["activity_for_s"] == 24
    line = hb.describe_lost(lost)
    assert line.startswith("rank 2 (trainer on slot n2g0, node 2") and "no heartbeat for 20 s" in line
    assert "its last activity: training batch 3 (for 24 s)" in line


def test_a_beat_left_by_an_earlier_run_counts_for_nothing(tmp_path, clock):
    """A worker's first beat of a run may take FIRST_BEAT_FACTOR timeouts (a loaded node);
    past that it is lost, and the beat an earlier run left does not describe it."""
    _beat(tmp_path, 1, now=NOW - 3600, activity="saving the checkpoint of version 4")
    dog = hb.Watchdog(tmp_path, [1], lambda r: {}, interval_s=1, timeout_s=5, on_lost=lambda lost: None)
    assert dog.check(5) is None  # silent for an hour, but not since this watchdog started
    clock.now += 5.5
    assert dog.check(5) is None  # past the timeout, but it has not beaten in this run yet
    clock.now += 5 * hb.FIRST_BEAT_FACTOR - 5.5 + 0.5  # 15.5 s since the watchdog started
    lost = dog.check(5)
    assert lost["rank"] == 1 and lost["how"] == "never beat in this run" and lost["silent_s"] == 15.5
    assert lost["last_activity"] == "never beat" and "checkpoint" not in hb.describe_lost(lost)


def test_once_a_worker_has_beaten_the_plain_timeout_holds(tmp_path, clock):
    dog = hb.Watchdog(tmp_path, [1, 2], lambda r: {}, interval_s=1, timeout_s=5, on_lost=lambda lost: None)
    _beat(tmp_path, 1, now=NOW + 1)
    clock.now += 6.5  # rank 1 silent 5.5 s since its beat; rank 2 never beat (6.5 s, under 15)
    lost = dog.check(5)
    assert lost["rank"] == 1 and lost["how"] == "stopped answering"


def test_a_worker_still_starting_has_the_first_beats_grace(tmp_path, clock):
    """A starting rank's beating thread may wait on the GIL a native call holds (a shared
    library loading): until its main thread says what it does, FIRST_BEAT_FACTOR timeouts."""
    dog = hb.Watchdog(tmp_path, [1, 2], lambda r: {}, interval_s=1, timeout_s=5, on_lost=lambda lost: None)
    _beat(tmp_path, 1, now=NOW + 1, activity=hb.STARTING)
    _beat(tmp_path, 2, now=NOW + 1, activity="trainer: training batch 4")
    clock.now += 7  # both silent 6 s: rank 2 said what it does, rank 1 is still starting
    assert dog.check(5)["rank"] == 2
    _beat(tmp_path, 2, now=NOW + 7, activity="trainer: training batch 4")
    assert dog.check(5) is None  # rank 1: 6 s of its 15
    clock.now += 9.5  # rank 1 silent 15.5 s since its beat
    _beat(tmp_path, 2, now=clock.now, activity="trainer: training batch 5")
    lost = dog.check(5)
    assert lost["rank"] == 1 and lost["how"] == "stopped answering" and lost["last_activity"] == hb.STARTING


def test_the_watchdog_names_a_worker_that_beats_but_makes_no_progress(tmp_path, clock):
    """A rank hung in Python: its heartbeat thread beats on, its loop has not gone round
    for longer than job.progress_timeout_s; a rank waiting for others is not hung."""
    dog = hb.Watchdog(tmp_path, [1, 2, 3], lambda r: {"slot": f"n{r}g0", "node": r}, interval_s=1, timeout_s=5,
                      on_lost=lambda lost: None, progress_timeout_s=300)
    dog.started -= 3600
    _beat(tmp_path, 1, progress=NOW - 1, waiting=False)
    _beat(tmp_path, 2, progress=NOW - 900, waiting=True, activity="trainer: waiting for batch 4's 3 groups")
    _beat(tmp_path, 3, progress=NOW - 300, waiting=False, activity="trainer: training batch 4")
    assert dog.check(5) is None  # every one beats
    assert dog.check_progress(300, NOW) is None  # rank 3: exactly 300 s, not past it; rank 2 waits
    lost = dog.check_progress(300, NOW + 30)
    assert lost["rank"] == 3 and lost["silent_s"] is None and lost["last_activity"] == "trainer: training batch 4"
    line = hb.describe_lost(lost)
    assert "made no progress for 330 s while its heartbeat went on (hung? job.progress_timeout_s=300)" in line
    assert "its last activity: trainer: training batch 4" in line
    _beat(tmp_path, 4, progress=NOW - 900, waiting=False)  # not a worker of this job
    _beat(tmp_path, 1, now=NOW - 7200, progress=NOW - 7200, waiting=False)  # its beat is older than the watchdog
    assert dog.check_progress(300, NOW + 30)["rank"] == 3


def test_a_ranks_notes_and_loop_turns_are_its_progress(tmp_path, clock):
    hb.note("trainer: training batch 1")
    assert hb._state["progress"] == NOW and hb._state["waiting"] is False
    clock.now += 10
    hb.note("trainer: waiting for batch 2's 3 groups", waiting=True)
    clock.now += 10
    hb.progressed()
    assert hb._state["progress"] == NOW + 20 and hb._state["waiting"] is True and hb._state["since"] == NOW + 10
    hb.Heartbeat(tmp_path, 1, interval_s=1, timeout_s=0, slot="n0g0")._write()
    beat = hb.read_beat(tmp_path, 1)
    assert beat["progress"] == NOW + 20 and beat["waiting"] is True


def test_the_watchdog_names_a_dead_local_process_at_its_first_look(tmp_path):
    """SIGUSR1 from mpiexec (``peer_failed``) wakes the watchdog at once; its first look at
    the local workers' processes names the one that is gone."""
    hb.standing_down.clear()  # another test of this process may have shut a world down
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    seen = []
    dog = hb.Watchdog(tmp_path, [4], lambda r: {"slot": "n2g0", "node": 2}, interval_s=3600, timeout_s=3600,
                      on_lost=seen.append)
    _beat(tmp_path, 4, now=time.time(), pid=child.pid, host=socket.gethostname(), role="leader")
    dog.check(3600)  # notes the local worker's pid
    looks, look = [], dog.check_processes

    def counted():  # at most three looks, then the watchdog is closed (a test that fails ends)
        looks.append(1)
        if len(looks) >= 3:
            dog.close()
        return look()

    dog.check_processes = counted
    child.kill()
    child.wait()
    hb.peer_failed.set()
    try:
        dog.start()
        dog._thread.join()
    finally:
        hb.peer_failed.clear()
    assert len(looks) == 1 and len(seen) == 1, (looks, seen)
    assert seen[0]["rank"] == 4 and seen[0]["role"] == "leader" and "died" in seen[0]["how"]


def test_the_post_mortem_names_the_task_srun_reports_dead(tmp_path, clock):
    beats = tmp_path / "heartbeats"
    for r in range(4):
        _beat(beats, r, role="leader" if r == 3 else "trainer", activity=f"rank {r} busy")
    (tmp_path / "events.jsonl").write_text(json.dumps({"kind": "world_started"}) + "\n")
    output = "srun: error: node-2: task 3: Killed\nsrun: error: node-0: tasks 0-2: Terminated\n"
    line = hb.post_mortem(tmp_path, output, {"SLURM_JOB_ID": "77", "SLURM_RESTART_COUNT": "1"}, True, 3)
    assert line.startswith("rank 3 (leader on slot n3g0") and "reported by srun on node-2" in line
    assert "its last activity: rank 3 busy (for 4 s)" in line
    events = read_jsonl(tmp_path / "events.jsonl")
    assert [e["kind"] for e in events] == ["world_started", "rank_lost", "failure"] and events[1]["requeue"]
    assert "job 77: rank 3" in (tmp_path / "REQUEUE").read_text()
    # said once: a second post-mortem of the same run repeats the line and writes nothing
    assert hb.post_mortem(tmp_path, output, {}, True, 3) == line and len(read_jsonl(tmp_path / "events.jsonl")) == 3


def test_the_post_mortem_asks_no_requeue_when_slurm_itself_ended_the_world(tmp_path, clock):
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


def test_a_step_srun_cancelled_because_a_task_died_is_a_lost_rank_and_requeues(tmp_path, clock):
    """Seen in the soak: a trainer killed with -9; srun ended the step (its plain STEP
    CANCELLED line) before rank 0's watchdog named the rank, and the post-mortem took it for
    a scancel: no requeue, the job failed."""
    for r in range(5):
        _beat(tmp_path / "heartbeats", r, role="trainer", activity=f"rank {r} training")
    (tmp_path / "events.jsonl").write_text(json.dumps({"kind": "world_started"}) + "\n")
    output = ("srun: error: node2: task 3: Killed\n"
              "srun: launch/slurm: _step_signal: Terminating StepId=17000003.0\n"
              "slurmstepd-node1: error: *** STEP 17000003.0 ON node1 CANCELLED AT 2026-11-27T11:40:13 ***\n"
              "srun: error: node4: task 4: Terminated\n")
    line = hb.post_mortem(tmp_path, output, {"SLURM_JOB_ID": "17000003", "SLURM_RESTART_COUNT": "0"}, True, 3)
    assert line.startswith("rank 3 (trainer") and "Killed" in line
    assert [e["kind"] for e in read_jsonl(tmp_path / "events.jsonl")] == ["world_started", "rank_lost", "failure"]
    assert (tmp_path / "REQUEUE").exists()


def test_the_post_mortem_adds_nothing_when_the_run_said_why(tmp_path, clock):
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
