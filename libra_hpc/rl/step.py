"""One GRPO step from finished trajectories: the staleness bound, group advantages, the
batch, and the engine's clipped policy-gradient step. The learning loop (issue 13, item 5)
and the job call these as they are.

Pure at import time (torch is imported by :meth:`TrainBatch.to_policy_batch`, inside the
call, on the training ranks only).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

from libra_hpc.rl.grpo import TrainBatch, build_batch, compute_advantages
from libra_hpc.rl.staleness import drop_stale
from libra_hpc.rl.trajectory import Trajectory

log = logging.getLogger(__name__)


@dataclass
class BatchReport:
    """What :func:`prepare_batch` kept and left out, for the step log: trajectories given
    (``given``), ``dropped_stale`` by reason (:mod:`.staleness`), zero-variance groups and
    trajectories left out, sequences and trained tokens in the batch, mean reward of the
    given trajectories and ``max_lag`` of the kept ones."""

    given: int
    dropped_stale: dict[str, int] = field(default_factory=dict)
    groups: int = 0
    filtered_groups: int = 0
    filtered_trajectories: int = 0
    sequences: int = 0
    trained_tokens: int = 0
    mean_reward: float = 0.0
    max_lag: int = 0


def prepare_batch(trajectories: Sequence[Trajectory], rl, *, train_version: int, pad_id: int,
                  rows_multiple: int = 1, seq_len: int | None = None) -> tuple[TrainBatch | None, BatchReport]:
    """The global batch that trains policy ``train_version`` from ``trajectories``, with
    the ``rl`` section's options (:class:`libra_hpc.config.RLConfig`: ``max_staleness``,
    ``advantage_norm``, ``advantage_eps``, ``filter_zero_variance``, ``loss_aggregation``,
    ``kl_coef``, ``off_policy_correction`` and ``is_cap``). None (and the report saying why)
    when nothing is left to train on."""
    report = BatchReport(given=len(trajectories),
                         mean_reward=sum(t.reward for t in trajectories) / max(len(trajectories), 1))
    fresh = drop_stale(trajectories, train_version, rl.max_staleness)
    report.dropped_stale, report.max_lag = dict(fresh.dropped), fresh.max_lag
    adv = compute_advantages(fresh.kept, norm=rl.advantage_norm, eps=rl.advantage_eps,
                             filter_zero_variance=rl.filter_zero_variance)
    report.groups, report.filtered_groups = adv.groups, adv.filtered_groups
    report.filtered_trajectories = adv.filtered_trajectories
    if not adv.trajectories:
        log.warning("policy %d: nothing to train on (%s)", train_version, report)
        return None, report
    batch = build_batch(adv.trajectories, adv.values, pad_id=pad_id, aggregation=rl.loss_aggregation,
                        kl_coef=rl.kl_coef, seq_len=seq_len, rows_multiple=rows_multiple,
                        is_cap=rl.is_cap if rl.off_policy_correction == "tis" else 0.0)
    report.sequences, report.trained_tokens = batch.num_sequences, batch.trained_tokens
    return batch, report


def grpo_step(engine, batch: TrainBatch, *, ref_logprobs=None, prox_logprobs=None):
    """One optimizer step of ``engine`` (a :class:`~libra_hpc.engines.train.MegatronTrainEngine`)
    on ``batch`` (this DP replica's share): the engine's clipped policy-gradient loss with
    the batch's rollout log-probs as the behaviour policy, aggregation weights, KL term and
    off-policy correction. ``ref_logprobs`` [B, S-1]: the reference policy's log-probs of
    ``batch.tokens``, needed when ``batch.kl_coef > 0``; ``prox_logprobs``: the trainer's
    own log-probs before the step's first pass, for the correction of a step of several
    passes (None: each pass's own forward, exact for one pass). Returns the engine's
    StepStats (collective)."""
    return engine.train_step(batch.to_policy_batch(ref_logprobs, prox_logprobs))
