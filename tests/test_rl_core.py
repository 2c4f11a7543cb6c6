"""The RL core alone (libra_hpc/rl/): the trajectory record, GRPO advantages against hand
computation, loss masks around tool output, zero-variance filtering, the staleness bound,
and the loss aggregation modes and KL term through the engine's loss function."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from libra_hpc.rl import (
    NOT_GENERATED,
    Trajectory,
    build_batch,
    compute_advantages,
    drop_stale,
    group_advantages,
    loss_mask,
    prepare_batch,
)
from libra_hpc.rl.grpo import sequence_weights

ROOT = Path(__file__).resolve().parent.parent


def traj(group="g0", prompt="p0", reward=1.0, generated=(0, 0, 1, 1), version=0, versions=None, tokens=None):
    gen = [bool(g) for g in generated]
    n = len(gen)
    versions = versions or [version if g else NOT_GENERATED for g in gen]
    return Trajectory(prompt_id=prompt, group_id=group, tokens=tokens or [10 + i for i in range(n)], generated=gen,
                      logprobs=[-0.1 * (i + 1) if g else 0.0 for i, g in enumerate(gen)], versions=versions,
                      reward=reward, finish_reason="stop")


# ----------------------------------------------------------------- trajectory record

def test_trajectory_round_trips_through_a_dict_and_refuses_bad_records_by_name():
    t = traj(versions=[-1, -1, 3, 4])
    assert Trajectory.from_dict(t.to_dict()) == t
    assert (t.oldest_version, t.newest_version, t.num_generated) == (3, 4, 2)
    with pytest.raises(ValueError, match=r"trajectory g0/p0: logprobs has 3 entries but tokens has 4"):
        Trajectory.from_dict({**t.to_dict(), "logprobs": [0.0, 0.0, -1.0]})
    with pytest.raises(ValueError, match=r"g0/p0: missing fields \['reward'\], unknown fields \['rewrd'\]"):
        Trajectory.from_dict({**{k: v for k, v in t.to_dict().items() if k != "reward"}, "rewrd": 1.0})
    with pytest.raises(ValueError, match=r"logprobs\[2\] = 0.5 on a generated token"):
        Trajectory.from_dict({**t.to_dict(), "logprobs": [0.0, 0.0, 0.5, -1.0]})
    with pytest.raises(ValueError, match=r"versions\[3\] = -1 on a generated token"):
        traj(versions=[-1, -1, 0, -1])
    with pytest.raises(ValueError, match="generated\\[0\\] is True"):
        traj(generated=(1, 0, 1))
    with pytest.raises(ValueError, match="reward is nan"):
        traj(reward=math.nan)


# ------------------------------------------------------------------------ advantages

def test_advantages_match_a_hand_computed_group():
    # rewards 1,0,0,0: mean 0.25; sample std sqrt((0.75² + 3·0.25²)/3) = 0.5
    assert group_advantages([1.0, 0.0, 0.0, 0.0], eps=0.0) == pytest.approx([1.5, -0.5, -0.5, -0.5])
    assert group_advantages([1.0, 0.0, 0.0, 0.0], eps=0.5) == pytest.approx([0.75, -0.25, -0.25, -0.25])
    assert group_advantages([1.0, 0.0, 0.0, 0.0], norm="none") == pytest.approx([0.75, -0.25, -0.25, -0.25])
    assert group_advantages([2.0, 4.0], eps=0.0) == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2)])
    with pytest.raises(ValueError, match="rl.advantage_norm"):
        group_advantages([1.0], norm="batch")


def test_zero_variance_groups_are_filtered_and_counted():
    batch = [traj("a", reward=1.0), traj("b", reward=0.0), traj("a", reward=0.0), traj("b", reward=0.0),
             traj("c", reward=1.0), traj("c", reward=1.0), traj("c", reward=1.0)]
    kept = compute_advantages(batch, eps=0.0)
    assert (kept.groups, kept.filtered_groups, kept.filtered_trajectories) == (3, 2, 5)
    assert [t.group_id for t in kept.trajectories] == ["a", "a"]
    assert kept.values == pytest.approx([1 / math.sqrt(2), -1 / math.sqrt(2)])
    everything = compute_advantages(batch, eps=1e-6, filter_zero_variance=False)
    assert everything.filtered_groups == 0 and len(everything.trajectories) == 7
    assert [t.group_id for t in everything.trajectories] == ["a", "a", "b", "b", "c", "c", "c"]
    assert everything.values[2:] == [0.0] * 5  # no signal, but their tokens would count


# ---------------------------------------------------------------- masks and batches

def test_loss_mask_and_batch_exclude_prompt_and_tool_tokens():
    # prompt (3) | generated tool call (2) | tool output (2) | generated answer (2)
    t = traj("g", reward=1.0, generated=(0, 0, 0, 1, 1, 0, 0, 1, 1))
    assert loss_mask(t) == [0, 0, 1, 1, 0, 0, 1, 1]  # position i scores token i+1
    other = traj("g", reward=0.0, generated=(0, 1, 1))
    batch = build_batch([t, other], [2.0, -1.0], pad_id=7, rows_multiple=4)
    assert batch.num_sequences == 2 and len(batch.tokens) == 4 and batch.trained_tokens == 6
    assert batch.tokens[1] == [10, 11, 12, 7, 7, 7, 7, 7, 7] and batch.tokens[3] == [7] * 9
    assert batch.loss_mask[1] == [1, 1, 0, 0, 0, 0, 0, 0] and batch.loss_mask[3] == [0] * 8
    assert batch.advantages[0] == [0, 0, 2.0, 2.0, 0, 0, 2.0, 2.0]
    assert batch.old_logprobs[0] == pytest.approx([0, 0, -0.4, -0.5, 0, 0, -0.8, -0.9])  # logprobs[i+1]
    assert batch.weights[0] == [0, 0, 1, 1, 0, 0, 1, 1]  # token mean
    with pytest.raises(ValueError, match="trajectory g/p0 has 9 tokens, more than seq_len=5"):
        build_batch([t], [1.0], pad_id=0, seq_len=5)


def _losses_by_aggregation():
    """Two sequences of 1 and 3 trained tokens, on-policy (ratio 1), advantages chosen so
    that the per-token losses are -A: a = 1 | b, c, d = 2, 3, 7."""
    import torch

    from libra_hpc.engines.train.loss import policy_gradient_loss

    short = traj("g", generated=(0, 1), reward=1.0)
    long = traj("g", generated=(0, 0, 1, 1, 1), reward=0.0)
    out = {}
    for mode in ("token_mean", "seq_mean_token_sum", "seq_mean_token_mean"):
        batch = build_batch([short, long], [0.0, 0.0], pad_id=0, aggregation=mode)
        batch.advantages = [[-1.0, 0, 0, 0], [0, -2.0, -3.0, -7.0]]
        pb = batch.to_policy_batch()
        logp = pb.old_logprobs.clone().requires_grad_()
        loss_sum, tokens, _ = policy_gradient_loss(logp, pb.advantages, pb.loss_mask, pb.old_logprobs,
                                                   weights=pb.weights)
        out[mode] = (loss_sum / tokens).item()
    return out


def test_aggregation_modes_on_a_hand_made_batch():
    losses = _losses_by_aggregation()
    assert losses["token_mean"] == pytest.approx((1 + 2 + 3 + 7) / 4)
    assert losses["seq_mean_token_sum"] == pytest.approx((1 + (2 + 3 + 7)) / 2)
    assert losses["seq_mean_token_mean"] == pytest.approx((1 + (2 + 3 + 7) / 3) / 2)
    assert sequence_weights([1, 3, 0], "seq_mean_token_mean") == pytest.approx([2.0, 2 / 3, 0.0])
    with pytest.raises(ValueError, match="rl.loss_aggregation"):
        sequence_weights([1], "sum")


def test_kl_term_is_k3_to_the_reference_and_needs_one():
    import torch

    from libra_hpc.engines.train.loss import PolicyBatch, policy_gradient_loss

    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    ref = torch.tensor([[-1.0, -1.5]])
    zero = torch.zeros(1, 2)
    loss, _, report = policy_gradient_loss(logp, zero, torch.tensor([[1.0, 1.0]]), ref_logprobs=ref, kl_coef=0.1)
    loss.backward()
    k3 = math.exp(0.5) - 0.5 - 1  # at the first token policy == reference: 0
    assert report["kl"].item() == pytest.approx(k3) and loss.item() == pytest.approx(0.1 * k3)
    assert logp.grad[0].tolist() == pytest.approx([0.0, 0.1 * (1 - math.exp(0.5))])  # descent raises logp to ref
    with pytest.raises(ValueError, match="kl_coef=0.1: .*needs ref_logprobs"):
        PolicyBatch(torch.zeros(1, 3, dtype=torch.long), zero, zero, kl_coef=0.1)


def test_off_policy_gap_and_truncated_importance_weights_match_a_hand_computation():
    """Three trained tokens whose rollout (behaviour) log-probs differ from the trainer's by
    δ = logp - old = +0.1, -1.5, +2.0, a masked one with a huge gap; cap C = 2. The gap is
    k3 of KL(behaviour‖trainer) summed, the largest |δ|; with the correction each token's
    loss is -min(exp(δ), C)·A at ratio 1 (one pass: the trainer's own log-probs are the
    proximal policy), without it the PPO ratio exp(δ) is clipped against the rollout's."""
    import torch

    from libra_hpc.engines.train.loss import PolicyBatch, policy_gradient_loss

    logp = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    deltas = [0.1, -1.5, 2.0]
    old = torch.tensor([[-1.0 - 0.1, -2.0 + 1.5, -0.5 - 2.0, 0.0]])  # position 3 masked, behaviour 0 there
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    adv = torch.tensor([[1.0, -2.0, 0.5, 9.0]])
    k3 = sum(math.exp(d) - 1 - d for d in deltas)

    x = logp.clone().requires_grad_()
    loss, tokens, report = policy_gradient_loss(x, adv, mask, old, 0.2, is_cap=2.0)
    weights = [min(math.exp(d), 2.0) for d in deltas]  # trainer over rollout: exp(prox - old) = exp(δ)
    assert weights == pytest.approx([math.exp(0.1), math.exp(-1.5), 2.0])
    assert loss.item() == pytest.approx(-(weights[0] * 1.0 + weights[1] * -2.0 + weights[2] * 0.5))
    loss.backward()  # ratio 1, inside the clip: d/dlogp = -w·A
    assert x.grad[0].tolist() == pytest.approx([-weights[0] * 1.0, weights[1] * 2.0, -weights[2] * 0.5, 0.0])
    assert report["gap_kl"].item() == pytest.approx(k3) and report["gap_max"].item() == pytest.approx(2.0)
    assert report["is_capped"].item() == 1 and tokens.item() == 3

    plain, _, report = policy_gradient_loss(logp, adv, mask, old, 0.2)  # PPO against the rollout's log-probs
    expected = -sum(min(math.exp(d) * a, min(max(math.exp(d), 0.8), 1.2) * a) for d, a in zip(deltas, (1.0, -2.0, 0.5)))
    assert plain.item() == pytest.approx(expected)
    assert report["gap_kl"].item() == pytest.approx(k3) and report["is_capped"].item() == 0
    assert report["clipped"].item() == 2  # exp(-1.5) and exp(2.0) left [0.8, 1.2], exp(0.1) did not

    prox = torch.tensor([[-1.0, -2.0, -0.6, 0.0]])  # a later pass: the proximal policy is the first pass's
    _, _, report = policy_gradient_loss(logp, adv, mask, old, 0.2, is_cap=2.0, prox_logprobs=prox)
    assert report["clipped"].item() == 0  # r = exp(logp - prox): exp(0.1) on the third token only
    with pytest.raises(ValueError, match="is_cap=2.0: .*needs old_logprobs"):
        PolicyBatch(torch.zeros(1, 3, dtype=torch.long), mask[:, :2], adv[:, :2], is_cap=2.0)



def test_the_rollout_gap_is_never_negative_for_tiny_gaps_in_float32():
    """exp(δ) - 1 - δ in float32 gave -5e-11 for δ near 1e-5 (CI's job test asserted
    ``logprob_gap_kl >= 0`` and failed); the k3 estimate is >= 0 term by term and stays so."""
    import torch

    from libra_hpc.engines.train.loss import policy_gradient_loss

    rng = torch.Generator().manual_seed(0)
    logp = -torch.rand((64, 256), generator=rng, dtype=torch.float32) * 5
    old = logp - (torch.rand((64, 256), generator=rng, dtype=torch.float32) - 0.5) * 4e-5
    mask = torch.ones_like(logp)
    _, _, report = policy_gradient_loss(logp, torch.zeros_like(logp), mask, old, 0.2)
    truth = ((logp - old).double() ** 2 / 2).sum().item()  # k3 ≈ δ² / 2 for small δ
    naive = ((torch.exp(logp - old) - 1.0 - (logp - old)) * mask).sum().item()
    assert report["gap_kl"].item() == pytest.approx(truth, rel=0.05)
    assert abs(naive - truth) > 10 * truth  # float32 rounding of exp(δ) - 1 swamps δ² / 2
    for delta in (1e-5, -1e-5, 3e-6):
        one = torch.tensor([[-1.0]])
        _, _, report = policy_gradient_loss(one, torch.zeros_like(one), torch.ones_like(one), one - delta, 0.2)
        assert report["gap_kl"].item() >= 0.0

def test_the_correction_is_an_rl_option_that_reaches_the_batch():
    from libra_hpc.config import RLConfig

    traj_ = traj("g", generated=(0, 1, 1), reward=1.0)
    other = traj("g", generated=(0, 1, 1), reward=0.0)
    for correction, cap in (("none", 0.0), ("tis", 3.0)):
        batch, _ = prepare_batch([traj_, other], RLConfig(off_policy_correction=correction, is_cap=3.0),
                                 train_version=0, pad_id=0)
        assert batch.is_cap == cap and batch.to_policy_batch().is_cap == cap
    with pytest.raises(ValueError, match="off_policy_correction"):
        RLConfig(off_policy_correction="vtrace")


# ------------------------------------------------------------------------- staleness

def test_staleness_bound_drops_exactly_the_stale_trajectories():
    g = (0, 1, 1, 1)
    batch = {"lag0": traj(versions=[-1, 5, 5, 5], generated=g), "lag2": traj(versions=[-1, 3, 3, 3], generated=g),
             "lag3": traj(versions=[-1, 2, 2, 2], generated=g),
             "partial_ok": traj(versions=[-1, 3, 4, 5], generated=g),  # oldest token lags 2: kept
             "partial_stale": traj(versions=[-1, 2, 4, 5], generated=g),  # its first token lags 3
             "empty": traj(generated=(0, 0))}
    report = drop_stale(batch.values(), train_version=5, max_staleness=2)
    assert [next(k for k, v in batch.items() if v is t) for t in report.kept] == ["lag0", "lag2", "partial_ok"]
    assert dict(report.dropped) == {"stale": 1, "stale_partial": 1, "nothing_generated": 1}
    assert report.max_lag == 2 and report.num_dropped == 3
    sync = drop_stale(batch.values(), train_version=5, max_staleness=0)
    assert [t.versions[1] for t in sync.kept] == [5]
    with pytest.raises(ValueError, match="a token of policy version 5, but training is at version 4"):
        drop_stale([batch["lag0"]], train_version=4, max_staleness=1)


def test_prepare_batch_applies_the_bound_then_the_groups():
    from libra_hpc.config import RLConfig

    rl = RLConfig(max_staleness=1)
    g = (0, 1, 1)
    batch = [traj("a", reward=1.0, generated=g, version=3), traj("a", reward=0.0, generated=g, version=3),
             traj("a", reward=0.0, generated=g, version=1),  # stale: its group is left with two
             traj("b", reward=1.0, generated=g, version=3), traj("b", reward=0.0, generated=g, version=1)]
    train, report = prepare_batch(batch, rl, train_version=3, pad_id=0, rows_multiple=2)
    assert report.dropped_stale == {"stale": 2} and report.filtered_groups == 1  # b has one survivor
    assert report.sequences == 2 and len(train.tokens) == 2 and report.trained_tokens == 4
    assert [row[1] for row in train.advantages] == pytest.approx([1 / math.sqrt(2), -1 / math.sqrt(2)], rel=1e-5)
    none, why = prepare_batch(batch[3:], rl, train_version=3, pad_id=0)
    assert none is None and why.filtered_groups == 1


# ---------------------------------------------------------------------------- config

def test_rl_options_are_validated_and_the_shipped_configs_still_load():
    from libra_hpc.config import ConfigError, RLConfig, load_config

    rl = RLConfig()
    assert (rl.advantage_norm, rl.loss_aggregation, rl.kl_coef, rl.filter_zero_variance) == \
        ("group_std", "token_mean", 0.0, True)
    for path in (ROOT / "configs").glob("*.yaml"):
        load_config(path)
    with pytest.raises(ConfigError, match="loss_aggregation"):
        load_config(None, ["rl.loss_aggregation=sum"])
    with pytest.raises(ConfigError, match="kl_coef"):
        load_config(None, ["rl.kl_coef=-0.1"])
