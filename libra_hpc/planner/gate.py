"""Replanning gate: when to look at a new plan, and when one is worth applying (pure).

A check runs every ``every_steps`` steps, or earlier on a pressure event: the rollout
queue deeper than ``queue_depth_threshold``, or the rollout / training time ratio outside
``ratio_band`` (one side waits on the other). At a check the candidate is applied only when

    (current objective − candidate objective) × horizon − switch cost > margin_s

(``horizon``: ``horizon_steps``, by default ``every_steps``)

i.e. the time it saves until the next check pays for the move with room to spare, and
with hysteresis, so that a workload alternating between two shapes does not flap:
- the improvement must persist for ``confirm_checks`` checks in a row, in the same
  direction: GPUs toward rollout, or toward training (when the caller passes the current
  plan), else the very same candidate (training shape and rollout instance counts).
  A check without a worthwhile gain, or one pointing the other way, restarts the count;
  under steady drift the candidate changes from check to check but the direction holds,
  so the latest candidate is applied;
- a decisive change skips the confirmation: one whose predicted gain is at least
  ``decisive_gain`` of the current plan's predicted step and at least twice the cost
  models' measured error (a step predicted to shrink by half after a regime change is not
  noise, and each check it waits runs a step on the plan that no longer fits);
- no change within ``min_dwell_steps`` steps of the last applied one (with
  ``dwell_same_way``: none that moves GPUs back; a further move the same way may go);
- with ``confirm_next_step`` a winner's confirming check may run at the next step (the
  control loop otherwise spaces pressure checks ``every_steps // 5`` apart).
Every :class:`Decision` says why, for ``events.jsonl``. Units: seconds, steps.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass

from libra_hpc.planner.search import Plan, PlanResult

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GateOptions:
    """Knobs of the replanning gate. Candidates for ``PlannerConfig`` fields (see the report)."""

    every_steps: int = 10
    """Periodic check interval K, steps; also the horizon the gain is counted over unless
    ``horizon_steps`` says otherwise."""
    queue_depth_threshold: int = 256
    """Trajectories waiting for a rollout instance above which a check runs at once."""
    ratio_band: tuple[float, float] = (0.8, 1.25)
    """Rollout / training time ratio outside [low, high] triggers a check (async: one side idles)."""
    margin_s: float = 10.0
    """Net saving (s, over the horizon, after the reconfiguration cost) a change must exceed."""
    confirm_checks: int = 2
    """Consecutive checks the same candidate must win before it is applied (1: at once)."""
    min_dwell_steps: int = 20
    """Steps after an applied change during which no other change is applied."""
    horizon_steps: int | None = None
    """Steps a change's gain is counted over (None: ``every_steps``). A gate that checks
    every step (the clairvoyant policy's) still values a change over the configured
    horizon: counted over one step, no gain ever paid a drain of two steps' time, and it
    stayed on a layout twice as slow for 50 steps."""
    min_gain: float = 0.0
    """Share of the current plan's predicted step a change of the rollout instances must
    save per step: a smaller predicted gain is within the rollout model's error and is
    kept out. A change of the training shape alone (same instances) is exempt."""

    decisive_gain: float = 1.0
    """Share of the current plan's predicted step a candidate must save per step (and at
    least twice ``model_error`` of :meth:`ReplanGate.consider`) to be applied at its first
    winning check, without ``confirm_checks``; 1 or more: never (every change confirms)."""

    dwell_same_way: bool = True
    """A change that moves GPUs the same way as the last applied one is not held back by
    ``min_dwell_steps`` (a move back, or a reshuffle of the same split, is)."""
    confirm_next_step: bool = True
    """A winning candidate's confirming check may run at the next step (else the caller's
    spacing of pressure checks applies to it too)."""

    def __post_init__(self) -> None:
        lo, hi = self.ratio_band
        if (self.every_steps < 1 or (self.horizon_steps is not None and self.horizon_steps < 1)
                or self.confirm_checks < 1 or self.min_dwell_steps < 0 or self.margin_s < 0
                or not 0 <= self.min_gain < 1 or self.decisive_gain <= 0):
            raise ValueError(f"GateOptions: every_steps, confirm_checks >= 1, min_dwell_steps, margin_s >= 0, "
                             f"0 <= min_gain < 1, decisive_gain > 0: {self}")
        if not 0 < lo <= 1 <= hi:
            raise ValueError(f"GateOptions.ratio_band must satisfy 0 < low <= 1 <= high, got {self.ratio_band}")
        if self.queue_depth_threshold < 1:
            raise ValueError(f"GateOptions.queue_depth_threshold must be >= 1, got {self.queue_depth_threshold}")


@dataclass(frozen=True)
class Decision:
    apply: bool
    reason: str
    checked: bool = False
    """A check ran at this step (periodic or pressure)."""
    trigger: str = ""
    """What started the check: ``periodic``, ``pressure: ...`` or empty."""
    net_gain_s: float = 0.0
    """Predicted saving over the horizon minus the reconfiguration cost, s."""


def direction(p: Plan, current: Plan) -> tuple:
    """Which way ``p`` moves GPUs relative to ``current`` (same split: the same candidate)."""
    delta = p.rollout_gpus - current.rollout_gpus
    if delta > 0:
        return ("toward rollout",)
    if delta < 0:
        return ("toward training",)
    return signature(p)


_MOVES = {("toward rollout",), ("toward training",)}


def signature(p: Plan) -> tuple:
    """What makes two plans the same change: training shape and rollout instance counts."""
    s = p.train
    return (s.tp, s.pp, s.dp, s.micro_batch, s.recompute, tuple(sorted(p.rollout_counts.items())))


class ReplanGate:
    """Stateful gate; call :meth:`consider` once per step (cheap when no check is due)."""

    def __init__(self, options: GateOptions = GateOptions()):
        self.opt = options
        self.last_check: int | None = None
        self.last_apply: int | None = None
        self.pending: tuple | None = None
        self.streak = 0
        self.moved: tuple | None = None
        """Which way the last applied change moved GPUs (:func:`direction`); None when not
        known (a change the caller applied past the gate, e.g. for memory)."""

    def due(self, step: int, pressure: Mapping[str, float]) -> str:
        """The trigger of a check at ``step``, or '' when none is due. ``pressure`` keys:
        ``queue_depth`` (trajectories waiting), ``rollout_train_ratio`` (T_rollout / T_train
        measured over the last steps); missing keys are no pressure."""
        o = self.opt
        depth = pressure.get("queue_depth")
        if depth is not None and depth > o.queue_depth_threshold:
            return f"pressure: queue depth {depth:g} > {o.queue_depth_threshold}"
        ratio = pressure.get("rollout_train_ratio")
        if ratio is not None and not o.ratio_band[0] <= ratio <= o.ratio_band[1]:
            return f"pressure: rollout/training time ratio {ratio:.2f} outside [{o.ratio_band[0]}, {o.ratio_band[1]}]"
        if self.last_check is None or step - self.last_check >= o.every_steps:
            return "periodic"
        return ""

    def confirming(self, step: int) -> bool:
        """A candidate won the last check and waits for its confirmation, which a check at
        ``step`` could give (no dwell holds it back)."""
        return self.opt.confirm_next_step and self.pending is not None and not self._dwelling(step, self.pending)

    def _dwelling(self, step: int, sig: tuple) -> bool:
        """Whether the dwell after the last applied change holds back a change ``sig``: one
        that moves GPUs back, or moves none, within ``min_dwell_steps`` (flapping). A further
        move the same way is not held: under a steady drift the best split keeps moving,
        and a plan applied halfway through a regime change would otherwise stay a dwell long."""
        if self.last_apply is None or step - self.last_apply >= self.opt.min_dwell_steps:
            return False
        return not (self.opt.dwell_same_way and sig == self.moved and sig in _MOVES)

    def consider(self, step: int, current_objective_s: float, candidate: PlanResult, reconfig_cost_s: float,
                 pressure: Mapping[str, float] | None = None, current: Plan | None = None,
                 model_error: float = 0.0) -> Decision:
        """Whether to apply ``candidate`` now instead of the current plan, whose objective
        re-costed on today's observations is ``current_objective_s``. ``reconfig_cost_s``:
        what the switch costs (the control loop's: the pause and the pipeline's drain).
        ``current`` (optional) lets the hysteresis count checks by direction instead of by
        identical candidate.
        ``model_error``: the cost models' relative error measured by this run (its fitted
        calibration, :func:`~libra_hpc.planner.control.model_error`); with ``min_gain`` > 0
        a rollout change must save more than the larger of the two."""
        o = self.opt
        trigger = self.due(step, pressure or {})
        if not trigger:
            return Decision(False, f"no check due: next periodic check at step {self.last_check + o.every_steps}, "
                                   "no pressure")
        self.last_check = step
        new = candidate.plan
        gain = current_objective_s - new.objective
        horizon = o.horizon_steps or o.every_steps
        net = gain * horizon - reconfig_cost_s
        money = (f"gain {gain:.3g} s/step × {horizon} steps − switch {reconfig_cost_s:.3g} s "
                 f"= {net:.3g} s")
        if net <= o.margin_s:
            self.pending, self.streak = None, 0
            return self._say(step, Decision(False, f"{trigger}; keep: {money} <= margin {o.margin_s:g} s",
                                            True, trigger, net))
        same_rollout = current is not None and new.rollout_counts == current.rollout_counts
        need = max(o.min_gain, model_error) if o.min_gain > 0 else 0.0
        if gain < need * current_objective_s and not same_rollout:
            self.pending, self.streak = None, 0
            what = (f"min_gain {o.min_gain:g}" if need == o.min_gain
                    else f"the cost models' measured error {model_error:.0%}")
            return self._say(step, Decision(False, f"{trigger}; keep: gain {gain:.3g} s/step < {what} "
                                                   f"× current step {current_objective_s:.3g} s (within the cost "
                                                   f"model's error)", True, trigger, net))
        sig = direction(new, current) if current is not None else signature(new)
        self.streak = self.streak + 1 if sig == self.pending else 1
        self.pending = sig
        if self._dwelling(step, sig):
            return self._say(step, Decision(False, f"{trigger}; keep: {money} > margin, but dwell: last change at step "
                                                   f"{self.last_apply}, none before step "
                                                   f"{self.last_apply + o.min_dwell_steps}", True, trigger, net))
        decisive = gain >= max(o.decisive_gain, 2 * model_error) * current_objective_s > 0
        if self.streak < o.confirm_checks and not decisive:
            return self._say(step, Decision(False, f"{trigger}; wait: {money} > margin {o.margin_s:g} s for "
                                                   f"{self.streak}/{o.confirm_checks} consecutive checks "
                                                   f"({new.describe()})", True, trigger, net))
        streak, self.last_apply, self.pending, self.streak = self.streak, step, None, 0
        self.moved = sig if current is not None else None
        why = (f"for {o.confirm_checks} consecutive checks" if streak >= o.confirm_checks else
               f"decisive: gain {gain / current_objective_s:.0%} of the current step >= decisive_gain "
               f"{o.decisive_gain:g}")
        return self._say(step, Decision(True, f"{trigger}; apply {new.describe()}: {money} > margin "
                                              f"{o.margin_s:g} s {why}", True, trigger, net))

    @staticmethod
    def _say(step: int, d: Decision) -> Decision:
        log.info("replan gate step %d: %s", step, d.reason)
        return d
