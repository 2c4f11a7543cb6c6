"""GRPO checked against a peer: TRL's ``GRPOTrainer`` (``trl==1.13.0``, pinned in
pyproject's ``test`` extra and imported from site-packages; no TRL code lives in this
repository) computes group advantages and the clipped policy loss, KL term included, on
the same rewards and log-probs as :mod:`libra_hpc.rl.grpo` and
:func:`~libra_hpc.engines.train.loss.policy_gradient_loss`; loss, gradient and KL agree to
1e-6 in float64.

TRL's arithmetic runs unchanged: its own methods (``_generate_and_score_completions`` for
the advantages, ``_compute_loss`` for the loss) are called on a stand-in for the trainer
whose settings are copied from a real ``GRPOConfig`` the way ``GRPOTrainer.__init__``
copies them; only the parts that would need a model are stubbed: generation and the reward
functions hand back our tokens and rewards, the per-token log-prob function our log-probs,
and accelerate's collectives are those of one process.

What maps to what (ours → TRL):

- ``rl.advantage_norm``: ``group_std`` → ``scale_rewards="group"``; ``none`` → ``"none"``.
- ``rl.loss_aggregation``: ``token_mean`` → ``loss_type="bnpo"`` and ``"dapo"`` (one
  process, one micro-batch: DAPO's ``num_items_in_batch`` is the batch's token count);
  ``seq_mean_token_mean`` → ``"grpo"``; ``seq_mean_token_sum`` → ``"luspo"`` with
  token-level ratios (its per-sequence sums averaged), and ``"dr_grpo"`` up to its constant.
- ``training.ppo_clip`` ε → ``epsilon`` (``epsilon_high`` unset: symmetric); ``rl.kl_coef``
  → ``beta``; our k3 → TRL's k3 with ``use_bias_correction_kl=False``.
- A tool-output span inside a completion (``generated`` False, loss mask 0) → TRL's
  ``tool_mask`` 0.

Intended differences, each checked as such:

1. The std epsilon: TRL adds a fixed 1e-4 to the group's std; ours adds
   ``rl.advantage_eps`` (default 1e-6). With 1e-4 they agree; at the default, ours is
   TRL's times ``(σ + 1e-4) / (σ + 1e-6)``.
2. Zero-variance groups: TRL keeps them (advantage 0, their tokens in the denominators);
   ``rl.filter_zero_variance`` (default on) leaves them out of the batch. Off, the
   advantages agree; on, the kept groups' advantages agree and the others are absent.
3. ``dr_grpo`` divides the token sum by ``B × max_completion_length``; ours
   (``seq_mean_token_sum``) by ``B``: Dr. GRPO's constant, which only scales the step.
4. The KL term: TRL 1.13 multiplies k3 by the importance ratio π/π_old by default
   (``use_bias_correction_kl=True``); ours is the uncorrected k3 of the GRPO paper (and
   verl). On-policy the two agree; off-policy TRL's default minus ours is
   ``β · agg((r - 1) · k3)``.
5. Rows with nothing to train (the all-masked rows ``build_batch`` adds for whole
   micro-batches) do not count in our ``B``; TRL's batch has no such rows.
"""

from __future__ import annotations

import random
import sysconfig
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from libra_hpc.engines.train.loss import policy_gradient_loss
from libra_hpc.rl import NOT_GENERATED, Trajectory, build_batch, compute_advantages
from libra_hpc.rl.grpo import AGGREGATIONS, TrainBatch

ROOT = Path(__file__).resolve().parents[1]
TRL_VERSION = "1.13.0"  # pyproject.toml's test extra pins the same
TOL = 1e-6
PROMPT = 3  # prompt tokens of every sample (TRL left-pads prompts; the loss never sees them)
GROUP = 4  # samples per group (TRL's num_generations)
SEEDS = range(5)

LOSS_TYPES = {  # our aggregation → the TRL loss types with the same arithmetic
    "token_mean": ("bnpo", "dapo"),
    "seq_mean_token_mean": ("grpo",),
    "seq_mean_token_sum": ("luspo",),
}


@pytest.fixture(scope="module")
def trl_grpo():
    """TRL's GRPO trainer module, from the pinned, installed package (TRL imports vLLM and
    transformers' Trainer: about ten seconds, once per worker)."""
    import trl
    from trl.trainer import grpo_trainer

    assert trl.__version__ == TRL_VERSION, f"trl {trl.__version__} installed; the test extra pins {TRL_VERSION}"
    where = Path(grpo_trainer.__file__).resolve()
    site = {Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib")}
    assert "site-packages" in where.parts and any(where.is_relative_to(s) for s in site), where
    assert not where.is_relative_to(ROOT), f"{where}: the peer must be the installed package, not code in the repo"
    return grpo_trainer


# ------------------------------------------------------------------------ the same data

class Case:
    """``groups`` GRPO groups of ``GROUP`` samples: a prompt of ``PROMPT`` tokens, then a
    completion of 1..``width`` tokens, some with a tool-output span inside; rewards (one
    group all equal); and per completion token the old (rollout), current and reference
    log-probs, [B, width] float64, where the current ones move the ratio past the clip range
    both ways."""

    def __init__(self, seed: int, groups: int = 3, width: int = 9):
        rng = random.Random(seed)
        gen = torch.Generator().manual_seed(seed)
        self.b, self.width = groups * GROUP, width
        self.lengths = [rng.randint(1, width) for _ in range(self.b)]
        self.tool = torch.ones(self.b, width)  # TRL's tool_mask: 0 on tool-output tokens
        for i, n in enumerate(self.lengths):
            if n >= 4 and rng.random() < 0.6:  # a tool return between two model turns
                start = rng.randint(1, n - 2)
                self.tool[i, start:rng.randint(start + 1, n - 1)] = 0.0
        self.completion = (torch.arange(width)[None, :] < torch.tensor(self.lengths)[:, None]).float()
        self.rewards = [float(rng.choice([0.0, 0.25, 0.5, 1.0])) for _ in range(self.b)]
        self.rewards[GROUP:2 * GROUP] = [0.5] * GROUP  # a zero-variance group
        self.old = -torch.rand(self.b, width, generator=gen, dtype=torch.float64) * 3.0
        self.cur = self.old + 0.4 * torch.randn(self.b, width, generator=gen, dtype=torch.float64)
        self.ref = self.old + 0.3 * torch.randn(self.b, width, generator=gen, dtype=torch.float64)
        self.ids = torch.randint(2, 50, (self.b, PROMPT + width), generator=gen)

    @property
    def mask(self) -> torch.Tensor:
        return self.completion * self.tool

    def trajectories(self) -> list[Trajectory]:
        out = []
        for i, n in enumerate(self.lengths):
            gen = [False] * PROMPT + [bool(self.tool[i, j]) for j in range(n)]
            out.append(Trajectory(
                prompt_id=f"p{i // GROUP}", group_id=f"g{i // GROUP}", tokens=self.ids[i, :PROMPT + n].tolist(),
                generated=gen,
                logprobs=[0.0] * PROMPT + [float(self.old[i, j]) if gen[PROMPT + j] else 0.0 for j in range(n)],
                versions=[0 if g else NOT_GENERATED for g in gen], reward=self.rewards[i], finish_reason="stop"))
        return out

    def ours(self, completion_values: torch.Tensor) -> torch.Tensor:
        """Per-completion-token values [B, width] as our per-position array [B, S-1] (S the
        longest trajectory): position t scores token t+1, so completion token j sits at
        position PROMPT-1+j; the prompt's positions get values the mask must hide."""
        junk = torch.full((self.b, PROMPT - 1), -7.5, dtype=completion_values.dtype)
        return torch.cat([junk, completion_values[:, :max(self.lengths)]], dim=1)


# --------------------------------------------------------------------- TRL, unchanged

def trl_config(grpo, tmp: Path, **overrides):
    settings = {"num_generations": GROUP, "per_device_train_batch_size": GROUP, **overrides}
    return grpo.GRPOConfig(output_dir=str(tmp), report_to=[], use_cpu=True, **settings)


def trl_trainer(grpo, args, **stubs) -> SimpleNamespace:
    """A stand-in for ``GRPOTrainer`` with the attributes its ``__init__`` sets from
    ``args`` (the subset the two methods read), one process, no model."""
    one_process = SimpleNamespace(device=torch.device("cpu"), num_processes=1, process_index=0,
                                  is_main_process=True, gather=lambda t: t, reduce=lambda t, reduction: t)
    return SimpleNamespace(
        args=args, accelerator=one_process, model=SimpleNamespace(training=True, is_gradient_checkpointing=False),
        ref_model=None, beta=args.beta, loss_type=args.loss_type, epsilon_low=args.epsilon,
        epsilon_high=args.epsilon_high if args.epsilon_high is not None else args.epsilon,
        importance_sampling_level=args.importance_sampling_level, scale_rewards=args.scale_rewards,
        multi_objective_aggregation=args.multi_objective_aggregation, num_generations=args.num_generations,
        num_iterations=args.num_iterations, max_completion_length=args.max_completion_length,
        top_entropy_quantile=args.top_entropy_quantile, off_policy_mask_threshold=args.off_policy_mask_threshold,
        use_vllm=args.use_vllm, vllm_importance_sampling_correction=args.vllm_importance_sampling_correction,
        mask_truncated_completions=args.mask_truncated_completions, pad_to_multiple_of=args.pad_to_multiple_of,
        current_gradient_accumulation_steps=args.gradient_accumulation_steps,
        _entropy_bonus_enabled=args.entropy_coef != 0.0 or args.use_adaptive_entropy, aux_loss_enabled=False,
        reward_weights=torch.ones(1, dtype=torch.float32), reward_func_names=["ours"],
        tools=None, environment_factories=None, environments=None, log_multimodal=args.log_multimodal,
        _tokenizer=SimpleNamespace(pad_token_id=0, eos_token_id=1),
        processing_class=SimpleNamespace(batch_decode=lambda ids, skip_special_tokens: [""] * len(ids)),
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
        _logs={"images": [], "prompt": [], "completion": [], "advantages": [],
               "rewards": defaultdict(list), "extra": defaultdict(list)},
        _pending_extra_logs=defaultdict(list), _pending_metrics=defaultdict(list), **stubs)


def trl_advantages(grpo, tmp: Path, case: Case, scale_rewards: str, monkeypatch) -> torch.Tensor:
    """TRL's ``_generate_and_score_completions`` on ``case``: its group advantages [B]."""
    monkeypatch.setattr(grpo, "gather_object", lambda obj: obj)  # accelerate's, for one process
    args = trl_config(grpo, tmp, scale_rewards=scale_rewards, per_device_train_batch_size=case.b)
    ids = [row[PROMPT:PROMPT + n].tolist() for row, n in zip(case.ids, case.lengths)]
    generated = ([row[:PROMPT].tolist() for row in case.ids], ids, None, [""] * case.b, None, {}, None, None)
    rewards = torch.tensor(case.rewards, dtype=torch.float64)[:, None]
    trainer = trl_trainer(grpo, args, _generate=lambda prompts: generated,
                          _calculate_rewards=lambda inputs, prompts, completions, ids: rewards)
    out = grpo.GRPOTrainer._generate_and_score_completions(trainer, [{"prompt": "q"}] * case.b)
    return out["advantages"]


def trl_loss(grpo, tmp: Path, case: Case, advantages: torch.Tensor, cur: torch.Tensor, *, loss_type: str,
             beta: float, epsilon: float = 0.2, bias_correction: bool = False) -> tuple[torch.Tensor, SimpleNamespace]:
    """TRL's ``_compute_loss`` on ``case`` with current log-probs ``cur`` (the model's
    forward pass replaced by handing them back)."""
    args = trl_config(grpo, tmp, loss_type=loss_type, beta=beta, epsilon=epsilon,
                      use_bias_correction_kl=bias_correction, max_completion_length=case.width)
    forward = lambda *model_inputs, **options: (cur, torch.zeros_like(cur), None)  # noqa: E731 (logps, entropy, aux)
    trainer = trl_trainer(grpo, args, _get_per_token_logps_and_entropies=forward)
    inputs = {"prompt_ids": case.ids[:, :PROMPT], "prompt_mask": torch.ones(case.b, PROMPT, dtype=torch.long),
              "completion_ids": case.ids[:, PROMPT:], "completion_mask": case.completion.long(),
              "tool_mask": case.tool.long(), "advantages": advantages, "old_per_token_logps": case.old,
              "num_items_in_batch": case.mask.sum()}
    if beta:
        inputs["ref_per_token_logps"] = case.ref
    return grpo.GRPOTrainer._compute_loss(trainer, None, inputs), trainer


# -------------------------------------------------------------------------------- ours

def our_loss(case: Case, batch: TrainBatch, cur: torch.Tensor, clip_eps: float = 0.2):
    """The engine's step loss on ``batch`` (``build_batch``'s lists in float64): the loss
    sum over the global token count, as the Megatron step divides it."""
    f64 = lambda rows: torch.tensor(rows, dtype=torch.float64)  # noqa: E731
    rows = len(batch.tokens)
    pad = lambda x: torch.cat([x, torch.zeros(rows - case.b, x.shape[1], dtype=x.dtype)])  # noqa: E731
    ref = pad(case.ours(case.ref)) if batch.kl_coef else None
    loss_sum, tokens, report = policy_gradient_loss(
        pad(case.ours(cur)), f64(batch.advantages), f64(batch.loss_mask), f64(batch.old_logprobs), clip_eps,
        weights=f64(batch.weights), ref_logprobs=ref, kl_coef=batch.kl_coef)
    return loss_sum / tokens, report["kl"] / tokens


def our_batch(case: Case, aggregation: str, beta: float, rows_multiple: int = 1):
    adv = compute_advantages(case.trajectories(), eps=1e-4, filter_zero_variance=False)
    batch = build_batch(adv.trajectories, adv.values, pad_id=0, aggregation=aggregation, kl_coef=beta,
                        rows_multiple=rows_multiple)
    return torch.tensor(adv.values, dtype=torch.float64), batch


# ------------------------------------------------------------------------------- tests

def test_the_peer_is_the_pinned_installed_trl(trl_grpo):
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"trl=={TRL_VERSION}"' in pyproject
    assert trl_grpo.GRPOTrainer.__module__ == "trl.trainer.grpo_trainer"


@pytest.mark.parametrize("seed", SEEDS)
def test_group_advantages_agree_with_trl(trl_grpo, tmp_path, monkeypatch, seed):
    case = Case(seed)
    trajectories = case.trajectories()
    order = list(range(case.b))
    random.Random(seed).shuffle(order)  # ours groups by group_id, in any order; TRL by consecutive blocks
    for norm, scale in (("group_std", "group"), ("none", "none")):
        theirs = trl_advantages(trl_grpo, tmp_path, case, scale, monkeypatch)
        adv = compute_advantages([trajectories[i] for i in order], norm=norm, eps=1e-4, filter_zero_variance=False)
        by_sample = {id(t): v for t, v in zip(adv.trajectories, adv.values)}
        ours = torch.tensor([by_sample[id(t)] for t in trajectories], dtype=torch.float64)
        assert torch.allclose(ours, theirs, rtol=0, atol=TOL), (norm, ours, theirs)
        assert theirs[GROUP:2 * GROUP].abs().max() == 0  # the zero-variance group: 0 in both

    # (1) the std epsilon: ours at its default 1e-6 is TRL's times (σ + 1e-4) / (σ + 1e-6)
    theirs = trl_advantages(trl_grpo, tmp_path, case, "group", monkeypatch)
    sigma = torch.tensor(case.rewards, dtype=torch.float64).view(-1, GROUP).std(dim=1).repeat_interleave(GROUP)
    ours = torch.tensor(compute_advantages(trajectories, filter_zero_variance=False).values, dtype=torch.float64)
    assert torch.allclose(ours, theirs * (sigma + 1e-4) / (sigma + 1e-6), rtol=0, atol=TOL)
    assert (ours - theirs).abs().max() > 1e-5 or sigma.min() > 1  # the difference is there to see

    # (2) zero-variance filtering: the kept groups' advantages are TRL's, the flat group is gone
    kept = compute_advantages(trajectories, eps=1e-4)
    assert kept.filtered_groups == 1 and kept.filtered_trajectories == GROUP
    rows = [i for i in range(case.b) if not GROUP <= i < 2 * GROUP]
    assert kept.trajectories == [trajectories[i] for i in rows]
    assert torch.allclose(torch.tensor(kept.values, dtype=torch.float64), theirs[rows], rtol=0, atol=TOL)


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_clipped_loss_gradient_and_kl_agree_with_trl(trl_grpo, tmp_path, aggregation, beta):
    for seed in SEEDS:
        case = Case(seed)
        advantages, batch = our_batch(case, aggregation, beta)
        ratio = (case.cur - case.old).exp()
        moving = case.mask.bool() & (advantages[:, None] != 0)
        assert ((ratio > 1.2) & moving).any() and ((ratio < 0.8) & moving).any()  # clipping is exercised both ways
        cur = case.cur.clone().requires_grad_(True)
        ours, our_kl = our_loss(case, batch, cur)
        (our_grad,) = torch.autograd.grad(ours, cur)
        for loss_type in LOSS_TYPES[aggregation]:
            theirs, trainer = trl_loss(trl_grpo, tmp_path, case, advantages, cur, loss_type=loss_type, beta=beta)
            (their_grad,) = torch.autograd.grad(theirs, cur)
            assert abs(float(ours - theirs)) < TOL, (seed, loss_type, float(ours), float(theirs))
            assert torch.allclose(our_grad, their_grad, rtol=0, atol=TOL), (seed, loss_type)
            if beta:  # TRL's logged KL: the masked token mean of k3, as our report's sum over the token count
                assert abs(trainer._metrics["train"]["kl"][-1] - float(our_kl)) < TOL


def test_the_aggregations_tell_apart(trl_grpo, tmp_path):
    # the pairing above is no accident: on the same case the three aggregations differ
    case = Case(0)
    losses = {}
    for aggregation, loss_types in LOSS_TYPES.items():
        advantages, batch = our_batch(case, aggregation, 0.0)
        losses[aggregation] = float(our_loss(case, batch, case.cur)[0])
        theirs, _ = trl_loss(trl_grpo, tmp_path, case, advantages, case.cur, loss_type=loss_types[0], beta=0.0)
        assert abs(losses[aggregation] - float(theirs)) < TOL
    values = sorted(losses.values())
    assert min(b - a for a, b in zip(values, values[1:])) > 1e-3, losses


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_dr_grpo_is_our_sequence_sum_mean_over_its_constant(trl_grpo, tmp_path, beta):
    # (3) Dr. GRPO divides the token sum by B × max_completion_length, ours by B
    for seed in SEEDS:
        case = Case(seed)
        advantages, batch = our_batch(case, "seq_mean_token_sum", beta)
        ours, _ = our_loss(case, batch, case.cur)
        theirs, _ = trl_loss(trl_grpo, tmp_path, case, advantages, case.cur, loss_type="dr_grpo", beta=beta)
        assert abs(float(ours) / case.width - float(theirs)) < TOL


def test_trl_default_kl_is_ours_times_the_importance_ratio(trl_grpo, tmp_path):
    # (4) TRL's default use_bias_correction_kl weighs k3 by r = π/π_old; ours does not
    beta = 0.5  # large enough for the correction to stand far above the tolerance
    for seed in SEEDS:
        case = Case(seed)
        r = (case.cur - case.old).exp()
        delta = case.ref - case.cur
        k3 = delta.exp() - delta - 1.0
        for aggregation in AGGREGATIONS:
            advantages, batch = our_batch(case, aggregation, beta)
            ours, _ = our_loss(case, batch, case.cur)
            loss_type = LOSS_TYPES[aggregation][0]
            theirs, _ = trl_loss(trl_grpo, tmp_path, case, advantages, case.cur, loss_type=loss_type, beta=beta,
                                 bias_correction=True)
            weights = torch.tensor(batch.weights, dtype=torch.float64)[:, PROMPT - 1:]
            n = case.mask.sum()
            extra = beta * (weights * ((r - 1.0) * k3)[:, :weights.shape[1]]).sum() / n
            assert abs(float(theirs - ours) - float(extra)) < TOL, (seed, aggregation)
            assert abs(float(extra)) > 100 * TOL  # off-policy, the correction is visible
            on_policy, _ = trl_loss(trl_grpo, tmp_path, case, advantages, case.old, loss_type=loss_type, beta=beta,
                                    bias_correction=True)
            ours_on, _ = our_loss(case, batch, case.old)
            assert abs(float(on_policy - ours_on)) < TOL  # r = 1: the same


def test_padding_rows_do_not_count_as_sequences(trl_grpo, tmp_path):
    # (5) build_batch's all-masked rows (whole micro-batches) are not sequences of B
    case = Case(0)
    for aggregation in AGGREGATIONS:
        advantages, batch = our_batch(case, aggregation, 0.04, rows_multiple=5)
        assert len(batch.tokens) == 15 > case.b
        ours, _ = our_loss(case, batch, case.cur)
        theirs, _ = trl_loss(trl_grpo, tmp_path, case, advantages, case.cur, loss_type=LOSS_TYPES[aggregation][0],
                             beta=0.04)
        assert abs(float(ours - theirs)) < TOL, aggregation


def test_truncated_importance_sampling_agrees_with_trls_vllm_correction(trl_grpo, tmp_path, monkeypatch):
    """``rl.off_policy_correction: tis`` against TRL's ``vllm_importance_sampling_correction``
    (``token_truncate``): TRL's ``_generate_and_score_completions`` is handed the rollout's
    log-probs as vLLM's sampling log-probs and the trainer's own (the proximal policy) as
    its forward pass, and computes the truncated weights min(exp(prox - rollout), C); its
    ``_compute_loss`` takes the ratio against the proximal policy and weighs each token's
    loss by them. Ours gets the rollout's log-probs as ``old_logprobs``, the trainer's as
    ``prox_logprobs`` and C as ``is_cap``: loss and gradient agree to 1e-6, and the weights
    are truncated on some tokens (C is below the largest)."""
    monkeypatch.setattr(trl_grpo, "gather_object", lambda obj: obj)
    cap = 1.5
    for seed in SEEDS:
        case = Case(seed)
        gen = torch.Generator().manual_seed(100 + seed)
        w = max(case.lengths)  # TRL pads completions to the longest
        prox = case.old + 0.5 * torch.randn(case.b, case.width, generator=gen, dtype=torch.float64)
        prox[:, w:] = 0.0
        assert ((prox - case.old).exp()[case.mask.bool()] > cap).any()  # truncation is exercised
        args = trl_config(trl_grpo, tmp_path, scale_rewards="group", per_device_train_batch_size=case.b,
                          use_vllm=True, vllm_importance_sampling_correction=True,
                          vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=cap)
        ids = [row[PROMPT:PROMPT + n].tolist() for row, n in zip(case.ids, case.lengths)]
        tool = [case.tool[i, :n].long().tolist() for i, n in enumerate(case.lengths)]
        sampled = [case.old[i, :n].tolist() for i, n in enumerate(case.lengths)]
        generated = ([row[:PROMPT].tolist() for row in case.ids], ids, tool, [""] * case.b, sampled, {}, None, None)
        rewards = torch.tensor(case.rewards, dtype=torch.float64)[:, None]
        trainer = trl_trainer(trl_grpo, args, _generate=lambda prompts: generated,
                              _calculate_rewards=lambda inputs, prompts, completions, ids: rewards,
                              _get_per_token_logps_and_entropies=lambda *a, **k: (prox[:, :w], None, None),
                              vllm_importance_sampling_mode=args.vllm_importance_sampling_mode,
                              vllm_importance_sampling_clip_min=args.vllm_importance_sampling_clip_min,
                              vllm_importance_sampling_clip_max=args.vllm_importance_sampling_clip_max)
        inputs = trl_grpo.GRPOTrainer._generate_and_score_completions(trainer, [{"prompt": "q"}] * case.b)
        weights = inputs["importance_sampling_ratio"]
        mask = case.mask[:, :w]
        assert torch.allclose(weights * mask, (prox - case.old).exp().clamp(max=cap)[:, :w] * mask, atol=TOL)

        cur = (prox + 0.3 * torch.randn(case.b, case.width, generator=gen, dtype=torch.float64))[:, :w]
        cur.requires_grad_(True)
        args = trl_config(trl_grpo, tmp_path, loss_type="bnpo", beta=0.0, use_vllm=True,
                          vllm_importance_sampling_correction=True, max_completion_length=case.width)
        forward = lambda *model_inputs, **options: (cur, torch.zeros_like(cur), None)  # noqa: E731
        loss_trainer = trl_trainer(trl_grpo, args, _get_per_token_logps_and_entropies=forward)
        inputs = dict(inputs, num_items_in_batch=mask.sum())
        theirs = trl_grpo.GRPOTrainer._compute_loss(loss_trainer, None, inputs)
        (their_grad,) = torch.autograd.grad(theirs, cur)

        adv = torch.tensor(compute_advantages(case.trajectories(), eps=1e-4, filter_zero_variance=False).values,
                           dtype=torch.float64)
        assert torch.allclose(adv, inputs["advantages"], atol=TOL)
        batch = build_batch(case.trajectories(), adv.tolist(), pad_id=0, is_cap=cap)
        f64 = lambda rows: torch.tensor(rows, dtype=torch.float64)  # noqa: E731
        loss_sum, tokens, report = policy_gradient_loss(
            case.ours(cur), f64(batch.advantages), f64(batch.loss_mask), f64(batch.old_logprobs), 0.2,
            weights=f64(batch.weights), is_cap=batch.is_cap, prox_logprobs=case.ours(prox))
        ours = loss_sum / tokens
        (our_grad,) = torch.autograd.grad(ours, cur)
        assert abs(float(ours - theirs)) < TOL, (seed, float(ours), float(theirs))
        assert torch.allclose(our_grad, their_grad, rtol=0, atol=TOL), seed
        assert report["is_capped"] > 0
