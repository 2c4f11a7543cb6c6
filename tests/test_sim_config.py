"""Scenario files and traces that are wrong fail with the file, the field and what to do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from libra_hpc.config import ConfigError, ExperimentConfig, load_config, validate_config
from libra_hpc.planner.gate import GateOptions
from libra_hpc.sim.__main__ import main
from libra_hpc.sim.config import SimConfig, load_sim_config, validate_sim_config
from libra_hpc.sim.trace import TraceError, read_trace, to_record, write_trace
from libra_hpc.envs.synthetic import SyntheticWorkload

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = sorted((ROOT / "configs" / "sim").glob("*.yaml"))


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_every_shipped_scenario_loads(path):
    cfg = load_sim_config(path)
    assert cfg.name == path.stem and cfg.policies


def base() -> dict:
    return load_sim_config(ROOT / "configs" / "sim" / "a800-swe.yaml").model_dump(mode="python")


def problems(raw: dict) -> str:
    with pytest.raises(ConfigError) as err:
        validate_sim_config(raw, "scenario.yaml")
    return str(err.value)


def test_unknown_key_names_the_path_and_the_valid_keys():
    raw = base()
    raw["workload"]["tols"] = raw["workload"].pop("tools")
    text = problems(raw)
    assert "scenario.yaml" in text and "workload.tols: unknown key in workload; did you mean 'tools'?" in text
    assert "Valid keys are: prompt_pool, prompt_tokens, turn_tokens" in text


@pytest.mark.parametrize("path, valid", [
    ("planner.every_step", "prior, hybrid_nodes, min_rollout_gpus, window, every_steps"),  # an experiment section
    ("costs.reconfig", "weight_sync_s, colocate_switch_s, reconfig_s"),                   # a simulator section
    ("workload.tools.0.latency_s.medain", "median, sigma"),                                # inside a list item
    ("workload.tools.1.output_tokens.success.sigmma", "median, sigma"),                     # inside a dict value
    ("polices", "name, workload, trace, costs, search, policies"),                          # the top level
])
def test_unknown_key_anywhere_in_a_scenario_file_fails_naming_it(tmp_path, path, valid):
    raw = base()
    node = raw
    *parents, leaf = path.split(".")
    for part in parents:
        node = node[int(part)] if part.isdigit() else node[part]
    node[leaf] = 1
    file = tmp_path / "typo.yaml"
    file.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as err:
        load_sim_config(file)
    assert str(file) in str(err.value)
    assert f"{path}: unknown key" in str(err.value) and valid in str(err.value)


@pytest.mark.parametrize("old, new", [("seed", "rl.seed"), ("cluster.model", "model.name"),
                                      ("rl.seq_len", "training.seq_len")])
def test_a_key_of_the_old_scenario_schema_says_where_it_moved(old, new):
    raw = base()
    node = raw
    *parents, leaf = old.split(".")
    for part in parents:
        node = node[part]
    node[leaf] = 0
    assert f"{old}: unknown key" in problems(raw) and f"it moved to {new}" in problems(raw)


def test_a_key_given_twice_is_refused_naming_it_and_both_lines(tmp_path):
    lines = (ROOT / "configs" / "sim" / "a800-swe.yaml").read_text().splitlines()
    at = lines.index("planner:") + 1
    lines[at:at] = ["  every_steps: 5"]  # the file sets planner.every_steps further down as well
    second = next(i for i, line in enumerate(lines) if line.startswith("  every_steps:") and i != at)
    file = tmp_path / "twice.yaml"
    file.write_text("\n".join(lines) + "\n")
    with pytest.raises(ConfigError) as err:
        load_sim_config(file)
    text = str(err.value)
    assert str(file) in text
    assert f"planner.every_steps: the key 'every_steps' is given twice (lines {at + 1} and {second + 1})" in text


def test_a_scenario_is_an_experiment_without_the_live_layout_checks():
    raw = base()
    cfg = validate_sim_config(raw)
    assert isinstance(cfg, ExperimentConfig) and cfg.batch_size == 40 * 8
    # The live job's initial-layout defaults (2-GPU rollout pattern, TP 1, borrow at step 2)
    # do not fit a 6 × 8 cluster run for 2 steps; the simulator takes its layouts from the
    # planner, so the scenario is valid while the same sections as an experiment are not.
    raw["rl"]["steps"] = 2
    raw["planner"]["borrow_at_step"] = 5
    validate_sim_config(raw)
    experiment = {k: v for k, v in raw.items() if k in ExperimentConfig.model_fields}
    with pytest.raises(ConfigError, match="rollout.tp_per_node: \\[1, 1\\] sums to 2 GPUs"):
        validate_config(experiment)
    # The checks both share still run for a scenario.
    raw["scheduler"]["size_thresholds"] = [4096, 256]
    assert "scheduler.size_thresholds" in problems(raw)


def test_gate_fields_are_in_the_experiment_planner_and_reach_the_control_loop():
    from libra_hpc.sim.context import Context
    from libra_hpc.sim.policies import SETUPS, control_options

    gate = {"every_steps": 3, "margin_s": 2.5, "confirm_checks": 4, "min_dwell_steps": 7, "min_gain": 0.05}
    more = {"window": 64, "hybrid_margin": 0.25, "min_rollout_gpus": 9}
    live = load_config(None, [f"planner.{k}={v}" for k, v in {**gate, **more}.items()])
    assert {k: getattr(live.planner, k) for k in {**gate, **more}} == {**gate, **more}
    cfg = load_sim_config(ROOT / "configs" / "sim" / "a800-swe.yaml",
                          {"rl.steps": 2, **{f"planner.{k}": v for k, v in {**gate, **more}.items()}})
    options = control_options(Context(cfg), SETUPS["libra"])
    assert options.gate == GateOptions(**gate)
    assert (options.window, options.hybrid_margin, options.min_rollout_gpus) == (64, 0.25, 9)


def test_wrong_types_ranges_and_cross_field_errors_are_named():
    raw = base()
    raw["rl"]["steps"] = "100"
    raw["cluster"]["gpus_per_node"] = 0
    text = problems(raw)
    assert "rl.steps" in text and "cluster.gpus_per_node" in text
    raw = base()
    raw["scheduler"]["bucket_token_limits"] = {3: 100}
    assert "powers of two" in problems(raw)
    raw = base()
    raw["trace"] = "x.jsonl"
    assert "exactly one of 'workload'" in problems(raw)
    raw = base()
    raw["workload"]["tools"][0]["output_tokens"].pop("timeout")
    assert "missing ['timeout']" in problems(raw)
    raw = base()
    raw["policies"] = ["libra", "libra_fast"]
    assert "policies.1" in problems(raw)


def test_prompts_per_step_beyond_the_pool_is_refused():
    raw = base()
    raw["workload"]["prompt_pool"] = 10
    assert "rl.prompts_per_step: 40 exceeds workload.prompt_pool=10" in problems(raw)


def test_trace_round_trip_and_errors_name_line_and_field(tmp_path):
    cfg = load_sim_config(ROOT / "configs" / "sim" / "a800-swe.yaml")
    batch = SyntheticWorkload(cfg.workload, cfg.rl, 3, cfg.training.seq_len).batch(0)[:20]
    path = tmp_path / "t.jsonl"
    assert write_trace(path, batch) == 20
    assert read_trace(path) == batch
    record = to_record(batch[0])
    record["turns"][0]["tool"] = {"name": "bash", "latency_s": -1, "status": "success", "output_tokens": 3}
    record["turns"].append({"gen_tokens": 5, "tool": None})
    path.write_text("\n" + json.dumps(record) + "\n")
    with pytest.raises(TraceError, match=r"t.jsonl:2: turns\[0\].tool.latency_s"):
        read_trace(path)
    path.write_text(json.dumps({**to_record(batch[0]), "extra": 1}))
    with pytest.raises(TraceError, match=r"unknown keys \['extra'\]"):
        read_trace(path)
    path.write_text('{"step": 0')
    with pytest.raises(TraceError, match="t.jsonl:1: not JSON"):
        read_trace(path)


def test_cli_reports_a_bad_scenario_and_writes_a_trace(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\ncluster: {nodes: 1}\n")
    assert main(["--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "exactly one of 'workload'" in err and "planner.hybrid_nodes: 1 must be < cluster.nodes=1" in err
    assert main(["--config", str(ROOT / "configs" / "sim" / "a800-swe.yaml"), "--set", "rl.stepz=2"]) == 2
    assert "rl.stepz: unknown key in rl; did you mean 'steps'?" in capsys.readouterr().err
    out = tmp_path / "trace.jsonl"
    assert main(["--config", str(ROOT / "configs" / "sim" / "a800-swe.yaml"), "--steps", "2",
                 "--write-trace", str(out)]) == 0
    assert len(read_trace(out)) == 2 * 320


def test_every_scenario_field_is_documented():
    from pydantic import BaseModel

    from libra_hpc.sim.config import SimConfig

    def walk(model, prefix=""):
        for name, field in model.model_fields.items():
            nested = field.annotation if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel) else None
            if nested is None:
                assert field.description, f"{prefix}{name} has no docstring"
            else:
                assert nested.__doc__, f"section {prefix}{name} has no docstring"
                walk(nested, f"{prefix}{name}.")
    walk(SimConfig)


def test_every_option_of_both_schemas_is_in_the_config_readme():
    from libra_hpc.config_reference import README, field_paths

    text = README.read_text()
    paths = field_paths(SimConfig)
    assert {"planner.every_steps", "scheduler.saturation", "costs.reconfig_s", "workload.tools[].latency_s.median",
            "rl.prompts_per_step", "tools.wall_time_s", "policies"} <= set(paths)
    missing = [p for p in paths if f"`{p}`" not in text]
    assert not missing, f"configs/README.md lacks {missing}: python -m libra_hpc.config_reference --write"
