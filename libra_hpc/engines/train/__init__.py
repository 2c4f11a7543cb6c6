"""Megatron-Core training engine: the HF-architecture GPTModel, conversion both ways,
a policy-gradient step with the Megatron optimizer, HF export, checkpoints with resharding,
and the CPU shims megatron needs without CUDA. Imports torch and megatron lazily where it
can; import the submodules (``engine``, ``convert``, ...) directly."""
