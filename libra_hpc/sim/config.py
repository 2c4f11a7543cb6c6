"""The simulator's scenario schema (``configs/sim/*.yaml``): strict, unknown keys refused.

One YAML file is one scenario: the cluster, the model, the RL batch, the workload (or a
trace to replay), the costs the cost models do not cover, and the policies to compare.
Every field has a docstring with its unit; the scenario files say where each number comes
from. A bad file fails with the file name, the dotted field path and what is allowed
(:class:`SimConfigError`), like the experiment schema (libra_hpc/config.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from libra_hpc.config import LengthPrior, describe_error, parse_yaml

POLICIES = ("colocated", "async_static", "libra", "libra_no_replan", "libra_no_hybrid", "homogeneous_least_load",
            "length_aware", "oracle", "oracle_best")
"""Registered policy names (libra_hpc/sim/policies.py)."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, use_attribute_docstrings=True)


class LogNormal(_Section):
    """A log-normal distribution given by its median and the sigma of its logarithm."""

    median: float = Field(gt=0)
    """Median of the distribution (in the unit of the field that uses it)."""
    sigma: float = Field(0.0, ge=0)
    """Standard deviation of the natural log; 0 makes it a constant."""


class ClusterSpec(_Section):
    """The simulated cluster."""

    nodes: int = Field(ge=1)
    """Nodes in the cluster."""
    gpus_per_node: int = Field(8, ge=1, le=64)
    """GPUs per node (the largest TP group that stays on NVLink)."""
    hardware: str = Field("a800-80g", min_length=1)
    """GPU profile: a name under ``configs/hardware`` or a path."""
    model: str = Field("qwen3-14b", min_length=1)
    """Model profile: a name under ``configs/models`` or a path."""


class RLSpec(_Section):
    """The RL loop: batch shape, steps, staleness."""

    steps: int = Field(ge=1)
    """RL steps (optimizer steps) simulated."""
    prompts_per_step: int = Field(ge=1)
    """Prompts per RL step; the batch is ``prompts_per_step × group_size`` trajectories."""
    group_size: int = Field(8, ge=1)
    """Samples per prompt (GRPO group)."""
    max_staleness: int = Field(1, ge=0)
    """Asynchronous policies: a batch's rollout starts at most this many policy versions
    ahead of training (0 serialises rollout and training even on split GPUs)."""
    seq_len: int = Field(ge=16)
    """Longest trajectory in tokens (prompt + all turns + tool outputs): the context cap
    of rollout and the training sequence length used for memory checks."""


class ToolSpec(_Section):
    """One tool type: its latency, how it fails, how much it returns."""

    name: str = Field(min_length=1, pattern=r"^[^|]+$")
    """Tool type name (``python``, ``bash``, ``search``); no ``|``."""
    weight: float = Field(1.0, gt=0)
    """Relative frequency among the tools of a prompt that does not favour another one."""
    latency_s: LogNormal
    """Seconds one successful call takes."""
    failure_latency_factor: float = Field(1.0, gt=0)
    """Latency of a failing call relative to a successful one."""
    timeout_s: float = Field(gt=0)
    """Wall-time limit: a hanging call costs exactly this and returns ``timeout``."""
    timeout_rate: float = Field(0.0, ge=0, lt=1)
    """Probability that one call hangs (on average over prompts; each prompt draws its own
    rate uniformly from 0 to twice this)."""
    fails_on_bug: bool = True
    """A call fails while the agent's work still has bugs (code execution, tests); a tool
    that cannot fail that way (search) sets false and fails with ``error_rate`` only."""
    error_rate: float = Field(0.0, ge=0, lt=1)
    """Probability that a call fails for reasons unrelated to bugs (bad query, flaky service)."""
    output_tokens: dict[Literal["success", "failure", "timeout"], LogNormal]
    """Tokens the tool's output adds to the context, per status."""

    @model_validator(mode="after")
    def _statuses(self) -> ToolSpec:
        missing = {"success", "failure", "timeout"} - set(self.output_tokens)
        if missing:
            raise ValueError(f"tool {self.name!r}: output_tokens needs every status, missing {sorted(missing)}")
        return self


class DriftSpec(_Section):
    """Non-stationary lengths over RL steps: multiplier ``m(s)`` on turn tokens and on the
    odds of another tool call. It rises linearly from 1 to ``1 + growth`` at ``peak_step``,
    then falls linearly by ``decline × growth`` until the last step."""

    growth: float = Field(0.0, ge=0)
    """Relative growth of turn length and tool use at the peak (0.5: +50%)."""
    peak_step: int = Field(1, ge=1)
    """Step of the peak."""
    decline: float = Field(0.0, ge=0, le=1)
    """Fraction of the growth given back between the peak and the last step."""


class WorkloadSpec(_Section):
    """The synthetic agentic workload (see libra_hpc/sim/workload.py for the process)."""

    prompt_pool: int = Field(ge=1)
    """Distinct prompts; each step samples ``prompts_per_step`` of them (epochs repeat
    prompts, which is what the per-prompt causal trees learn from)."""
    prompt_tokens: LogNormal
    """Prompt length in tokens (system prompt + task)."""
    turn_tokens: LogNormal
    """Tokens generated by a first turn of a prompt of median difficulty; ``sigma`` is the
    turn-to-turn noise."""
    difficulty_sigma: float = Field(0.5, ge=0)
    """Log-normal sigma of the per-prompt multiplier on turn length."""
    stretch: dict[Literal["write", "success", "failure", "timeout"], float] = Field(
        default_factory=lambda: {"write": 1.0, "success": 0.4, "failure": 2.0, "timeout": 1.2})
    """Turn length relative to ``turn_tokens`` after each kind of tool return (``write``:
    the first turn)."""
    bug_rate: list[float] = Field(default_factory=lambda: [0.1, 0.7], min_length=2, max_length=2)
    """Per-prompt range of the probability of one more bug (bugs are geometric): while
    bugs remain, bug-sensitive tools fail and the agent spends a long turn on each."""
    no_tool: float = Field(0.1, ge=0, le=1)
    """Probability that a trajectory answers without any tool call."""
    check_again: float = Field(0.3, ge=0, le=1)
    """Probability of one more tool call after a success (verification)."""
    max_turns: int = Field(16, ge=1)
    """Most turns (generation segments) per trajectory."""
    primary_tool_weight: float = Field(10.0, ge=1)
    """Odds of a prompt's main tool against each other tool."""
    tools: list[ToolSpec] = Field(min_length=1)
    """Tool types."""
    drift: DriftSpec = DriftSpec()

    @model_validator(mode="after")
    def _check(self) -> WorkloadSpec:
        lo, hi = self.bug_rate
        if not 0 <= lo <= hi < 1:
            raise ValueError(f"bug_rate {self.bug_rate}: need 0 <= low <= high < 1")
        names = [t.name for t in self.tools]
        if len(set(names)) != len(names):
            raise ValueError(f"tools: duplicate tool names in {names}")
        missing = {"write", "success", "failure", "timeout"} - set(self.stretch)
        if missing:
            raise ValueError(f"stretch needs write, success, failure, timeout; missing {sorted(missing)}")
        return self


class CostSpec(_Section):
    """Costs outside the planner's cost models (each an assumption the report lists)."""

    weight_sync_s: float | None = Field(None, ge=0)
    """Seconds to push new weights to the rollout instances after a training step
    (asynchronous policies); null: weight bytes over one inter-node link."""
    colocate_switch_s: float = Field(20.0, ge=0)
    """Colocated policy: seconds per step to switch all GPUs between the training and the
    rollout engine (offload/reload, resharding, KV cache re-allocation), both ways."""
    reconfig_s: float = Field(30.0, ge=0)
    """Seconds a plan change stalls rollout and training (engines restarted, groups rebuilt)."""
    hybrid_fetch_s: float | None = Field(None, ge=0)
    """Seconds a hybrid replica spends fetching weights and optimizer shards; null:
    bf16 weights + fp32 grads + Adam shard bytes of one replica over one inter-node link."""
    tool_slots: int | None = Field(None, ge=1)
    """Concurrent tool calls the sandbox pool runs (each type); null: unbounded."""
    resync_steps: int = Field(256, ge=1)
    """Decode steps after which a running batch re-prices its step time even if nothing
    joined or left (the KV context grows every step)."""
    max_num_seqs: int = Field(256, ge=1)
    """Sequences one rollout instance runs at once (vLLM ``max_num_seqs``)."""


class SchedulerSpec(_Section):
    """C-MLFQ and its baselines (libra_hpc.scheduler)."""

    bucket_token_limits: dict[int, int] = Field(default_factory=lambda: {1: 1024, 2: 4096, 4: 16384, 8: 1 << 30})
    """Rollout TP → most remaining output tokens routed to that bucket (MLFQ levels); its
    keys are also the rollout TP sizes the simulator may use."""
    bucket_limits: Literal["fixed", "share"] = "share"
    """``fixed``: the limits above. ``share``: when nothing is in flight the limits follow
    the layout, on the quantity C-MLFQ compares (remaining output tokens after a tool
    return): bucket ``i`` (ascending TP) takes the turns whose remaining tokens are up to the
    length at which the tokens they decode (plus every first turn, which starts on the top
    level) reach the cumulative GPU share of buckets ``0..i`` in the recent window (so a plan with no TP1 instances has no idle large-TP bucket waiting for
    trajectories the fixed limits would never send there)."""
    size_thresholds: list[int] = Field(default_factory=lambda: [256, 4096])
    """Tool output characters that separate the S/M/L size classes."""
    tree_window: int = Field(256, ge=2)
    """Samples per causal-tree node."""
    min_samples: int = Field(8, ge=1)
    """Samples before a tree node is trusted."""
    rebuild_every: int = Field(1000, ge=1)
    """Finished trajectories between tree rebuilds."""
    predictor_noise: float = Field(0.5, ge=0)
    """``length_aware`` ablation: sigma of the log-normal error of its length predictor."""
    affinity_tokens: int = Field(16384, ge=0)
    """Prefix affinity of every router but fifo: a turn that stays in its bucket runs where
    its previous turn ran while that instance has at most this many more outstanding tokens
    than the bucket's least loaded one (libra_hpc/scheduler/routers.py); 0: least loaded."""
    saturation: float = Field(1.0, gt=0)
    """An instance counts as saturated for routing (the router sends the turn to a
    neighbouring bucket) when its leased turns reach this multiple of its *decode knee*:
    the smallest batch whose step takes twice a lone sequence's step at the mean KV need
    of a turn (at most the seats the KV capacity allows); in tokens, times the mean turn
    length. 1.0: saturated once each sequence decodes at half its lone speed."""


class PlannerSpec(_Section):
    """Global planner, replanning gate and hybrid pool (libra_hpc.planner)."""

    prior: LengthPrior = LengthPrior()
    hybrid_nodes: int = Field(1, ge=0)
    """Last nodes of the cluster forming the hybrid pool (when the plan leaves them to rollout)."""
    min_rollout_gpus: int = Field(8, ge=1)
    """Rollout never gets fewer GPUs."""
    window: int = Field(512, ge=8)
    """Finished trajectories the planner's length profile is built from."""
    every_steps: int = Field(10, ge=1)
    """Replanning gate: periodic check interval, steps."""
    margin_s: float = Field(10.0, ge=0)
    """Replanning gate: net saving over the horizon a change must exceed, s."""
    confirm_checks: int = Field(2, ge=1)
    """Replanning gate: consecutive winning checks before a change is applied."""
    min_dwell_steps: int = Field(10, ge=0)
    """Replanning gate: steps after a change during which no other is applied."""
    hybrid_margin: float = Field(0.1, ge=0)
    """Hybrid pool: borrow when T_train > T_rollout × (1 + margin), release in reverse."""


class SearchSpec(_Section):
    """How baselines get their best static configuration."""

    sample_steps: int = Field(3, ge=1)
    """RL steps, spread over the run, on which each candidate configuration is simulated."""


class SimConfig(_Section):
    """One simulator scenario."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    """Scenario name (report titles, default output folder)."""
    seed: int = 0
    """Seed of the workload and of every random choice (the only source of randomness)."""
    cluster: ClusterSpec
    rl: RLSpec
    workload: WorkloadSpec | None = None
    """The synthetic workload; leave out when ``trace`` is given."""
    trace: str | None = None
    """JSONL trace to replay instead of the synthetic workload (format: libra_hpc/sim/trace.py);
    relative paths are taken from the scenario file's folder."""
    costs: CostSpec = CostSpec()
    scheduler: SchedulerSpec = SchedulerSpec()
    planner: PlannerSpec = PlannerSpec()
    search: SearchSpec = SearchSpec()
    policies: list[Literal[POLICIES]] = Field(default_factory=lambda: list(POLICIES), min_length=1)  # type: ignore[valid-type]
    """Policies to compare (``colocated``, ``async_static``, ``libra``, ``libra_no_replan``,
    ``libra_no_hybrid``, ``homogeneous_least_load``, ``length_aware``, ``oracle``, ``oracle_best``)."""

    @model_validator(mode="after")
    def _check(self) -> SimConfig:
        if (self.workload is None) == (self.trace is None):
            raise ValueError("give exactly one of 'workload' (synthetic) and 'trace' (replay)")
        g = self.cluster.gpus_per_node
        bad = [tp for tp in self.scheduler.bucket_token_limits if tp < 1 or tp & (tp - 1) or tp > g]
        if bad:
            raise ValueError(f"scheduler.bucket_token_limits: TP sizes {bad} must be powers of two <= gpus_per_node={g}")
        if self.planner.hybrid_nodes >= self.cluster.nodes:
            raise ValueError(f"planner.hybrid_nodes={self.planner.hybrid_nodes} must be < cluster.nodes={self.cluster.nodes}")
        if self.planner.min_rollout_gpus >= self.cluster.nodes * g:
            raise ValueError(f"planner.min_rollout_gpus={self.planner.min_rollout_gpus} leaves no GPU for training "
                             f"({self.cluster.nodes * g} GPUs)")
        if len(set(self.policies)) != len(self.policies):
            raise ValueError(f"policies: {self.policies} lists a policy twice")
        return self

    @property
    def batch_size(self) -> int:
        return self.rl.prompts_per_step * self.rl.group_size


class SimConfigError(ValueError):
    """A scenario that cannot run; the message names the file and each bad field."""

    def __init__(self, source: str, problems: list[str]):
        self.problems = problems
        super().__init__(f"invalid simulator scenario ({source}):\n" + "\n".join(f"  - {p}" for p in problems))


def validate_sim_config(raw: object, source: str = "<dict>") -> SimConfig:
    """A SimConfig from plain data; raises SimConfigError naming each bad field."""
    if not isinstance(raw, dict):
        raise SimConfigError(source, [f"the top level must be a mapping, got {type(raw).__name__}"])
    try:
        return SimConfig.model_validate(raw)
    except ValidationError as exc:
        raise SimConfigError(source, [describe_error(err, root=SimConfig) for err in exc.errors()]) from None


def load_sim_config(path: str | Path, overrides: dict | None = None) -> SimConfig:
    """Read and check a scenario file; ``overrides`` (dotted keys → values) apply first.
    A relative ``trace`` path is resolved against the file's folder."""
    path = Path(path)
    try:
        raw = parse_yaml(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise SimConfigError(str(path), [f"cannot read the file: {exc.strerror}"]) from None
    except yaml.YAMLError as exc:
        raise SimConfigError(str(path), [f"not valid YAML: {exc}"]) from None
    if isinstance(raw, dict):
        for dotted, value in (overrides or {}).items():
            node = raw
            *parents, leaf = dotted.split(".")
            for part in parents:
                node = node.setdefault(part, {})
            node[leaf] = value
        if isinstance(raw.get("trace"), str) and not Path(raw["trace"]).is_absolute():
            raw["trace"] = str(path.parent / raw["trace"])
    return validate_sim_config(raw, str(path))
