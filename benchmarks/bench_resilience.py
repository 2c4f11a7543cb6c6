"""Resilience soak: the job under Slurm, with the faults a cluster throws at it.

The multi-fault successor of ``bench_soak.py`` (that one: tool chaos and one killed leader
under mpiexec; this one: the batch system's faults under Slurm). It starts the emulated
Slurm cluster of the tests (``tests/slurm_cluster.py``: slurmctld, slurmd per node,
accounting), then runs the default job (``configs/default.yaml``, ``rl.steps=12``, the
warm start cached in ``--cache``) ``--runs`` times through ``sbatch sbatch/libra.sh``.
Each run gets one fault at a random step (from ``--seed``); over the runs every type comes
at least once (the types are dealt in turn, then at random):

- ``time_limit``: the limit cut with ``scontrol update TimeLimit`` so that Slurm's warning
  (``--signal=B:USR2@150``) lands within 30 s, TP-2 instances generating;
- ``requeue``: ``scontrol requeue`` of the running job (every rank killed mid-step);
- ``kill``: ``kill -9`` of a random rank (found by its heartbeat);
- ``hang``: a random worker's main thread hung in Python (``LIBRA_FAULTS=1``, SIGRTMIN;
  its heartbeat thread beats on: ``job.progress_timeout_s`` must name it);
- ``kill_in_join``: ``kill -9`` of a trainer while a hybrid replica is joining training.

A run must come back by itself (Slurm requeues it; ``cluster.max_requeues``) and finish.

    python benchmarks/bench_resilience.py [--runs 5] [--steps 12] [--seed 0] [--cache DIR]

It prints one row per run, then one JSON line: ``runs``, ``faults`` (count by type),
``completed``, ``hangs`` (runs not finished within ``--run-timeout``), ``steps_missing``,
``steps_duplicated``, ``trajectories_lost``, ``trajectories_duplicated``, ``max_exit_s``
(from the stop decision, each world's first ``rank_lost``/``failure``/``shutdown`` event,
to the last process of that world gone) and ``shm_left`` (``/dev/shm`` segments of this user that
no live process holds, left after the runs and not there before).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from libra_hpc.cluster.shm import SHM, in_use, stale  # noqa: E402
from libra_hpc.metrics.runlog import read_jsonl  # noqa: E402
from slurm_cluster import LocalSlurmCluster, free_port_base  # noqa: E402

FAULTS = ("time_limit", "requeue", "kill", "hang", "kill_in_join")
STOP_EVENTS = ("rank_lost", "failure", "shutdown")
"""The controller's decision that a world ends (a time-limit warning's ``stop_requested``
comes before the grace it gives the step in flight, so it is not one; ``scontrol requeue``
kills the world without a decision of the job's)."""


def deal(runs: int, rng: random.Random) -> list[str]:
    """One fault per run: every type once (in a shuffled order), then at random."""
    first = list(FAULTS)
    rng.shuffle(first)
    return (first + [rng.choice(FAULTS) for _ in range(max(0, runs - len(FAULTS)))])[:runs]


def our_shm() -> set[str]:
    """This user's stale segments in /dev/shm now."""
    entries = []
    for path in SHM.iterdir():
        try:
            st = path.lstat()
        except OSError:
            continue
        entries.append((path.name, st.st_uid, st.st_mtime))
    return set(stale(entries, uid=os.getuid(), used=in_use(), now=time.time(), min_age_s=0))


class Run:
    """One sbatch job and its fault, followed to its end."""

    def __init__(self, cluster: LocalSlurmCluster, workdir: Path, fault: str, at_step: int, args, rng: random.Random):
        self.cluster, self.fault, self.at_step, self.args, self.rng = cluster, fault, at_step, args, rng
        self.workdir = workdir
        (workdir / "logs").mkdir(parents=True)
        sets = [f"rl.steps={args.steps}", f"job.cache_dir={args.cache}", "job.checkpoint_every_steps=2",
                "cluster.max_requeues=3", f"job.progress_timeout_s={args.progress_timeout}"]
        env = {**os.environ, **cluster.env, "LIBRA_FAULTS": "1"}  # sbatch exports it to every rank
        self.job = subprocess.run(["sbatch", "--parsable", f"--chdir={workdir}", "--time=60", "--signal=B:USR2@150",
                                   "-N", "6", "--ntasks-per-node=2", "--gpus-per-node=2",
                                   str(ROOT / "sbatch" / "libra.sh"), str(args.config), *sets],
                                  capture_output=True, text=True, check=True, env=env).stdout.strip()
        self.folder = workdir / "logs" / f"libra-{self.job}"
        self.injected: str | None = None
        self.exits: list[float] = []
        self.exit_kinds: list[str] = []  # each stop decision's kind and its exit seconds
        self.pids: dict[int, int] = {}

    def events(self) -> list[dict]:
        return read_jsonl(self.folder / "events.jsonl") if (self.folder / "events.jsonl").exists() else []

    def steps(self) -> list[int]:
        path = self.folder / "metrics.jsonl"
        return [m["step"] for m in read_jsonl(path) if m["kind"] == "step"] if path.exists() else []

    def beats(self) -> list[dict]:
        out = []
        for path in sorted((self.folder / "heartbeats").glob("rank-*.json")):
            try:
                out.append(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue
        return out

    def state(self) -> str:
        said = self.cluster.run("scontrol", "show", "job", "-o", self.job, check=False)
        for word in said.split():
            if word.startswith("JobState="):
                return word.split("=", 1)[1]
        return "UNKNOWN"

    def inject(self) -> None:
        """The fault, once its moment came."""
        events, beats = self.events(), self.beats()
        workers = [b for b in beats if b["rank"] != 0]
        if self.fault == "kill_in_join":
            if not any(e["kind"] == "hybrid" and e.get("state") in ("requested", "fetching_state") for e in events):
                return
        elif len(self.steps()) < self.at_step:
            return
        if self.fault == "time_limit":
            elapsed = self.cluster.run("squeue", "-h", "-j", self.job, "-o", "%M").strip()
            minutes = sum(int(x) * 60 ** i for i, x in enumerate(reversed(elapsed.replace("-", ":").split(":"))))
            self.cluster.run("scontrol", "update", f"JobId={self.job}", f"TimeLimit={minutes // 60 + 3}")
        elif self.fault == "requeue":
            self.cluster.run("scontrol", "requeue", self.job)
        elif self.fault in ("kill", "kill_in_join", "hang"):
            pool = [b for b in workers if b["role"] == "trainer"] if self.fault == "kill_in_join" else beats
            if self.fault == "hang":
                pool = workers
            if not pool:
                return
            victim = self.rng.choice(pool)
            os.kill(victim["pid"], signal.SIGKILL if self.fault != "hang" else signal.SIGRTMIN)
            self.injected = f"{self.fault}: rank {victim['rank']} ({victim['role']})"
            return
        self.injected = f"{self.fault} after {len(self.steps())} steps"

    def watch_exits(self) -> None:
        """From each stop decision, the seconds until the last process of that world is gone."""
        for beat in self.beats():
            self.pids[beat["pid"]] = beat["rank"]
        decided: list[tuple[float, str] | None] = []
        for e in self.events():  # each world's first stop decision (None: killed without one)
            if e["kind"] == "world_started":
                decided.append(None)
            elif e["kind"] in STOP_EVENTS and decided and decided[-1] is None:
                decided[-1] = (e["t"], e["kind"])
        while len(self.exit_kinds) < len(decided) - 1 and decided[len(self.exit_kinds)] is None:
            self.exit_kinds.append("no decision")  # a world Slurm killed: nothing of the job's to time
        if len(self.exit_kinds) >= len(decided) or decided[len(self.exit_kinds)] is None:
            return
        alive = [pid for pid in self.pids if Path(f"/proc/{pid}").exists()]
        if not alive:
            t, kind = decided[len(self.exit_kinds)]
            self.exits.append(time.time() - t)
            self.exit_kinds.append(f"{kind}:{time.time() - t:.1f}s")
            self.pids.clear()

    def follow(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        restored = False
        while time.monotonic() < deadline:
            if self.injected is None and self.folder.exists():
                self.inject()
            if self.fault == "time_limit" and self.injected and not restored and \
                    sum(e["kind"] == "world_started" for e in self.events()) >= 2:
                # a job requeued after its limit starts its next run with its whole limit; the cut one
                # stays on the job in Slurm, and every later run would meet the warning again
                self.cluster.run("scontrol", "update", f"JobId={self.job}", "TimeLimit=60", check=False)
                restored = True
            self.watch_exits()
            state = self.state()
            if state in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
                break
            time.sleep(0.5)
        else:
            state = "HUNG"
            self.cluster.run("scancel", self.job, check=False)
        steps = self.steps()
        summary_path = self.folder / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
        return {"job": self.job, "fault": self.fault, "injected": self.injected, "state": state,
                "completed": bool(summary.get("completed")) and state == "COMPLETED",
                "worlds": sum(e["kind"] == "world_started" for e in self.events()),
                "steps_missing": len(set(range(self.args.steps)) - set(steps)),
                "steps_duplicated": len(steps) - len(set(steps)),
                "trajectories_lost": summary.get("trajectories_lost"),
                "trajectories_duplicated": summary.get("trajectories_duplicated"),
                "max_exit_s": round(max(self.exits), 1) if self.exits else None, "exits": ",".join(self.exit_kinds),
                "log_folder": str(self.folder)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "default.yaml")
    parser.add_argument("--cache", default=str(Path.home() / ".cache" / "libra_hpc"), help="job.cache_dir")
    parser.add_argument("--faults", default=",".join(FAULTS), help="the fault types to deal (comma-separated)")
    parser.add_argument("--progress-timeout", type=float, default=120.0, help="job.progress_timeout_s")
    parser.add_argument("--run-timeout", type=float, default=1500.0, help="a run not finished by then is a hang")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    kinds = [f for f in args.faults.split(",") if f]
    unknown = sorted(set(kinds) - set(FAULTS))
    if unknown:
        parser.error(f"--faults: unknown {unknown}; known: {', '.join(FAULTS)}")
    faults = [f for f in deal(args.runs * len(FAULTS), rng) if f in kinds][:args.runs]
    faults += [rng.choice(kinds) for _ in range(args.runs - len(faults))]
    root = Path(tempfile.mkdtemp(prefix="resilience-"))
    shm_before = our_shm()
    rows = []
    started = time.monotonic()
    with LocalSlurmCluster(root / "slurm", nodes=6, gpus_per_node=2, port_base=free_port_base(nodes=6)) as cluster:
        for i, fault in enumerate(faults):
            run = Run(cluster, root / f"run-{i}", fault, rng.randint(2, args.steps - 3), args, rng)
            row = run.follow(args.run_timeout)
            rows.append(row)
            print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)
    shm_left = sorted(our_shm() - shm_before)
    counts = {f: faults.count(f) for f in FAULTS}
    exits = [r["max_exit_s"] for r in rows if r["max_exit_s"] is not None]
    result = {"runs": len(rows), "faults": counts, "completed": sum(r["completed"] for r in rows),
              "hangs": sum(r["state"] == "HUNG" for r in rows),
              "steps_missing": sum(r["steps_missing"] for r in rows),
              "steps_duplicated": sum(r["steps_duplicated"] for r in rows),
              "trajectories_lost": sum(r["trajectories_lost"] or 0 for r in rows),
              "trajectories_duplicated": sum(r["trajectories_duplicated"] or 0 for r in rows),
              "max_exit_s": max(exits) if exits else None, "shm_left": len(shm_left),
              "wall_s": round(time.monotonic() - started, 1), "seed": args.seed}
    print(json.dumps(result))
    return 0 if result["completed"] == len(rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
