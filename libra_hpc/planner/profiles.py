"""Hardware and model profiles: the physical numbers the cost models start from.

Profiles are data (``configs/hardware/*.yaml``, ``configs/models/*.yaml``, each number with
its source in a comment) read into strict pydantic models: an unknown key, a string where a
number belongs or an impossible shape (KV heads that do not divide the heads) fails with the
file and the dotted field. Derived quantities (parameter counts, weight and KV bytes, FLOPs
per token) are methods here so that every cost model computes them the same way.

Units: bytes, FLOP, seconds; ``GB`` is 1e9 bytes (datasheet convention), ``GB/s`` 1e9 B/s,
``TFLOP/s`` 1e12 FLOP/s.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from libra_hpc.config import ConfigError, describe_error, parse_yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
HARDWARE_DIR = REPO_ROOT / "configs" / "hardware"
MODELS_DIR = REPO_ROOT / "configs" / "models"


class _Profile(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, use_attribute_docstrings=True)


class HardwareProfile(_Profile):
    """One accelerator (or a CPU slot standing for one) and the node it sits in."""

    name: str = Field(min_length=1)
    """Label for logs, e.g. ``A800-80G``."""
    memory_gb: float = Field(gt=0)
    """Device memory per GPU, GB (1e9 bytes), as the datasheet states it."""
    memory_bandwidth_gbps: float = Field(gt=0)
    """Peak device-memory bandwidth per GPU, GB/s."""
    bf16_tflops: float = Field(gt=0)
    """Peak dense BF16 matrix throughput per GPU (without 2:4 sparsity), TFLOP/s."""
    intra_node_gbps: float = Field(gt=0)
    """GPU-to-GPU link bandwidth inside a node, per GPU and per direction, GB/s
    (NVLink: half the bidirectional datasheet figure)."""
    inter_node_gbps: float = Field(gt=0)
    """Network bandwidth per GPU between nodes, per direction, GB/s (e.g. one 200 Gb/s
    HDR NIC per GPU: 25)."""
    gpus_per_node: int = Field(ge=1, le=64)
    """GPUs in one node (the largest tensor-parallel group that stays on NVLink)."""

    @property
    def memory_bytes(self) -> float:
        return self.memory_gb * 1e9

    @property
    def bandwidth_bps(self) -> float:
        """Device-memory bandwidth, bytes/s."""
        return self.memory_bandwidth_gbps * 1e9

    @property
    def peak_flops(self) -> float:
        """Dense BF16 peak, FLOP/s."""
        return self.bf16_tflops * 1e12

    def link_bps(self, inter_node: bool) -> float:
        """Per-GPU, per-direction bandwidth of the link a collective runs over, bytes/s."""
        return (self.inter_node_gbps if inter_node else self.intra_node_gbps) * 1e9


class ModelProfile(_Profile):
    """A decoder-only transformer (Qwen2/Qwen3 family: GQA, SwiGLU MLP, RMSNorm), dense or MoE."""

    name: str = Field(min_length=1)
    """Label for logs, e.g. ``Qwen3-14B``."""
    num_layers: int = Field(ge=1)
    """Transformer blocks (``num_hidden_layers``)."""
    hidden_size: int = Field(ge=1)
    """Residual stream width (``hidden_size``)."""
    num_heads: int = Field(ge=1)
    """Query heads (``num_attention_heads``)."""
    num_kv_heads: int = Field(ge=1)
    """Key/value heads (``num_key_value_heads``); must divide ``num_heads`` (GQA)."""
    head_dim: int = Field(ge=1)
    """Width of one attention head (``head_dim``)."""
    intermediate_size: int = Field(ge=1)
    """Dense SwiGLU MLP width (``intermediate_size``); unused by MoE layers."""
    vocab_size: int = Field(ge=1)
    """Rows of the embedding table and of the LM head."""
    tie_embeddings: bool = False
    """The LM head shares the embedding matrix (``tie_word_embeddings``)."""
    qk_norm: bool = False
    """RMSNorm on queries and keys per head (Qwen3): 2·head_dim weights per layer."""
    qkv_bias: bool = False
    """Biases on the q, k and v projections (Qwen2.5)."""
    num_experts: int = Field(0, ge=0)
    """Routed experts per MoE layer (``num_experts``); 0 for a dense model."""
    experts_per_token: int = Field(0, ge=0)
    """Experts each token is routed to (``num_experts_per_tok``); 0 for a dense model."""
    moe_intermediate_size: int = Field(0, ge=0)
    """SwiGLU width of one expert (``moe_intermediate_size``); 0 for a dense model."""

    @model_validator(mode="after")
    def _check_shape(self) -> ModelProfile:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads})")
        moe = (self.num_experts, self.experts_per_token, self.moe_intermediate_size)
        if any(moe) and not all(moe):
            raise ValueError("num_experts, experts_per_token and moe_intermediate_size are all 0 (dense) "
                             f"or all positive (MoE); got {moe}")
        if self.experts_per_token > self.num_experts:
            raise ValueError(f"experts_per_token ({self.experts_per_token}) exceeds num_experts ({self.num_experts})")
        return self

    # ------------------------------------------------------------------ parameter counts

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def attention_params(self) -> int:
        """Weights of one attention block: q, k, v, o projections (+ biases, + q/k norms)."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        n = h * q + 2 * h * kv + q * h
        if self.qkv_bias:
            n += q + 2 * kv
        if self.qk_norm:
            n += 2 * self.head_dim
        return n

    @property
    def expert_params(self) -> int:
        """Weights of one routed expert (gate, up, down)."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    def mlp_params(self, active: bool = False) -> int:
        """Weights of one MLP block: the dense SwiGLU, or router + all (or, ``active``, the
        routed top-k) experts."""
        if not self.is_moe:
            return 3 * self.hidden_size * self.intermediate_size
        experts = self.experts_per_token if active else self.num_experts
        return self.hidden_size * self.num_experts + experts * self.expert_params

    def layer_params(self, active: bool = False) -> int:
        """One transformer block: attention + MLP + its two RMSNorms."""
        return self.attention_params + self.mlp_params(active) + 2 * self.hidden_size

    @property
    def embedding_params(self) -> int:
        """Input embedding plus the LM head when it is not tied (final norm excluded)."""
        return self.vocab_size * self.hidden_size * (1 if self.tie_embeddings else 2)

    def param_count(self, active: bool = False) -> int:
        """All weights (``active``: those one token touches; equal for a dense model)."""
        return self.num_layers * self.layer_params(active) + self.embedding_params + self.hidden_size

    def matmul_params(self, active: bool = True) -> int:
        """Weights used in matrix products per token: all layers' and the LM head, not the
        input embedding (a lookup) nor norms."""
        per_layer = self.layer_params(active) - 2 * self.hidden_size
        return self.num_layers * per_layer + self.vocab_size * self.hidden_size

    def weight_bytes(self, dtype_bytes: int = 2) -> int:
        """Bytes of all weights at ``dtype_bytes`` per parameter (bf16: 2)."""
        return self.param_count() * dtype_bytes

    # ------------------------------------------------------------------ per-token costs

    def kv_bytes_per_token(self, dtype_bytes: int = 2) -> int:
        """KV-cache bytes one token occupies across all layers (keys and values)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def attention_flops_per_token(self, context: float) -> float:
        """Forward FLOP of QKᵀ and AV for one token attending to ``context`` tokens."""
        return 4.0 * self.num_layers * self.num_heads * self.head_dim * context

    def flops_per_token(self, context: float = 0.0) -> float:
        """Forward FLOP for one token: 2 per active matmul weight plus the attention term.
        ``context`` is the number of tokens it attends to (for causal training over a
        sequence of length s, the average is s/2)."""
        return 2.0 * self.matmul_params(active=True) + self.attention_flops_per_token(context)

    def sequence_train_flops(self, tokens: float) -> float:
        """Forward and backward FLOP of training one causal sequence of ``tokens``: 3 × its
        tokens × the FLOP of a token attending to half of them (attention makes it grow
        faster than the tokens)."""
        return 3.0 * tokens * self.flops_per_token(tokens / 2)


# ---------------------------------------------------------------------------- loading

P = TypeVar("P", bound=_Profile)


def load_hardware(name_or_path: str | Path) -> HardwareProfile:
    """A hardware profile by name (``a800-80g`` → ``configs/hardware/a800-80g.yaml``) or
    path. Raises ConfigError naming the file and the field."""
    return _load(HardwareProfile, name_or_path, HARDWARE_DIR)


def load_model(name_or_path: str | Path) -> ModelProfile:
    """A model profile by name (``qwen3-14b`` → ``configs/models/qwen3-14b.yaml``) or path.
    Raises ConfigError naming the file and the field."""
    return _load(ModelProfile, name_or_path, MODELS_DIR)


def available(directory: Path) -> list[str]:
    """Profile names shipped in ``directory``."""
    return sorted(p.stem for p in directory.glob("*.yaml"))


def _resolve(name_or_path: str | Path, directory: Path) -> Path:
    text = str(name_or_path)
    if isinstance(name_or_path, Path) or "/" in text or text.endswith((".yaml", ".yml")):
        return Path(name_or_path)
    path = directory / f"{text.lower()}.yaml"
    if not path.exists():
        names = available(directory)
        hint = difflib.get_close_matches(text.lower(), names, n=1)
        did_you_mean = f"; did you mean '{hint[0]}'?" if hint else ""
        raise ConfigError(str(path), [f"no profile named {text!r}{did_you_mean} Available: {', '.join(names)}"])
    return path


def _load(schema: type[P], name_or_path: str | Path, directory: Path) -> P:
    path = _resolve(name_or_path, directory)
    source = str(path)
    try:
        raw = parse_yaml(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ConfigError(source, [f"cannot read the file: {exc.strerror}"]) from None
    except yaml.YAMLError as exc:
        raise ConfigError(source, [f"not valid YAML: {exc}"]) from None
    if not isinstance(raw, dict):
        raise ConfigError(source, [f"the top level must be a mapping of fields, got {type(raw).__name__}"])
    try:
        return schema.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(source, [describe_error(err, schema) for err in exc.errors()]) from None
