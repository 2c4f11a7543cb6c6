"""Heartbeats and post-mortems: a rank that dies or stops answering ends the job within
a bounded time, named (rank, role, slot, node, host, last activity).

Every rank runs a small thread that rewrites ``<log folder>/heartbeats/rank-<r>.json``
every ``job.heartbeat_s`` seconds: its role, slot, host, pid, and its last activity (what
its main thread said it was doing, and since when). The files live on the log folder's
file system (shared under Slurm), so beating needs no MPI call, and a rank busy in a long
vLLM or Megatron call keeps beating (both release the GIL).

- **A rank that dies** (``kill -9``, the OOM killer, a crash in native code). Two things
  name it.
  - **Locally**, ``mpiexec -disable-auto-cleanup`` leaves the other ranks running and tells
    them with SIGUSR1 (noted here, where its default action would kill them). Rank 0's
    :class:`Watchdog` looks at the processes of the workers on its host at once, and every
    0.1 s anyway. It writes the ``rank_lost`` event for the one that is gone. Without that
    flag ``mpiexec`` kills every rank within milliseconds, and its report names the first
    process of its proxy, not the one that died.
  - **Under Slurm**, ``srun --kill-on-bad-exit`` ends the step and reports the dead task,
    which is the rank. The launcher runs :func:`post_mortem` once the world has ended
    (``sbatch/libra.sh``, the submitit step, ``launch.py``). When the run wrote no
    ``rank_lost`` or ``failure``, the post-mortem matches srun's report against the beats
    and writes the event.

  Under Slurm the job then asks for a requeue while requeues are left. An MPI job cannot
  shrink in place, so the job comes back whole and resumes from its newest checkpoint.
- **A rank that stops answering without dying** (frozen, stopped, its node cut off). Rank
  0's :class:`Watchdog` thread sees its file age past ``job.heartbeat_timeout_s``. It
  writes the same event, asks for the requeue and aborts the world.
- **A worker whose controller is gone.** Each worker watches rank 0's file the same way
  and exits, so the world does not outlive it.

- **A rank hung in Python code** (a deadlock, a call that never returns) still beats: the
  thread runs. Its main thread says what it does with :func:`note`, at every turn of its
  role loop, and whether it is only waiting for others (a command, its batch's groups);
  the beat carries the time of the last note. Rank 0's watchdog names a worker that is
  not waiting and made no progress for ``job.progress_timeout_s`` (0: off) and ends the
  job the same way as for a dead rank.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import threading
import time
from pathlib import Path
from typing import Callable

log = logging.getLogger(__name__)

STARTING = "starting"
"""A rank's activity until its main thread first says what it does (:func:`note`)."""
_state = {"activity": STARTING, "since": time.time(), "role": "rank", "progress": time.time(), "waiting": False}
peer_failed = threading.Event()
"""Set when the launcher says a process of the world ended (SIGUSR1 from ``mpiexec``)."""
standing_down = threading.Event()
"""Set by the controller before it tells the ranks to stop: ranks that exit from then on
are not lost (:func:`stand_down`)."""


def stand_down() -> None:
    """The world is being shut down on purpose: the watchdog stops looking."""
    standing_down.set()


def install_failure_notice() -> None:
    """SIGUSR1 from ``mpiexec -disable-auto-cleanup``: a process of the world ended. Noted
    (rank 0's watchdog looks at once), not fatal."""
    def _noted(signum, _frame) -> None:
        peer_failed.set()

    signal.signal(signal.SIGUSR1, _noted)


def ignore_failure_notice() -> None:
    """From here on SIGUSR1 is ignored: a rank ending normally makes ``mpiexec`` signal
    the others, and a Python handler is reset to the default (fatal) action while the
    interpreter shuts down."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


def note(activity: str, role: str | None = None, waiting: bool = False) -> None:
    """What this rank's main thread is doing now, and that it made progress (cheap: a few
    assignments). ``waiting``: it now only waits for other ranks (not hung if that lasts)."""
    now = time.time()
    if activity != _state["activity"]:
        _state["activity"], _state["since"] = activity, now
    _state["progress"], _state["waiting"] = now, waiting
    if role is not None:
        _state["role"] = role


def progressed() -> None:
    """This rank's loop went round once more (what it does is unchanged)."""
    _state["progress"] = time.time()


def beat_path(folder: Path, rank: int) -> Path:
    return folder / f"rank-{rank}.json"


def read_beat(folder: Path, rank: int) -> dict | None:
    """A rank's last beat, or None when it has not beaten yet (or its file is being
    replaced right now)."""
    try:
        return json.loads(beat_path(folder, rank).read_text())
    except (OSError, ValueError):
        return None


class Heartbeat:
    """This rank's beating thread; on a worker it also watches rank 0 and calls
    ``on_controller_lost`` (default: exit the process) when rank 0 falls silent."""

    def __init__(self, folder: Path, rank: int, interval_s: float, timeout_s: float, slot: str = "controller",
                 on_controller_lost: Callable[[str], None] | None = None):
        self.folder, self.rank, self.interval_s, self.timeout_s = Path(folder), rank, interval_s, timeout_s
        self.slot = slot
        self.on_controller_lost = on_controller_lost or _exit
        self.started = time.time()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{rank}", daemon=True)

    def start(self) -> Heartbeat:
        self.folder.mkdir(parents=True, exist_ok=True)
        self._write()
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()

    def _write(self) -> None:
        record = {"rank": self.rank, "slot": self.slot, "t": time.time(), "pid": os.getpid(), "host": socket.gethostname(),
                  "role": _state["role"], "activity": _state["activity"], "since": _state["since"],
                  "progress": _state["progress"], "waiting": _state["waiting"]}
        path = beat_path(self.folder, self.rank)
        staging = path.with_suffix(f".{os.getpid()}.tmp")
        staging.write_text(json.dumps(record))
        os.replace(staging, path)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._write()
            except OSError as exc:  # a full or vanished disk must not kill the rank; the watchdog will see
                log.warning("heartbeat of rank %d not written: %s", self.rank, exc)
            if self.rank != 0 and self.timeout_s > 0:
                silent = _silent_s(self.folder, 0, self.started)
                if silent > self.timeout_s:
                    self.on_controller_lost(f"rank {self.rank}: the controller (rank 0) has not beaten for "
                                            f"{silent:.0f} s (job.heartbeat_timeout_s={self.timeout_s:g}); exiting")
                    return


FIRST_BEAT_FACTOR = 3
"""A worker's first beat of a run may come this many heartbeat timeouts after the watchdog
started, and while its beat still says ``starting`` the next may come that late too
(:meth:`Watchdog.check`)."""


def _silent_s(folder: Path, rank: int, started: float) -> float:
    """Seconds since ``rank`` last beat (since ``started`` if it never has)."""
    beat = read_beat(folder, rank)
    if beat is None and beat_path(folder, rank).exists():
        return 0.0  # being replaced this instant
    return time.time() - max(beat["t"] if beat else started, started)  # a beat from an earlier run counts for nothing


def _exit(message: str) -> None:
    log.error(message)
    os._exit(70)


class Watchdog:
    """Rank 0: the workers that died or fell silent. Every ``POLL_S`` it looks at the
    processes of the workers on its own host (from their beats: pid and host), so that a
    death there is named within a fraction of a second, before MPICH tears the world
    down; every ``interval_s`` it reads every worker's beat, and one silent for longer than
    ``timeout_s`` is lost. The first lost worker is described and handed to ``on_lost``
    (which ends the job)."""

    POLL_S = 0.1

    def __init__(self, folder: Path, workers: list[int], describe: Callable[[int], dict], interval_s: float,
                 timeout_s: float, on_lost: Callable[[dict], None], progress_timeout_s: float = 0.0):
        self.folder, self.workers, self.describe = Path(folder), workers, describe
        self.interval_s, self.timeout_s, self.on_lost = interval_s, timeout_s, on_lost
        self.progress_timeout_s = progress_timeout_s
        self.started = time.time()
        self.host = socket.gethostname()
        self.local: dict[int, dict] = {}  # rank → its last beat, for the workers on this host
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()

    def check(self, timeout_s: float) -> dict | None:
        """The worker silent longest past its limit, described; else None. The limit is
        ``timeout_s`` once a worker has beaten in this run and said what it does,
        :data:`FIRST_BEAT_FACTOR` times that before its first beat and while its beats say
        it is still ``starting`` (importing torch, vLLM and Megatron: the world's formation
        has shown every rank alive). A starting rank's beating thread waits for the GIL
        that a long native call of its main thread holds (a shared library loading), and
        on a loaded node that took 30 s twice in CI's job tests: a resume's first beats
        (named from the beat the run before had left), and a check world's rank between
        its first beat and its second, 56 s into its start. Also notes the workers on this
        host (their pids) for :meth:`check_processes`."""
        silent = []
        for rank in self.workers:
            beat = read_beat(self.folder, rank)
            fresh = beat is not None and beat["t"] >= self.started
            if fresh and beat.get("host") == self.host:
                self.local[rank] = beat
            settled = fresh and beat.get("activity") != STARTING
            limit = timeout_s if settled else timeout_s * FIRST_BEAT_FACTOR
            seconds = _silent_s(self.folder, rank, self.started)
            silent.append((seconds - limit, seconds, rank, fresh))
        silent.sort(reverse=True)
        if not silent or silent[0][0] <= 0:
            return None
        _, seconds, rank, fresh = silent[0]
        beat = read_beat(self.folder, rank) if fresh else None
        return {"rank": rank, **self.describe(rank), "silent_s": round(seconds, 1),
                **_from_beat(beat or {}, time.time()),
                "how": "stopped answering" if fresh else "never beat in this run"}

    def check_progress(self, timeout_s: float, now: float) -> dict | None:
        """The worker that is not waiting for others and whose main thread made no progress
        for longest, if that is over ``timeout_s`` (its heartbeat thread may beat on), described."""
        stuck = []
        for rank in self.workers:
            beat = read_beat(self.folder, rank)
            if beat is not None and "progress" in beat and not beat.get("waiting") and beat["t"] >= self.started:
                stuck.append((now - max(beat["progress"], self.started), rank, beat))
        stuck.sort(key=lambda item: item[:2], reverse=True)
        if not stuck or stuck[0][0] <= timeout_s:
            return None
        seconds, rank, beat = stuck[0]
        return {"rank": rank, **self.describe(rank), "silent_s": None, **_from_beat(beat, now),
                "how": f"made no progress for {seconds:.0f} s while its heartbeat went on (hung? "
                       f"job.progress_timeout_s={timeout_s:g})"}

    def check_processes(self) -> dict | None:
        """The one worker on this host whose process is gone (or a zombie), described.
        When several are gone the launcher is already killing the world, and which went
        first is for the post-mortem to say (None here)."""
        gone = [(rank, beat) for rank, beat in sorted(self.local.items()) if not _alive(beat["pid"])]
        if len(gone) != 1:
            return None
        rank, beat = gone[0]
        return {"rank": rank, **self.describe(rank), "silent_s": None, **_from_beat(beat, time.time()),
                "how": f"died (process {beat['pid']} gone, seen by rank 0's watchdog on {self.host})"}

    def _run(self) -> None:
        next_beats = 0.0
        while not self._stop.is_set():
            peer_failed.wait(self.POLL_S)  # wakes at once when the launcher says a process ended
            if standing_down.is_set():
                return
            lost = self.check_processes()
            if lost is None and time.monotonic() >= next_beats:
                next_beats = time.monotonic() + self.interval_s
                lost = self.check(self.timeout_s)
                if lost is None and self.progress_timeout_s > 0:
                    lost = self.check_progress(self.progress_timeout_s, time.time())
            if lost is not None:
                self.on_lost(lost)
                return


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie (a killed child its parent has not reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def _from_beat(beat: dict, now: float) -> dict:
    return {"host": beat.get("host"), "pid": beat.get("pid"), "role": beat.get("role", "not started"),
            "last_activity": beat.get("activity", "never beat"),
            "activity_for_s": round(now - beat["since"], 1) if "since" in beat else None}


def describe_lost(lost: dict) -> str:
    """The one line a user reads: which rank, where, doing what."""
    doing = lost["last_activity"]
    if lost.get("activity_for_s") is not None:
        doing += f" (for {lost['activity_for_s']:.0f} s)"
    how = lost["how"]
    if lost.get("silent_s") is not None:
        how += f": no heartbeat for {lost['silent_s']:.0f} s"
    return (f"rank {lost['rank']} ({lost['role']} on slot {lost.get('slot')}, node {lost.get('node')}, "
            f"host {lost.get('host')}, pid {lost.get('pid')}) {how}; its last activity: {doing}")


_SRUN = re.compile(r"srun: error: (\S+): tasks? (\d+)(?:-\d+)?: (.+)")
_SLURM_ENDED = re.compile(r"\*\*\* (?:JOB|STEP) \S+ ON \S+ CANCELLED AT \S+(?: DUE TO ([A-Z_ ]+?))? \*\*\*")


def slurm_ended(launcher_output: str) -> str | None:
    """Why Slurm itself ended the world, as slurmstepd says it (``JOB REQUEUE``,
    ``TIME LIMIT``, ``PREEMPTION``; ``cancelled`` for ``scancel``), or None. Ranks killed
    that way are not lost: nothing needs naming, and Slurm already decided what happens to
    the job (a requeue it started must not be asked for twice)."""
    found = _SLURM_ENDED.search(launcher_output)
    if found is None:
        return None
    return (found.group(1) or "cancelled").strip()


def _died_before_the_cancel(launcher_output: str) -> bool:
    """``srun`` reported a task dead (``Killed``, ``Exited with exit code``: not the
    ``Terminated`` its own cancel causes) before the step's plain ``CANCELLED`` line (no
    ``DUE TO``): srun ended the step because of that death. Seen in the soak when a trainer
    was killed: srun was faster than rank 0's watchdog, and the run was taken for a scancel
    and not requeued."""
    task, cancel = _SRUN.search(launcher_output), _SLURM_ENDED.search(launcher_output)
    return (task is not None and cancel is not None and task.start() < cancel.start()
            and not task.group(3).strip().startswith("Terminated"))


def dead_rank(folder: Path, launcher_output: str) -> dict | None:
    """Which rank's death ended the world: the first task ``srun`` reports dead (its task
    number is the rank), described from its beats (role, slot, last activity); None when
    the output names no task or no beat matches it."""
    srun = _SRUN.search(launcher_output)
    if srun is None:
        return None
    host, rank, said = srun.group(1), int(srun.group(2)), srun.group(3).strip()
    beat = read_beat(Path(folder), rank)
    if beat is None:
        return None
    now = time.time()
    return {"rank": rank, "slot": beat.get("slot"), "node": _node_of(beat.get("slot")),
            "how": f"died ({said}, reported by srun on {host})", "silent_s": None, **_from_beat(beat, now)}


def _node_of(slot: str | None) -> int | None:
    """``n3g1`` → 3."""
    if slot and slot.startswith("n") and "g" in slot:
        try:
            return int(slot[1:slot.index("g")])
        except ValueError:
            return None
    return None


def post_mortem(log_dir: Path, launcher_output: str, environ: dict, requeue: bool, max_requeues: int) -> str | None:
    """After a world ended badly: the line naming the rank whose death ended it. If the
    run wrote it already (rank 0's watchdog saw it), that line; if the run wrote nothing
    (no ``rank_lost``, ``failure`` or ``shutdown``) and ``srun`` named a dead task, append
    ``rank_lost`` and ``failure`` to the run's events and, under Slurm with requeues left,
    ask for a requeue. When Slurm ended the world itself (``scontrol requeue``, the time
    limit, preemption, ``scancel``: :func:`slurm_ended`), a ``stopped_by_slurm`` event
    instead, and no requeue: one asked for then would run the job once more after it
    finishes. None when there is nothing to say (a rank that raised named itself
    in a ``failure`` event)."""
    from libra_hpc.metrics.runlog import JsonlWriter, read_jsonl
    from libra_hpc.runtime.resume import ask_requeue, requeue_refusal

    events = read_jsonl(log_dir / "events.jsonl")
    starts = [i for i, e in enumerate(events) if e["kind"] == "world_started"]
    this_run = events[starts[-1]:] if starts else events
    said = [e["line"] for e in this_run if e["kind"] in ("rank_lost", "stopped_by_slurm")]
    if said or any(e["kind"] in ("failure", "shutdown") for e in this_run):
        return said[0] if said else None
    ended = slurm_ended(launcher_output)
    if ended == "cancelled" and _died_before_the_cancel(launcher_output):
        ended = None  # srun cancelled the step because a task died (kill on bad exit): a lost rank
    if ended is not None:
        line = f"Slurm ended the world ({ended}); no rank was lost, and no requeue is asked for"
        writer = JsonlWriter(log_dir / "events.jsonl")
        try:
            writer.write("stopped_by_slurm", reason=ended, line=line)
        finally:
            writer.close()
        return line
    lost = dead_rank(log_dir / "heartbeats", launcher_output)
    if lost is None:
        return None
    line = describe_lost(lost)
    refusal = requeue_refusal(environ, requeue, max_requeues)
    writer = JsonlWriter(log_dir / "events.jsonl")
    try:
        writer.write("rank_lost", **lost, line=line, requeue=refusal is None,
                     **({"requeue_refused": refusal} if refusal else {}))
        writer.write("failure", rank=lost["rank"], error=f"RankLost: {line}")
    finally:
        writer.close()
    if refusal is None:
        ask_requeue(log_dir, f"job {environ['SLURM_JOB_ID']}: {line}")
    return line


def post_mortem_of(log_dir: Path, launcher_output: str) -> str | None:
    """:func:`post_mortem` under this process's environment, with the requeue settings of
    the run's own config (``<log_dir>/config.yaml``): what the Slurm batch step
    (``libra_hpc.cluster.slurm.run_world_step``) and ``sbatch/libra.sh`` run after ``srun``
    failed."""
    from libra_hpc.config import load_config

    cfg = load_config(str(Path(log_dir) / "config.yaml"), [])
    return post_mortem(Path(log_dir), launcher_output, dict(os.environ), cfg.cluster.requeue,
                       cfg.cluster.max_requeues)


def main(argv: list[str] | None = None) -> int:
    """``python -m libra_hpc.runtime.heartbeat LOG_DIR OUTPUT``: the post-mortem, for
    ``sbatch/libra.sh`` after ``srun`` failed (reads the config from the log folder)."""
    import sys

    log_dir, output = (Path(a) for a in (argv if argv is not None else sys.argv[1:]))
    text = output.read_text(errors="replace") if output.is_file() else ""
    line = post_mortem_of(log_dir, text)
    if line:
        print(f"libra: {line}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
