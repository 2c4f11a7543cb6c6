"""GRPO: group-relative advantages, loss masks, and the training batch of one step.

Pure (no torch at module level): :class:`TrainBatch` holds plain lists; its
:meth:`TrainBatch.to_policy_batch` builds the engine's
:class:`~libra_hpc.engines.train.loss.PolicyBatch`, whose loss
(:func:`~libra_hpc.engines.train.loss.policy_gradient_loss`, the clipped surrogate plus the
optional k3 KL term) is the one and only policy-gradient loss of the project.

Advantages (Shao et al. 2024, DeepSeekMath): the samples of one prompt form a group; a
sample's advantage is ``(r - mean(r_group)) / (std(r_group) + eps)`` (``std``: sample
standard deviation, Bessel-corrected, as TRL and verl compute it), or ``r - mean`` with
``rl.advantage_norm: none`` (Dr. GRPO, Liu et al. 2025: dividing by the std favours
too-easy and too-hard prompts). Every generated token of a sample carries its advantage;
prompt and tool-output tokens carry none (loss mask 0).

A group whose rewards are all equal has advantage 0 everywhere: no gradient, but its
tokens still count in a token-mean denominator, diluting the others. With
``rl.filter_zero_variance`` (DAPO's dynamic sampling, without the re-sampling) such groups
are left out of the batch and counted.

Loss aggregation (``rl.loss_aggregation``), with ``ℓ_it`` the per-token loss of token t of
sequence i, ``L_i`` its trained tokens, ``B`` the sequences and ``N = Σ L_i``:

- ``token_mean``: ``Σ_it ℓ_it / N``: every token weighs the same (DAPO; verl's default);
- ``seq_mean_token_sum``: ``Σ_i Σ_t ℓ_it / B``: per-sequence sums, averaged (no length
  normalisation inside a sequence; Dr. GRPO's unbiased form up to a constant);
- ``seq_mean_token_mean``: ``Σ_i (Σ_t ℓ_it / L_i) / B``: per-sequence means, averaged (the
  original GRPO; short sequences' tokens weigh more).

The engine always divides its loss sum by the global batch's trained-token count ``N``
(megatron's per-token loss, so micro-batches and DP replicas add up exactly); the modes are
per-token weights ``w_it`` with ``Σ w_it ℓ_it / N`` equal to the formulas above. Build the
*global* batch, then slice it per DP replica: the weights use the global ``N`` and ``B``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from libra_hpc.rl.trajectory import Trajectory

NORMS = ("group_std", "none")
AGGREGATIONS = ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean")


def group_advantages(rewards: Sequence[float], *, norm: str = "group_std", eps: float = 1e-6) -> list[float]:
    """Advantages of one group's rewards: ``r - mean``, divided by ``std + eps`` with
    ``norm="group_std"`` (sample std; a group of one has std 0)."""
    if norm not in NORMS:
        raise ValueError(f"advantage norm {norm!r}; choose one of {list(NORMS)} (rl.advantage_norm)")
    if not rewards:
        raise ValueError("a GRPO group needs at least one reward")
    mean = sum(rewards) / len(rewards)
    centred = [r - mean for r in rewards]
    if norm == "none":
        return centred
    n = len(rewards)
    std = math.sqrt(sum(c * c for c in centred) / (n - 1)) if n > 1 else 0.0
    return [c / (std + eps) for c in centred]


@dataclass
class Advantages:
    """:func:`compute_advantages`' result: ``trajectories`` and their ``values`` (one
    advantage each, same order), ``groups`` seen, and the zero-variance groups and
    trajectories left out (``filtered_groups``, ``filtered_trajectories``)."""

    trajectories: list[Trajectory] = field(default_factory=list)
    values: list[float] = field(default_factory=list)
    groups: int = 0
    filtered_groups: int = 0
    filtered_trajectories: int = 0


def group_trains(rewards: Sequence[float], filter_zero_variance: bool = True) -> bool:
    """Whether a group with these rewards is trained: not when ``filter_zero_variance`` and
    every reward is equal (nothing to learn from it)."""
    return not (filter_zero_variance and max(rewards) == min(rewards))


def compute_advantages(trajectories: Sequence[Trajectory], *, norm: str = "group_std", eps: float = 1e-6,
                       filter_zero_variance: bool = True) -> Advantages:
    """Group the trajectories by ``group_id`` (groups in order of first appearance, members
    in their order) and give each its group-relative advantage. Groups whose rewards are
    all equal are left out when ``filter_zero_variance``. Run it after the staleness bound:
    a group is the samples that survived it."""
    groups: dict[str, list[Trajectory]] = {}
    for t in trajectories:
        groups.setdefault(t.group_id, []).append(t)
    out = Advantages(groups=len(groups))
    for members in groups.values():
        rewards = [t.reward for t in members]
        if not group_trains(rewards, filter_zero_variance):
            out.filtered_groups += 1
            out.filtered_trajectories += len(members)
            continue
        out.trajectories.extend(members)
        out.values.extend(group_advantages(rewards, norm=norm, eps=eps))
    return out


def loss_mask(trajectory: Trajectory) -> list[int]:
    """Per position t (``len(tokens) - 1`` of them; position t scores token t+1): 1 where
    token t+1 was generated by the policy, 0 for prompt and tool-output tokens."""
    return [int(g) for g in trajectory.generated[1:]]


def sequence_weights(lengths: Sequence[int], aggregation: str) -> list[float]:
    """Per-sequence token weight ``w_i`` for trained-token counts ``lengths`` (``L_i``) such
    that ``Σ_i w_i Σ_t ℓ_it / N`` is the ``aggregation`` (module docstring); sequences
    without trained tokens get 0 and do not count in ``B``."""
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"loss aggregation {aggregation!r}; choose one of {list(AGGREGATIONS)} "
                         "(rl.loss_aggregation)")
    total, seqs = sum(lengths), sum(1 for n in lengths if n > 0)
    if aggregation == "token_mean":
        return [1.0 if n > 0 else 0.0 for n in lengths]
    if aggregation == "seq_mean_token_sum":
        return [total / seqs if n > 0 else 0.0 for n in lengths]
    return [total / (seqs * n) if n > 0 else 0.0 for n in lengths]


@dataclass
class TrainBatch:
    """The GRPO step's batch as plain lists, every per-token row ``S - 1`` long (position t
    scores token t+1, the engine's convention): ``tokens`` [B][S] right-padded;
    ``loss_mask`` 1 on generated tokens; ``advantages`` the sequence's advantage on its
    generated tokens (0 elsewhere); ``old_logprobs`` the rollout log-probs (0 elsewhere);
    ``weights`` the aggregation weights (:func:`sequence_weights`); ``kl_coef`` β of the
    KL-to-reference term; ``is_cap`` the off-policy correction's cap (0: none). Rows past ``num_sequences`` are all-masked padding rows (the
    batch splits into whole micro-batches)."""

    tokens: list[list[int]]
    loss_mask: list[list[int]]
    advantages: list[list[float]]
    old_logprobs: list[list[float]]
    weights: list[list[float]]
    num_sequences: int
    kl_coef: float = 0.0
    is_cap: float = 0.0

    @property
    def trained_tokens(self) -> int:
        return sum(map(sum, self.loss_mask))

    def to_policy_batch(self, ref_logprobs=None, prox_logprobs=None):
        """The engine's :class:`~libra_hpc.engines.train.loss.PolicyBatch` (imports torch).
        ``ref_logprobs`` [B, S-1]: the reference policy's log-probs of ``tokens``, needed
        when ``kl_coef > 0``; ``prox_logprobs``: the trainer's log-probs before the step's
        first pass (the off-policy correction of a step of several passes)."""
        import torch

        from libra_hpc.engines.train.loss import PolicyBatch

        return PolicyBatch(torch.tensor(self.tokens, dtype=torch.long),
                           torch.tensor(self.loss_mask, dtype=torch.float32),
                           torch.tensor(self.advantages, dtype=torch.float32),
                           old_logprobs=torch.tensor(self.old_logprobs, dtype=torch.float32),
                           weights=torch.tensor(self.weights, dtype=torch.float32),
                           ref_logprobs=ref_logprobs, kl_coef=self.kl_coef, is_cap=self.is_cap,
                           prox_logprobs=prox_logprobs)


def build_batch(trajectories: Sequence[Trajectory], advantages: Sequence[float], *, pad_id: int,
                aggregation: str = "token_mean", kl_coef: float = 0.0, seq_len: int | None = None,
                rows_multiple: int = 1, is_cap: float = 0.0) -> TrainBatch:
    """The training batch of ``trajectories`` with one ``advantages`` value each (from
    :func:`compute_advantages`). Rows are padded with ``pad_id`` to the longest trajectory,
    or to ``seq_len`` tokens when given (a longer trajectory is refused by name); the row
    count is padded up to a multiple of ``rows_multiple`` with all-masked rows. ``is_cap`` >
    0: the off-policy correction's cap (``rl.is_cap`` with ``rl.off_policy_correction: tis``)."""
    if len(trajectories) != len(advantages):
        raise ValueError(f"{len(trajectories)} trajectories but {len(advantages)} advantages; one each")
    if not trajectories:
        raise ValueError("no trajectories to train on (all stale or in zero-variance groups?)")
    if kl_coef < 0:
        raise ValueError(f"kl_coef={kl_coef}; it must be >= 0 (rl.kl_coef)")
    longest = max(len(t.tokens) for t in trajectories)
    width = longest if seq_len is None else seq_len
    for t in trajectories:
        if len(t.tokens) > width:
            raise ValueError(f"trajectory {t.name} has {len(t.tokens)} tokens, more than seq_len={width}")
    masks = [loss_mask(t) for t in trajectories]
    weights = sequence_weights([sum(m) for m in masks], aggregation)
    if is_cap < 0:
        raise ValueError(f"is_cap={is_cap}; it must be >= 0 (rl.is_cap)")
    batch = TrainBatch([], [], [], [], [], num_sequences=len(trajectories), kl_coef=kl_coef, is_cap=is_cap)
    for t, mask, adv, w in zip(trajectories, masks, advantages, weights):
        pad = width - len(t.tokens)
        batch.tokens.append(list(t.tokens) + [pad_id] * pad)
        batch.loss_mask.append(mask + [0] * pad)
        batch.advantages.append([adv * m for m in mask] + [0.0] * pad)
        batch.old_logprobs.append([lp if m else 0.0 for lp, m in zip(t.logprobs[1:], mask)] + [0.0] * pad)
        batch.weights.append([w * m for m in mask] + [0.0] * pad)
    while len(batch.tokens) % rows_multiple:
        batch.tokens.append([pad_id] * width)
        for rows in (batch.loss_mask, batch.advantages, batch.old_logprobs, batch.weights):
            rows.append([0] * (width - 1) if rows is batch.loss_mask else [0.0] * (width - 1))
    return batch
