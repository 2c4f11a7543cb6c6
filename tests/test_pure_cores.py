"""The pure-logic cores import neither MPI nor torch (DESIGN.md: the simulator and the
live runtime drive the very same objects)."""

from __future__ import annotations

import subprocess
import sys

import pytest

PURE = ["libra_hpc.config", "libra_hpc.cluster.layout", "libra_hpc.cluster.topology", "libra_hpc.cluster.slurm",
        "libra_hpc.scheduler", "libra_hpc.scheduler.service", "libra_hpc.scheduler.routers",
        "libra_hpc.scheduler.synthetic", "libra_hpc.planner", "libra_hpc.planner.costs", "libra_hpc.planner.profiles",
        "libra_hpc.planner.hybrid", "libra_hpc.planner.search", "libra_hpc.planner.gate",
        "libra_hpc.planner.prior"]


@pytest.mark.parametrize("module", PURE)
def test_module_imports_neither_mpi_nor_torch(module):
    code = (f"import sys, {module}; heavy = sorted({{m.split('.')[0] for m in sys.modules}} & {{'torch', 'mpi4py'}}); "
            "print(','.join(heavy))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "", f"{module} pulls in {done.stdout.strip()}"
