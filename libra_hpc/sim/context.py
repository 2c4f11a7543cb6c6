"""What every simulated policy of one scenario shares: profiles, cost models, the workload,
and the static layouts the baselines are searched over."""

from __future__ import annotations

import logging
from dataclasses import replace
from types import SimpleNamespace

from libra_hpc.cluster.layout import Group, Layout, Slot
from libra_hpc.envs.synthetic import SyntheticWorkload, Trajectory
from libra_hpc.planner.control import profiles
from libra_hpc.planner.costs import (
    Calibration,
    LengthSample,
    RolloutCost,
    TrainShape,
)
from libra_hpc.planner.hybrid import HybridPool
from libra_hpc.rl.grpo import compute_advantages
from libra_hpc.sim.config import SimConfig
from libra_hpc.sim.instance import CostStepModel, StepModel
from libra_hpc.sim.rollout import InstanceSpec
from libra_hpc.sim.trace import TraceWorkload, read_trace

log = logging.getLogger(__name__)


class Context:
    """Profiles, calibration, engine timing per TP, the workload, derived costs."""

    def __init__(self, cfg: SimConfig):
        self.cfg = cfg
        self.model, self.hw = profiles(cfg)
        self.cal = Calibration(max_num_seqs=cfg.costs.max_num_seqs, note="simulator defaults")
        self.step_models: dict[int, StepModel] = {}
        self.rollout_costs: dict[int, RolloutCost] = {}
        for tp in sorted(cfg.scheduler.bucket_token_limits):
            cost = RolloutCost(self.model, self.hw, tp, self.cal)
            if cost.infeasible:
                log.info("rollout TP%d left out: %s", tp, cost.infeasible)
                continue
            self.rollout_costs[tp] = cost
            self.step_models[tp] = CostStepModel(cost)
        if not self.step_models:
            raise ValueError(f"no rollout TP size of scheduler.bucket_token_limits fits {self.model.name} on {self.hw.name}")
        self.tps = tuple(sorted(self.step_models, reverse=True))
        self.workload = (TraceWorkload(read_trace(cfg.trace)) if cfg.trace is not None
                         else SyntheticWorkload(cfg.workload, cfg.rl, cfg.rl.seed, cfg.training.seq_len))
        weight_bytes = self.model.weight_bytes(2)
        link = self.hw.link_bps(inter_node=True)
        self.weight_sync_s = cfg.costs.weight_sync_s if cfg.costs.weight_sync_s is not None else weight_bytes / link
        self._batches: dict[int, list[Trajectory]] = {}

    @property
    def gpus(self) -> int:
        return self.cfg.cluster.nodes * self.cfg.cluster.gpus_per_node

    def batch(self, step: int) -> list[Trajectory]:
        """Step ``step``'s trajectories (memoised: policies replay the same batches), each
        marked ``trained`` as the job's trainer would (:func:`mark_trained`)."""
        if step not in self._batches:
            self._batches[step] = mark_trained(self.workload.batch(step), self.cfg.rl.filter_zero_variance)
            if len(self._batches) > 512:
                self._batches.pop(next(iter(self._batches)))
        return self._batches[step]

    def fetch_s(self, shape: TrainShape) -> float:
        """Seconds a hybrid replica takes to receive its training state: bf16 weights, fp32
        gradient buffer and its Adam shard (12 bytes/param over DP) per GPU over one link."""
        if self.cfg.costs.hybrid_fetch_s is not None:
            return self.cfg.costs.hybrid_fetch_s
        params = self.model.param_count() / (shape.tp * shape.pp)
        return params * (2 + 4 + 12 / (shape.dp + 1)) / self.hw.link_bps(inter_node=True)

    # ------------------------------------------------------------------ static layouts
    def static_layout(self, train: TrainShape, rollout_tp: int, colocated: bool = False) -> Layout:
        """Training on the first ``train.gpus`` slots, homogeneous rollout instances of
        ``rollout_tp`` on the others. ``colocated``: rollout instances on every slot and no
        training group (training time-shares them with the shape ``train``)."""
        c = self.cfg.cluster
        g = c.gpus_per_node
        slots = [Slot(n, i) for n in range(c.nodes) for i in range(g)]
        start = 0 if colocated else train.gpus
        if not colocated and train.gpus % g and (g - train.gpus % g) % rollout_tp:
            raise ValueError(f"TP{rollout_tp} instances do not fill the node training leaves partly")
        groups = [] if colocated else [Group(0, "training", tuple(slots[:start]), train.tp, train.pp, train.dp)]
        free = slots[start:]
        groups += [Group(i + 1, "rollout", tuple(free[i * rollout_tp:(i + 1) * rollout_tp]), rollout_tp)
                   for i in range(len(free) // rollout_tp)]
        return Layout(c.nodes, g, tuple(groups), reason="colocated" if colocated else "static split")


def instances_of(layout: Layout, pool: HybridPool | None = None) -> tuple[InstanceSpec, ...]:
    """The rollout instances of ``layout`` as the simulated rollout side runs them (hybrid
    ones name the pool replica they belong to)."""
    owner = {slot: r.rid for r in pool.all_replicas() for slot in r.slots} if pool is not None else {}
    return tuple(InstanceSpec(g.gid, g.tp, owner.get(g.slots[0])) for g in layout.rollout_instances)


def describe(layout: Layout, train: TrainShape, pool: HybridPool | None = None, colocated: bool = False) -> str:
    """One line for reports: the training shape and the rollout instances per TP size."""
    counts: dict[int, int] = {}
    for g in layout.rollout_instances:
        counts[g.tp] = counts.get(g.tp, 0) + 1
    roll = " ".join(f"{n}×TP{tp}" for tp, n in sorted(counts.items()))
    t = train
    head = "colocated: " if colocated else ""
    hybrid = f", hybrid pool {len(pool.all_replicas())} replica(s)" if pool else ""
    return (f"{head}train TP{t.tp} PP{t.pp} DP{t.dp} mbs{t.micro_batch}{' recompute' if t.recompute else ''} "
            f"({t.gpus} GPUs) | rollout {roll} ({sum(counts[tp] * tp for tp in counts)} GPUs){hybrid}")


def mark_trained(batch: list[Trajectory], filter_zero_variance: bool) -> list[Trajectory]:
    """``batch`` with ``trained`` False on the groups the job's trainer leaves out: with
    ``filter_zero_variance``, those whose rewards are all equal (the trainer's own rule,
    :func:`~libra_hpc.rl.grpo.compute_advantages`). A batch without rewards is all trained."""
    if not filter_zero_variance or any(t.reward is None for t in batch):
        return batch
    members = [SimpleNamespace(group_id=t.prompt_id, reward=t.reward, tid=t.tid) for t in batch]
    kept = {m.tid for m in compute_advantages(members).trajectories}
    return [t if t.tid in kept else replace(t, trained=False) for t in batch]


def trained_of(batch: list[Trajectory]) -> list[Trajectory]:
    """The trajectories of ``batch`` its training step trains (:func:`mark_trained`)."""
    return [t for t in batch if t.trained]


def samples_of(trajectories: list[Trajectory]) -> list[LengthSample]:
    """The planner's view of finished trajectories (prompt, generated, turns, tool seconds,
    tool-output tokens: prefilled, not decoded, and part of the prompt; whether it is trained)."""
    out = []
    for t in trajectories:
        returned = sum(c.output_tokens for c in t.calls)
        out.append(LengthSample(t.prompt_tokens + returned, t.gen_tokens, len(t.turns), t.tool_time_s, returned,
                                t.trained))
    return out


def critical_path_s(ctx: Context, trajectories: list[Trajectory]) -> float:
    """Floor of a batch's rollout makespan, s: the longest serial time of one trajectory
    alone on the fastest instance shape (prefill, decode at batch 1, tool calls). No policy
    finishes the batch sooner."""
    model = ctx.step_models[max(ctx.step_models)]
    worst = 0.0
    for t in trajectories:
        context, total = t.prompt_tokens, model.prefill_s(t.prompt_tokens)
        for i, tokens in enumerate(t.turns):
            total += tokens * model.step_s(1, context + tokens / 2)
            context += tokens
            if i < len(t.calls):
                total += t.calls[i].latency_s + model.prefill_s(t.calls[i].output_tokens)
                context += t.calls[i].output_tokens
        worst = max(worst, total)
    return worst
