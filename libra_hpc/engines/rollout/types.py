"""What the rollout engine returns: plain dataclasses, no vLLM or torch types."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Generation:
    """One sampled continuation of one prompt.

    ``logprobs[i]`` is the log-probability of ``tokens[i]`` under the model's own
    distribution (temperature 1, no top-p truncation) given the prompt and
    ``tokens[:i]``: the quantity a policy-gradient loss and ``score()`` use, whatever the
    sampling temperature was. ``finish_reason``: ``stop`` (an end-of-turn token, which is
    included in ``tokens``) or ``length`` (``max_tokens`` or the context limit reached)."""

    tokens: list[int]
    logprobs: list[float]
    finish_reason: str


@dataclass(frozen=True)
class RolloutStats:
    """A snapshot of one engine.

    ``kv_capacity_tokens``: tokens the KV cache holds in all (blocks × block size).
    ``kv_usage``: fraction of KV blocks in use now (0 between blocking calls: finished
    requests free theirs, prefix-cached blocks count as free; while submitted turns run,
    the share they hold). ``last_batch_kv_fraction``: tokens of
    the last ``generate`` (prompts + outputs) over the capacity, capped at 1: the peak
    usage had every sequence been resident at once (an upper bound of the real peak).
    ``last_tokens_per_s``: generated tokens of the last ``generate`` over its wall time
    (prefill included). ``last_prefix_cached_fraction``: prompt tokens of the last
    ``generate`` whose KV came from the prefix cache (later turns of a trajectory reuse the
    earlier ones'). ``weight_version``: weight updates applied since start."""

    kv_capacity_tokens: int
    kv_usage: float
    last_batch_kv_fraction: float
    last_generated_tokens: int
    last_wall_s: float
    last_tokens_per_s: float
    last_prefix_cached_fraction: float
    weight_version: int
