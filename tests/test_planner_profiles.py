"""Hardware and model profiles: the shipped files load, parameter counts match the model
cards, derived quantities match hand arithmetic, bad files fail naming file and field."""

from __future__ import annotations

import pytest

from libra_hpc.config import ConfigError
from libra_hpc.planner.profiles import (
    HARDWARE_DIR,
    MODELS_DIR,
    HardwareProfile,
    ModelProfile,
    available,
    load_hardware,
    load_model,
)

GOOD_MODEL = """\
name: m
num_layers: 2
hidden_size: 64
num_heads: 4
num_kv_heads: 2
head_dim: 16
intermediate_size: 128
vocab_size: 1000
"""


def test_every_shipped_profile_loads():
    assert available(HARDWARE_DIR) == ["a100-80g", "a800-80g", "cpu", "h100-80g", "h200-141g"]
    assert available(MODELS_DIR) == ["qwen2.5-7b", "qwen3-14b", "qwen3-30b-a3b", "qwen3-32b", "qwen3-4b", "tiny"]
    assert all(isinstance(load_hardware(n), HardwareProfile) for n in available(HARDWARE_DIR))
    assert all(isinstance(load_model(n), ModelProfile) for n in available(MODELS_DIR))


# Model cards (huggingface.co/Qwen/...): total parameters, and activated ones for the MoE.
@pytest.mark.parametrize(("name", "total_b", "active_b"), [
    ("qwen3-4b", 4.0, 4.0), ("qwen3-14b", 14.8, 14.8), ("qwen3-32b", 32.8, 32.8),
    ("qwen3-30b-a3b", 30.5, 3.3), ("qwen2.5-7b", 7.61, 7.61)])
def test_parameter_counts_match_the_model_cards(name, total_b, active_b):
    m = load_model(name)
    assert m.param_count() / 1e9 == pytest.approx(total_b, rel=0.02)
    assert m.param_count(active=True) / 1e9 == pytest.approx(active_b, rel=0.02)


def test_tiny_model_by_hand():
    m = load_model("tiny")
    # attention: q 128·128 + k,v 2·128·(2·32) + o 128·128 = 16384 + 16384 + 16384 = 49152, + q/k norms 2·32 = 49216
    assert m.attention_params == 49216
    # MLP 3·128·256 = 98304; layer = 49216 + 98304 + 2·128 (norms) = 147776
    assert m.layer_params() == 147776
    # 4 layers 591104 + tied embedding 4096·128 = 524288 + final norm 128 = 1115520
    assert m.param_count() == 1115520
    assert m.weight_bytes(2) == 2231040
    # KV: 2 (k, v) · 4 layers · 2 KV heads · 32 · 2 bytes = 1024 B per token
    assert m.kv_bytes_per_token(2) == 1024
    # matmul weights: 4·(147776 - 256) + LM head 524288 = 1114368; forward FLOPs 2× that,
    # plus attention 4 · 4 layers · 4 heads · 32 · 100 context = 204800
    assert m.flops_per_token(0) == 2 * 1114368
    assert m.flops_per_token(100) == 2 * 1114368 + 204800


def test_qwen3_14b_weights_and_kv_by_hand():
    m = load_model("qwen3-14b")
    # 14,768,307,200 parameters × 2 bytes (bf16) = 29.54 GB
    assert m.weight_bytes(2) == 29_536_614_400
    # KV: 2 · 40 layers · 8 KV heads · 128 · 2 bytes = 163,840 B per token
    assert m.kv_bytes_per_token() == 163_840


def test_moe_active_parameters_count_the_routed_experts_only():
    m = load_model("qwen3-30b-a3b")
    per_layer_gap = (m.num_experts - m.experts_per_token) * m.expert_params  # 120 · 3·2048·768
    assert m.param_count() - m.param_count(active=True) == m.num_layers * per_layer_gap
    dense = load_model("qwen3-14b")
    assert dense.param_count() == dense.param_count(active=True)


def test_hardware_units_and_links():
    a100, a800, h200 = load_hardware("a100-80g"), load_hardware("A800-80G"), load_hardware("h200-141g")
    assert a800.intra_node_gbps < a100.intra_node_gbps  # the export variant's only cut
    assert a800.bf16_tflops == a100.bf16_tflops == 312.0
    assert h200.bandwidth_bps == 4.8e12 and h200.peak_flops == 989e12
    for hw in (a100, a800, h200):
        assert hw.link_bps(inter_node=True) < hw.link_bps(inter_node=False)


# ------------------------------------------------------------------------- loader errors


def _write(tmp_path, text, name="p.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_unknown_key_names_file_field_and_valid_keys(tmp_path):
    path = _write(tmp_path, GOOD_MODEL + "num_layer: 3\n")
    with pytest.raises(ConfigError) as err:
        load_model(path)
    text = str(err.value)
    assert str(path) in text and "num_layer: unknown key in the top level; did you mean 'num_layers'?" in text
    assert "Valid keys are: name, num_layers" in text


def test_string_where_a_number_belongs_is_refused(tmp_path):
    path = _write(tmp_path, GOOD_MODEL.replace("hidden_size: 64", 'hidden_size: "64"'))
    with pytest.raises(ConfigError, match=r"hidden_size: .*got '64'"):
        load_model(path)


def test_missing_field_and_bad_gqa_shape(tmp_path):
    with pytest.raises(ConfigError, match="vocab_size: required, missing"):
        load_model(_write(tmp_path, GOOD_MODEL.replace("vocab_size: 1000\n", "")))
    with pytest.raises(ConfigError, match=r"num_kv_heads \(3\) must divide num_heads \(4\)"):
        load_model(_write(tmp_path, GOOD_MODEL.replace("num_kv_heads: 2", "num_kv_heads: 3")))
    with pytest.raises(ConfigError, match="all 0 \\(dense\\) or all positive"):
        load_model(_write(tmp_path, GOOD_MODEL + "num_experts: 8\n"))


def test_hardware_refuses_nonsense(tmp_path):
    text = ("name: x\nmemory_gb: -80\nmemory_bandwidth_gbps: 1\nbf16_tflops: 1\nintra_node_gbps: 1\n"
            "inter_node_gbps: 1\ngpus_per_node: 8\n")
    with pytest.raises(ConfigError, match="memory_gb: input should be greater than 0"):
        load_hardware(_write(tmp_path, text))


def test_unknown_name_lists_the_shipped_profiles():
    with pytest.raises(ConfigError, match=r"no profile named 'qwen3-14'; did you mean 'qwen3-14b'\? Available: "):
        load_model("qwen3-14")


def test_unreadable_and_non_mapping_files(tmp_path):
    with pytest.raises(ConfigError, match="cannot read the file"):
        load_model(tmp_path / "absent.yaml")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_model(_write(tmp_path, "name: [unclosed\n"))
    with pytest.raises(ConfigError, match="must be a mapping of fields, got list"):
        load_model(_write(tmp_path, "- 1\n"))
