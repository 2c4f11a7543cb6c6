"""What every simulated policy of one scenario shares: profiles, cost models, the workload,
and the allocations (who trains, which rollout instances exist)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from libra_hpc.cluster.layout import LayoutError
from libra_hpc.planner.costs import (
    Calibration,
    LengthProfile,
    LengthSample,
    RolloutCost,
    TrainShape,
)
from libra_hpc.planner.hybrid import HybridPool, HybridPoolError, PhaseTimeouts
from libra_hpc.planner.profiles import (
    HardwareProfile,
    ModelProfile,
    load_hardware,
    load_model,
)
from libra_hpc.planner.search import Plan, plan_to_layout
from libra_hpc.planner.search import RolloutInstance as PlanInstance
from libra_hpc.sim.config import SimConfig
from libra_hpc.sim.instance import CostStepModel, StepModel
from libra_hpc.sim.rollout import InstanceSpec
from libra_hpc.sim.trace import TraceWorkload, read_trace
from libra_hpc.sim.workload import SyntheticWorkload, Trajectory

log = logging.getLogger(__name__)
HYBRID_TIMEOUTS = PhaseTimeouts(requested=1e6, fetching_state=1e6, zero_grad_sync=1e6, releasing=1e6)
"""The simulator drives every phase to its end itself (no member fails), so timeouts never fire."""


@dataclass(frozen=True)
class Allocation:
    """Who does what. ``train``: the core training group's shape (its GPUs are the first
    ``train.gpus`` slots); ``instances``: rollout instances (hybrid ones name their replica);
    ``colocated``: rollout and training time-share all GPUs."""

    train: TrainShape
    instances: tuple[InstanceSpec, ...]
    colocated: bool = False
    plan: Plan | None = None
    pool: HybridPool | None = None

    @property
    def rollout_gpus(self) -> int:
        return sum(s.tp for s in self.instances)

    def describe(self) -> str:
        counts: dict[int, int] = {}
        for s in self.instances:
            counts[s.tp] = counts.get(s.tp, 0) + 1
        roll = " ".join(f"{n}×TP{tp}" for tp, n in sorted(counts.items()))
        t = self.train
        head = "colocated: " if self.colocated else ""
        hybrid = f", hybrid pool {len(self.pool.all_replicas())} replica(s)" if self.pool else ""
        return (f"{head}train TP{t.tp} PP{t.pp} DP{t.dp} mbs{t.micro_batch}{' recompute' if t.recompute else ''} "
                f"({t.gpus} GPUs) | rollout {roll} ({self.rollout_gpus} GPUs){hybrid}")


class Context:
    """Profiles, calibration, engine timing per TP, the workload, derived costs."""

    def __init__(self, cfg: SimConfig):
        self.cfg = cfg
        self.model: ModelProfile = load_model(cfg.cluster.model)
        hw = load_hardware(cfg.cluster.hardware)
        self.hw: HardwareProfile = hw.model_copy(update={"gpus_per_node": cfg.cluster.gpus_per_node})
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
                         else SyntheticWorkload(cfg.workload, cfg.rl, cfg.seed))
        weight_bytes = self.model.weight_bytes(2)
        link = self.hw.link_bps(inter_node=True)
        self.weight_sync_s = cfg.costs.weight_sync_s if cfg.costs.weight_sync_s is not None else weight_bytes / link
        self._batches: dict[int, list[Trajectory]] = {}

    @property
    def gpus(self) -> int:
        return self.cfg.cluster.nodes * self.cfg.cluster.gpus_per_node

    def batch(self, step: int) -> list[Trajectory]:
        """Step ``step``'s trajectories (memoised: policies replay the same batches)."""
        if step not in self._batches:
            self._batches[step] = self.workload.batch(step)
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

    # ------------------------------------------------------------------ allocations
    def static_allocation(self, train: TrainShape, rollout_tp: int, colocated: bool = False) -> Allocation:
        """Training on the first ``train.gpus`` slots (all when colocated), homogeneous
        rollout instances of ``rollout_tp`` on the others (on all when colocated)."""
        free = self.gpus if colocated else self.gpus - train.gpus
        g = self.cfg.cluster.gpus_per_node
        if not colocated and train.gpus % g and (g - train.gpus % g) % rollout_tp:
            raise ValueError(f"TP{rollout_tp} instances do not fill the node training leaves partly")
        instances = tuple(InstanceSpec(i + 1, rollout_tp) for i in range(free // rollout_tp))
        return Allocation(train, instances, colocated)

    def plan_allocation(self, plan: Plan, hybrid: bool) -> Allocation:
        """The plan's layout; with ``hybrid``, its last ``planner.hybrid_nodes`` nodes form
        the hybrid pool when they hold rollout instances only and split into whole replicas.

        The pool's rule: no rollout instance on a hybrid node may span more than one
        training replica (lending a replica must stop no other instance). The training
        replica's slots on a node come in Megatron order (TP chunks, interleaved over PP
        and DP), so a plan whose hybrid-node instances are wider than a replica's chunk
        cannot form it, whatever PP is (TP2 PP1 DP10 or TP1 DP20 fail with TP4 rollout on
        the node). When that happens and the plan predicts that training may become the
        bottleneck (``t_train × (1 + hybrid_margin) >= t_rollout / k``, the condition under
        which the pool lends replicas), the hybrid node's instances are re-split into the
        largest smaller TP size that forms the pool (:func:`resplit_hybrid`): narrower
        instances decode slower, a price worth paying only for a pool that may be used.
        Otherwise, or when no split forms it, the plan runs without a pool (logged)."""
        c = self.cfg.cluster
        layout = plan_to_layout(plan, c.nodes, c.gpus_per_node, 0)
        pool = None
        if hybrid and self.cfg.planner.hybrid_nodes:
            first = None
            k = max(1, self.cfg.rl.max_staleness)
            useful = plan.t_train * (1 + self.cfg.planner.hybrid_margin) >= plan.t_rollout / k
            splits = sorted((t for t in self.step_models if t < c.gpus_per_node), reverse=True) if useful else []
            for tp in [None, *splits]:
                candidate = plan if tp is None else resplit_hybrid(plan, tp, c.nodes - self.cfg.planner.hybrid_nodes)
                if candidate is None:
                    continue
                try:
                    hl = plan_to_layout(candidate, c.nodes, c.gpus_per_node, self.cfg.planner.hybrid_nodes)
                    pool = HybridPool.from_layout(hl, min_rollout_gpus=self.cfg.planner.min_rollout_gpus,
                                                  timeouts=HYBRID_TIMEOUTS)
                except (LayoutError, HybridPoolError) as exc:
                    first = first or str(exc)
                    continue
                if tp is not None:
                    log.info("plan %s: hybrid-node rollout re-split to TP%d so the hybrid pool forms (%s)",
                             plan.describe(), tp, first)
                plan, layout = candidate, hl
                break
            if pool is None:
                log.info("plan %s runs without a hybrid pool: %s%s", plan.describe(), first,
                         "" if useful else " (not re-split: the plan predicts training will not be the bottleneck)")
        owner = {}
        if pool is not None:
            for r in pool.all_replicas():
                for slot in r.slots:
                    owner[slot] = r.rid
        instances = tuple(InstanceSpec(g.gid, g.tp, owner.get(g.slots[0])) for g in layout.rollout_instances)
        return Allocation(plan.train, instances, False, plan, pool)


def resplit_hybrid(plan: Plan, tp: int, first_hybrid_node: int) -> Plan | None:
    """``plan`` with every rollout instance wider than ``tp`` on nodes from
    ``first_hybrid_node`` on cut into instances of ``tp`` GPUs (slots in order); None when
    no instance there is wider (nothing would change)."""
    out, changed = [], False
    for inst in plan.rollout:
        if inst.tp > tp and inst.slots[0].node >= first_hybrid_node:
            out.extend(PlanInstance(tp, inst.slots[i:i + tp]) for i in range(0, inst.tp, tp))
            changed = True
        else:
            out.append(inst)
    return replace(plan, rollout=tuple(out)) if changed else None


def length_profile(trajectories: list[Trajectory], batch_size: int) -> LengthProfile:
    """The planner's view of finished trajectories (prompt, generated, turns, tool seconds)."""
    samples = [LengthSample(t.prompt_tokens + sum(c.output_tokens for c in t.calls), t.gen_tokens, len(t.turns),
                            t.tool_time_s) for t in trajectories]  # tool outputs are prefilled, not decoded
    return LengthProfile.from_samples(samples, batch_size)


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
