"""The policy-gradient objective on per-token log-probs (GRPO / PPO clipped surrogate).

Token convention used throughout the training engine: a batch of B sequences of S
tokens gives B × (S-1) positions; position t scores token t+1 given tokens 0..t. Every
per-token array (log-probs, advantages, old log-probs, the loss mask) is [B, S-1].
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PolicyBatch:
    """One optimizer step's sequences for this DP replica.

    ``tokens`` [B, S] int64 (right-padded); ``loss_mask`` [B, S-1], 1 where position t's
    next token is a generated token the policy is trained on (0 for prompt, tool output,
    padding); ``advantages`` [B, S-1] float (GRPO: the sequence's group-normalised reward
    repeated over its tokens); ``old_logprobs`` [B, S-1] the behaviour policy's log-probs
    (the rollout engine's), or None for a purely on-policy step (ratio 1). ``weights``
    [B, S-1]: per-token loss weights (None: 1), how :mod:`libra_hpc.rl.grpo` turns the
    engine's per-token mean into its other aggregation modes; ``ref_logprobs`` [B, S-1]:
    the reference policy's log-probs, required when ``kl_coef`` (β of the k3 KL penalty,
    see :func:`policy_gradient_loss`) is above 0. ``is_cap`` > 0 turns on the off-policy
    correction (``rl.off_policy_correction: tis``) with that cap; ``prox_logprobs``
    [B, S-1] is then the trainer's own log-probs before the step's first update (None: the
    current forward's, exact for a step of one pass)."""

    tokens: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    weights: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    kl_coef: float = 0.0
    is_cap: float = 0.0
    prox_logprobs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        b, s = self.tokens.shape
        if self.kl_coef < 0 or (self.kl_coef > 0 and self.ref_logprobs is None):
            raise ValueError(f"PolicyBatch.kl_coef={self.kl_coef}: it must be >= 0, and above 0 the batch needs "
                             "ref_logprobs (the reference policy's log-probs of tokens)")
        if self.is_cap < 0 or (self.is_cap > 0 and self.old_logprobs is None):
            raise ValueError(f"PolicyBatch.is_cap={self.is_cap}: it must be >= 0, and above 0 the batch needs "
                             "old_logprobs (the rollout's log-probs the correction weighs against)")
        for name in ("loss_mask", "advantages", "old_logprobs", "weights", "ref_logprobs", "prox_logprobs"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != (b, s - 1):
                raise ValueError(f"PolicyBatch.{name} has shape {tuple(value.shape)}; tokens are {b}×{s}, "
                                 f"so per-token arrays must be {b}×{s - 1} (position t scores token t+1)")

    def slice(self, start: int, stop: int) -> PolicyBatch:
        cut = lambda x: None if x is None else x[start:stop]  # noqa: E731
        return PolicyBatch(self.tokens[start:stop], self.loss_mask[start:stop], self.advantages[start:stop],
                           cut(self.old_logprobs), cut(self.weights), cut(self.ref_logprobs), self.kl_coef,
                           self.is_cap, cut(self.prox_logprobs))

    def take(self, rows: torch.Tensor) -> PolicyBatch:
        """The batch's ``rows`` (an index tensor), in that order."""
        pick = lambda x: None if x is None else x[rows]  # noqa: E731
        return PolicyBatch(self.tokens[rows], self.loss_mask[rows], self.advantages[rows],
                           pick(self.old_logprobs), pick(self.weights), pick(self.ref_logprobs), self.kl_coef,
                           self.is_cap, pick(self.prox_logprobs))

    def narrow(self, width: int) -> PolicyBatch:
        """The first ``width`` tokens of every row (and the per-token arrays' first ``width`` - 1)."""
        cut = lambda x: None if x is None else x[:, :width - 1]  # noqa: E731
        return PolicyBatch(self.tokens[:, :width], cut(self.loss_mask), cut(self.advantages),
                           cut(self.old_logprobs), cut(self.weights), cut(self.ref_logprobs), self.kl_coef,
                           self.is_cap, cut(self.prox_logprobs))

    def trained_widths(self) -> torch.Tensor:
        """Per row, the tokens up to and including its last trained one ([B] int64; 1 for a
        row with nothing to train): what the loss sees of the row (attention is causal, so
        what follows cannot change it)."""
        used = self.loss_mask.ne(0)
        last = used.shape[1] - used.flip(1).int().argmax(1)  # last trained position + 1
        return torch.where(used.any(1), last + 1, torch.ones_like(last))


def policy_gradient_loss(logprobs: torch.Tensor, advantages: torch.Tensor, loss_mask: torch.Tensor,
                         old_logprobs: torch.Tensor | None = None, clip_eps: float = 0.2, *,
                         weights: torch.Tensor | None = None, ref_logprobs: torch.Tensor | None = None,
                         kl_coef: float = 0.0, is_cap: float = 0.0,
                         prox_logprobs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate summed over masked tokens: ``-Σ w·min(r·A, clip(r, 1-ε, 1+ε)·A)``
    with ``r = exp(logp - old)`` (``old`` = ``logp`` detached when not given: r = 1 and
    the gradient is REINFORCE's ``-A·∇logp``) and per-token weights ``w`` (1 when not
    given). With ``kl_coef`` β > 0, each token adds ``β·k3``, the k3 estimator of
    KL(π‖π_ref) (Schulman 2020; GRPO's): ``k3 = exp(ref - logp) - (ref - logp) - 1``, ≥ 0,
    unbiased when tokens are sampled from π.

    Off-policy correction (``is_cap`` C > 0; ``rl.off_policy_correction: tis``): the
    rollout's tokens come from a behaviour policy ``old`` (an older version, and vLLM's
    numerics) while the trainer's own policy before this update is ``prox``
    (``prox_logprobs``, else ``logp`` detached). The ratio is taken against ``prox``, and
    each token's loss is weighted by the truncated importance weight
    ``min(exp(prox - old), C)``: ``-Σ w·min(exp(prox - old), C)·min(r·A, clip(r)·A)`` with
    ``r = exp(logp - prox)`` (the decoupled objective of AReaL with the behaviour weight
    truncated as in truncated importance sampling). The KL term is not weighted.

    Returns (loss sum, token count, report): the caller divides by the token count of the
    whole global batch (megatron's ``calculate_per_token_loss``), so micro-batches and DP
    replicas with different token counts weigh every token equally. ``report["kl"]`` is
    the k3 sum over masked tokens (unweighted). When ``old`` is given the report also
    measures the rollout-vs-trainer gap on masked tokens, δ = logp - old:
    ``report["gap_kl"]``, the sum of k3 estimates of KL(behaviour‖trainer), exp(δ) - 1 - δ;
    ``report["gap_max"]``, the largest |δ|; ``report["is_capped"]``, tokens whose importance
    weight was truncated (0 without the correction)."""
    mask = loss_mask.to(logprobs.dtype)
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)
    behaviour = None if old_logprobs is None else old_logprobs.to(logprobs.dtype)
    if is_cap > 0:
        if behaviour is None:
            raise ValueError(f"is_cap={is_cap} needs old_logprobs (the rollout's log-probs)")
        old = logprobs.detach() if prox_logprobs is None else prox_logprobs.to(logprobs.dtype)
        raw = torch.exp(old - behaviour)
        importance = raw.clamp(max=is_cap)
    else:
        old = logprobs.detach() if behaviour is None else behaviour
        raw = importance = None
    ratio = torch.exp(logprobs - old)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    if importance is not None:
        per_token = per_token * importance
    kl = zero
    if kl_coef > 0:
        if ref_logprobs is None:
            raise ValueError(f"kl_coef={kl_coef} needs ref_logprobs (the reference policy's log-probs)")
        delta = ref_logprobs.to(logprobs.dtype) - logprobs
        k3 = torch.exp(delta) - delta - 1.0
        per_token = per_token + kl_coef * k3
        kl = (k3.detach() * mask).sum()
    weighted = mask if weights is None else mask * weights.to(logprobs.dtype)
    loss_sum = (per_token * weighted).sum()
    tokens = loss_mask.sum().to(torch.int)
    with torch.no_grad():
        clipped_tokens = (((ratio - 1.0).abs() > clip_eps).to(mask.dtype) * mask).sum()
        gap_kl = gap_max = capped = zero
        if behaviour is not None:
            gap = logprobs.detach() - behaviour
            # expm1: exp(δ) - 1 - δ in float32 came out -5e-11 for a δ of 1e-5 (CI's job test); each term is >= 0
            gap_kl = ((torch.expm1(gap) - gap).clamp_min(0.0) * mask).sum()
            gap_max = (gap.abs() * mask).max() if mask.numel() else zero
        if raw is not None:
            capped = ((raw > is_cap).to(mask.dtype) * mask).sum()
    return loss_sum, tokens, {"loss_sum": loss_sum.detach(), "tokens": tokens.detach().float(),
                              "clipped": clipped_tokens, "kl": kl, "gap_kl": gap_kl, "gap_max": gap_max,
                              "is_capped": capped}
