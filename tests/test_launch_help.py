"""``python launch.py --help``: the examples keep one command per line (click rewraps a
docstring's paragraphs unless told not to)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from click.testing import CliRunner

ROOT = Path(__file__).resolve().parents[1]


def test_the_help_lists_one_example_per_line():
    spec = importlib.util.spec_from_file_location("launch_cli", ROOT / "launch.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out = CliRunner().invoke(module.main, ["--help"], terminal_width=80).output
    examples = [line.strip() for line in out.splitlines() if line.strip().startswith("python launch.py")]
    assert len(examples) == 6, out
    assert examples[0].startswith("python launch.py --nodes 6") and examples[0].endswith("# the embedded default")
    assert all(e.count("python launch.py") == 1 for e in examples)
