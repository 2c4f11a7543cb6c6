"""A Megatron-Core GPTModel with exactly the Hugging Face Qwen2/Qwen3/Llama architecture.

RMSNorm (eps from the config), SwiGLU MLP without biases, rotary embeddings with the HF
theta (non-interleaved halves, as HF's ``rotate_half``), grouped-query attention with
``head_dim`` from the config, Q/K/V biases when the architecture has them (Qwen2),
per-head RMSNorm of queries and keys before RoPE (Qwen3), tied or untied output head. Dropout is off: RL log-probs must be reproducible, and the rollout
engine has none. Built with megatron's local (pure torch) layer spec so it runs on CPU;
on GPUs the same spec runs with CUDA tensors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from libra_hpc.engines.train.convert import ModelShape


def transformer_config(shape: ModelShape, *, tp: int, pp: int, dtype: torch.dtype, cpu_init: bool):
    """The TransformerConfig for ``shape`` at TP=``tp``, PP=``pp`` (parameters in ``dtype``)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    if shape.num_layers % pp:
        raise ValueError(f"pipeline_parallel={pp} does not divide num_hidden_layers={shape.num_layers}")
    shape.check_tp(tp)
    return TransformerConfig(
        num_layers=shape.num_layers, hidden_size=shape.hidden_size, ffn_hidden_size=shape.ffn_hidden_size,
        num_attention_heads=shape.num_heads, num_query_groups=shape.num_kv_heads, kv_channels=shape.head_dim,
        normalization="RMSNorm", layernorm_epsilon=shape.norm_eps, gated_linear_unit=True, activation_func=F.silu,
        add_bias_linear=False, add_qkv_bias=shape.qkv_bias, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, gradient_accumulation_fusion=False, persist_layer_norm=False,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, sequence_parallel=False,
        params_dtype=dtype, pipeline_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        attention_softmax_in_fp32=True, use_cpu_initialization=cpu_init, perform_initialization=True,
        calculate_per_token_loss=True)


def build_gpt(shape: ModelShape, config, *, pre_process: bool, post_process: bool):
    """A GPTModel for this rank's pipeline stage; its random initial weights are replaced
    by the converted checkpoint.

    Initialisation is *not* skipped (``perform_initialization=True``) although the weights
    are overwritten: in megatron-core 0.16.1 the parallel linear layers set their
    ``tensor_model_parallel`` attributes only inside the initialisers, and without them
    every TP rank but 0 counts its weight shards as duplicates, so the global gradient
    norm (and clipping) silently leaves them out at TP > 1."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    return GPTModel(
        config=config, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm",
                                                                           qk_layernorm=shape.qk_norm),
        vocab_size=shape.vocab_size, max_sequence_length=shape.max_positions, pre_process=pre_process,
        post_process=post_process, parallel_output=True,
        share_embeddings_and_output_weights=shape.tied_embeddings, position_embedding_type="rope",
        rotary_percent=1.0, rotary_base=shape.rope_theta)
