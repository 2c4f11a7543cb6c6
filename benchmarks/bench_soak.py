"""Soak run: does a long RL run lose anything when its tools misbehave and a rank dies?

Runs the job of ``configs/soak.yaml`` locally: the default job's model, task and warm start
on 4 emulated nodes × 2, for 30 steps. ``tools.chaos`` makes 10% of the tool calls fail and
5% hang past ``tools.call_timeout_s``. Once ``--kill-after`` steps have run, the script
kills one rollout leader (``kill -9``; the rank that holds its trajectories and their tool
calls), waits for the job to end, and resumes it with ``launch.py --resume``. At the end
it reads the log folder.

    python benchmarks/bench_soak.py [--steps 30] [--kill-after 10] [--logs DIR] [--cache DIR]

It prints a table, and the last line is JSON with:

- ``trajectories_lost`` (the acceptance: 0) and ``trajectories_duplicated``;
- the faults injected, and the failures and timeouts the model read;
- the resilience numbers:
  - ``detect_s``: from the kill to the ``rank_lost`` event;
  - ``down_s``: from the kill to the end of the world;
  - ``resume_s``: from ``--resume`` to the first step trained again;
  - ``steps_lost``: the steps trained again.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from libra_hpc.metrics.runlog import read_jsonl  # noqa: E402

CONFIG = ROOT / "configs" / "soak.yaml"


def steps_done(folder: Path) -> int:
    return sum(m["kind"] == "step" for m in read_jsonl(folder / "metrics.jsonl"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-after", type=int, default=10, help="kill a rollout leader once this many steps ran")
    parser.add_argument("--logs", default=None, help="logging.dir (default: a new temporary folder)")
    parser.add_argument("--cache", default=None, help="job.cache_dir (warm starts; default: ~/.cache/libra_hpc)")
    args = parser.parse_args()
    logs = Path(args.logs or tempfile.mkdtemp(prefix="soak-"))
    sets = ["--set", f"rl.steps={args.steps}"] + (["--set", f"job.cache_dir={args.cache}"] if args.cache else [])
    launch = [sys.executable, str(ROOT / "launch.py")]
    started = time.monotonic()
    first = subprocess.Popen([*launch, "--config", str(CONFIG), "--executor", "local", "--set", f"logging.dir={logs}",
                              *sets], cwd=ROOT, start_new_session=True)
    folder, victim, killed_at = None, None, None
    try:
        while first.poll() is None:
            found = list(logs.glob("libra-*"))
            folder = found[0] if found else None
            if folder is not None and victim is None and steps_done(folder) >= args.kill_after:
                beats = [json.loads(p.read_text()) for p in sorted((folder / "heartbeats").glob("rank-*.json"))]
                victim = next(b for b in beats if b["role"] == "leader")
                os.kill(victim["pid"], signal.SIGKILL)
                killed_at = time.time()
                print(f"killed rank {victim['rank']} (rollout leader, pid {victim['pid']}) after "
                      f"{steps_done(folder)} steps", flush=True)
            time.sleep(0.2)
        down_s = time.time() - killed_at if killed_at else None
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
    if victim is None:
        print(f"the run ended (status {first.returncode}) before {args.kill_after} steps; nothing was killed")
        return 1
    events = read_jsonl(folder / "events.jsonl")
    lost = next((e for e in events if e["kind"] == "rank_lost"), None)
    rows_before = steps_done(folder)
    resumed_at = time.time()
    second = subprocess.run([*launch, "--resume", str(folder), *sets], cwd=ROOT)
    metrics = read_jsonl(folder / "metrics.jsonl")
    events = read_jsonl(folder / "events.jsonl")
    resumed = next(e for e in events if e["kind"] == "resumed")
    after = [m for m in metrics if m["kind"] == "step" and m["t"] > resumed["t"]]
    summary = json.loads((folder / "summary.json").read_text())
    injected = summary.get("tool_faults_injected", {"fail": 0, "hang": 0})
    row = {"completed": summary["completed"], "steps": summary["steps"], "returncodes": [first.returncode,
                                                                                          second.returncode],
           "trajectories_trained": summary["trajectories_trained"], "trajectories_lost": summary["trajectories_lost"],
           "trajectories_duplicated": summary["trajectories_duplicated"],
           "tool_calls_second_run": summary["tool_calls"], "injected_failures_second_run": injected["fail"],
           "injected_hangs_second_run": injected["hang"], "tool_errors_at_runner_second_run": summary["tool_failures"],
           "timeouts_read_by_model": summary["tool_timeouts"],
           "failed_returns_read_by_model": sum(m.get("tool_failures", 0) for m in metrics if m["kind"] == "step"),
           "killed": f"rank {victim['rank']} ({victim['role']}) after {rows_before} steps",
           "named_as": lost["line"] if lost else None,
           "detect_s": round(lost["t"] - killed_at, 2) if lost else None, "down_s": round(down_s, 2),
           "resume_s": round(after[0]["t"] - resumed_at, 1) if after else None,
           "resumed_from_version": resumed["version"], "steps_lost": resumed["metric_rows_dropped"],
           "wall_s": round(time.monotonic() - started, 1), "log_folder": str(folder)}
    width = max(len(k) for k in row)
    for key, value in row.items():
        print(f"{key:<{width}}  {value}")
    print(json.dumps(row))
    return 0 if summary["completed"] and summary["trajectories_lost"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
