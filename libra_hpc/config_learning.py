"""The learning half's sections of the experiment schema: the RL loop (``rl``), the
built-in agentic tasks (``tasks``) and the warm start (``warmstart``). Part of
:class:`libra_hpc.config.ExperimentConfig`; import them from :mod:`libra_hpc.config`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator

from libra_hpc.config_yaml import _Section


class RLConfig(_Section):
    """The RL loop. One step rolls out ``prompts_per_step × group_size`` trajectories and
    trains on all of them: that product is the global batch of the training step (the
    planner, the simulator and the batch checks all use it; ``ExperimentConfig.batch_size``)."""

    steps: int = Field(4, ge=1)
    """Number of RL steps (optimizer steps) the controller runs, or the simulator simulates."""
    prompts_per_step: int = Field(3, ge=1)
    """Prompts sampled per RL step."""
    group_size: int = Field(4, ge=1)
    """Samples per prompt (GRPO group): trajectories of one prompt are compared with each other."""
    max_staleness: int = Field(1, ge=0)
    """Policy versions a trajectory may lag behind training; 0 is synchronous RL (rollout
    and training alternate even on separate GPUs). Measured per trajectory from the oldest
    policy version among its generated tokens (partial rollout mixes versions); older
    trajectories are dropped and counted (libra_hpc/rl/staleness.py)."""
    partial_rollout: bool = False
    """Tail-decoupled rollout (libra_hpc/rl/partial.py): a step trains on the first
    ``prompts_per_step × group_size`` trajectories to finish that the staleness bound
    allows, instead of waiting for its batch's slowest one; unfinished ones generate on into
    later steps, and one that would outlive the bound is regenerated from its prompt (its
    tokens counted as wasted, within `partial_waste_budget`). The unit is the GRPO group
    (whole groups train together). In the simulator and the live job
    (libra_hpc/runtime/partial.py); both report the wasted token share and the trained
    against the generated length p90."""
    partial_waste_budget: float = Field(0.05, ge=0, lt=1)
    """Partial rollout: the share of all generated tokens that regenerated trajectories may
    have wasted; past it a step waits for its expiring trajectories as whole-trajectory
    rollout would."""
    stream_training: bool = False
    """Train each GRPO group of the coming step as soon as it is complete (gradient
    accumulation, ``MegatronTrainEngine.accumulate``), one optimizer step when the batch
    is: the same update as the whole batch at once (exactly, with `loss_aggregation:
    token_mean`; the per-sequence weights of the other two are per part, as they are per
    DP replica), while the batch's slowest trajectories still generate. Only the last
    groups and the optimizer step remain when the batch completes, so a rollout-bound
    pipeline stops paying the whole training step in series with the rollout. Steps with
    more than one pass (`update_epochs`) train whole; with `partial_rollout` on it does
    nothing (a partial-rollout step chooses its groups only when it trains). In the
    simulator and the live job."""
    advantage_norm: Literal["group_std", "none"] = "group_std"
    """GRPO advantage of a sample: its reward minus its group's mean, divided by the group's
    (sample) standard deviation plus `advantage_eps` (`group_std`, DeepSeekMath's GRPO) or
    not divided (`none`, Dr. GRPO: no bias towards too-easy and too-hard prompts)."""
    advantage_eps: float = Field(1e-6, gt=0)
    """Added to the group's reward standard deviation before dividing (`advantage_norm: group_std`)."""
    filter_zero_variance: bool = True
    """Leave out of the training batch the groups whose samples all got the same reward (their
    advantages are 0: no gradient, but their tokens would dilute a token mean); counted in
    the step log."""
    loss_aggregation: Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"] = "token_mean"
    """How per-token losses make the step's loss. `token_mean`: mean over all trained tokens
    of the batch, every token weighs the same (DAPO). `seq_mean_token_sum`: each sequence's
    token sum, averaged over sequences (Dr. GRPO, up to a constant). `seq_mean_token_mean`:
    each sequence's token mean, averaged over sequences (the original GRPO: a short
    sequence's tokens weigh more). Prompt and tool-output tokens never count."""
    kl_coef: float = Field(0.0, ge=0)
    """β of the KL-to-reference penalty added to every trained token's loss (k3 estimator of
    KL(policy‖reference)); 0 (the default) turns it off and needs no reference policy."""
    off_policy_correction: Literal["none", "tis"] = "none"
    """How the loss treats tokens a rollout sampled from another policy than the trainer's
    (an older version within `max_staleness`, partial rollout, and vLLM's numerics). `none`:
    the PPO ratio is taken against the rollout's log-probs and clipped (the behaviour policy
    as PPO's old policy). `tis`: the ratio is taken against the trainer's own log-probs
    before the update, and each token's loss is weighted by the importance weight
    trainer/rollout truncated at `is_cap` (AReaL's decoupled objective with truncated
    importance sampling; libra_hpc/engines/train/loss.py). Either way each step logs the
    gap (`logprob_gap_kl`, `logprob_gap_max`) and its staleness mix."""
    is_cap: float = Field(2.0, gt=0)
    """The cap C of the truncated importance weight min(trainer/rollout, C) (`off_policy_correction: tis`)."""
    update_epochs: dict[int, int] = Field(default_factory=lambda: {0: 1})
    """Optimizer passes over each batch (PPO epochs), from a step on: ``{0: 1, 14: 3}`` is one
    pass per batch, three from step 14 on. More passes make training the bottleneck; the
    default config uses that for a training-bound phase in which the hybrid pool pays."""
    seed: int = 0
    """Seed of every random choice of the run (the simulator's workload included)."""
    task: str = "arithmetic"
    """The agentic task the policy is trained on (libra_hpc/envs/, docs/tasks.md): a built-in task by name (`arithmetic`: word problems solved with a calculator/Python tool in the sandbox; `search`: question answering by searching a generated document collection), configured by its `tasks.<name>` section; or a user's task as `package.module:Factory`, imported from `sys.path` and called with `tasks.plugin` as keyword arguments."""

    @property
    def stream_groups(self) -> int:
        """GRPO groups a step trains as they finish (`stream_training`, which
        `partial_rollout` turns off), or 0."""
        return self.prompts_per_step if self.stream_training and not self.partial_rollout else 0


class _TaskSplits(_Section):
    """What every built-in task has: its two splits and the episode length."""

    train_prompts: int = Field(2000, ge=1)
    """Prompts of the training split."""
    heldout_prompts: int = Field(300, ge=1)
    """Prompts of the held-out split (their texts never appear in the training split: checked by text hash)."""
    max_turns: int = Field(10, ge=1)
    """Model turns per episode; an episode that has not answered by then ends with reward 0."""


class ArithmeticTaskConfig(_TaskSplits):
    """Arithmetic word problems that need the `calculator` / `python` tools (run in the tool sandbox through the orchestrator): one tool call per step of the problem; the reward is 1 for the exact final number in `<answer>...</answer>`, else 0. Generated from `rl.seed`; no downloads."""

    min_steps: int = Field(1, ge=1, le=6)
    """Fewest arithmetic steps (tool calls a careful solver makes) of one problem."""
    max_steps: int = Field(4, ge=1, le=6)
    """Most arithmetic steps of one problem."""


SEARCH_KINDS = {"year": 1, "company": 1, "employer": 1, "town": 1, "job": 1, "river": 2, "founded": 2, "hq-river": 3}
"""The search task's question kinds (``tasks.search.kinds``) and how many documents each
chains through (libra_hpc/envs/search.py asks them)."""


class SearchTaskConfig(_TaskSplits):
    """Question answering by searching a document collection the project generates (fictional people, towns and companies): the `search` tool returns the best-matching passages, a miss means another search; multi-hop questions need one search per hop. The reward is 1 for the normalised exact answer in `<answer>...</answer>`, else 0."""

    entities: int = Field(400, ge=20)
    """People in the generated collection (each with a town and a company, each one document)."""
    max_hops: int = Field(3, ge=1, le=3)
    """Most documents a question chains through (1: the answer is in the first document found)."""
    top_k: int = Field(2, ge=1, le=10)
    """Passages one search returns."""
    kinds: list[str] | None = Field(None, min_length=1)
    """Question kinds to ask, drawn uniformly: `year`, `company`, `employer` (the company
    again, asked "Which firm employs …?"), `town`, `job` (one document),
    `river`, `founded` (two), `hq-river` (three); none may chain through more than `max_hops`
    documents. null: a number of documents uniform in 1..`max_hops`, then a kind of it."""

    @field_validator("kinds")
    @classmethod
    def _kinds_fit(cls, value, info):
        unknown = sorted(set(value or ()) - set(SEARCH_KINDS))
        if unknown:
            raise ValueError(f"unknown question kinds {unknown}; the kinds are {list(SEARCH_KINDS)}")
        hops = info.data.get("max_hops", 3)
        over = [k for k in value or () if SEARCH_KINDS[k] > hops]
        if over:
            raise ValueError(f"{over} chain through more than max_hops={hops} documents; raise max_hops or drop them")
        return value


class TasksConfig(_Section):
    """One section per built-in agentic task (libra_hpc/envs/, docs/tasks.md); `rl.task` chooses which one runs."""

    arithmetic: ArithmeticTaskConfig = ArithmeticTaskConfig()
    search: SearchTaskConfig = SearchTaskConfig()
    plugin: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments of a user's task factory when `rl.task` is `package.module:Factory` (e.g. `{prompts: data/my.jsonl}`)."""


class WarmStartConfig(_Section):
    """The warm start (libra_hpc/rl/warmstart.py): a short supervised pass that teaches the
    policy the chat and tool-call format on demonstrations of the task's noisy scripted
    solver (training split only), before RL. Built once and cached by a fingerprint of
    these fields, the task and the base model."""

    demonstrations: int = Field(2000, ge=1)
    """Solver episodes (with real tool returns) to train on."""
    epochs: int = Field(2, ge=1)
    """Passes over the demonstrations."""
    batch_size: int = Field(16, ge=1)
    """Demonstrations per supervised step."""
    lr: float = Field(1e-3, gt=0)
    """Adam learning rate of the supervised pass (the peak, with ``schedule: cosine``)."""
    schedule: Literal["cosine", "constant"] = "cosine"
    """Learning-rate schedule: `cosine`, a linear warm-up over the first 3% of the steps, then
    a cosine decay to 5% of ``lr`` at the last step (a lower loss); `constant`, ``lr``
    throughout (a less peaked policy, which samples more varied episodes: more groups with
    a success for RL to reinforce, see docs/learning.md)."""
    guess: float = Field(0.75, ge=0, le=1)
    """Share of the ``guess_on`` prompts on which the solver answers at once without tools,
    with a guess drawn from the training answers of the prompt's kind (right about as often
    as that prior is): the over-confidence RL has to unlearn."""
    guess_on: list[str] | None = None
    """Prompt kinds the solver guesses on (a prompt's `meta["kind"]`: search `year`, `company`,
    `employer`, `town`, `job` (one document), `river`, `founded` (two), `hq-river` (three); arithmetic
    `1-step` … `6-step`); null: multi-step problems (two or more tool calls needed). A kind the
    task does not have is refused when the warm start is built."""
    seed: int = Field(0, ge=0)
    """Seed of the solver's noise and of the batch order."""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """Arithmetic of the supervised pass (the weights and optimizer stay fp32): `bf16`, matrix
    products and attention in bfloat16 under autocast (mixed precision; about 1.2x faster on a
    CPU with native bfloat16); `fp32` throughout; `auto`, `bf16` where the CPU computes it
    natively (AVX-512 BF16 or AMX) or on a GPU, else `fp32`. The resolved value is part of
    the build's fingerprint."""
    loss_on: Literal["turns", "transcript"] = "turns"
    """Tokens the supervised pass trains on: `turns`, the solver's own turns (supervised fine-tuning);
    `transcript`, every token of the demonstration, questions and tool outputs included (a small
    model learns to copy names and numbers from them much sooner)."""


def epochs_at(schedule: dict[int, int], step: int) -> int:
    """The ``rl.update_epochs`` value in force at ``step`` (1 before the first key)."""
    keys = [k for k in schedule if k <= step]
    return schedule[max(keys)] if keys else 1
