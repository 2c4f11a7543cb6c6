"""configs/README.md, generated from the schema so the documentation cannot drift from it.

    python -m libra_hpc.config_reference --write    # rewrite configs/README.md
    python -m libra_hpc.config_reference            # print it

tests/test_config_reference.py fails when the file and the schema disagree.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel

from libra_hpc.config import ExperimentConfig

README = Path(__file__).resolve().parents[1] / "configs" / "README.md"

INTRO = """\
# Experiment configuration

One YAML file describes one experiment. Every section and every key is optional: what is
left out takes the default below. A misspelled key, a value of the wrong type or a shape
the cluster cannot hold (e.g. TP 16 on 8-GPU nodes) stops `launch.py` before anything is
submitted, naming the field.

- `default.yaml`: the embedded default, runs anywhere (`python launch.py --nodes 6`).
- `a800-6node.yaml`: the Libra paper's 48-GPU setup (6 × 8 A800-80G, Qwen3-14B).
- `hardware/*.yaml`, `models/*.yaml`: GPU and model profiles for the planner's cost
  models (`libra_hpc.planner.profiles`; every number names its source in a comment).

Override any field from the command line: `python launch.py --set rl.steps=8 --set
cluster.partition=gpu` (values are YAML: `--set rollout.tp_per_node=[1,1,2,4]`);
`--nodes`, `--gpus-per-node` and `--executor` are shortcuts for the cluster fields.
`sbatch sbatch/libra.sh CONFIG KEY=VALUE ...` takes the same overrides and sets
`cluster.nodes` / `cluster.gpus_per_node` from the allocation.

YAML is read with YAML 1.2 numbers: `time_limit: 2:00:00` is a time, not 7200.

This file is generated from the schema (`libra_hpc/config.py`):
`python -m libra_hpc.config_reference --write`.
"""


def render() -> str:
    parts = [INTRO]
    for name, field in ExperimentConfig.model_fields.items():
        section: type[BaseModel] = field.annotation  # type: ignore[assignment]
        parts.append(f"## `{name}`\n\n{_doc(section)}\n")
        parts.append("| key | type | default | meaning |\n|---|---|---|---|")
        parts.extend(_rows(name, section))
        parts.append("")
    return "\n".join(parts)


def _rows(prefix: str, model: type[BaseModel]) -> list[str]:
    """One table row per field; nested sections (e.g. ``planner.prior``) expand in place."""
    rows = []
    for key, sub in model.model_fields.items():
        if isinstance(sub.annotation, type) and issubclass(sub.annotation, BaseModel):
            rows.append(f"| `{prefix}.{key}` | section | | {_doc(sub.annotation)} |")
            rows.extend(_rows(f"{prefix}.{key}", sub.annotation))
            continue
        meaning = " ".join((sub.description or "").split())
        default = _default(sub.get_default(call_default_factory=True))
        rows.append(f"| `{prefix}.{key}` | {_type(sub.annotation)} | `{default}` | {meaning} |")
    return rows


def _doc(model: type[BaseModel]) -> str:
    return " ".join((model.__doc__ or "").split())


def _type(annotation: Any) -> str:
    if get_origin(annotation) is Literal:
        return "one of " + ", ".join(f"`{v}`" for v in get_args(annotation))
    text = str(annotation).replace("typing.", "").replace("<class '", "").replace("'>", "")
    return text.replace("|", "or")


def _default(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value).replace("|", "\\|")


def main(argv: list[str]) -> int:
    text = render()
    if "--write" in argv:
        README.write_text(text)
        print(f"wrote {README}")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
