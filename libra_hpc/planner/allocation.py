"""A plan's allocation: its layout and the elastic hybrid pool that layout forms (pure).

The pool's rule: no rollout instance on a hybrid node may span more than one training
replica (lending a replica must stop no other instance). A lent replica takes a run of
TP×PP node-major hybrid slots (``cluster/layout.py`` ``lend_hybrid_to_training``), so a plan
whose hybrid-node instances are wider than a replica (TP×PP GPUs) cannot form it (TP2 PP1
DP10 or TP1 DP20 fail with TP4 rollout on the node); cutting those instances narrower
(:func:`resplit_hybrid`) may.
"""

from __future__ import annotations

import logging
from dataclasses import replace

from libra_hpc.cluster.layout import Layout, LayoutError
from libra_hpc.planner.hybrid import HybridPool, HybridPoolError
from libra_hpc.planner.options import ControlOptions
from libra_hpc.planner.pipeline import rollout_side_s
from libra_hpc.planner.search import Plan, plan_to_layout
from libra_hpc.planner.search import RolloutInstance as PlanInstance

log = logging.getLogger(__name__)


def resplit_hybrid(plan_: Plan, tp: int, first_hybrid_node: int) -> Plan | None:
    """``plan_`` with every rollout instance wider than ``tp`` on nodes from
    ``first_hybrid_node`` on cut into instances of ``tp`` GPUs (slots in order); None when
    no instance there is wider (nothing would change)."""
    out, changed = [], False
    for inst in plan_.rollout:
        if inst.tp > tp and inst.slots[0].node >= first_hybrid_node:
            out.extend(PlanInstance(tp, inst.slots[i:i + tp]) for i in range(0, inst.tp, tp))
            changed = True
        else:
            out.append(inst)
    return replace(plan_, rollout=tuple(out)) if changed else None


def resplit_sizes(o: ControlOptions) -> list[int]:
    """The rollout TP sizes a hybrid node's instances may be cut to, widest first."""
    return sorted((t for t in o.rollout_tps if t < o.gpus_per_node), reverse=True)


def pool_of(plan_: Plan, o: ControlOptions) -> HybridPool | None:
    """The hybrid pool ``plan_``'s layout forms as it is, or None."""
    try:
        layout = plan_to_layout(plan_, o.nodes, o.gpus_per_node, o.hybrid_nodes, reason="valuation")
        return HybridPool.from_layout(layout, min_rollout_gpus=o.min_rollout_gpus, timeouts=o.hybrid_timeouts)
    except (LayoutError, HybridPoolError):
        return None


def allocate(plan_: Plan, o: ControlOptions, reason: str, resplit: bool = True,
             tail_s: float = 0.0) -> tuple[Plan, Layout, HybridPool | None]:
    """The plan's layout; with the hybrid pool on, its last ``hybrid_nodes`` nodes form
    the pool when they hold rollout instances only and split into whole replicas.

    When the pool does not form as planned (see the module docstring) and the plan
    predicts that training may become the bottleneck (``t_train × (1 + hybrid_margin) >=
    t_rollout / k``, when the pool lends replicas), the hybrid node's instances are
    re-split into the largest smaller TP size that forms the pool: narrower instances
    decode slower, a price worth paying only for a pool that may be used. Otherwise, or
    when no split forms it, the plan runs without a pool (logged). ``resplit`` False: the
    plan comes from :meth:`~libra_hpc.planner.valuation.PlanValuation.best_plan`, which
    weighed the re-split already. ``tail_s``: the calibration's ``stream_tail_s`` (the rollout
    side's weight, :func:`~libra_hpc.planner.pipeline.rollout_side_s`). Returns the plan
    (re-split or not), its layout and pool."""
    layout = plan_to_layout(plan_, o.nodes, o.gpus_per_node, 0, reason=reason)
    pool = None
    if o.hybrid and o.hybrid_nodes:
        first = None
        useful = resplit and plan_.t_train * (1 + o.hybrid_margin) >= rollout_side_s(
            plan_.t_rollout, o.max_staleness, o.stream_groups, tail_s)
        splits = resplit_sizes(o) if useful else []
        for tp in [None, *splits]:
            candidate = plan_ if tp is None else resplit_hybrid(plan_, tp, o.nodes - o.hybrid_nodes)
            if candidate is None:
                continue
            try:
                hl = plan_to_layout(candidate, o.nodes, o.gpus_per_node, o.hybrid_nodes, reason=reason)
                pool = HybridPool.from_layout(hl, min_rollout_gpus=o.min_rollout_gpus, timeouts=o.hybrid_timeouts)
            except (LayoutError, HybridPoolError) as exc:
                first = first or str(exc)
                continue
            if tp is not None:
                log.info("plan %s: hybrid-node rollout re-split to TP%d so the hybrid pool forms (%s)",
                         plan_.describe(), tp, first)
            plan_, layout = candidate, hl
            break
        if pool is None:
            log.info("plan %s runs without a hybrid pool: %s%s", plan_.describe(), first,
                     "" if useful else " (not re-split: the plan predicts training will not be the bottleneck)" if resplit
                     else " (the plan search weighed the re-split: not worth it)")
    return plan_, layout, pool
