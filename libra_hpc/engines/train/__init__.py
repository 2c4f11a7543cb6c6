"""Megatron-Core training engine: a GPTModel with the Hugging Face Qwen2/Llama
architecture, exact weight conversion both ways, a policy-gradient step with the Megatron
optimizer, HF export for the rollout side, checkpoints with resharding, and the CPU shims
megatron needs without CUDA (``cpu_shims``). Importing this package imports torch, not
megatron (that happens when an engine starts)."""

from libra_hpc.engines.train.checkpoint import load_checkpoint, save_checkpoint
from libra_hpc.engines.train.convert import ModelShape
from libra_hpc.engines.train.engine import MegatronTrainEngine, StepStats
from libra_hpc.engines.train.loss import PolicyBatch, policy_gradient_loss
from libra_hpc.engines.train.parallel import Placement, TrainingWorld, start_torch_world, stop_torch_world

__all__ = ["MegatronTrainEngine", "ModelShape", "Placement", "PolicyBatch", "StepStats", "load_checkpoint",
           "policy_gradient_loss", "save_checkpoint", "start_torch_world", "stop_torch_world", "TrainingWorld"]
