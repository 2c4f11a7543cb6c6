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
    (the rollout engine's), or None for a purely on-policy step (ratio 1)."""

    tokens: torch.Tensor
    loss_mask: torch.Tensor
    advantages: torch.Tensor
    old_logprobs: torch.Tensor | None = None

    def __post_init__(self) -> None:
        b, s = self.tokens.shape
        for name in ("loss_mask", "advantages", "old_logprobs"):
            value = getattr(self, name)
            if value is not None and tuple(value.shape) != (b, s - 1):
                raise ValueError(f"PolicyBatch.{name} has shape {tuple(value.shape)}; tokens are {b}×{s}, "
                                 f"so per-token arrays must be {b}×{s - 1} (position t scores token t+1)")

    def slice(self, start: int, stop: int) -> PolicyBatch:
        old = None if self.old_logprobs is None else self.old_logprobs[start:stop]
        return PolicyBatch(self.tokens[start:stop], self.loss_mask[start:stop], self.advantages[start:stop], old)


def policy_gradient_loss(logprobs: torch.Tensor, advantages: torch.Tensor, loss_mask: torch.Tensor,
                         old_logprobs: torch.Tensor | None = None,
                         clip_eps: float = 0.2) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate summed over masked tokens: ``-Σ min(r·A, clip(r, 1-ε, 1+ε)·A)``
    with ``r = exp(logp - old)`` (``old`` = ``logp`` detached when not given: r = 1 and
    the gradient is REINFORCE's ``-A·∇logp``).

    Returns (loss sum, token count, report): the caller divides by the token count of the
    whole global batch (megatron's ``calculate_per_token_loss``), so micro-batches and DP
    replicas with different token counts weigh every token equally."""
    mask = loss_mask.to(logprobs.dtype)
    old = logprobs.detach() if old_logprobs is None else old_logprobs.to(logprobs.dtype)
    ratio = torch.exp(logprobs - old)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - clip_eps, 1.0 + clip_eps) * advantages
    per_token = -torch.minimum(unclipped, clipped)
    loss_sum = (per_token * mask).sum()
    tokens = loss_mask.sum().to(torch.int)
    with torch.no_grad():
        clipped_tokens = (((ratio - 1.0).abs() > clip_eps).to(mask.dtype) * mask).sum()
    return loss_sum, tokens, {"loss_sum": loss_sum.detach(), "tokens": tokens.detach().float(),
                              "clipped": clipped_tokens}
