"""launch.py end to end without Slurm: dry runs, refusals before anything starts, and the
MPI world under mpiexec with emulated nodes (real mpi4py, real torch gloo groups)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from slurm_cluster import busiest_processes

from libra_hpc.cluster.local import remove_stale_shm
from libra_hpc.cluster.slurm import WORLD_STEP_DEFAULTS, world_step_env
from libra_hpc.metrics.runlog import read_jsonl

ROOT = Path(__file__).resolve().parents[1]


def launch(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    """Run launch.py in a session of its own; on timeout the whole session (mpiexec and every
    rank) is killed, so that a hung world cannot starve the tests that follow."""
    argv = [sys.executable, str(ROOT / "launch.py"), *args]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
                               start_new_session=True)
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        busiest = busiest_processes()
        os.killpg(process.pid, signal.SIGKILL)
        out, err = process.communicate()
        pytest.fail(f"launch.py {' '.join(args)} still running after {timeout} s; its output:\n{out}\n{err}\n{busiest}")
    return subprocess.CompletedProcess(argv, process.returncode, out, err)


CHECK = ("--set", "job.mode=check", "--set", "rl.steps=6", "--set", "planner.borrow_at_step=2",
         "--set", "planner.return_at_step=4")
"""The cluster check (``job.mode: check``) with the scripted hybrid-pool steps, its test hook."""


def only_log_folder(logs: Path) -> Path:
    folders = [p for p in logs.iterdir() if p.is_dir() and p.name != "submitit"]
    assert len(folders) == 1, folders
    return folders[0]


def test_dry_run_prints_the_48_gpu_request_and_layout():
    done = launch("--nodes", "6", "--config", "configs/a800-6node.yaml", "--dry-run")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "6 nodes × 8 GPUs = 48 GPUs" in out and "49 MPI ranks" in out
    for line in ("#SBATCH --nodes=6", "#SBATCH --gpus-per-node=8", "#SBATCH --ntasks-per-node=8", "#SBATCH --requeue"):
        assert line in out
    assert "srun --mpi=pmi2" in out and "--ntasks=49" in out
    transport = {k: v for k, v in world_step_env(dict(os.environ)).items() if k in WORLD_STEP_DEFAULTS}
    assert "job step's MPI transport: " + " ".join(f"{k}={v}" for k, v in transport.items()) in out
    rows = [line.split() for line in out.splitlines() if line[:1].isdigit()]
    assert [int(r[0]) for r in rows] == list(range(6))
    assert all(len(r) == 9 for r in rows)  # node index + 8 GPU cells
    assert all(cell == "T(tp8)" for r in rows[:4] for cell in r[1:])
    assert rows[4][1:] == ["R1(tp1)", "R2(tp1)", "R3(tp2)", "R3(tp2)", "R4(tp4)", "R4(tp4)", "R4(tp4)", "R4(tp4)"]
    assert all(cell.endswith("*") for cell in rows[5][1:])  # node 5: the hybrid pool


@pytest.mark.parametrize(
    "yaml_text, field",
    [
        ("cluster:\n  nodse: 6\n", "cluster.nodse"),
        ("cluster:\n  nodes: six\n", "cluster.nodes"),
        ("cluster:\n  gpus_per_node: 8\ntraining:\n  tensor_parallel: 16\n", "training.tensor_parallel"),
    ],
    ids=["misspelled-key", "wrong-type", "tp16-on-8-gpu-nodes"],
)
def test_bad_config_exits_before_anything_starts(tmp_path, yaml_text, field):
    config = tmp_path / "bad.yaml"
    config.write_text(yaml_text + f"logging:\n  dir: {tmp_path / 'logs'}\n")
    done = launch("--config", str(config), "--executor", "local")
    assert done.returncode != 0
    assert field in done.stderr and str(config) in done.stderr
    assert not (tmp_path / "logs").exists(), "a log folder means something was started"


def test_misspelled_key_suggests_the_right_one(tmp_path):
    done = launch("--set", "training.tensor_paralel=2", "--dry-run")
    assert done.returncode != 0
    assert "did you mean 'tensor_parallel'" in done.stderr


@pytest.mark.mpi
def test_local_world_runs_two_layouts_to_completion(tmp_path):
    done = launch("--nodes", "6", "--executor", "local", "--set", f"logging.dir={tmp_path}", *CHECK)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "done: exit status 0" in done.stdout
    folder = only_log_folder(tmp_path)
    assert f"log folder: {folder}" in done.stdout
    # a start may first remove what a killed job left in /dev/shm (another test's, a soak's)
    events = [e for e in read_jsonl(folder / "events.jsonl") if e["kind"] != "leftovers_removed"]
    kinds = [e["kind"] for e in events]
    assert kinds[0] == "world_started" and kinds[-1] == "shutdown" and "failure" not in kinds
    started = events[0]
    assert started["world_size"] == 13 and started["emulated_nodes"] is True
    applied = [e for e in events if e["kind"] == "layout_applied"]
    assert [(e["version"], e["step"]) for e in applied] == [(0, 0), (1, 2), (2, 4)]
    assert [e["gpus"]["training"] for e in applied] == [4, 6, 4]
    assert applied[2]["groups"] == applied[0]["groups"]  # the pool came back as it was
    checks = [e for e in events if e["kind"] == "group_check"]
    assert [e["step"] for e in checks] == list(range(6)) and all(e["ok"] for e in checks)
    # After lending, the training group spans the hybrid node's ranks too.
    assert checks[2]["groups"]["training"]["size"] == 6
    metrics = read_jsonl(folder / "metrics.jsonl")
    assert [m["gpus_training"] + m["gpus_rollout"] for m in metrics] == [12] * 6
    assert "nodes: 6" in (folder / "config.yaml").read_text()


def _start_long_world(tmp_path: Path) -> subprocess.Popen:
    """A local world of 3 emulated nodes that runs until stopped, already past its start."""
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "launch.py"), "--nodes", "3", "--executor", "local", "--set", "job.mode=check", "--set", "rl.steps=100000",
         "--set", "planner.hybrid_nodes=0", "--set", "planner.borrow_at_step=null",
         "--set", "planner.return_at_step=null", "--set", f"logging.dir={tmp_path}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, start_new_session=True)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("*/events.jsonl")) or len(read_jsonl(next(tmp_path.glob("*/events.jsonl")))) < 4:
        if process.poll() is not None:
            pytest.fail(f"launch.py ended early:\n{process.stdout.read()}")
        if time.monotonic() > deadline:
            busiest = busiest_processes()
            pytest.fail(f"the world never got going; its output:\n{_finish(process, timeout=0)}\n{busiest}")
        time.sleep(0.2)
    return process


def _rank_pids(marker: str) -> dict[int, int]:
    """MPI rank → pid for the ranks of this run (their command line names ``marker``);
    MPICH exports PMI_RANK to every rank."""
    pids = {}
    for pid in subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split():
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        for item in environ:
            if item.startswith(b"PMI_RANK="):
                pids[int(item.split(b"=")[1])] = int(pid)
    return pids


def _shm_mapped_by(pids) -> set[Path]:
    """The /dev/shm/mpich_shm_* files that the processes ``pids`` map."""
    mapped = set()
    for pid in pids:
        try:
            lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
        except OSError:
            continue
        mapped |= {Path(line.split()[-1]) for line in lines if "/dev/shm/mpich_shm_" in line}
    return mapped


def _finish(process: subprocess.Popen, timeout: float = 120) -> str:
    """Wait up to ``timeout`` s for launch.py, then kill its whole session; its output."""
    try:
        out, _ = process.communicate(timeout=timeout)
        return out
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        return process.communicate()[0]
    finally:
        try:
            os.killpg(process.pid, signal.SIGKILL)  # launch.py, mpiexec and any rank left
        except ProcessLookupError:
            pass
        process.wait()


@pytest.mark.mpi
def test_a_dead_worker_fails_the_job_with_a_clear_report(tmp_path):
    process = _start_long_world(tmp_path)
    pids = _rank_pids(str(tmp_path))
    for _ in range(60):  # under load a rank can be slow to show in /proc (CI saw 1 of 7): look again
        if len(pids) == 7 or process.poll() is not None:
            break
        time.sleep(0.5)
        pids = _rank_pids(str(tmp_path))
    assert sorted(pids) == list(range(7)), f"ranks found: {pids}; launch.py:\n{_finish(process, timeout=0)}"
    # this world's own segments (another xdist worker's worlds make theirs meanwhile: CI saw one)
    segments = _shm_mapped_by(pids.values())
    assert segments, "the world's ranks map no /dev/shm/mpich_shm_* segment: nothing to check"
    os.kill(pids[3], signal.SIGKILL)
    out = _finish(process)
    assert process.returncode == 1, out
    assert "FAILED" in out and "no shutdown event" in out and "job.out" in out
    left = [p for p in segments if p.exists()]
    assert not left, f"the killed world's shared memory was left behind: {left}"


@pytest.mark.mpi
def test_slurm_time_limit_warning_stops_the_run_cleanly(tmp_path):
    process = _start_long_world(tmp_path)
    for pid in _rank_pids(str(tmp_path)).values():  # Slurm signals every task of the step
        os.kill(pid, signal.SIGUSR2)
    out = _finish(process)
    assert process.returncode == 0, out
    events = read_jsonl(next(tmp_path.glob("*/events.jsonl")))
    stop = [e for e in events if e["kind"] == "stop_requested"]
    assert stop and stop[0]["signal"] == "SIGUSR2"
    assert events[-1]["kind"] == "shutdown" and 0 < events[-1]["steps"] < 100000


@pytest.mark.mpi
def test_world_that_does_not_match_the_config_is_refused(tmp_path):
    started = time.time() - 1
    done = subprocess.run(
        ["mpiexec", "-n", "3", sys.executable, "-m", "libra_hpc.run", "--log-dir", str(tmp_path / "run"),
         "--set", "cluster.nodes=2"],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    remove_stale_shm(started)  # MPI_Abort leaves MPICH's shared memory behind
    assert done.returncode != 0
    failure = [e for e in read_jsonl(tmp_path / "run" / "events.jsonl") if e["kind"] == "failure"]
    assert failure and "TopologyError" in failure[0]["error"]
    assert "3 ranks" in failure[0]["error"] and "cluster.nodes" in failure[0]["error"]


def test_plan_prints_the_planners_choice_per_node_with_predicted_times():
    done = launch("--config", "configs/a800-6node.yaml", "--plan")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "plan for Qwen3-14B on 6 nodes × 8 A800-80G" in out and "predicted per RL step: T_train" in out
    rows = [line.split() for line in out.splitlines() if line[:1].isdigit()]
    assert [int(r[0]) for r in rows] == list(range(6)) and all(len(r) == 9 for r in rows)
    cells = [cell for r in rows for cell in r[1:]]
    assert any(c.startswith("T(") for c in cells) and any(c.startswith("R") for c in cells)
    assert "runners-up in the" in out and "best rollout of the rest: " in out  # each says why it lost


@pytest.mark.parametrize("override, field", [("cluster.hardware=b200", "cluster.hardware"),
                                             ("model.name=llama-405b", "model.name")])
def test_plan_with_an_unknown_profile_names_the_field(override, field):
    done = launch("--set", override, "--plan")
    assert done.returncode != 0 and field in done.stderr and "Available:" in done.stderr
