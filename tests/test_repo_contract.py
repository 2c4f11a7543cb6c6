"""What the repository promises its users and its authors: the README's set-up commands are
the ones CI runs, configs/README.md documents exactly the schema, and no import of
``libra_hpc/`` runs up the layers (:data:`LAYERS`)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from libra_hpc.config_reference import README as CONFIG_README
from libra_hpc.config_reference import render

ROOT = Path(__file__).resolve().parents[1]


def readme_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S)][:2]


def test_readme_opens_with_install_and_run_then_install_and_test():
    main, tests = readme_commands()
    assert main == "bash scripts/install.sh && python launch.py --nodes 6"
    assert tests.startswith("bash scripts/install.sh --test && ") and "pytest" in tests


def test_ci_runs_the_readme_test_command():
    ci_lines = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert readme_commands()[1] in ci_lines


def test_config_reference_matches_the_schema():
    assert CONFIG_README.read_text() == render(), "regenerate: python -m libra_hpc.config_reference --write"


# ---------------------------------------------------------------------------- layers

LAYERS = (
    ("entry points", {"__init__", "launcher", "run", "config_reference"}),
    ("drivers", {"runtime", "sim"}),
    ("learning and tools", {"rl", "tools"}),
    ("cores and engines", {"planner", "scheduler", "engines"}),
    ("world and tasks", {"cluster", "envs"}),
    ("leaves", {"parallel", "metrics"}),
    ("config", {"config", "_compiled"}),
)
"""The packages of ``libra_hpc/`` from the top down (``config`` is every ``config*.py``
module). A module imports only its own package and the layers below it: never a higher
layer, never another package of its own layer (the simulator and the runtime drive the
same cores and never each other). Imports inside functions count too: they run all the
same. Beside STYLE.md's coarse order (cli/runtime → cluster/engines → planner/scheduler →
types) two things are as the code has them: cluster/ sits under the cores (they share its
layout, message tags and process environment; it decides nothing), and rl/ sits over
engines/ (the warm start and the GRPO batch build on the training engine)."""


def _package(path: Path) -> str:
    """``libra_hpc/a/b.py`` → ``a``; ``libra_hpc/config_yaml.py`` → ``config``."""
    return _grouped(path.relative_to(ROOT / "libra_hpc").parts[0].removesuffix(".py"))


def _module_package(dotted: str) -> str | None:
    """``libra_hpc.a.b`` → ``a``; None outside ``libra_hpc``."""
    parts = dotted.split(".")
    return _grouped(parts[1]) if parts[0] == "libra_hpc" and len(parts) > 1 else None


def _grouped(name: str) -> str:
    return "config" if name.startswith("config") and name != "config_reference" else name


def package_imports() -> list[tuple[str, str, str]]:
    """Every import of a ``libra_hpc`` module by another package, module-level or inside a
    function: ``(importing package, imported package, "file:line module")``."""
    found = []
    for path in sorted((ROOT / "libra_hpc").rglob("*.py")):
        source = _package(path)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "libra_hpc":
                targets = [f"libra_hpc.{alias.name}" for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [node.module]
            else:
                assert not isinstance(node, ast.ImportFrom), f"{path}:{node.lineno}: a relative import"
                continue
            for target in targets:
                package = _module_package(target)
                if package is not None and package != source:
                    found.append((source, package, f"{path.relative_to(ROOT)}:{node.lineno} {target}"))
    return found


def layer_violations() -> list[str]:
    rank = {package: i for i, (_, packages) in enumerate(LAYERS) for package in packages}
    on_disk = {_package(p) for p in (ROOT / "libra_hpc").rglob("*.py")}
    problems = [f"libra_hpc/{p}: in no layer of LAYERS" for p in sorted(on_disk - rank.keys())]
    for source, target, where in package_imports():
        if rank[target] < rank[source]:
            problems.append(f"{where}: {source} ({LAYERS[rank[source]][0]}) imports up, {target} "
                            f"({LAYERS[rank[target]][0]})")
        elif rank[target] == rank[source]:
            problems.append(f"{where}: {source} imports {target}, of its own layer ({LAYERS[rank[source]][0]})")
    return problems


def package_cycles() -> list[list[str]]:
    """Strongly connected sets of more than one package in the import graph."""
    graph: dict[str, set[str]] = {}
    for source, target, _ in package_imports():
        graph.setdefault(source, set()).add(target)
    reach = {p: _reachable(graph, p) for p in graph}
    cycles = {frozenset(q for q in reach[p] if p in reach.get(q, ())) for p in graph if p in reach[p]}
    return sorted(sorted(cycle) for cycle in cycles)


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


def test_no_import_runs_up_the_layers():
    assert layer_violations() == []


def test_no_import_cycle_between_packages():
    assert package_cycles() == []


if __name__ == "__main__":  # the check's own report: python tests/test_repo_contract.py
    imports = package_imports()
    print(f"{len(imports)} imports between packages of libra_hpc/ (module and function level)")
    for line in layer_violations() or ["no import runs up the layers"]:
        print(line)
    print(f"package cycles: {package_cycles() or 'none'}")
