"""What the repository promises its users: the README's set-up commands are the ones CI
runs, and configs/README.md documents exactly the schema."""

from __future__ import annotations

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
