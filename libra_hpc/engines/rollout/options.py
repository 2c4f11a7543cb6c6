"""Pure checks and settings for starting a vLLM engine (no vLLM or torch imports).

Everything the engine constructor decides before vLLM loads lives here, so it is tested
without starting an engine: argument validation with errors that name the option, the
vLLM engine arguments, and the process environment vLLM needs (which vLLM reads only from
the environment). ``VllmRolloutEngine`` applies these; nothing else should set them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("cpu", "cuda")


def checkpoint_config(model_path: str | os.PathLike) -> dict[str, Any]:
    """``config.json`` of a Hugging Face checkpoint directory, or FileNotFoundError naming it."""
    path = Path(model_path)
    config = path / "config.json"
    if not config.is_file():
        what = "does not exist" if not path.exists() else "has no config.json"
        raise FileNotFoundError(f"rollout engine: model path {path} {what}; give a Hugging Face checkpoint "
                                "directory (config.json, *.safetensors, tokenizer files)")
    return json.loads(config.read_text())


def check_options(*, tp: int, device: str, dtype: str, max_model_len: int, kv_cache_gib: float,
                  max_positions: int | None, cpus: Sequence[Sequence[int]] | None,
                  devices: Sequence[int] | None, cpu_threads: int = 1) -> None:
    """Raise ValueError naming the first unusable option."""
    if device not in DEVICES:
        raise ValueError(f"rollout engine: device={device!r}; use one of {DEVICES}")
    if dtype not in DTYPES:
        raise ValueError(f"rollout engine: dtype={dtype!r}; use one of {DTYPES}")
    if tp < 1:
        raise ValueError(f"rollout engine: tp={tp}; the tensor-parallel size must be >= 1")
    if max_model_len < 2:
        raise ValueError(f"rollout engine: max_model_len={max_model_len}; must be >= 2 tokens")
    if max_positions is not None and max_model_len > max_positions:
        raise ValueError(f"rollout engine: max_model_len={max_model_len} exceeds the model's "
                         f"max_position_embeddings={max_positions}")
    if not kv_cache_gib > 0:
        raise ValueError(f"rollout engine: kv_cache_gib={kv_cache_gib}; must be > 0 (GiB of KV cache per instance)")
    if cpu_threads < 1:
        raise ValueError(f"rollout engine: cpu_threads={cpu_threads}; must be >= 1")
    if cpus is not None and (device != "cpu" or len(cpus) != tp or not all(cpus)):
        raise ValueError(f"rollout engine: cpus={cpus}; on device cpu give one non-empty list of core ids "
                         f"per TP rank ({tp}), and nothing on {device}")
    if devices is not None and (device != "cuda" or len(devices) != tp):
        raise ValueError(f"rollout engine: devices={devices}; on device cuda give exactly tp={tp} GPU ids "
                         "(the slots the layout lends this instance), and nothing on cpu")


def default_cpus(tp: int, allowed: Sequence[int]) -> list[list[int]]:
    """Split the cores this process may use into ``tp`` contiguous, disjoint groups (one
    per TP worker process on CPU); ValueError if there are fewer cores than TP ranks."""
    allowed = sorted(allowed)
    if len(allowed) < tp:
        raise ValueError(f"rollout engine: tp={tp} on cpu needs one core per TP rank, "
                         f"but this process may use {len(allowed)} ({allowed}); lower tp or give more cores")
    per, extra = divmod(len(allowed), tp)
    groups, start = [], 0
    for rank in range(tp):
        size = per + (rank < extra)
        groups.append(allowed[start:start + size])
        start += size
    return groups


def engine_env(*, device: str, tp: int, cpus: Sequence[Sequence[int]] | None,
               devices: Sequence[int] | None) -> dict[str, str]:
    """Environment variables vLLM reads, as this engine needs them.

    - ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core runs in this process, so
      ``update_weights`` hands tensors over in memory (``weights_iterator``) and start-up
      takes seconds instead of tens of seconds. TP > 1 still starts one worker process
      per TP rank (vLLM's multiprocessing executor).
    - ``VLLM_CPU_OMP_THREADS_BIND`` (cpu, TP > 1): the cores of each TP worker,
      ``"0,1|2,3"``; vLLM's automatic binding wants one NUMA node per worker and refuses
      TP > 1 on a one-socket machine.
    - ``VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS`` (cpu, TP > 1, unless set): 1800. On emulated
      nodes every rank shares the host's cores, and one step of a TP worker pair can take
      minutes under load (seen: a 200-prompt evaluation step on 2 cores with 13 ranks);
      vLLM's default of 300 s then kills a slow but healthy engine.
    - ``CUDA_VISIBLE_DEVICES`` (cuda, when ``devices`` is given): the GPU slots lent to
      this instance; it must be set before CUDA is first used in the process."""
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if device == "cpu" and tp > 1:
        groups = cpus if cpus is not None else default_cpus(tp, sorted(os.sched_getaffinity(0)))
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(str(c) for c in group) for group in groups)
        env["VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS"] = os.environ.get("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "1800")
    if device == "cuda" and devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
    return env


def engine_kwargs(model_path: str, *, tp: int, device: str, dtype: str, seed: int, max_model_len: int,
                  kv_cache_gib: float, enable_prefix_caching: bool) -> dict[str, Any]:
    """Keyword arguments of ``vllm.LLM`` for this engine.

    ``kv_cache_memory_bytes`` fixes the KV cache size on CPU and GPU alike (on GPU it
    replaces ``gpu_memory_utilization``), so two instances sharing a machine do not both
    claim most of its memory; it is per TP rank. Eager mode on CPU (no graph compilation:
    starts in seconds); on GPUs vLLM's CUDA graphs stay on (decode throughput), and in-place
    weight reloads keep the parameter storage the graphs captured."""
    return {
        "model": model_path, "tokenizer": model_path, "tensor_parallel_size": tp, "dtype": dtype, "seed": seed,
        "max_model_len": max_model_len, "kv_cache_memory_bytes": int(kv_cache_gib * (1 << 30)),
        "enforce_eager": device == "cpu", "enable_prefix_caching": enable_prefix_caching,
    }


def check_prompts(prompts: Sequence[Sequence[int]], *, vocab_size: int, max_model_len: int, what: str) -> None:
    """Each prompt a non-empty list of token ids in [0, vocab_size) shorter than the context
    (vLLM needs room for one generated token, also when scoring)."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence):
        raise TypeError(f"rollout engine: {what} takes a list of token-id lists, got {type(prompts).__name__}")
    for i, prompt in enumerate(prompts):
        if not prompt or isinstance(prompt, (str, bytes)):
            raise ValueError(f"rollout engine: {what}[{i}] is empty or not a token-id list")
        if len(prompt) >= max_model_len:
            raise ValueError(f"rollout engine: {what}[{i}] has {len(prompt)} tokens; the engine's "
                             f"max_model_len is {max_model_len}")
        bad = [t for t in prompt if not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"rollout engine: {what}[{i}] holds token ids outside [0, {vocab_size}): {bad[:5]}")


def check_weights(shapes: dict[str, tuple[int, ...]], expected: dict[str, tuple[int, ...]]) -> None:
    """A weight update must name every checkpoint tensor once with its shape: vLLM's in-place
    reload of a partial or misnamed set leaves the engine half-updated."""
    missing = sorted(set(expected) - set(shapes))
    unknown = sorted(set(shapes) - set(expected))
    wrong = sorted(f"{n}: {shapes[n]} != {expected[n]}"
                   for n in set(shapes) & set(expected) if shapes[n] != expected[n])
    if missing or unknown or wrong:
        raise ValueError("rollout engine: update_weights needs the full Hugging Face state dict of the checkpoint; "
                         f"missing {missing[:5]}{'…' if len(missing) > 5 else ''}, unknown {unknown[:5]}, "
                         f"wrong shapes {wrong[:5]}; nothing was applied")


def checkpoint_shapes(model_path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of every ``*.safetensors`` file in a checkpoint, read from the
    file headers (8-byte little-endian length, then JSON) without loading any weight."""
    shapes: dict[str, tuple[int, ...]] = {}
    files = sorted(Path(model_path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"rollout engine: model path {model_path} has no *.safetensors weights")
    for file in files:
        with open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        shapes.update({name: tuple(meta["shape"]) for name, meta in header.items() if name != "__metadata__"})
    return shapes


def instance_devices(instance: Any, device: str) -> list[int] | None:
    """The GPU ids a rollout instance (a layout ``Group``) runs on: its slots' local GPU
    indices on cuda (a TP group never crosses a node), None on cpu, where slots are
    emulated and the engine splits the process's cores."""
    if instance.role != "rollout" or len(instance.slots) != instance.tp:
        raise ValueError(f"rollout engine: {instance.name} is a {instance.role} group of {len(instance.slots)} "
                         f"slots with tp={instance.tp}; a rollout instance has exactly tp slots")
    nodes = sorted({slot.node for slot in instance.slots})
    if len(nodes) != 1:
        raise ValueError(f"rollout engine: {instance.name} spans nodes {nodes}; a TP group must stay on one node")
    return [slot.gpu for slot in instance.slots] if device == "cuda" else None
