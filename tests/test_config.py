"""The experiment schema: shipped configs, readable errors, overrides, time limits."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from libra_hpc.config import ConfigError, ExperimentConfig, dump_config, load_config, validate_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
A800 = CONFIGS / "a800-6node.yaml"
DEFAULT = CONFIGS / "default.yaml"


def _a800_raw() -> dict:
    return yaml.safe_load(A800.read_text())


def _problems(raw: dict) -> str:
    with pytest.raises(ConfigError) as info:
        validate_config(raw, "test.yaml")
    return str(info.value)


# ------------------------------------------------------------------ shipped configs


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_load(path):
    cfg = load_config(path)
    assert isinstance(cfg, ExperimentConfig)
    # every GPU slot is either training or rollout, and rollout keeps its minimum
    assert cfg.training_slots + cfg.planner.min_rollout_gpus <= cfg.cluster.total_gpus


def test_a800_shape():
    cfg = load_config(A800)
    assert (cfg.cluster.nodes, cfg.cluster.gpus_per_node, cfg.cluster.total_gpus) == (6, 8, 48)
    t = cfg.training
    assert (t.tensor_parallel, t.pipeline_parallel, t.data_parallel) == (8, 1, 4)
    assert cfg.training_slots == 32
    assert cfg.rollout.tp_per_node == [1, 1, 2, 4]
    assert cfg.rollout.node_patterns == [[1, 1, 2, 4]]
    assert cfg.planner.hybrid_nodes == 1
    assert cfg.cluster.executor == "slurm"


def test_default_config_alternates_rollout_patterns():
    cfg = load_config(DEFAULT)
    assert cfg.rollout.node_patterns == [[1, 1], [2]]
    assert load_config(None) == ExperimentConfig()  # no file: the schema's defaults


# ----------------------------------------------------------------- schema errors


@pytest.mark.parametrize(
    "section, key, path, right",
    [
        (None, "traning", "traning", "training"),
        ("cluster", "nodse", "cluster.nodse", "nodes"),
        ("rollout", "tp_per_nod", "rollout.tp_per_nod", "tp_per_node"),
    ],
)
def test_misspelled_key(section, key, path, right):
    raw = _a800_raw()
    if section is None:
        raw[key] = {}
    else:
        raw[section][key] = 1
    msg = _problems(raw)
    assert f"{path}: unknown key" in msg
    assert f"did you mean '{right}'" in msg
    valid = ExperimentConfig.model_fields if section is None else ExperimentConfig.model_fields[section].annotation.model_fields
    assert "Valid keys are: " + ", ".join(valid) in msg
    assert "test.yaml" in msg


def test_unknown_key_without_close_match_lists_keys_only():
    raw = _a800_raw()
    raw["cluster"]["zzzzzz"] = 1
    msg = _problems(raw)
    assert "cluster.zzzzzz: unknown key" in msg
    assert "did you mean" not in msg
    assert "gpus_per_node" in msg


@pytest.mark.parametrize("value", ["6", 6.0, True], ids=["string", "float", "bool"])
def test_wrong_type_is_not_coerced(value):
    raw = _a800_raw()
    raw["cluster"]["nodes"] = value
    msg = _problems(raw)
    assert "cluster.nodes:" in msg
    assert f"(got {value!r})" in msg


def test_wrong_literal_names_allowed_values():
    raw = _a800_raw()
    raw["cluster"]["executor"] = "slrum"
    msg = _problems(raw)
    assert "cluster.executor: got 'slrum'" in msg
    for allowed in ("'auto'", "'slurm'", "'local'"):
        assert allowed in msg


@pytest.mark.parametrize(
    "section, key, value, expected",
    [
        ("training", "tensor_parallel", 16, "training.tensor_parallel: 16 must divide cluster.gpus_per_node=8"),
        ("training", "tensor_parallel", 3, "training.tensor_parallel: 3 must divide"),
        # 8 × 5 = 40 of 48 leaves 8 = min_rollout_gpus, so 6 replicas (48) leave nothing
        ("training", "data_parallel", 6, "training: TP×PP×DP = 48 GPU slots leaves 0 of the 48"),
        ("rollout", "tp_per_node", [1, 1, 2], "rollout.tp_per_node: [1, 1, 2] sums to 4 GPUs"),
        ("rollout", "tp_per_node", [[1, 1, 2, 4], [4, 2]], "rollout.tp_per_node: [4, 2] sums to 6 GPUs"),
        ("rollout", "tp_per_node", [3, 5], "rollout.tp_per_node: sizes must be powers of two"),
        ("rollout", "tp_per_node", [6, 2], "got [6]"),
        ("planner", "hybrid_nodes", 3, "planner.hybrid_nodes: 3 but only 2 node(s)"),
        ("cluster", "time_limit", "1h", "cluster.time_limit: '1h' is not a Slurm time"),
        ("cluster", "time_limit", "1:2:3:4", "cluster.time_limit: '1:2:3:4' is not a Slurm time"),
    ],
)
def test_impossible_shape(section, key, value, expected):
    raw = _a800_raw()
    raw[section][key] = value
    assert expected in _problems(raw)


def test_the_stop_grace_and_a_save_must_fit_between_the_warning_and_the_limit():
    raw = _a800_raw()
    raw.setdefault("job", {}).update(stop_grace_s=100, checkpoint_save_s=30)
    raw["cluster"]["signal_before_limit_s"] = 120
    assert ("job.stop_grace_s: 100 s for the step in flight plus job.checkpoint_save_s=30 s for its checkpoint do "
            "not fit in the cluster.signal_before_limit_s=120 s") in _problems(raw)
    raw["job"]["checkpoint_on_stop"] = False  # nothing is saved on the warning: nothing to fit
    assert validate_config(raw).job.stop_grace_s == 100
    raw["job"]["checkpoint_on_stop"] = True
    raw["cluster"].update(signal_before_limit_s=130)
    assert validate_config(raw).cluster.signal_before_limit_s == 130


def test_data_parallel_five_still_fits():
    raw = _a800_raw()
    raw["planner"]["hybrid_nodes"] = 0
    raw["training"]["data_parallel"] = 5
    raw["rl"]["prompts_per_step"] = 25  # × 8 samples = 200: splits over DP 5
    assert validate_config(raw).training_slots == 40


@pytest.mark.parametrize("borrow, ret", [(5, 3), (5, 5), (None, 3)])
def test_return_must_come_after_borrow(borrow, ret):
    raw = _a800_raw()
    raw["planner"].update(borrow_at_step=borrow, return_at_step=ret)
    assert f"planner.return_at_step: {ret} must come after planner.borrow_at_step={borrow}" in _problems(raw)


def test_steps_outside_run():
    raw = _a800_raw()
    raw["planner"]["borrow_at_step"] = 200  # rl.steps is 200: steps 0..199
    assert "planner.borrow_at_step: 200 is outside" in _problems(raw)


def test_the_replanning_gate_is_part_of_the_experiment_planner():
    fields = ExperimentConfig.model_fields["planner"].annotation.model_fields
    gate = {"window": 512, "every_steps": 10, "margin_s": 10.0, "confirm_checks": 2, "min_dwell_steps": 10,
            "hybrid_margin": 0.1, "min_rollout_gpus": 1}
    assert {name: fields[name].default for name in gate} == gate  # one default, live and simulated
    assert all(fields[name].description for name in gate)
    cfg = load_config(A800, ["planner.every_steps=4", "planner.margin_s=2.5"])
    assert (cfg.planner.every_steps, cfg.planner.margin_s) == (4, 2.5)
    assert "planner.every_steps: input should be greater than or equal to 1 (got 0)" in _problems(
        {**_a800_raw(), "planner": {**_a800_raw()["planner"], "every_steps": 0}})


def test_the_batch_is_prompts_times_group_and_the_old_key_says_so():
    cfg = load_config(A800)
    assert (cfg.rl.prompts_per_step, cfg.rl.group_size, cfg.batch_size) == (40, 8, 320)
    raw = _a800_raw()
    raw["training"]["global_batch_size"] = 320
    assert ("training.global_batch_size: unknown key in training; it moved to rl.prompts_per_step "
            "(the batch is rl.prompts_per_step × rl.group_size).") in _problems(raw)


# --------------------------------------------------------------- duplicate keys


def test_a_key_given_twice_is_refused_naming_it_its_path_and_both_lines(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("cluster:\n  nodes: 6\n  gpus_per_node: 8\n  nodes: 4\n"
                    "rollout:\n  tp_per_node: [[1, 1, 2, 4]]\nrl: {steps: 4, steps: 5}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)
    assert info.value.problems == [
        "cluster.nodes: the key 'nodes' is given twice (lines 2 and 4); a repeated key would silently "
        "replace the first value, keep one",
        "rl.steps: the key 'steps' is given twice (lines 7 and 7); a repeated key would silently "
        "replace the first value, keep one",
    ]


def test_a_repeated_section_and_a_repeat_inside_a_list_are_refused(tmp_path):
    path = tmp_path / "twice.yaml"
    path.write_text("rl:\n  steps: 4\nlogging: {level: INFO}\nrl:\n  steps: 5\n"
                    "tools:\n  slurm_args:\n    - {a: 1, a: 2}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    text = str(info.value)
    assert "rl: the key 'rl' is given twice (lines 1 and 4)" in text
    assert "tools.slurm_args.0.a: the key 'a' is given twice (lines 8 and 8)" in text


def test_distinct_keys_and_yaml_merges_are_not_duplicates(tmp_path):
    path = tmp_path / "merge.yaml"
    path.write_text("scheduler:\n  bucket_token_limits: {1: 1024, 2: 4096, 4: 16384, 8: 1073741824}\n"
                    "rl: &rl {steps: 4, group_size: 4}\nlogging: {level: INFO}\n")
    assert load_config(path).rl.steps == 4
    from libra_hpc.config import parse_yaml
    assert parse_yaml("base: &b {x: 1, y: 2}\nother:\n  <<: *b\n  x: 3\n")["other"] == {"x": 3, "y": 2}


def test_a_key_given_twice_in_a_set_value_is_refused():
    with pytest.raises(ConfigError) as info:
        load_config(A800, ["scheduler.bucket_token_limits={1: 10, 1: 20}"])
    assert "the key '1' is given twice" in str(info.value)


# -------------------------------------------------------------------- overrides


def test_set_overrides_parse_yaml_values():
    cfg = load_config(A800, ["cluster.nodes=7", "rollout.tp_per_node=[[1,1,2,4],[4,4]]",
                             "planner.hybrid_nodes=2", "cluster.partition=gpu", "cluster.requeue=false",
                             "rl.prompts_per_step=15"])  # 15 × 8 = 120 splits over DP 4, 5 and 6
    assert cfg.cluster.nodes == 7
    assert cfg.planner.hybrid_nodes == 2
    assert cfg.rollout.node_patterns == [[1, 1, 2, 4], [4, 4]]
    assert cfg.cluster.partition == "gpu"
    assert cfg.cluster.requeue is False
    assert cfg.training.tensor_parallel == 8  # untouched fields stay as in the file


def test_set_on_defaults_creates_sections():
    cfg = load_config(None, ["cluster.nodes=4", "rollout.tp_per_node=[[1,1],[2]]"])
    assert cfg.cluster.nodes == 4
    assert cfg.rollout.node_patterns == [[1, 1], [2]]


@pytest.mark.parametrize("item", ["nodes", "=4"])
def test_malformed_override(item):
    with pytest.raises(ConfigError) as info:
        load_config(A800, [item])
    assert f"--set {item!r}: expected KEY=VALUE" in str(info.value)


def test_override_into_a_scalar():
    with pytest.raises(ConfigError) as info:
        load_config(A800, ["cluster.nodes.x=1"])
    assert "cluster.nodes is a value, not a section" in str(info.value)


def test_every_bad_override_is_reported():
    with pytest.raises(ConfigError) as info:
        load_config(A800, ["nodes", "cluster.nodes.x=1"])
    assert len(info.value.problems) == 2


def test_override_value_is_still_validated():
    with pytest.raises(ConfigError) as info:
        load_config(A800, ["cluster.nodes='6'"])
    assert "cluster.nodes:" in str(info.value)


def test_cli_kwargs_apply_and_none_is_ignored():
    cfg = load_config(A800, **{"cluster.nodes": 7, "cluster.partition": None, "rl.steps": 10})
    assert cfg.cluster.nodes == 7
    assert cfg.cluster.partition is None
    assert cfg.rl.steps == 10
    cfg = load_config(A800, **{"cluster.nodes": None})
    assert cfg.cluster.nodes == 6


@pytest.mark.parametrize("text, minutes", [("90", 90), ("30:00", 30), ("2:00:00", 120)])
def test_set_time_limit_in_slurm_format(text, minutes):
    cfg = load_config(A800, [f"cluster.time_limit={text}"])
    assert cfg.cluster.time_limit_minutes == minutes


# ------------------------------------------------------------------- time limits


@pytest.mark.parametrize(
    "text, minutes",
    [
        ("90", 90),                    # MM
        ("0", 1),                      # never below one minute
        ("30:00", 30),                 # MM:SS
        ("30:01", 31),                 # MM:SS rounds up
        ("00:00:30", 1),               # HH:MM:SS, under a minute rounds up
        ("02:30:00", 150),             # HH:MM:SS
        ("01:00:59", 61),
        ("1-00", 24 * 60),             # D-HH
        ("2-12", 60 * 60),
        ("1-02:30", 24 * 60 + 150),    # D-HH:MM
        ("1-00:00:00", 1440),          # D-HH:MM:SS
        ("0-00:10:01", 11),
    ],
)
def test_time_limit_minutes(text, minutes):
    raw = _a800_raw()
    raw["cluster"]["time_limit"] = text
    assert validate_config(raw).cluster.time_limit_minutes == minutes


# ------------------------------------------------------------------ dump / files


@pytest.mark.parametrize(
    "path, overrides",
    [(DEFAULT, []), (A800, []), (A800, ["cluster.time_limit='1:30:00'", "cluster.partition=gpu", "model.path=/ckpt"])],
)
def test_dump_round_trips(tmp_path, path, overrides):
    cfg = load_config(path, overrides)
    out = tmp_path / "resolved.yaml"
    out.write_text(dump_config(cfg))
    again = load_config(out)
    assert again == cfg
    assert dump_config(again) == dump_config(cfg)


def test_missing_file_names_it(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(missing)
    assert str(missing) in str(info.value)
    assert "cannot read the file" in str(info.value)


def test_directory_instead_of_file(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path)
    assert str(tmp_path) in str(info.value)


@pytest.mark.parametrize("text, kind", [("- a\n- b\n", "list"), ("hello\n", "str"), ("42\n", "int")])
def test_non_mapping_yaml(tmp_path, text, kind):
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)
    assert f"must be a mapping of sections, got {kind}" in str(info.value)


def test_invalid_yaml(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("cluster: [nodes\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)
    assert "not valid YAML" in str(info.value)


def test_empty_file_gives_defaults(tmp_path):
    path = tmp_path / "empty.yaml"
    path.write_text("")
    assert load_config(path) == ExperimentConfig()


def test_binary_file_gives_config_error(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"\xff\xfe\x00\x01garbage")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    "scheduler, field",
    [
        ({"size_thresholds": [10, 20, 30, 40, 50]}, "scheduler.size_thresholds"),
        ({"size_thresholds": [4096, 256]}, "scheduler.size_thresholds"),
        ({"min_samples": 300, "tree_window": 256}, "scheduler.min_samples"),
        ({"bucket_token_limits": {1: 1000, 2: 1000, 4: 5000, 8: 9000}}, "scheduler.bucket_token_limits"),
        ({"bucket_token_limits": {1: 1000, 4: 5000}}, "scheduler.bucket_token_limits"),  # default rollout uses TP 2
    ],
)
def test_scheduler_settings_the_router_cannot_use_are_refused(scheduler, field):
    with pytest.raises(ConfigError) as info:
        validate_config({"scheduler": scheduler})
    assert field in str(info.value)


def test_global_batch_must_split_over_every_dp_the_hybrid_pool_reaches():
    with pytest.raises(ConfigError) as info:
        load_config(A800, ["rl.prompts_per_step=32"])  # 32 × 8 = 256: DP 4 fine, DP 5 (node 5 lent) not
    assert "rl.prompts_per_step: the batch rl.prompts_per_step × rl.group_size = 256 does not split over DP [5]" \
        in str(info.value)
    assert "multiple of 20" in str(info.value)
    assert load_config(A800, ["rl.prompts_per_step=30"]).batch_size == 240  # a multiple of 20 passes
