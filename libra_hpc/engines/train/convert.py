"""Hugging Face Qwen2/Qwen3/Llama weights ⇄ Megatron-Core GPTModel shards, exactly.

Pure tensor reshuffling (cat, chunk, view; no arithmetic), so a round trip returns the
same bits. Megatron's layout, for the local spec (``get_gpt_layer_local_spec``):

* ``linear_qkv`` fuses Q, K and V **per query group**: for each KV head g, the
  ``heads/groups`` query heads of g, then K_g, then V_g (rows of ``head_dim`` each). Groups
  are contiguous, so TP rank r holds groups ``[r·G/tp, (r+1)·G/tp)``: the rank's shard is
  the r-th contiguous chunk of the fused tensor (same for the bias).
* ``linear_fc1`` fuses the SwiGLU gate and up projections **per TP rank**: rank r holds
  ``cat(gate_r, up_r)`` where ``gate_r`` is the r-th row chunk of ``gate_proj``; megatron
  splits its local output in half (first half through SiLU).
* Column-parallel weights (embedding, output layer, Q/K/V, fc1) split rows across TP;
  row-parallel ones (``linear_proj``, ``linear_fc2``) split columns; norms are replicated.

A pipeline stage numbers its layers from 0; ``layer_offset`` maps them to the global HF
layer index. The first stage holds the embedding, the last the final norm and the output
layer. With tied embeddings the output layer *is* the embedding when one stage holds both;
with PP > 1 the last stage holds a copy (megatron keeps the two in step), not exported.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True)
class ModelShape:
    """The architecture numbers both sides must agree on (from an HF ``config.json``)."""

    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool
    tied_embeddings: bool
    norm_eps: float
    rope_theta: float
    max_positions: int
    qk_norm: bool = False
    """RMSNorm over each query and key head before RoPE (Qwen3)."""

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], source: str = "config.json") -> ModelShape:
        """Read a Qwen2, Qwen3 or Llama ``config.json`` dict; anything else is refused by name."""
        kind = config.get("model_type")
        if kind not in _KINDS:
            raise ValueError(f"{source}: model_type={kind!r}; the Megatron conversion knows {sorted(_KINDS)}")
        if config.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act={config['hidden_act']!r}; only SwiGLU (silu) is converted")
        rope = config.get("rope_parameters") or {}
        scaling = config.get("rope_scaling") or ({} if rope.get("rope_type", "default") == "default" else rope)
        if scaling:
            raise ValueError(f"{source}: RoPE scaling {scaling!r} is not converted (plain RoPE only)")
        heads = config["num_attention_heads"]
        theta = config.get("rope_theta", rope.get("rope_theta", 10000.0))
        return cls(
            vocab_size=config["vocab_size"], hidden_size=config["hidden_size"],
            ffn_hidden_size=config["intermediate_size"], num_layers=config["num_hidden_layers"],
            num_heads=heads, num_kv_heads=config.get("num_key_value_heads", heads),
            head_dim=config.get("head_dim") or config["hidden_size"] // heads,
            qkv_bias=kind == "qwen2" or bool(config.get("attention_bias", False)),
            tied_embeddings=bool(config.get("tie_word_embeddings", False)),
            norm_eps=config["rms_norm_eps"], rope_theta=float(theta),
            max_positions=config.get("max_position_embeddings", 4096), qk_norm=kind == "qwen3")

    def check_tp(self, tp: int) -> None:
        """Raise unless every split dimension divides by ``tp`` (the vocabulary is not
        padded: padded rows would change the softmax)."""
        for what, n in (("vocab_size", self.vocab_size), ("num_key_value_heads", self.num_kv_heads),
                        ("num_attention_heads", self.num_heads), ("intermediate_size", self.ffn_hidden_size)):
            if n % tp:
                raise ValueError(f"tensor_parallel={tp} does not divide the model's {what}={n}; "
                                 f"choose a TP size that divides it")


_KINDS = ("llama", "qwen2", "qwen3")


def _layer_pairs(hf_layer: str, mg_layer: str, shape: ModelShape) -> list[tuple[str, str]]:
    """Name pairs (HF, Megatron) that map one-to-one up to TP splitting."""
    pairs = [(f"{hf_layer}.input_layernorm.weight", f"{mg_layer}.input_layernorm.weight"),
             (f"{hf_layer}.post_attention_layernorm.weight", f"{mg_layer}.pre_mlp_layernorm.weight"),
             (f"{hf_layer}.self_attn.o_proj.weight", f"{mg_layer}.self_attention.linear_proj.weight"),
             (f"{hf_layer}.mlp.down_proj.weight", f"{mg_layer}.mlp.linear_fc2.weight")]
    if shape.qk_norm:  # per-head norms of head_dim, replicated over TP
        pairs += [(f"{hf_layer}.self_attn.q_norm.weight", f"{mg_layer}.self_attention.q_layernorm.weight"),
                  (f"{hf_layer}.self_attn.k_norm.weight", f"{mg_layer}.self_attention.k_layernorm.weight")]
    return pairs


_ROW_PARALLEL = ("linear_proj.weight", "linear_fc2.weight")
_REPLICATED = ("layernorm.weight",)


def _split(name: str, full: torch.Tensor, tp_rank: int, tp: int) -> torch.Tensor:
    if name.endswith(_REPLICATED):
        return full.clone()
    dim = 1 if name.endswith(_ROW_PARALLEL) else 0
    return full.chunk(tp, dim=dim)[tp_rank].clone()


def _join(name: str, shards: Sequence[torch.Tensor]) -> torch.Tensor:
    if name.endswith(_REPLICATED):
        return shards[0].clone()
    return torch.cat(list(shards), dim=1 if name.endswith(_ROW_PARALLEL) else 0)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    """HF q/k/v (weights [out, hidden] or biases [out]) → megatron's per-group layout."""
    g, per = shape.num_kv_heads, shape.num_heads // shape.num_kv_heads
    tail = q.shape[1:]
    q = q.reshape(g, per * shape.head_dim, *tail)
    k = k.reshape(g, shape.head_dim, *tail)
    v = v.reshape(g, shape.head_dim, *tail)
    return torch.cat([q, k, v], dim=1).reshape(-1, *tail)


def split_qkv(qkv: torch.Tensor, shape: ModelShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inverse of :func:`fuse_qkv`."""
    g, per, d = shape.num_kv_heads, shape.num_heads // shape.num_kv_heads, shape.head_dim
    tail = qkv.shape[1:]
    grouped = qkv.reshape(g, (per + 2) * d, *tail)
    q, k, v = grouped.split([per * d, d, d], dim=1)
    return q.reshape(-1, *tail).clone(), k.reshape(-1, *tail).clone(), v.reshape(-1, *tail).clone()


def megatron_shard(hf: Mapping[str, torch.Tensor], shape: ModelShape, *, tp_rank: int = 0, tp: int = 1,
                   layer_offset: int = 0, num_layers: int | None = None, first_stage: bool = True,
                   last_stage: bool = True) -> Tensors:
    """The Megatron state dict of one (TP rank, pipeline stage) from full HF weights.

    ``num_layers`` layers starting at global layer ``layer_offset`` (default: all)."""
    shape.check_tp(tp)
    num_layers = shape.num_layers - layer_offset if num_layers is None else num_layers
    out: Tensors = {}
    if first_stage:
        out["embedding.word_embeddings.weight"] = _split("emb", _get(hf, "model.embed_tokens.weight"), tp_rank, tp)
    for local in range(num_layers):
        hl, ml = f"model.layers.{layer_offset + local}", f"decoder.layers.{local}"
        for hf_name, mg_name in _layer_pairs(hl, ml, shape):
            out[mg_name] = _split(mg_name, _get(hf, hf_name), tp_rank, tp)
        att = f"{hl}.self_attn"
        kinds = ("weight", "bias") if shape.qkv_bias else ("weight",)
        for kind in kinds:
            fused = fuse_qkv(*(_get(hf, f"{att}.{p}_proj.{kind}") for p in "qkv"), shape)
            out[f"{ml}.self_attention.linear_qkv.{kind}"] = fused.chunk(tp, dim=0)[tp_rank].clone()
        gate = _get(hf, f"{hl}.mlp.gate_proj.weight").chunk(tp, dim=0)[tp_rank]
        up = _get(hf, f"{hl}.mlp.up_proj.weight").chunk(tp, dim=0)[tp_rank]
        out[f"{ml}.mlp.linear_fc1.weight"] = torch.cat([gate, up], dim=0)
    if last_stage:
        out["decoder.final_layernorm.weight"] = _get(hf, "model.norm.weight").clone()
        if not shape.tied_embeddings:
            out["output_layer.weight"] = _split("out", _get(hf, "lm_head.weight"), tp_rank, tp)
        elif not first_stage:  # tied, PP > 1: the last stage keeps its own copy of the embedding
            out["output_layer.weight"] = _split("out", _get(hf, "model.embed_tokens.weight"), tp_rank, tp)
    return out


def hf_from_shards(shards: Sequence[Mapping[str, torch.Tensor]], shape: ModelShape, *, layer_offset: int = 0,
                   first_stage: bool = True, last_stage: bool = True) -> Tensors:
    """Full HF weights of one pipeline stage from its Megatron shards, one per TP rank in
    TP-rank order. Inverse of :func:`megatron_shard`; with tied embeddings the output
    layer is not exported (HF reads the head from ``embed_tokens``)."""
    layers = sorted({int(k.split(".")[2]) for k in shards[0] if k.startswith("decoder.layers.")})
    out: Tensors = {}
    if first_stage:
        out["model.embed_tokens.weight"] = _join("emb", [s["embedding.word_embeddings.weight"] for s in shards])
    for local in layers:
        hl, ml = f"model.layers.{layer_offset + local}", f"decoder.layers.{local}"
        for hf_name, mg_name in _layer_pairs(hl, ml, shape):
            out[hf_name] = _join(mg_name, [s[mg_name] for s in shards])
        kinds = ("weight", "bias") if shape.qkv_bias else ("weight",)
        for kind in kinds:
            fused = torch.cat([s[f"{ml}.self_attention.linear_qkv.{kind}"] for s in shards], dim=0)
            for p, t in zip("qkv", split_qkv(fused, shape)):
                out[f"{hl}.self_attn.{p}_proj.{kind}"] = t
        halves = [s[f"{ml}.mlp.linear_fc1.weight"].chunk(2, dim=0) for s in shards]
        out[f"{hl}.mlp.gate_proj.weight"] = torch.cat([h[0] for h in halves], dim=0)
        out[f"{hl}.mlp.up_proj.weight"] = torch.cat([h[1] for h in halves], dim=0)
    if last_stage:
        out["model.norm.weight"] = shards[0]["decoder.final_layernorm.weight"].clone()
        if not shape.tied_embeddings:
            out["lm_head.weight"] = _join("out", [s["output_layer.weight"] for s in shards])
    return out


def _get(hf: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    try:
        return hf[name]
    except KeyError:
        raise KeyError(f"HF checkpoint has no tensor {name!r} (has {len(hf)} tensors, e.g. "
                       f"{sorted(hf)[:3]}); is it a Qwen2/Llama checkpoint of the configured shape?") from None
