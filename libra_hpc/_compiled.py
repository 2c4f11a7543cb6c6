"""The compiled scheduler core: which modules are compiled, whether the compiled ones are
current, and the switch to their Python sources. (Here, outside libra_hpc.scheduler, so
that the switch can be thrown before that package imports its modules.)

``pip install -e .`` (scripts/install.sh) compiles :data:`COMPILED` with mypyc (setup.py):
the same source, type-checked and turned into a C extension that sits beside each ``.py``
and is imported instead of it. The queue service answers a decision in about half the
time (benchmarks/bench_cmlfq.py). Nothing else changes: without a compiler the build
keeps the pure-Python modules, and a module whose ``.py`` is newer than its extension (an
edit since the last install) would run stale code, so then every compiled module is
loaded from source instead, with a warning, until the next ``pip install -e .``.

No MPI, no torch; stdlib only (imported first by ``libra_hpc.scheduler``; the tests'
``--scheduler-source`` option calls :func:`use_sources`).
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import logging
import sys
from pathlib import Path

log = logging.getLogger(__name__)

PACKAGE = "libra_hpc.scheduler"
COMPILED = ("state", "tree", "routers", "protocol", "records", "service")
"""Modules setup.py compiles: the hot path of a decision. types.py stays interpreted (the
data types every other package shares, and errors that subclass builtin errors, which a
compiled class cannot)."""

SOURCES = Path(__file__).resolve().parent / "scheduler"
GROUP = "_mypyc__mypyc"
"""mypyc's shared library of the compiled modules, beside them (setup.py's group_name)."""


def extension_of(module: str, folder: Path = SOURCES) -> Path | None:
    """The compiled extension of ``module`` (one of :data:`COMPILED`) beside its source, if built."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidate = folder / f"{module}{suffix}"
        if candidate.exists():
            return candidate
    return None


def stale_modules(folder: Path = SOURCES) -> list[str]:
    """Compiled modules whose source changed after they were built."""
    stale = []
    for module in COMPILED:
        extension = extension_of(module, folder)
        if extension is not None and (folder / f"{module}.py").stat().st_mtime > extension.stat().st_mtime:
            stale.append(module)
    return stale


class _SourceFinder:
    """A meta path finder that loads the :data:`COMPILED` modules from their ``.py``."""

    def find_spec(self, name: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        package, _, module = name.rpartition(".")
        if package != PACKAGE or module not in COMPILED:
            return None
        return importlib.util.spec_from_file_location(name, SOURCES / f"{module}.py")


def use_sources() -> None:
    """Import the compiled modules from their Python sources from now on (all of them:
    compiled and interpreted modules of one build are not mixed). Must run before the
    first of them is imported; RuntimeError names the ones already loaded."""
    loaded = [m for m in COMPILED if f"{PACKAGE}.{m}" in sys.modules and is_compiled(sys.modules[f"{PACKAGE}.{m}"])]
    if loaded:
        raise RuntimeError(f"{PACKAGE}: compiled modules {loaded} are already imported; choose the Python "
                           "sources before importing them")
    if not any(isinstance(finder, _SourceFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _SourceFinder())


def is_compiled(module: object) -> bool:
    """Whether ``module`` was loaded from a compiled extension."""
    return str(getattr(module, "__file__", "")).endswith(tuple(importlib.machinery.EXTENSION_SUFFIXES))


def status() -> str:
    """``compiled`` (the service module runs compiled), ``source`` (Python), for reports."""
    module = sys.modules.get(f"{PACKAGE}.service")
    if module is None:
        module = importlib.import_module(f"{PACKAGE}.service")
    return "compiled" if is_compiled(module) else "source"


def prefer_current() -> None:
    """Fall back to the sources when a compiled module is older than its source, or when
    the compiled modules' shared library is missing (a copy without it)."""
    if any(extension_of(module) for module in COMPILED) and extension_of(GROUP) is None:
        log.warning("%s: compiled modules without their shared library %s; running every scheduler module from "
                    "its Python source. Rebuild with `pip install -e .`.", PACKAGE, GROUP)
        use_sources()
        return
    stale = stale_modules()
    if stale:
        log.warning("%s: %s changed since they were compiled; running every scheduler module from its Python "
                    "source (about half the speed). Rebuild with `pip install -e .` (or scripts/install.sh).",
                    PACKAGE, ", ".join(f"{m}.py" for m in stale))
        use_sources()
