"""The private Slurm cluster runs our job shape: N nodes x G GPUs, one srun --mpi=pmi2
step of N*G+1 mpi4py ranks (rank 0 is the extra controller on the first node)."""
from __future__ import annotations

import collections
import sys
import time
from collections.abc import Callable

import pytest
from slurm_cluster import busiest_processes

from libra_hpc.cluster.slurm import WORLD_STEP_DEFAULTS

pytestmark = pytest.mark.slurm
ENV = " ".join(f"{k}={v}" for k, v in WORLD_STEP_DEFAULTS.items())  # as launch.py's world step

SLURM_WAIT_S = 120.0
"""How long a test waits for the private cluster to get somewhere: a hang guard, never a
measure of speed (slurmctld and slurmdbd share two busy cores with everything else)."""


def wait_for_slurm(cluster, what: str, probe: Callable[[], object], until: Callable[[object], bool] = bool,
                   timeout_s: float = SLURM_WAIT_S):
    """Ask ``probe`` until its answer satisfies ``until`` and return that answer; after
    ``timeout_s`` fail naming ``what``, the last answer, the cluster's queue and the busiest
    processes."""
    deadline = time.monotonic() + timeout_s
    while not until(got := probe()):
        if time.monotonic() > deadline:
            queue = cluster.run("squeue", "-h", "-o", "%i %j %T %r", check=False)
            pytest.fail(f"{what}: not after {timeout_s:g} s (last answer {got!r})\nsqueue:\n{queue}\n"
                        f"{busiest_processes()}")
        time.sleep(0.2)
    return got


RANK_REPORT = ("import os; from mpi4py import MPI; w = MPI.COMM_WORLD; "
               "print('RANK', w.Get_rank(), w.Get_size(), os.environ['SLURM_NODEID'], "
               "os.environ.get('CUDA_VISIBLE_DEVICES'), flush=True)")


def test_mpi_step_with_controller_rank(slurm_cluster, tmp_path):
    n, g = slurm_cluster.nodes, slurm_cluster.gpus
    step = (f"{ENV} srun --mpi=pmi2 --overcommit --nodes={n} --ntasks={n * g + 1} "
            f"{sys.executable} -c \"{RANK_REPORT}\"")
    job_id = slurm_cluster.run(
        "sbatch", "--parsable", "--job-name=mpi-shape", f"--output={tmp_path}/%j.out",
        f"--nodes={n}", f"--ntasks-per-node={g}", f"--gpus-per-node={g}",
        f"--chdir={tmp_path}", "--wrap", step).strip()
    output = tmp_path / f"{job_id}.out"
    assert slurm_cluster.wait_job(job_id, timeout_s=SLURM_WAIT_S) == "COMPLETED", output.read_text()

    rows = [line.split() for line in output.read_text().splitlines()
            if line.startswith("RANK ")]
    assert sorted(int(r[1]) for r in rows) == list(range(n * g + 1))
    assert {int(r[2]) for r in rows} == {n * g + 1}
    per_node = collections.Counter(int(r[3]) for r in rows)
    assert per_node == {0: g + 1, **{i: g for i in range(1, n)}}
    assert {r[4] for r in rows} == {",".join(map(str, range(g)))}


def test_accounting_reports_final_states(slurm_cluster, tmp_path):
    ids = {want: slurm_cluster.run("sbatch", "--parsable", f"--output={tmp_path}/%j.out",
                                   "--wrap", cmd).strip()
           for want, cmd in (("COMPLETED", "true"), ("FAILED", "exit 3"))}
    for want, job_id in ids.items():
        assert slurm_cluster.wait_job(job_id, timeout_s=SLURM_WAIT_S) == want
        wait_for_slurm(slurm_cluster, f"sacct reporting job {job_id} {want}",  # slurmdbd gets it asynchronously
                       lambda: slurm_cluster.run("sacct", "-X", "-n", "-j", job_id, "-o", "State").strip(),
                       until=lambda state: state == want)


@pytest.mark.parametrize("failure, reported", [
    ("kill -PIPE $$", r"sbatch .*failed \(-13\)"),
    ("echo 'slurm_load_jobs error: Socket timed out on send/recv operation' >&2; exit 1",
     r"sbatch .*failed \(1\): .*Socket timed out"),
], ids=["sigpipe", "busy-controller"])
def test_a_query_that_failed_in_transit_is_asked_again_and_a_submission_is_not(tmp_path, monkeypatch, failure,
                                                                                reported):
    """CI saw ``scontrol show job`` die of SIGPIPE (rc -13) while the job it polled ran on,
    and a full test run saw it give up with "Socket timed out on send/recv operation" (rc
    1) while slurmctld was busy: a query is asked again, a submission (not idempotent) that
    failed so is reported, never sent twice."""
    from slurm_cluster import LocalSlurmCluster

    calls = tmp_path / "calls"
    for name in ("scontrol", "sbatch"):  # fail on the first call, answer after
        script = tmp_path / name
        script.write_text(f"#!/bin/sh\necho {name} >> {calls}\n"
                          f"[ $(grep -c {name} {calls}) -gt 1 ] && {{ echo JobState=COMPLETED; exit 0; }}\n"
                          f"{failure}\n")
        script.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{__import__('os').environ['PATH']}")
    cluster = LocalSlurmCluster(tmp_path / "root")
    assert cluster.wait_job("1", timeout_s=SLURM_WAIT_S) == "COMPLETED"
    with pytest.raises(RuntimeError, match=reported):
        cluster.run("sbatch", "--wrap", "true")
    assert calls.read_text().split() == ["scontrol", "scontrol", "sbatch"]
