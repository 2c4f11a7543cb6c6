"""The simulator's scenario schema (``configs/sim/*.yaml``): the experiment schema plus the
simulator's own sections.

A scenario is an :class:`~libra_hpc.config.ExperimentConfig` (cluster, model, training,
planner, scheduler, rl, ...: the same fields, defaults and documentation as the live job)
with what only a simulation needs: the workload (or a trace to replay; the workload's schema,
:class:`~libra_hpc.envs.synthetic.WorkloadSpec`, lives with its generator), the costs the cost
models do not cover, how baselines search for their best static configuration, the policies
to compare and a name. It is read by the one loader (``load_config(path,
schema=SimConfig)``; :func:`load_sim_config` is that call) and refused with the one error
(:class:`~libra_hpc.config.ConfigError`): a misspelled key fails naming it and the valid
keys, like an experiment. The scenario files say where each number comes from.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator

from libra_hpc.config import ExperimentConfig, _Section, check_common, load_config, validate_config
from libra_hpc.envs.synthetic import WorkloadSpec

log = logging.getLogger(__name__)

POLICIES = ("colocated", "libra", "static_hindsight", "static_pilot", "phase_static", "phase_static_late", "libra_no_replan",
            "libra_no_hybrid", "homogeneous_least_load", "length_aware", "libra_true_lengths", "static_true_lengths",
            "libra_known_start")
"""Registered policy names (libra_hpc/sim/policies.py)."""
DIAGNOSTIC = ("libra_known_start",)
"""Policies run only when named (``policies``): measurements of one of Libra's inputs."""

ALIASES = {"async_static": "static_hindsight", "oracle": "libra_true_lengths", "oracle_best": "static_true_lengths"}
"""Old policy names and the policies they now load as: ``async_static`` (the best fixed split,
once searched over whole-node training sizes and one rollout TP) is ``static_hindsight``;
the two "oracles" were Libra's plans or the static split with true lengths, not optima."""


def policy_name(name: str) -> str:
    """The registered name of ``name`` (an old alias maps to its new name, logged)."""
    if name in ALIASES:
        log.warning("policy %r is now called %r (it loads as that)", name, ALIASES[name])
        return ALIASES[name]
    return name


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
    reshard_s: float = Field(20.0, ge=0)
    """Seconds training stalls to move to another TP size on the same GPUs (EARL's
    re-shard: checkpoint saved, reloaded at the new shape); rollout goes on meanwhile."""
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


class SearchSpec(_Section):
    """How baselines get their best static configuration."""

    sample_steps: int = Field(3, ge=1)
    """RL steps, spread over the run, on which each colocated candidate configuration is
    simulated."""
    top_plans: int = Field(5, ge=1)
    """``static_hindsight`` and ``phase_static``: how many of the plan search's best plans
    (one per training GPU count, on the lengths the run or window will see) are simulated,
    beside every layout Libra applied; the best simulated tokens/s wins."""
    phase_window: int = Field(20, ge=1)
    """``phase_static``: RL steps per window; each window runs its own hindsight-best split,
    paying Libra's relayout cost (drain, then ``costs.reconfig_s``) at every change."""
    phase_lag: int = Field(1, ge=1)
    """``phase_static_late``: steps after its window's first step that each of
    ``phase_static``'s changes is requested (1: as soon as a policy that reacts to what it
    measured could have seen one step of the new regime)."""


class SimConfig(ExperimentConfig):
    """One simulator scenario: the experiment's sections (above) and the simulator's own.
    configs/README.md ("What the job uses today") lists which experiment fields the
    simulator reads."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    """Scenario name (report titles, default output folder)."""
    workload: WorkloadSpec | None = None
    """The synthetic workload; leave out when ``trace`` is given."""
    trace: str | None = None
    """JSONL trace to replay instead of the synthetic workload (format: libra_hpc/sim/trace.py);
    relative paths are taken from the scenario file's folder."""
    costs: CostSpec = CostSpec()
    search: SearchSpec = SearchSpec()
    policies: list[Literal[POLICIES]] = Field(  # type: ignore[valid-type]
        default_factory=lambda: [p for p in POLICIES if p not in DIAGNOSTIC], min_length=1)
    """Policies to compare (``colocated``, ``libra``, ``static_hindsight``, ``static_pilot``,
    ``phase_static``, ``phase_static_late``, ``libra_no_replan``, ``libra_no_hybrid``, ``homogeneous_least_load``,
    ``length_aware``, ``libra_true_lengths``, ``static_true_lengths``, and, only when named,
    ``libra_known_start``; libra_hpc/sim/policies.py says what each is). The old names ``async_static``, ``oracle`` and ``oracle_best`` load as
    ``static_hindsight``, ``libra_true_lengths`` and ``static_true_lengths``."""

    @field_validator("policies", mode="before")
    @classmethod
    def _renamed(cls, value: Any) -> Any:
        return [policy_name(v) if isinstance(v, str) else v for v in value] if isinstance(value, list) else value

    def cross_field_problems(self) -> list[str]:
        """The experiment's common checks and the scenario's own. Not the live job's layout
        checks (check_layout): training TP×PP×DP, ``rollout.tp_per_node``, the batch split
        over DP and the scripted borrow/return steps describe the live job's *initial*
        layout, which the simulator does not take: each policy's allocations come from the
        planner (Libra) or the search (baselines), so checking those defaults against a
        scenario's cluster would refuse valid scenarios (the default 2-GPU rollout pattern
        on 8-GPU nodes, a borrow step past a short run)."""
        c, p = self.cluster, self.planner
        g = c.gpus_per_node
        problems = check_common(self)
        if (self.workload is None) == (self.trace is None):
            problems.append("workload, trace: give exactly one of 'workload' (synthetic) and 'trace' (replay)")
        bad = [tp for tp in self.scheduler.bucket_token_limits if tp < 1 or tp & (tp - 1) or tp > g]
        if bad:
            problems.append(f"scheduler.bucket_token_limits: TP sizes {bad} must be powers of two <= "
                            f"cluster.gpus_per_node={g} (they are the rollout TP sizes the simulator may use)")
        if p.hybrid_nodes >= c.nodes:
            problems.append(f"planner.hybrid_nodes: {p.hybrid_nodes} must be < cluster.nodes={c.nodes}")
        if p.min_rollout_gpus >= c.total_gpus:
            problems.append(f"planner.min_rollout_gpus: {p.min_rollout_gpus} leaves no GPU for training "
                            f"({c.nodes} nodes × {g} = {c.total_gpus} GPUs)")
        if self.workload is not None and self.rl.prompts_per_step > self.workload.prompt_pool:
            problems.append(f"rl.prompts_per_step: {self.rl.prompts_per_step} exceeds workload.prompt_pool="
                            f"{self.workload.prompt_pool} (a step samples its prompts without replacement)")
        if len(set(self.policies)) != len(self.policies):
            problems.append(f"policies: {self.policies} lists a policy twice")
        return problems

    @classmethod
    def resolve_file_paths(cls, raw: dict[str, Any], folder: Path) -> None:
        """A relative ``trace`` is taken from the scenario file's folder."""
        if isinstance(raw.get("trace"), str) and not Path(raw["trace"]).is_absolute():
            raw["trace"] = str(folder / raw["trace"])


def validate_sim_config(raw: Any, source: str = "<dict>") -> SimConfig:
    """A SimConfig from plain data (``validate_config`` with the scenario schema); raises
    ConfigError naming each bad field."""
    return validate_config(raw, source, SimConfig)


def load_sim_config(path: str | Path, overrides: dict[str, Any] | None = None) -> SimConfig:
    """Read and check a scenario file: ``load_config(path, schema=SimConfig)``; ``overrides``
    (dotted keys → values, e.g. ``{"rl.steps": 6}``) apply first. Raises ConfigError."""
    return load_config(path, schema=SimConfig, **(overrides or {}))
