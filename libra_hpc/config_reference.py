"""configs/README.md, generated from the schema so the documentation cannot drift from it.

    python -m libra_hpc.config_reference --write    # rewrite configs/README.md
    python -m libra_hpc.config_reference            # print it

tests/test_repo_contract.py fails when the file and the schema disagree, and
tests/test_sim_config.py when an option of either schema (experiment, simulator scenario)
is missing from it.
"""

from __future__ import annotations

import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from libra_hpc.config import ExperimentConfig
from libra_hpc.sim.config import SimConfig

README = Path(__file__).resolve().parents[1] / "configs" / "README.md"

INTRO = """\
# Configuration

One YAML file describes one experiment. Every section and every key is optional: what is
left out takes the default below. A misspelled key, a value of the wrong type or a shape
the cluster cannot hold (e.g. TP 16 on 8-GPU nodes) stops `launch.py` before anything is
submitted, naming the field, what was given and the valid keys or values. A key given twice
in one mapping is refused too, with both line numbers (YAML would keep the last silently).

- `default.yaml`: the embedded default, runs anywhere (`python launch.py --nodes 6`).
- `a800-6node.yaml`: the Libra paper's 48-GPU setup (6 × 8 A800-80G, Qwen3-14B).
- `learning.yaml`, `learning-arith.yaml`: the learning experiments of
  `benchmarks/bench_learning.py` (the search task; the arithmetic task).
- `soak.yaml`: the soak run of `benchmarks/bench_soak.py` (faulty tools, a killed leader, a resume).
- `sim/*.yaml`: simulator scenarios (`python -m libra_hpc.sim --config configs/sim/a800-swe.yaml`):
  the same schema plus the simulator's own sections ([Simulator scenarios](#simulator-scenarios)).
- `hardware/*.yaml`, `models/*.yaml`: GPU and model profiles for the planner's cost
  models (`libra_hpc.planner.profiles`; every number names its source in a comment).

Override any field from the command line: `python launch.py --set rl.steps=8 --set
cluster.partition=gpu` (values are YAML: `--set rollout.tp_per_node=[1,1,2,4]`);
`--nodes`, `--gpus-per-node` and `--executor` are shortcuts for the cluster fields.
`sbatch sbatch/libra.sh CONFIG KEY=VALUE ...` takes the same overrides and sets
`cluster.nodes` / `cluster.gpus_per_node` from the allocation. `python -m libra_hpc.sim`
takes `--set` the same way.

YAML is read with YAML 1.2 numbers: `time_limit: 2:00:00` is a time, not 7200.

The batch of an RL step is `rl.prompts_per_step × rl.group_size` trajectories, and the
training step's global batch is that number (there is no separate training batch size).

This file is generated from the schema (`libra_hpc/config*.py`, `libra_hpc/sim/config.py`):
`python -m libra_hpc.config_reference --write`.

## What the job uses today

The schema describes the whole system; the job `launch.py` submits does not read all of it
yet. Kept here, in one place, instead of in the field descriptions; update it with the code.

- **Read by the running job** (`launch.py`, `libra_hpc/run.py`, `libra_hpc/runtime/`,
  `libra_hpc/cluster/`), `job.mode: rl`: `cluster` (the Slurm request, the MPI world,
  `torch_backend`, and `hardware` for the planner's cost models), the initial layout
  (`training.tensor_parallel`, `pipeline_parallel`, `data_parallel`, `rollout.tp_per_node`,
  `planner.hybrid_nodes`), `model`, the engines' fields (`training.micro_batch_size`, `lr`,
  `grad_clip`, `ppo_clip`, `distributed_optimizer`, `seq_len`, `rollout.max_new_tokens`,
  `temperature`, `kv_cache_gib`), `planner` (the control loop the simulator runs too,
  through `ControlOptions.from_config`, libra_hpc/planner/options.py: the prior, the
  replanning gate, `window`, `memory_headroom`, `replan`, `reconfig_s`, `price_drain`, `price_migrations`,
  the hybrid pool's `min_rollout_gpus` and `hybrid_margin`), `parallel`, the C-MLFQ queue and router
  (`scheduler.policy`, `tree_window`, `min_samples`, `rebuild_every`, `predictor_noise`,
  `affinity_tokens`, `bucket_token_limits`, `lease_s`, `max_batch`, `size_thresholds`,
  `error_markers`), `tools`, `rl` (task, steps, batch, staleness, GRPO options,
  `update_epochs`), `tasks`, `warmstart`, `job` and `logging`. `job.mode: check` reads the
  cluster and layout fields, `rl.steps` and the scripted hybrid-pool moves
  `planner.borrow_at_step` / `return_at_step`.
- **Read by `launch.py --plan`** (the control loop's first decision, printed, not run):
  `model.name`, `cluster.hardware`, `planner.prior`, `planner.hybrid_nodes`,
  `planner.min_rollout_gpus`, `training.seq_len`, `rl.prompts_per_step × rl.group_size`,
  `rl.max_staleness`, `rl.seed`, and `scheduler.bucket_token_limits` (its keys are the
  rollout TP sizes the planner may use).
- **Acted on only by the simulator so far**: `scheduler.bucket_limits` and `saturation`,
  and the simulator's own sections. The simulator also reads `cluster.nodes`,
  `gpus_per_node`, `hardware`, `model.name`, `training.seq_len`, `rl`, the rest of
  `planner` but `borrow_at_step` / `return_at_step`, and `scheduler`'s routing fields; it
  ignores the initial layout (its allocations come from the planner or the baselines'
  search), the rest of `cluster`, `tools` and `logging`.
- **Read by the learning benchmark** (`benchmarks/bench_learning.py` with
  `configs/learning.yaml`, docs/learning.md: the learning loop alone on two ranks): `warmstart`,
  `rl`, `rollout`, `training`, `model`, `tools` and `tasks`.
- **Read by nothing yet**: `scheduler.tree_save_every_s` (the queue service's benchmark and
  tests pass their own value).
"""

SIM_INTRO = """\
# Simulator scenarios

A scenario (`configs/sim/*.yaml`) is an experiment configuration (every section above,
same keys, same defaults) plus the sections below, read by the same loader with the same
errors. The simulator takes its allocations from the planner (Libra) or from a search
(baselines), so the live job's checks of the initial layout (`training` TP×PP×DP,
`rollout.tp_per_node`, the batch split over DP, `planner.borrow_at_step`) do not apply to
a scenario; see [What the job uses today](#what-the-job-uses-today) for what it reads.
"""


def render() -> str:
    parts = [INTRO]
    parts.extend(_section(name, field) for name, field in ExperimentConfig.model_fields.items())
    parts.append(SIM_INTRO)
    own = {name: f for name, f in SimConfig.model_fields.items() if name not in ExperimentConfig.model_fields}
    top = {name: f for name, f in own.items() if _model(f.annotation) is None}
    parts.append(f"## Scenario top level\n\n{_doc(SimConfig)}\n")
    parts.append("| key | type | default | meaning |\n|---|---|---|---|")
    parts.extend(_row(name, f) for name, f in top.items())
    parts.append("")
    parts.extend(_section(name, f) for name, f in own.items() if name not in top)
    return "\n".join(parts)


def field_paths(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every option of ``model`` as it appears in the README: dotted paths, ``[]`` for an
    item of a list, ``.<key>`` for a value of a mapping of sections."""
    paths = []
    for key, field in model.model_fields.items():
        path = f"{prefix}{key}"
        paths.append(path)
        nested = _model(field.annotation)
        if nested is not None:
            paths.extend(field_paths(nested, f"{path}{_joint(field.annotation)}."))
    return paths


def _section(name: str, field: FieldInfo) -> str:
    section = _model(field.annotation)
    assert section is not None, name
    lines = [f"## `{name}`\n\n{_doc(section)}\n", "| key | type | default | meaning |\n|---|---|---|---|"]
    lines.extend(_rows(name, section))
    return "\n".join(lines) + "\n"


def _rows(prefix: str, model: type[BaseModel]) -> list[str]:
    """One table row per field; nested sections (``planner.prior``, ``workload.tools[]``)
    expand in place."""
    rows = []
    for key, sub in model.model_fields.items():
        nested = _model(sub.annotation)
        if nested is not None:
            joint = _joint(sub.annotation)
            what = {"[]": "list of sections", ".<key>": "mapping of sections"}.get(joint, "section")
            keys = get_args(get_args(sub.annotation)[0]) if joint == ".<key>" else ()
            if keys:
                what += ", keys " + ", ".join(f"`{k}`" for k in keys)
            meaning = _cell(f"{_doc(nested)} {sub.description or ''}")
            rows.append(f"| `{prefix}.{key}` | {what} | {_default(sub)} | {meaning} |")
            rows.extend(_rows(f"{prefix}.{key}{joint}", nested))
            continue
        rows.append(_row(f"{prefix}.{key}", sub))
    return rows


def _row(path: str, field: FieldInfo) -> str:
    meaning = _cell(field.description or "")
    return f"| `{path}` | {_type(field.annotation)} | {_default(field)} | {meaning} |"


def _model(annotation: Any) -> type[BaseModel] | None:
    """The section a field holds, through ``X | None``, ``list[X]``, ``dict[K, X]``."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    if get_origin(annotation) in (typing.Union, types.UnionType, list, dict):
        for arg in get_args(annotation)[::-1]:
            found = _model(arg)
            if found is not None:
                return found
    return None


def _joint(annotation: Any) -> str:
    """How the path continues into a nested section: ``[]`` for lists, ``.<key>`` for maps."""
    origin = get_origin(annotation)
    if origin is list:
        return "[]"
    if origin is dict:
        return ".<key>"
    return ""


def _cell(text: str) -> str:
    """Text on one line, safe in a Markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")


def _doc(model: type[BaseModel]) -> str:
    return " ".join((model.__doc__ or "").split())


def _type(annotation: Any) -> str:
    if get_origin(annotation) is Literal:
        return "one of " + ", ".join(f"`{v}`" for v in get_args(annotation))
    text = str(annotation).replace("typing.", "").replace("<class '", "").replace("'>", "")
    for module in ("libra_hpc.sim.config.", "libra_hpc.envs.synthetic.", "libra_hpc.config_systems.",
                   "libra_hpc.config_learning.", "libra_hpc.config."):
        text = text.replace(module, "")
    return text.replace("|", "or")


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return ""
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{str(value).replace('|', chr(92) + '|')}`"


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
