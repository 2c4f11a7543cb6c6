"""The compiled scheduler core (libra_hpc/_compiled.py, setup.py): CI runs the compiled
modules, the same tests pass on the Python sources, and a compiled module older than its
source is never run."""

from __future__ import annotations

import ast
import importlib.machinery
import os
import subprocess
import sys
from pathlib import Path

from libra_hpc import _compiled

ROOT = Path(__file__).resolve().parent.parent


def test_setup_compiles_the_modules_the_loader_knows():
    tree = ast.parse((ROOT / "setup.py").read_text())
    listed = next(node.value for node in tree.body if isinstance(node, ast.Assign)
                  and getattr(node.targets[0], "id", None) == "COMPILED")
    assert ast.literal_eval(listed) == _compiled.COMPILED


def test_ci_runs_the_compiled_scheduler():
    from libra_hpc.scheduler import protocol, records, routers, service, state, tree
    compiled = {m.__name__: _compiled.is_compiled(m) for m in (state, tree, routers, protocol, records, service)}
    if os.environ.get("CI"):  # scripts/install.sh builds it; a silent fallback would hide a broken build
        assert all(compiled.values()), f"the install left these modules uncompiled: {compiled}"
    assert _compiled.status() == ("compiled" if compiled["libra_hpc.scheduler.service"] else "source")
    assert len(set(compiled.values())) == 1, f"compiled and source modules mixed: {compiled}"


def test_the_scheduler_tests_pass_on_the_python_sources():
    code = ("import sys, pytest; sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', '--scheduler-source', "
            "'tests/test_sched_service.py', 'tests/test_sched_routers.py', 'tests/test_sched_tree.py', "
            "'tests/test_sched_state.py']))")
    check = ("from libra_hpc.scheduler import service; from libra_hpc import _compiled; "
             "assert not _compiled.is_compiled(service), service.__file__")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert " passed" in done.stdout and "failed" not in done.stdout
    forced = subprocess.run([sys.executable, "-c", "from libra_hpc import _compiled; _compiled.use_sources(); " + check],
                            cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert forced.returncode == 0, forced.stderr


def test_a_compiled_module_older_than_its_source_is_not_used(tmp_path):
    suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
    for module in _compiled.COMPILED:
        (tmp_path / f"{module}.py").write_text("")
        (tmp_path / f"{module}{suffix}").write_bytes(b"")
    assert _compiled.stale_modules(tmp_path) == []
    os.utime(tmp_path / "tree.py", (1e9 + 10, 1e9 + 10))
    os.utime(tmp_path / f"tree{suffix}", (1e9, 1e9))  # built before the last edit
    assert _compiled.stale_modules(tmp_path) == ["tree"]
    (tmp_path / f"service{suffix}").unlink()  # not built: nothing stale about it
    assert _compiled.extension_of("service", tmp_path) is None
    assert _compiled.stale_modules(tmp_path) == ["tree"]
    # A stale build in the real package falls back to every source, with a warning that says how to rebuild.
    code = ("import os, logging; logging.basicConfig(); from libra_hpc import _compiled; "
            "_compiled.stale_modules = lambda folder=None: ['tree']; "
            "from libra_hpc.scheduler import service, tree; "
            "assert not _compiled.is_compiled(service) and not _compiled.is_compiled(tree)")
    warned = _fresh_python(code)
    assert "tree.py changed since they were compiled" in warned and "pip install -e ." in warned


def test_compiled_modules_without_their_shared_library_are_not_used():
    if _compiled.extension_of("service") is None:
        return  # nothing compiled here: nothing to lose (CI builds it, test_ci_runs_the_compiled_scheduler)
    code = ("import logging; logging.basicConfig(); from libra_hpc import _compiled; real = _compiled.extension_of; "
            "_compiled.extension_of = lambda module, folder=_compiled.SOURCES: None if module == _compiled.GROUP "
            "else real(module, folder); "
            "from libra_hpc.scheduler import service; assert not _compiled.is_compiled(service)")
    assert "without their shared library" in _fresh_python(code)


def _fresh_python(code: str) -> str:
    """Run ``code`` in a new interpreter from the repository root; its stderr (it must succeed)."""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stderr
