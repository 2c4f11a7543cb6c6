"""The plan search's reference optimum for small clusters (pure: no torch, no MPI): every
training shape × every per-node partition of the free slots into rollout instances, no
pruning. tests/test_planner_search.py and benchmarks/bench_planner.py hold
:func:`~libra_hpc.planner.search.plan` against it."""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

from libra_hpc.planner.costs import DEFAULT, Calibration, LengthProfile, rollout_makespan
from libra_hpc.planner.profiles import HardwareProfile, ModelProfile
from libra_hpc.planner.search import (
    Mode,
    PlanError,
    PlannerOptions,
    RLBatch,
    _check_args,
    _free_shape,
    _Search,
    fitting_training_cost,
)


def _partitions(size: int, parts: Sequence[int]) -> list[tuple[int, ...]]:
    """Multisets of ``parts`` (descending) summing to ``size``."""
    if size == 0:
        return [()]
    return [(p, *rest) for i, p in enumerate(parts) if p <= size
            for rest in _partitions(size - p, parts[i:])]


def exhaustive(model: ModelProfile, hardware: HardwareProfile, nodes: int, gpus_per_node: int,
               lengths: LengthProfile, batch: RLBatch, *, mode: Mode = "async",
               options: PlannerOptions = PlannerOptions(), calibration: Calibration = DEFAULT) -> tuple[float, str]:
    """Reference optimum for small clusters (<= 16 GPUs): every training shape (with
    recomputation when it does not fit otherwise) × every choice of per-node partitions of
    the free slots into rollout instances, no pruning, no memo of best per size. Returns
    (objective, description)."""
    _check_args(nodes, gpus_per_node, mode, options)
    if nodes * gpus_per_node > 16:
        raise PlanError(f"exhaustive() is for <= 16 GPUs, got {nodes * gpus_per_node}")
    hw = hardware.model_copy(update={"gpus_per_node": gpus_per_node})
    s = _Search(model, hw, nodes, gpus_per_node, lengths, batch, mode, options, calibration)
    best: tuple[float, str] = (math.inf, "nothing fits")
    seen: dict[tuple[int, ...], float] = {}
    for shape in s.train_shapes():
        cost = fitting_training_cost(model, hw, shape, calibration)
        if cost.infeasible:
            continue
        whole, partial = _free_shape(shape.gpus, nodes, gpus_per_node)
        sizes = ([partial] if partial else []) + [gpus_per_node] * whole
        for choice in itertools.product(*(_partitions(z, s.tps) for z in sizes)):
            flat = tuple(sorted((tp for part in choice for tp in part), reverse=True))
            if not flat:
                continue
            if flat not in seen:  # the makespan depends on the multiset only; memo, not pruning
                pools = [(s.costs[tp], flat.count(tp)) for tp in s.tps if tp in flat]
                seen[flat] = rollout_makespan(pools, lengths, in_flight=options.in_flight,
                                              length_aware=options.length_aware,
                                              migration=options.migration).makespan_s
            tr = seen[flat]
            o = s.objective(cost.step_s, tr)
            if o < best[0]:
                best = (o, f"{cost.shape} rollout {list(flat)}")
    return best
