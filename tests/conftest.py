"""Shared pytest fixtures."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # slurm_cluster.py, under any import mode
from slurm_cluster import LocalSlurmCluster, free_port_base, missing_binaries  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--scheduler-source", action="store_true",
                     help="run libra_hpc.scheduler from its Python sources where the install compiled it")


JOB_MODULES = ("test_job", "test_launch_local", "test_launch_slurm", "test_slurm_cluster", "test_tools_remote")
"""Modules whose tests start whole jobs (launch.py, sbatch) or use the private Slurm cluster."""

WORLD_MODULES = ("test_role_worlds", "test_engines_rollout")
"""Modules whose tests start many processes that poll (a 13-rank MPI world, a vLLM engine of
TP 2): they run in the jobs' unit, never beside a job's 13 ranks on the same cores. Beside
one, CI lost each once in about eight runs (both pass alone, every time): the idle role world
hung 300 s with its 12 workers in MPICH's ``bcast``, and the TP-2 engine's main process
waited past 600 s in vLLM's ``shm_broadcast`` for its worker's answer."""

SLOT_MODULES = ("test_tools_sandbox", "test_tools_hardening", "test_tools_orchestrator")
"""Modules whose tests share fixed sandbox slot uids (their module's ``UID``): each runs whole
on one worker. Split across two, a test on one worker reaps the slot uid's processes (a
slot starts empty; a killed call's leftovers are killed by uid) while the other worker's
sandbox or isolation probe runs as that uid: CI lost ten bwrap tests so ("probe exited
137", then exit 125)."""


def pytest_xdist_make_scheduler(config, log):
    """With two pytest-xdist workers (pyproject's addopts): the tests of ``JOB_MODULES`` and
    ``WORLD_MODULES`` are one unit of work, run in order by one worker (they share the
    session's Slurm cluster and warm-start cache, and each job loads both cores); each module of ``SLOT_MODULES`` is
    one unit; every other test is a unit of its own, run by whichever worker is free. (A
    conftest cannot give pytest-xdist's ``loadgroup`` its groups under pytest 9: the
    worker's renamed node ids are not used.)"""
    from xdist.scheduler import LoadScopeScheduling

    class JobsTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = Path(nodeid.split("::", 1)[0]).stem
            if module in JOB_MODULES or module in WORLD_MODULES:
                return "jobs"
            return module if module in SLOT_MODULES else nodeid

    return JobsTogether(config, log)


def pytest_configure(config):
    if config.getoption("--scheduler-source"):
        from libra_hpc import _compiled
        _compiled.use_sources()


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A private 4-node x 4-GPU Slurm cluster with accounting, started once per session."""
    reason = missing_binaries()
    if reason:
        if os.environ.get("CI"):  # CI installs Slurm (scripts/install.sh --test): never skip there
            pytest.fail(f"Slurm tests cannot run in CI: {reason}")
        pytest.skip(reason)
    with LocalSlurmCluster(tmp_path_factory.mktemp("slurm"),
                           port_base=free_port_base()) as cluster:
        yield cluster


@pytest.fixture(autouse=True, scope="module")
def _environment_restored_after_the_module():
    """vLLM edits this process's environment when an in-process engine starts (LD_PRELOAD of
    torch's libgomp, LOCAL_WORLD_SIZE, VLLM_* ...); a later module's subprocesses (mpiexec
    worlds, sbatch jobs, which export the caller's environment) must not inherit that."""
    saved = dict(os.environ)
    yield
    if dict(os.environ) != saved:
        os.environ.clear()
        os.environ.update(saved)


@pytest.fixture(scope="session")
def job_cache(tmp_path_factory) -> Path:
    """The model and warm-start cache (``job.cache_dir``) the small RL job's local runs
    share: the first run builds it (tens of seconds), the others load it."""
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """The tiny local model (libra_hpc/engines/tiny.py, seed 0), built once per test module."""
    from libra_hpc.engines.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="module")
def torch_world():
    """A one-rank gloo world in this process (the training world of one-rank engine tests)."""
    import socket

    import torch.distributed as dist

    assert not dist.is_initialized(), "another test left torch.distributed initialised"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
