"""Scenario files and traces that are wrong fail with the file, the field and what to do."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from libra_hpc.sim.__main__ import main
from libra_hpc.sim.config import SimConfigError, load_sim_config, validate_sim_config
from libra_hpc.sim.trace import TraceError, read_trace, to_record, write_trace
from libra_hpc.sim.workload import SyntheticWorkload

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = sorted((ROOT / "configs" / "sim").glob("*.yaml"))


@pytest.mark.parametrize("path", SCENARIOS, ids=lambda p: p.stem)
def test_every_shipped_scenario_loads(path):
    cfg = load_sim_config(path)
    assert cfg.name == path.stem and cfg.policies


def base() -> dict:
    return load_sim_config(ROOT / "configs" / "sim" / "a800-swe.yaml").model_dump(mode="python")


def problems(raw: dict) -> str:
    with pytest.raises(SimConfigError) as err:
        validate_sim_config(raw, "scenario.yaml")
    return str(err.value)


def test_unknown_key_names_the_path_and_the_valid_keys():
    raw = base()
    raw["workload"]["tols"] = raw["workload"].pop("tools")
    text = problems(raw)
    assert "scenario.yaml" in text and "workload.tols" in text and "tools" in text


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
    cfg = validate_sim_config(raw)
    with pytest.raises(ValueError, match="prompt_pool"):
        SyntheticWorkload(cfg.workload, cfg.rl, 0)


def test_trace_round_trip_and_errors_name_line_and_field(tmp_path):
    cfg = load_sim_config(ROOT / "configs" / "sim" / "a800-swe.yaml")
    batch = SyntheticWorkload(cfg.workload, cfg.rl, 3).batch(0)[:20]
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
    assert "rl: required, missing" in capsys.readouterr().err
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
