"""Rollout (vLLM) and training (Megatron-Core) engines (not built yet)."""
