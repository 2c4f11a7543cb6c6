"""The tiny local model: deterministic Hugging Face Qwen2 checkpoint and tokenizer."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest

from libra_hpc.config import ModelConfig
from libra_hpc.engines.tiny import TINY_DEFAULTS, build_tiny_model, resolve_model, task_corpus

FILES = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]


def test_same_seed_same_bytes_other_seed_other_weights(tiny, tmp_path):
    again = build_tiny_model(tmp_path / "again")
    other = build_tiny_model(tmp_path / "other", seed=1)
    for name in FILES:
        assert (again / name).read_bytes() == (tiny / name).read_bytes(), name
    assert (other / "model.safetensors").read_bytes() != (tiny / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (tiny / "tokenizer.json").read_bytes()


def test_an_identical_build_is_reused_and_a_different_one_refused(tiny, tmp_path):
    stamp = (tiny / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model(tiny) == tiny
    assert (tiny / "model.safetensors").stat().st_mtime_ns == stamp
    with pytest.raises(FileExistsError, match="seed 1"):
        build_tiny_model(tiny, seed=1)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="build_tiny_model: .* is not a build of ours"):
        build_tiny_model(tmp_path / "notes")
    (tmp_path / "empty").mkdir()
    assert (build_tiny_model(tmp_path / "empty") / "model.safetensors").read_bytes() == \
        (tiny / "model.safetensors").read_bytes()


def test_bad_architecture_is_refused():
    with pytest.raises(ValueError, match="head_dim=16"):
        build_tiny_model("/nonexistent/never-written", hidden_size=64, head_dim=16)
    with pytest.raises(ValueError, match="unknown override.*'hiden_size'"):
        build_tiny_model("/nonexistent/never-written", hiden_size=64)


def test_concurrent_builds_of_one_path_publish_one_copy(tmp_path):
    code = f"from libra_hpc.engines.tiny import build_tiny_model; build_tiny_model({str(tmp_path / 'm')!r}, seed=3)"
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no staging folder left behind
    assert build_tiny_model(tmp_path / "m", seed=3) == tmp_path / "m"


def test_transformers_loads_it_whole_and_tokenizes_like_the_raw_file(tiny):
    import torch
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, info = AutoModelForCausalLM.from_pretrained(tiny, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert model.dtype == torch.float32 and model.config.head_dim >= 32
    assert model.config.num_hidden_layers == TINY_DEFAULTS["num_hidden_layers"]
    tok, raw = AutoTokenizer.from_pretrained(tiny), Tokenizer.from_file(str(tiny / "tokenizer.json"))
    assert len(tok) == TINY_DEFAULTS["vocab_size"]
    texts = [*itertools.islice(task_corpus(20, seed=11), 20), "  spaces\n\n and ünïcode 数字 🙂"]
    for text in texts:
        assert tok.encode(text) == raw.encode(text).ids
        assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode(texts[0])) < len(texts[0]) / 3  # the BPE learned our task text
    prompt = tok.apply_chat_template([{"role": "user", "content": "Add 2 and 3."}], add_generation_prompt=True,
                                     tokenize=False)
    assert prompt == "<|im_start|>user\nAdd 2 and 3.<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>" and model.config.eos_token_id == tok.eos_token_id
    with torch.no_grad():
        logp = model(torch.tensor([tok.encode(texts[0])])).logits.log_softmax(-1)
    assert logp.max(-1).values.mean() > -3  # peaked, not near-uniform (log 1/1024 = -6.9)


def test_resolve_model_builds_the_tiny_model_or_checks_the_given_path(tmp_path):
    built = resolve_model(ModelConfig(path=None), cache_dir=tmp_path)
    assert built.parent == tmp_path and (built / "config.json").is_file()
    assert resolve_model(ModelConfig(path=None), cache_dir=tmp_path) == built
    assert resolve_model(ModelConfig(path=str(built))) == built
    with pytest.raises(FileNotFoundError, match=f"model.path: {tmp_path / 'missing'} does not exist"):
        resolve_model(ModelConfig(path=str(tmp_path / "missing")))
    with pytest.raises(FileNotFoundError, match=f"model.path: {tmp_path} has no config.json"):
        resolve_model(ModelConfig(path=str(tmp_path)))


def test_model_tiny_overrides_build_their_own_architecture_and_bad_keys_are_refused(tmp_path):
    import json

    from libra_hpc.config import load_config

    default = resolve_model(ModelConfig(path=None), cache_dir=tmp_path)
    deeper = resolve_model(ModelConfig(path=None, tiny={"num_hidden_layers": 3}), cache_dir=tmp_path)
    assert deeper != default
    assert json.loads((deeper / "config.json").read_text())["num_hidden_layers"] == 3
    assert json.loads((default / "config.json").read_text())["num_hidden_layers"] == 2
    with pytest.raises(ValueError, match=r"model\.tiny: tiny model: unknown override\(s\) \['layers'\]"):
        load_config(None, ["model.tiny={layers: 4}"])
    with pytest.raises(ValueError, match=r"model\.tiny: .*head_dim=16"):
        load_config(None, ["model.tiny={hidden_size: 64, head_dim: 16}"])
