"""A GRPO step on the real Megatron engine (tiny model, CPU, one rank): trajectories with
tool output → staleness bound → group advantages → batch → the engine's clipped
policy-gradient step. The step follows the aggregation weights, raises the log-probs of
positively-advantaged tokens, lowers the others', and gives masked (prompt, tool, padding)
positions exactly zero gradient."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from libra_hpc.config import RLConfig
from libra_hpc.rl import NOT_GENERATED, Trajectory, grpo_step, prepare_batch

# (prompt, generated, tool output, generated) token counts per trajectory; groups of two
SEGMENTS = [(4, 3, 2, 4), (4, 5, 3, 2), (5, 2, 2, 6), (5, 4, 0, 0)]
REWARDS = [1.0, 0.0, 0.0, 1.0]
GROUPS = ["a", "a", "b", "b"]


def _rollout(engine, vocab: int) -> list[Trajectory]:
    """Trajectories as a rollout would report them at policy version 0: random tokens,
    the generated ones carrying the current policy's log-probs."""
    gen = torch.Generator().manual_seed(0)
    out = []
    for i, (prompt, first, tool, second) in enumerate(SEGMENTS):
        generated = [False] * prompt + [True] * first + [False] * tool + [True] * second
        tokens = torch.randint(1, vocab, (1, len(generated)), generator=gen)
        lp = engine.logprobs(tokens)[0].tolist()  # lp[t] scores token t+1
        logprobs = [0.0] + [x if g else 0.0 for x, g in zip(lp, generated[1:])]
        out.append(Trajectory(prompt_id=f"p{GROUPS[i]}", group_id=GROUPS[i], tokens=tokens[0].tolist(),
                              generated=generated, logprobs=logprobs,
                              versions=[0 if g else NOT_GENERATED for g in generated], reward=REWARDS[i],
                              finish_reason="stop"))
    return out


def test_grpo_step_on_megatron_learns_the_advantaged_tokens_and_ignores_masked_ones(tiny, torch_world,
                                                                                  monkeypatch):
    from libra_hpc.engines.train import engine as engine_module
    from libra_hpc.engines.train.engine import MegatronTrainEngine

    engine = MegatronTrainEngine(tiny, tp=1, lr=1e-5, micro_batch_size=2)
    seen = []
    real_loss = engine_module.policy_gradient_loss

    def watched(logprobs, *args, **kw):
        logprobs.retain_grad()
        seen.append(logprobs)
        return real_loss(logprobs, *args, **kw)

    monkeypatch.setattr(engine_module, "policy_gradient_loss", watched)
    try:
        trajectories = _rollout(engine, engine.shape.vocab_size)
        rl = RLConfig(loss_aggregation="seq_mean_token_sum", max_staleness=1)
        batch, report = prepare_batch(trajectories, rl, train_version=engine.steps, pad_id=0, rows_multiple=2)
        assert report.sequences == 4 and report.filtered_groups == 0 and report.dropped_stale == {}
        pb = batch.to_policy_batch()
        before = engine.logprobs(pb.tokens)
        stats = [grpo_step(engine, batch) for _ in range(3)]
        after = engine.logprobs(pb.tokens)
    finally:
        engine.shutdown()

    mask = pb.loss_mask.bool()
    lengths = pb.loss_mask.sum(1)
    advantages = pb.advantages.max(1).values + pb.advantages.min(1).values  # the one nonzero value per row
    # first step at ratio 1 (old = rollout log-probs): seq_mean_token_sum is -(1/B) Σ_i A_i·L_i
    assert stats[0].tokens == int(lengths.sum()) == report.trained_tokens
    assert stats[0].loss == pytest.approx(-(advantages * lengths).sum().item() / 4, abs=1e-5)
    assert stats[0].clipped_fraction == 0.0
    losses = [s.loss for s in stats]
    assert losses[2] < losses[1] < losses[0], losses
    # gradient reached exactly the generated tokens of the first step's micro-batches
    # (micro-batches hold rows sorted by trained length, each cut after its last trained token)
    order = torch.argsort(pb.trained_widths(), stable=True)
    grads = torch.zeros_like(pb.loss_mask)
    for k, t in enumerate(seen[:2]):
        grads[order[2 * k:2 * k + 2], :t.shape[1]] = t.grad
    assert torch.all(grads[~mask] == 0.0), "a prompt, tool-output or padding position got gradient"
    assert torch.all(grads[mask] != 0.0)
    moved = ((after - before) * pb.loss_mask).sum(1)
    assert torch.all(moved[advantages > 0] > 0) and torch.all(moved[advantages < 0] < 0), (advantages, moved)


def test_kl_to_the_reference_reaches_the_engine_and_holds_the_policy_back(tiny, torch_world):
    """With ``rl.kl_coef`` the batch carries the reference log-probs; the engine reports
    k3 = 0 while the policy is the reference, > 0 once it moved, and a large β keeps it
    nearer the reference than β = 0 does."""
    from libra_hpc.engines.train.engine import MegatronTrainEngine

    drift = {}
    for beta in (0.0, 50.0):
        engine = MegatronTrainEngine(tiny, tp=1, lr=1e-5, micro_batch_size=2)
        try:
            trajectories = _rollout(engine, engine.shape.vocab_size)
            batch, _ = prepare_batch(trajectories, RLConfig(kl_coef=beta), train_version=0, pad_id=0)
            tokens, mask = torch.tensor(batch.tokens), torch.tensor(batch.loss_mask)
            reference = engine.logprobs(tokens)
            stats = [grpo_step(engine, batch, ref_logprobs=reference if beta else None) for _ in range(3)]
            drift[beta] = ((engine.logprobs(tokens) - reference).abs() * mask).sum().item()
        finally:
            engine.shutdown()
        if beta:
            assert stats[0].kl == pytest.approx(0.0, abs=1e-9) and stats[2].kl > 0
        else:
            assert all(s.kl == 0.0 for s in stats)
    assert drift[50.0] < drift[0.0], drift
    with pytest.raises(ValueError, match="needs ref_logprobs"):
        batch.to_policy_batch()



def test_the_rollout_vs_trainer_gap_is_measured_and_the_correction_reaches_the_engine(tiny, torch_world):
    """The step reports the gap between the rollout's log-probs and the trainer's: ~0 when
    the rollout sampled from the trainer's own weights, the shift when the rollout's
    log-probs are moved by a known amount; a later step of a stale batch (the policy moved)
    shows a gap > 0. With ``off_policy_correction: tis`` and a cap below the importance
    weights, every trained token's weight is truncated and the step reports so."""
    from libra_hpc.engines.train.engine import MegatronTrainEngine

    engine = MegatronTrainEngine(tiny, tp=1, lr=1e-5, micro_batch_size=2)
    try:
        trajectories = _rollout(engine, engine.shape.vocab_size)
        batch, _ = prepare_batch(trajectories, RLConfig(max_staleness=1), train_version=0, pad_id=0)
        first = grpo_step(engine, batch)
        assert first.gap_kl == pytest.approx(0.0, abs=1e-6) and first.gap_max < 1e-4 and first.is_capped == 0
        stale = grpo_step(engine, batch)  # the same rollout, one update later: off-policy by one version
        assert stale.gap_kl > 1e-8 and 1e-4 < stale.gap_max < 1.0, stale  # Adam moves the tiny model far per step
        shift = 2.0  # the rollout said each trained token was e^2 less likely than the trainer says
        trajectories = [dataclasses.replace(t, logprobs=[lp - shift if g else lp for lp, g in zip(t.logprobs, t.generated)])
                        for t in trajectories]
        rl = RLConfig(max_staleness=1, off_policy_correction="tis", is_cap=1.2)
        shifted, _ = prepare_batch(trajectories, rl, train_version=1, pad_id=0)
        stats = grpo_step(engine, shifted)
        drift = stale.gap_max  # how far two updates moved any token's log-prob
        assert shift - drift - 0.5 < stats.gap_max < shift + drift + 0.5
        assert stats.is_capped == pytest.approx(1.0), drift  # exp(2 - drift) > 1.2 on every trained token
    finally:
        engine.shutdown()
