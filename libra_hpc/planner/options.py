"""What Libra's control loop plans for and may do (:class:`ControlOptions`), and the
profiles and rollout TP sizes an experiment config gives it (pure: no torch, no MPI).

``launch.py --plan``, the job and the simulator build their loops from the same config
through here (:meth:`libra_hpc.planner.control.ControlLoop.from_config`), so they plan on
the same inputs.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from libra_hpc.config import LengthPrior
from libra_hpc.planner.calibration import Calibration
from libra_hpc.planner.costs import LengthProfile, RolloutCost
from libra_hpc.planner.gate import GateOptions
from libra_hpc.planner.hybrid import PhaseTimeouts
from libra_hpc.planner.migration import MigrationPricing
from libra_hpc.planner.prior import prior_lengths
from libra_hpc.planner.profiles import HardwareProfile, ModelProfile, load_hardware, load_model

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ControlOptions:
    """What the loop plans for and may do. Units: GPUs, sequences, tokens, seconds, steps."""

    nodes: int
    gpus_per_node: int
    global_batch: int
    """Trajectories per RL step (prompts × group size)."""
    seq_len: int
    """Longest trajectory in tokens: the prior's cap."""
    max_staleness: int
    """Policy versions rollout may run ahead of training (k); 0 is synchronous."""
    rollout_tps: tuple[int, ...]
    """Rollout instance TP sizes that fit the model (descending)."""
    prior: LengthPrior = LengthPrior()
    """Lengths assumed before any is observed (``planner.prior``)."""
    seed: int = 0
    hybrid_nodes: int = 1
    """Last nodes that form the hybrid pool when the plan leaves them to rollout."""
    min_rollout_gpus: int = 1
    window: int = 512
    """Finished trajectories the length profile of a replan is built from."""
    gate: GateOptions = GateOptions()
    hybrid_margin: float = 0.1
    """A pool move must be predicted to save this share of the step (``HybridLending.decide``)."""
    memory_headroom: float = 1.25
    """Training shapes must fit sequences this many times the observed mean (packed)
    length, up to ``seq_len``; a running shape that no longer does is replaced at once."""
    scale_shift: float | None = 0.2
    """The measured scale is measured again only while the mean length moved by at most
    this share since the last check; across a larger shift it is (1, 1) until the next
    steady check (None: measured always)."""
    reconfig_s: float = 30.0
    """Seconds a layout change pauses the job (the gate weighs the gain against it)."""
    price_drain: bool = True
    """The gate also counts the pipeline's drain for a change (``planner.price_drain``)."""
    hybrid_timeouts: PhaseTimeouts = PhaseTimeouts()
    replan: bool = True
    hybrid: bool = True
    clairvoyant: bool = False
    """Plan on the true lengths the driver passes (an oracle for comparisons)."""
    single_tp: bool = False
    """Restrict the search to the one rollout TP size that is best for the prior."""
    refine_top: int = 6
    length_aware_routing: bool = False
    """The router places turns by (true or predicted) length, so plans may count on the
    long trajectories reaching the fast instances (``PlannerOptions.length_aware``)."""
    migration: MigrationPricing | None = None
    """The bucket limits C-MLFQ's migrations are priced with (:func:`migration_pricing`;
    ``PlannerOptions.migration``); None: no migration is priced."""
    on_memory: str = "reshard"
    """Contexts outgrew the training shape: ``reshard`` (training to another TP size on the
    same GPUs, :mod:`libra_hpc.parallel.selector`) before ``replan`` (the whole split)."""
    tp_table: tuple[tuple[int, int], ...] | None = None
    """A measured training TP table (context tokens from which → TP size); None: by cost."""
    tp_hysteresis: float = 0.1
    tp_confirm: int = 2
    stream_groups: int = 0
    """``rl.stream_training``: the GRPO groups of a step, trained as they finish (0: off);
    the step objective counts only the last one's share of training after the rollout."""

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node

    def prior_profile(self) -> LengthProfile:
        """The length profile of :attr:`prior` for one batch (lengths capped at ``seq_len``)."""
        p = self.prior
        return prior_lengths(prompt_tokens=p.prompt_tokens, gen_tokens_median=p.gen_tokens_median,
                             tail_shape=p.tail_shape, turns=p.turns, tool_s_per_turn=p.tool_s_per_turn,
                             seq_len=self.seq_len, batch_size=self.global_batch, seed=self.seed)

    @classmethod
    def from_config(cls, cfg: Any, rollout_tps: Sequence[int], **setup: Any) -> ControlOptions:
        """The options an experiment config gives (a simulator scenario is one too): the
        cluster shape, the batch (``rl.prompts_per_step × rl.group_size``), ``rl`` and the
        ``planner`` section. ``setup``: what the caller adds (``reconfig_s``,
        ``hybrid_timeouts``) or what a policy may do (``replan``, ``hybrid``, ...).
        ``launch.py --plan``, the job and the simulator all come through here
        (:meth:`~libra_hpc.planner.control.ControlLoop.from_config`), so they plan on the
        same inputs."""
        c, p = cfg.cluster, cfg.planner
        return cls(
            nodes=c.nodes, gpus_per_node=c.gpus_per_node, global_batch=cfg.batch_size, seq_len=cfg.training.seq_len,
            max_staleness=cfg.rl.max_staleness, rollout_tps=tuple(rollout_tps),
            prior=p.prior,
            seed=cfg.rl.seed, hybrid_nodes=p.hybrid_nodes, min_rollout_gpus=p.min_rollout_gpus, window=p.window,
            gate=GateOptions(every_steps=p.every_steps, margin_s=p.margin_s, confirm_checks=p.confirm_checks,
                             min_dwell_steps=p.min_dwell_steps, min_gain=p.min_gain,
                             decisive_gain=p.decisive_gain, dwell_same_way=p.dwell_same_way,
                             confirm_next_step=p.confirm_next_step),
            scale_shift=p.scale_shift,
            hybrid_margin=p.hybrid_margin, memory_headroom=p.memory_headroom, price_drain=p.price_drain,
            on_memory=cfg.parallel.on_memory, tp_hysteresis=cfg.parallel.hysteresis,
            tp_confirm=cfg.parallel.confirm_checks,
            stream_groups=cfg.rl.stream_groups,
            tp_table=tuple(sorted(cfg.parallel.training_tp_by_context.items()))
            if cfg.parallel.training_tp_by_context else None,
            **{"length_aware_routing": cfg.scheduler.policy in ("oracle", "length_aware"),
               "migration": migration_pricing(cfg, cfg.scheduler.policy), **setup})


def migration_pricing(cfg: Any, router: str, share: bool | None = None) -> MigrationPricing | None:
    """What the plan valuation prices C-MLFQ's migrations with for ``router`` under the
    config ``cfg``: ``scheduler.bucket_token_limits`` (``share``: whether the limits follow
    the plan's GPU shares; None: as ``scheduler.bucket_limits`` says); None when ``router``
    is not ``cmlfq`` (FIFO and least-load routing never move a trajectory between buckets;
    length-aware ones are priced by their own placement) or ``planner.price_migrations``
    is off."""
    if router != "cmlfq" or not cfg.planner.price_migrations:
        return None
    pricing = MigrationPricing.from_config(cfg.scheduler)
    return pricing if share is None else MigrationPricing(pricing.limits, share)


def feasible_tps(model: ModelProfile, hw: HardwareProfile, tps: Sequence[int], cal: Calibration) -> tuple[int, ...]:
    """The rollout TP sizes of ``tps`` whose instances can hold the model (descending)."""
    out = []
    for tp in sorted(set(tps)):
        why = RolloutCost(model, hw, tp, cal).infeasible
        if why:
            log.info("rollout TP%d left out: %s", tp, why)
        else:
            out.append(tp)
    return tuple(sorted(out, reverse=True))


def profiles(cfg: Any) -> tuple[ModelProfile, HardwareProfile]:
    """The planner's profiles an experiment config names (``model.name``,
    ``cluster.hardware``), the hardware's node size set to ``cluster.gpus_per_node``."""
    hw = load_hardware(cfg.cluster.hardware)
    return load_model(cfg.model.name), hw.model_copy(update={"gpus_per_node": cfg.cluster.gpus_per_node})
