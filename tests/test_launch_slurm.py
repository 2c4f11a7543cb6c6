"""The two ways to submit, on the private 4-node Slurm cluster: ``sbatch sbatch/libra.sh``
and ``launch.py --executor slurm --wait``. Both must run the world to completion, apply a
second layout mid-run, and leave the expected events in logs/<name>-<jobid>/."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from libra_hpc.metrics.runlog import read_jsonl

pytestmark = pytest.mark.slurm
ROOT = Path(__file__).resolve().parents[1]
CHECK = ("--set", "job.mode=check", "--set", "rl.steps=6", "--set", "planner.borrow_at_step=2",
         "--set", "planner.return_at_step=4")
"""The cluster check (``job.mode: check``) with the scripted hybrid-pool steps, its test hook."""


def _env(cluster) -> dict[str, str]:
    return {**os.environ, **cluster.env, "PYTHON": sys.executable}


def _assert_world_events(folder: Path, nodes: int, gpus: int) -> list[dict]:
    events = read_jsonl(folder / "events.jsonl")
    kinds = [e["kind"] for e in events]
    assert kinds[0] == "world_started" and kinds[-1] == "shutdown", kinds
    assert "failure" not in kinds
    started = events[0]
    assert started["world_size"] == nodes * gpus + 1
    assert started["emulated_nodes"] is False  # nodes came from Slurm, not emulation
    # Slots follow Slurm's nodes, and each slot records the GPU Slurm bound to it.
    slots = {info["slot"]: info["gpu"] for info in started["ranks"].values()}
    assert slots == {f"n{n}g{g}": str(g) for n in range(nodes) for g in range(gpus)}
    applied = [e for e in events if e["kind"] == "layout_applied"]
    assert [e["version"] for e in applied] == [0, 1, 2]
    assert applied[1]["gpus"]["training"] > applied[0]["gpus"]["training"]  # hybrid pool lent mid-run
    assert all(e["ok"] for e in events if e["kind"] == "group_check")
    return events


def test_sbatch_script_runs_the_world(slurm_cluster, tmp_path):
    (tmp_path / "logs").mkdir()
    job_id = subprocess.run(
        ["sbatch", "--parsable", f"--chdir={tmp_path}", str(ROOT / "sbatch" / "libra.sh"),
         str(ROOT / "configs" / "default.yaml"), *[kv for kv in CHECK if kv != "--set"]],
        capture_output=True, text=True, check=True, env=_env(slurm_cluster)).stdout.strip()
    state = slurm_cluster.wait_job(job_id, timeout_s=240)
    folder = tmp_path / "logs" / f"libra-{job_id}"
    output = folder / "slurm.out"
    assert state == "COMPLETED", output.read_text() if output.exists() else list((tmp_path / "logs").iterdir())
    assert f"job {job_id}, 4 nodes x 2 GPUs" in output.read_text()  # the output moved into the job's folder
    _assert_world_events(folder, nodes=4, gpus=2)
    assert (folder / "config.yaml").exists() and (folder / "controller.log").exists()


def test_launch_py_submits_and_follows(slurm_cluster, tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), "--nodes", "4", "--executor", "slurm", "--wait",
         "--set", f"logging.dir={tmp_path}", *CHECK],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=_env(slurm_cluster))
    assert done.returncode == 0, done.stdout + done.stderr
    job_id = done.stdout.split("job ", 1)[1].split()[0]
    assert f"job {job_id}: RUNNING" in done.stdout and "done: Slurm state COMPLETED" in done.stdout
    assert "layout_applied: v1" in done.stdout  # progress was streamed while it ran
    _assert_world_events(tmp_path / f"libra-{job_id}", nodes=4, gpus=2)
    # With accounting on, Slurm keeps the real final state.
    assert slurm_cluster.run("sacct", "-X", "-n", "-j", job_id, "-o", "State").split() == ["COMPLETED"]


def test_launch_py_reports_a_failed_job(slurm_cluster, tmp_path):
    done = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), "--nodes", "4", "--gpus-per-node", "8", "--executor", "slurm",
         "--wait", "--set", "rollout.tp_per_node=[1,1,2,4]", "--set", "rl.prompts_per_step=15",
         "--set", "rl.group_size=4", "--set", "training.micro_batch_size=1",
         "--set", f"logging.dir={tmp_path}"],
        capture_output=True, text=True, timeout=300, cwd=ROOT, env=_env(slurm_cluster))
    # The nodes have 4 GPUs: Slurm refuses 8 per node at submission, and launch.py says so.
    assert done.returncode != 0
    assert "Traceback" not in done.stderr
    assert "sbatch refused 4 nodes × 8 GPUs" in done.stderr and "node configuration is not available" in done.stderr


def test_sbatch_runs_the_rl_job_with_least_load_routing(slurm_cluster, tmp_path):
    """The RL job itself under Slurm (the small config, the script's 4 × 2 header), with
    the trivial routing policy C-MLFQ is compared with; the report says which ran."""
    import json

    (tmp_path / "logs").mkdir()
    job_id = subprocess.run(
        ["sbatch", "--parsable", f"--chdir={tmp_path}", str(ROOT / "sbatch" / "libra.sh"),
         str(ROOT / "tests" / "data" / "job_small.yaml"), "scheduler.policy=least_load",
         f"job.cache_dir={tmp_path / 'cache'}"],
        capture_output=True, text=True, check=True, env=_env(slurm_cluster)).stdout.strip()
    state = slurm_cluster.wait_job(job_id, timeout_s=600)
    folder = tmp_path / "logs" / f"libra-{job_id}"
    assert state == "COMPLETED", (folder / "slurm.out").read_text() if (folder / "slurm.out").exists() else state
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["completed"] and summary["steps"] == 10 and summary["scheduler_policy"] == "least_load"
    assert summary["trajectories_lost"] == 0 and summary["trajectories_duplicated"] == 0
    assert "least_load" in (folder / "report.md").read_text()
    assert (folder / "checkpoint" / "model.safetensors").is_file()
