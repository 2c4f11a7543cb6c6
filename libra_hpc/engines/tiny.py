"""The tiny local policy model: a Qwen2-architecture causal LM and its own tokenizer.

Used wherever no real checkpoint is given (``model.path: null``): CI, laptops, the
emulated cluster. ``build_tiny_model`` writes a Hugging Face checkpoint directory that
transformers, vLLM and the Megatron conversion all load like any Qwen2 checkpoint:

- ``config.json`` / ``generation_config.json``: Qwen2 with ``TINY_DEFAULTS`` (libra_hpc/config.py; head size 32,
  the smallest the vLLM CPU attention backend accepts);
- ``model.safetensors``: float32 weights drawn from ``seed`` alone (same seed → identical
  bytes, on any machine with the same torch), never from transformers' initialisers;
- ``tokenizer.json`` + ``tokenizer_config.json`` (with a ChatML ``chat_template``): a
  byte-level BPE trained with the ``tokenizers`` library on ``task_corpus()``, text in our
  own words shaped like the agentic tasks (tool calls, code, arithmetic), and
  ``tasks_corpus()``, text of the built-in tasks drawn from a seed of its own.

A build is published atomically (written to a temporary sibling, then renamed), so ranks
that build the same model into a shared cache at the same time all end up reading one
complete copy. ``build.json`` records what was built; an identical request reuses it.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import random
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from libra_hpc.config import TINY_DEFAULTS, tiny_architecture

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>",
                  "<tool_response>", "</tool_response>"]
"""Added tokens, ids 0..6 in this order; ``<|im_end|>`` ends an assistant turn (EOS)."""

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""ChatML, as Qwen models use it: roles system / user / assistant / tool."""

QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
"""Qwen2's pre-tokenisation pattern (single digits, words with one leading non-letter)."""

_BUILD_VERSION = 3  # bump when the bytes a given spec produces change
_MARKER = "build.json"


_NOUNS = ["warehouse", "crate", "train", "station", "river", "bridge", "garden", "farmer", "basket", "apple",
          "orange", "ticket", "printer", "server", "cluster", "node", "queue", "request", "packet", "buffer",
          "cache", "memory", "kernel", "thread", "process", "file", "folder", "record", "table", "column",
          "invoice", "budget", "market", "price", "salary", "village", "museum", "library", "student",
          "teacher", "question", "answer", "matrix", "vector", "triangle", "circle", "square", "rectangle",
          "angle", "distance", "speed", "minute", "hour", "account", "balance", "sensor", "reading",
          "battery", "engine", "signal", "report", "sandbox", "container"]
_VERBS = ["check", "compute", "verify", "count", "measure", "compare", "collect", "filter", "parse", "sort",
          "merge", "split", "multiply", "divide", "subtract", "add", "round", "estimate", "inspect", "search",
          "read", "write", "open", "close", "restart", "retry", "schedule", "allocate", "release", "migrate",
          "update", "convert", "validate", "summarise", "record"]
_ADJS = ["first", "second", "last", "previous", "next", "total", "remaining", "average", "largest",
         "smallest", "empty", "full", "broken", "correct", "wrong", "partial", "careful", "quick", "slow",
         "careful", "expected", "observed", "missing", "valid", "invalid"]
_TOOLS = {"calculator": "expression", "run_python": "code", "grep": "pattern", "read_file": "path",
          "web_search": "query", "list_dir": "path", "sql_query": "statement"}


def _sentence(rng: random.Random) -> str:
    n1, n2, v, a = rng.choice(_NOUNS), rng.choice(_NOUNS), rng.choice(_VERBS), rng.choice(_ADJS)
    return rng.choice([
        f"I need to {v} the {a} {n1} before I look at the {n2}.",
        f"The {n1} depends on the {a} {n2}, so I will {v} it first.",
        f"Next, {v} each {n1} and keep the {a} one.",
        f"If the {n2} is {a}, the {n1} must be checked again.",
        f"Let me {v} the {n1}s; the {a} {n2} tells me what is left.",
    ])


def _code(rng: random.Random, name: str, a: int, c: int) -> str:
    op = rng.choice(["x * x", "x + 1", "abs(x)", "x // 2", "x % 7", "max(x, 0)"])
    kw = rng.choice(["sum", "max", "min", "sorted", "len"])
    return (f"def {name}_{rng.choice(_VERBS)}(xs):\n    result = [{op} for x in xs if x is not None]\n"
            f"    return {kw}(result)\n\nfor i in range({c}):\n    print(i, {name}_{rng.choice(_VERBS)}([{a}, i]))")


def task_corpus(dialogues: int = 2000, seed: int = 0) -> Iterator[str]:
    """Chat-formatted agentic dialogues (arithmetic with a calculator, code in a sandbox,
    file and web search, SQL), one string each, deterministic from ``seed``: text in our
    own words, shaped like the tasks; the tokenizer's training text."""
    rng = random.Random(seed)
    for _ in range(dialogues):
        tool = rng.choice(sorted(_TOOLS))
        a, b, c = rng.randint(2, 9999), rng.randint(2, 999), rng.randint(2, 40)
        noun, adj = rng.choice(_NOUNS), rng.choice(_ADJS)
        if tool == "calculator":
            task = f"A {noun} holds {a} items and gains {b} more each {rng.choice(_NOUNS)}. How many after {c} rounds?"
            arg, result = f"{a} + {b} * {c}", str(a + b * c)
        elif tool == "run_python":
            task = f"Write a function that will {rng.choice(_VERBS)} the {adj} values of a {noun} list."
            arg, result = _code(rng, noun, a, c), "\n".join(f"{i} {a + i}" for i in range(min(c, 4)))
        elif tool == "sql_query":
            task = f"Which {noun} has the {adj} {rng.choice(_NOUNS)}? Use the database."
            arg = f"SELECT id, {noun}_name FROM {noun}s WHERE amount > {b} ORDER BY amount DESC LIMIT {c};"
            result = "\n".join(f"{a + i} | {noun}_{i}" for i in range(3))
        else:
            task = f"Find the {adj} {noun} mentioned in data/{noun}_{c}.txt and report where it is."
            arg = f"data/{noun}_{c}.txt" if tool in ("read_file", "list_dir") else f"{adj} {noun}"
            result = f"line {a}: {noun} status={adj} value={b}"
        status = rng.choice(["success", "success", "success", "timeout", "error"])
        final = f"The answer is {result.split()[-1]}."
        if status != "success":
            result = f"{status}: the tool did not finish (exit code {rng.randint(1, 137)})"
            final = "The tool failed, so I cannot tell yet; I will retry with a smaller input."
        call = json.dumps({"name": tool, "arguments": {_TOOLS[tool]: arg}})
        thought = " ".join(_sentence(rng) for _ in range(rng.randint(1, 4)))
        answer = " ".join(_sentence(rng) for _ in range(rng.randint(1, 3)))
        yield ("<|im_start|>system\nYou are an agent. Think step by step and call tools when useful.<|im_end|>\n"
               f"<|im_start|>user\n{task}<|im_end|>\n"
               f"<|im_start|>assistant\n{thought}\n<tool_call>\n{call}\n</tool_call><|im_end|>\n"
               f"<|im_start|>tool\n<tool_response>\n{result}\n</tool_response><|im_end|>\n"
               f"<|im_start|>assistant\n{answer} {final}<|im_end|>\n<|endoftext|>")


def tasks_corpus(seed: int = 7) -> Iterator[str]:
    """Text of the built-in agentic tasks (libra_hpc/envs/) for the tokenizer: their system
    turns with the tool signatures, and the questions and documents of a search collection
    and arithmetic problems drawn from ``seed``, a seed of the tokenizer's own (not a task's:
    no prompt of a task's splits is in it). Names of people and towns then take a few
    tokens instead of one per letter."""
    from libra_hpc.envs.arithmetic import ArithmeticTask
    from libra_hpc.envs.arithmetic import generate as arithmetic_problem
    from libra_hpc.envs.search import SearchTask, build_world
    from libra_hpc.envs.search import generate as search_question

    for task in (ArithmeticTask, SearchTask):
        system = task.system_prompt(task.__new__(task))
        yield from [system] * 50
    for k in range(4):
        world = build_world(seed + k, 1000)
        yield from world.documents
        for i in range(1000):
            yield search_question(world, seed + k, i, 3).text
            yield arithmetic_problem(seed + k, i, 1, 6).text


def build_tiny_model(path: str | os.PathLike, *, seed: int = 0, **overrides: Any) -> Path:
    """Write (or reuse) the tiny checkpoint at ``path`` and return it as a Path.

    ``overrides`` replace keys of ``TINY_DEFAULTS`` (e.g. ``num_hidden_layers=4``); the head
    size must stay ≥ 32 and a multiple of 16 for vLLM's CPU attention. ``path`` may be
    missing or an empty directory. Raises FileExistsError if it holds something else
    (another build, or files that are not a build)."""
    spec = _spec(seed, overrides)
    return publish_build(Path(path), spec, lambda staging: _write(staging, spec), "build_tiny_model")


def publish_build(path: Path, spec: dict[str, Any], write: Callable[[Path], None], what: str) -> Path:
    """Publish a checkpoint directory built by ``write(staging)`` at ``path``, atomically:
    written to a temporary sibling, then renamed. ``spec`` (a JSON-able dict with a
    ``fingerprint``) is recorded in ``build.json``; when ``path`` already holds a build with
    the same fingerprint it is reused as is (nothing is written), another build or other
    files raise FileExistsError naming ``what``. Ranks publishing the same build at once all
    end up with one complete copy."""
    if path.exists() and not (path.is_dir() and not any(path.iterdir())):
        return _reuse(path, spec, what)
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        write(staging)
        _dump(staging / _MARKER, spec)
        for file in staging.iterdir():
            file.chmod(0o644)
        staging.chmod(0o755)  # mkdtemp makes it private; a shared cache is read by every rank
        try:
            staging.rename(path)
            log.info("%s: published %s at %s", what, spec["fingerprint"], path)
        except OSError:  # another process published the same path first (rename replaces only an empty dir)
            if not path.exists():
                raise
            return _reuse(path, spec, what)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return path


def resolve_model(model_cfg: Any, *, cache_dir: str | os.PathLike | None = None) -> Path:
    """The checkpoint directory for the ``model`` config section.

    ``model.path`` set: that directory, which must hold ``config.json``. Unset: the tiny model
    (seed 0) built once under ``cache_dir`` (default ``~/.cache/libra_hpc``) in a folder
    named by its fingerprint."""
    if model_cfg.path is not None:
        path = Path(model_cfg.path).expanduser()
        if not (path / "config.json").is_file():
            what = "does not exist" if not path.exists() else "has no config.json"
            raise FileNotFoundError(f"model.path: {path} {what}; give a Hugging Face checkpoint directory "
                                    "(config.json, *.safetensors, tokenizer files) or null for the tiny model")
        return path
    root = Path(cache_dir) if cache_dir is not None else Path.home() / ".cache" / "libra_hpc"
    overrides = dict(model_cfg.tiny)
    spec = _spec(0, overrides)
    return build_tiny_model(root / f"tiny-{spec['fingerprint']}", seed=0, **overrides)


def _spec(seed: int, overrides: dict[str, Any]) -> dict[str, Any]:
    arch = tiny_architecture(overrides)
    spec = {"version": _BUILD_VERSION, "seed": int(seed), "arch": arch}
    spec["fingerprint"] = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    return spec


def _reuse(path: Path, spec: dict[str, Any], what: str) -> Path:
    marker = path / _MARKER
    if not marker.is_file():
        raise FileExistsError(f"{what}: {path} exists but is not a build of ours (no {_MARKER}); "
                              "choose another path or remove it")
    found = json.loads(marker.read_text())
    if found.get("fingerprint") != spec["fingerprint"]:
        raise FileExistsError(f"{what}: {path} holds build {found.get('fingerprint')} "
                              f"(seed {found.get('seed')}), not the requested {spec['fingerprint']} "
                              f"(seed {spec.get('seed')}); choose another path or remove it")
    return path


def _write(out: Path, spec: dict[str, Any]) -> None:
    arch = spec["arch"]
    tokenizer = _train_tokenizer(arch["vocab_size"])
    tokenizer.save(str(out / "tokenizer.json"))
    ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    config = {**arch, "bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"]}
    _dump(out / "config.json", config)
    _dump(out / "generation_config.json", {"bos_token_id": ids["<|endoftext|>"],
                                            "eos_token_id": [ids["<|im_end|>"], ids["<|endoftext|>"]],
                                            "pad_token_id": ids["<|endoftext|>"]})
    _dump(out / "tokenizer_config.json", {
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "model_max_length": arch["max_position_embeddings"], "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {str(ids[t]): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                                               "normalized": False, "single_word": False} for t in SPECIAL_TOKENS}})
    _save_weights(out / "model.safetensors", arch, spec["seed"])


def _dump(file: Path, obj: Any) -> None:
    file.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


def _train_tokenizer(vocab_size: int):
    """Byte-level BPE on ``task_corpus()``, exactly ``vocab_size`` entries (specials first).

    Normaliser and pre-tokeniser are Qwen2's (NFC, its split pattern, byte level without
    regex): transformers rebuilds exactly this pipeline for any ``model_type: qwen2``
    checkpoint whatever tokenizer.json says, so anything else would make transformers and
    the raw ``tokenizers`` file disagree on ids."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(itertools.chain(task_corpus(), tasks_corpus()), trainer=trainer)
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size != vocab_size:
        raise ValueError(f"build_tiny_model: the tokenizer reached {size} entries, not vocab_size={vocab_size}; "
                         "choose a vocab_size between 300 and a few thousand")
    return tokenizer


def _save_weights(file: Path, arch: dict[str, Any], seed: int) -> None:
    """Every parameter from one torch.Generator seeded with ``seed``, in sorted-name order:
    linear weights N(0, 1/fan_in) (the output head 16/fan_in), embeddings N(0, 1), biases
    N(0, 0.02), norm scales 1 + N(0, 0.1). Peaked enough that log-prob comparisons are not between near-uniform
    distributions."""
    import torch
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in sorted(_param_shapes(arch).items()):
        x = torch.randn(shape, generator=gen, dtype=torch.float32)
        if name.endswith("norm.weight"):
            x = 1 + 0.1 * x
        elif name.endswith(".bias"):
            x = 0.02 * x
        elif name == "lm_head.weight":
            x = 4 * x / shape[1] ** 0.5  # logits with std ≈ 4: peaked, not near-uniform
        elif "embed_tokens" not in name:
            x = x / shape[1] ** 0.5
        tensors[name] = x.contiguous()
    save_file(tensors, str(file), metadata={"format": "pt"})


def _param_shapes(arch: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Hugging Face Qwen2ForCausalLM parameter names and shapes (untied head)."""
    h, f, v, d = arch["hidden_size"], arch["intermediate_size"], arch["vocab_size"], arch["head_dim"]
    q, kv = arch["num_attention_heads"] * d, arch["num_key_value_heads"] * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    if not arch["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (v, h)
    for i in range(arch["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (q, h), p + "self_attn.q_proj.bias": (q,),
            p + "self_attn.k_proj.weight": (kv, h), p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (h, q),
            p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f),
        })
    return shapes
