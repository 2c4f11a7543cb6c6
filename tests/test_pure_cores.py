"""The pure-logic cores import neither MPI nor torch (DESIGN.md: the simulator and the
live runtime drive the very same objects)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

PURE = ["libra_hpc.config", "libra_hpc.cluster.layout", "libra_hpc.cluster.topology", "libra_hpc.cluster.slurm",
        "libra_hpc.scheduler", "libra_hpc.scheduler.service", "libra_hpc.scheduler.routers",
        "libra_hpc.scheduler.synthetic", "libra_hpc.planner", "libra_hpc.planner.costs", "libra_hpc.planner.profiles",
        "libra_hpc.planner.hybrid", "libra_hpc.planner.search", "libra_hpc.planner.gate",
        "libra_hpc.planner.prior", "libra_hpc.planner.control", "libra_hpc.sim", "libra_hpc.sim.run",
        "libra_hpc.tools", "libra_hpc.tools.orchestrator", "libra_hpc.tools.scheduling", "libra_hpc.tools.replay",
        "libra_hpc.rl", "libra_hpc.rl.trajectory", "libra_hpc.rl.grpo", "libra_hpc.rl.staleness", "libra_hpc.rl.step",
        "libra_hpc.rl.rollout", "libra_hpc.rl.warmstart"]


@pytest.mark.parametrize("module", PURE)
def test_module_imports_neither_mpi_nor_torch(module):
    code = (f"import sys, {module}; heavy = sorted({{m.split('.')[0] for m in sys.modules}} & {{'torch', 'mpi4py'}}); "
            "print(','.join(heavy))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "", f"{module} pulls in {done.stdout.strip()}"


ROOT = Path(__file__).resolve().parent.parent
LIVE = ["runtime", "cluster", "planner", "scheduler", "engines", "tools"]
"""Packages of the live job: none may import the simulator (decisions live in planner/)."""


def _imports(path, root=None) -> set[str]:
    """Modules ``path`` imports (relative imports resolved against its package under ``root``)."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against the file's package
                parts = path.parent.relative_to(root or ROOT).parts
                package = parts[: len(parts) - node.level + 1]
                base = ".".join([*package, base] if base else package)
            found.add(base)
    return found



@pytest.mark.parametrize("package", LIVE)
def test_live_code_imports_nothing_from_the_simulator(package):
    offenders = {str(f.relative_to(ROOT)): sorted(m for m in _imports(f) if m == "libra_hpc.sim" or m.startswith("libra_hpc.sim."))
                 for f in (ROOT / "libra_hpc" / package).rglob("*.py")}
    offenders = {f: ms for f, ms in offenders.items() if ms}
    assert not offenders, f"the live code imports the simulator: {offenders}"


def test_the_import_scan_sees_relative_imports(tmp_path):
    """The scan resolves ``from ..sim import x`` (it must be able to fail)."""
    f = tmp_path / "libra_hpc" / "runtime" / "probe.py"
    f.parent.mkdir(parents=True)
    f.write_text("from ..sim import run\nfrom libra_hpc.sim.context import Context\nfrom . import loop\n")
    assert _imports(f, tmp_path) == {"libra_hpc.sim", "libra_hpc.sim.context", "libra_hpc.runtime"}


@pytest.mark.parametrize("module", ["libra_hpc.envs", "libra_hpc.envs.synthetic", "libra_hpc.envs.toolcall",
                                    "libra_hpc.envs.task", "libra_hpc.envs.arithmetic", "libra_hpc.envs.search",
                                    "libra_hpc.envs.plugin", "libra_hpc.envs.registry", "libra_hpc.envs.solvers"])
def test_the_shared_workload_imports_neither_mpi_nor_torch_nor_the_simulator(module):
    """The simulator, the scheduler's benchmark and tool replay share libra_hpc.envs; it is
    a pure core, below all three (issue 12)."""
    code = (f"import sys, {module}; print(','.join(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('torch', 'mpi4py') or m == 'libra_hpc.sim' or m.startswith('libra_hpc.sim.'))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "", f"{module} pulls in {done.stdout.strip()}"
    above = ("libra_hpc.sim", "libra_hpc.scheduler", "libra_hpc.tools")  # the packages that use it
    offenders = {str(f.relative_to(ROOT)): sorted(m for m in _imports(f) if m.startswith(above))
                 for f in (ROOT / "libra_hpc" / "envs").rglob("*.py")}
    assert not {f: ms for f, ms in offenders.items() if ms}, offenders
