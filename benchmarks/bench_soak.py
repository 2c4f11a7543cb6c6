"""Soak run: does a long RL run lose anything when its tools misbehave?

Runs the job of ``configs/soak.yaml`` locally. That is 30 steps of the arithmetic task,
whose calls run in the CPU sandbox pool, with ``tools.chaos`` making 10% of tool calls fail
and 5% hang past ``tools.call_timeout_s``. While it runs, the script kills one sandbox
process in the middle of a call (``kill -9`` of a process running as a sandbox slot uid),
once the run has passed ``--kill-after`` steps. Then it reads the run's log folder.

    python benchmarks/bench_soak.py [--steps 30] [--kill-after 10] [--logs /tmp/soak]

Prints a table; the last line is JSON with ``trajectories_lost`` (the acceptance: 0),
``trajectories_duplicated``, the injected faults, the failures and timeouts the model
read, the killed sandbox process and the wall time.
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


def sandbox_processes(uid_base: int, units: int) -> list[int]:
    """Pids of the processes running as a sandbox slot uid (a call in progress)."""
    pids = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            uid = next(int(line.split()[1]) for line in status.read_text().splitlines() if line.startswith("Uid:"))
        except (OSError, StopIteration, ValueError):
            continue
        if uid_base <= uid < uid_base + units:
            pids.append(int(status.parent.name))
    return pids


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--kill-after", type=int, default=10, help="kill a sandbox process once this many steps ran")
    parser.add_argument("--logs", default=None, help="logging.dir (default: a new temporary folder)")
    parser.add_argument("--cache", default=None, help="job.cache_dir (warm starts; default: ~/.cache/libra_hpc)")
    args = parser.parse_args()
    logs = Path(args.logs or tempfile.mkdtemp(prefix="soak-"))
    sets = ["--set", f"logging.dir={logs}", "--set", f"rl.steps={args.steps}"]
    if args.cache:
        sets += ["--set", f"job.cache_dir={args.cache}"]
    from libra_hpc.config import load_config

    cfg = load_config(str(ROOT / "configs" / "soak.yaml"), [])
    started = time.monotonic()
    process = subprocess.Popen([sys.executable, str(ROOT / "launch.py"), "--config", str(ROOT / "configs" / "soak.yaml"),
                                "--executor", "local", *sets], cwd=ROOT, start_new_session=True)
    killed: dict = {}
    try:
        while process.poll() is None:
            folders = list(logs.glob(f"{cfg.cluster.job_name}-*"))
            steps = sum(m["kind"] == "step" for m in read_jsonl(folders[0] / "metrics.jsonl")) if folders else 0
            if not killed and steps >= args.kill_after:
                pids = sandbox_processes(cfg.tools.uid_base, cfg.tools.max_workers)
                if pids:
                    os.kill(pids[0], signal.SIGKILL)
                    killed = {"pid": pids[0], "at_step": steps, "t_s": round(time.monotonic() - started, 1)}
                    print(f"killed sandbox process {pids[0]} during step {steps + 1}", flush=True)
            time.sleep(0.02 if steps >= args.kill_after and not killed else 0.5)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    wall = time.monotonic() - started
    [folder] = logs.glob(f"{cfg.cluster.job_name}-*")
    summary = json.loads((folder / "summary.json").read_text())
    injected = summary.get("tool_faults_injected", {"fail": 0, "hang": 0})
    row = {"completed": summary["completed"], "steps": summary["steps"], "returncode": process.returncode,
           "trajectories_trained": summary["trajectories_trained"], "trajectories_lost": summary["trajectories_lost"],
           "trajectories_duplicated": summary["trajectories_duplicated"], "tool_calls": summary["tool_calls"],
           "injected_failures": injected["fail"], "injected_hangs": injected["hang"],
           "tool_errors_at_runner": summary["tool_failures"], "timeouts_read_by_model": summary["tool_timeouts"],
           "killed_sandbox": killed or None, "wall_s": round(wall, 1), "log_folder": str(folder)}
    width = max(len(k) for k in row)
    for key, value in row.items():
        print(f"{key:<{width}}  {value}")
    print(json.dumps(row))
    return 0 if summary["completed"] and summary["trajectories_lost"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
