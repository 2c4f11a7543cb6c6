"""What Libra's control loop decides (:class:`LayoutChange`, :class:`AfterRollout`), and
the plain-data form of a decision that its journal records and the golden test compares
(:func:`journal_form`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from libra_hpc.cluster.layout import Layout
from libra_hpc.planner.hybrid import HybridPool, PoolEvent
from libra_hpc.planner.search import Plan, PlanResult


@dataclass(frozen=True)
class LayoutChange:
    """A decision to run on ``layout`` (its plan's predictions, its hybrid pool)."""

    step: int
    layout: Layout
    plan: Plan
    pool: HybridPool | None
    reason: str
    gain_s: float | None = None
    """Predicted step-time saving against the current plan (None for the first layout)."""
    result: PlanResult | None = None
    """The search behind it (runners-up, time spent)."""
    reshard: bool = False
    """Only the training TP size changes (same GPUs, same rollout instances): rollout
    need not drain; training reloads its checkpoint at the new shape."""

    def describe(self) -> str:
        pool = f", hybrid pool {len(self.pool.all_replicas())} replica(s)" if self.pool else ""
        return self.plan.describe() + pool


@dataclass
class AfterRollout:
    """What :meth:`~libra_hpc.planner.control.ControlLoop.after_rollout` decided: a layout change, or pool transitions."""

    change: LayoutChange | None = None
    pool_events: list[PoolEvent] = field(default_factory=list)
    pool_decided: bool = False
    """The hybrid pool's policy ran (a pool exists, no layout change, a training time is
    known, and a borrow would fit): ``pool_events`` is its answer, possibly empty."""


def journal_form(out: Any) -> Any:
    """A decision as plain data (what the golden test compares)."""
    if out is None:
        return None
    if isinstance(out, LayoutChange):
        return {"step": out.step, "layout": out.layout.summary(), "plan": out.plan.describe(),
                "t_train": out.plan.t_train, "t_rollout": out.plan.t_rollout, "objective": out.plan.objective,
                "reason": out.reason, "gain_s": out.gain_s,
                "pool": None if out.pool is None else [[str(s) for s in r.slots] for r in out.pool.all_replicas()]}
    if isinstance(out, AfterRollout):
        return {"change": journal_form(out.change), "pool_events": journal_form(out.pool_events),
                "pool_decided": out.pool_decided}
    if isinstance(out, list):
        return [e.to_dict() for e in out]
    raise TypeError(f"no journal form for {type(out).__name__}")
