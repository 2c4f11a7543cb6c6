"""Shared pytest fixtures."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # slurm_cluster.py, under any import mode
from slurm_cluster import LocalSlurmCluster, free_port_base, missing_binaries  # noqa: E402


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
