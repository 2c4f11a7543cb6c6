"""Engines: the tiny local model, vLLM rollout (``engines.rollout``) and Megatron-Core
training. Importing this package imports neither torch nor vLLM; they load when an engine
starts or a model is built."""

from libra_hpc.engines.tiny import TINY_DEFAULTS, build_tiny_model, resolve_model

__all__ = ["TINY_DEFAULTS", "build_tiny_model", "resolve_model"]
