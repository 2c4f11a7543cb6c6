"""When the control loop decides, and on what: the measurement window of the live job
(:class:`StepWindow`), and the rule for a layout change that waits for its moment
(:class:`PendingChange`), which the job and the simulator share.

Pure Python: steps and seconds in, answers out; the caller's clock.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

GAIN_STEPS = 3
"""Steps before and after a switch whose mean step time gives its measured gain; also the
most steps the window averages."""
MEASURED_STEPS = 2
"""Steps measured on the current layout (batches that did not overlap a switch) before
the control loop decides again; it decides on their mean times (up to GAIN_STEPS of them),
since one batch's rollout time on two shared cores varies by 2-3×."""


@dataclass
class StepWindow:
    """The steps the control loop decides on: (step, batch rollout s, training s), the
    step times, and the layout changes whose realised gain is still to be measured."""

    max_staleness: int
    steps: int
    """``rl.steps``: a change decided too late to be measured is not made."""
    times: list[tuple[int, float, float]] = field(default_factory=list)
    step_times: list[tuple[int, float]] = field(default_factory=list)
    measure_from: int = 0
    """The first step whose batch did not overlap the last switch."""
    gain_checks: list[tuple[int, dict]] = field(default_factory=list)

    def state_dict(self) -> dict:
        """The window as plain data (lists: a JSON round trip leaves it equal)."""
        return {"times": [list(t) for t in self.times], "step_times": [list(t) for t in self.step_times],
                "measure_from": self.measure_from, "gain_checks": [[v, dict(r)] for v, r in self.gain_checks]}

    def load_state_dict(self, state: dict, before: int) -> None:
        """Take on what :meth:`state_dict` saved, without the steps from ``before`` on (a
        resumed run trains them again)."""
        self.times = [tuple(t) for t in state["times"] if t[0] < before]
        self.step_times = [tuple(t) for t in state["step_times"] if t[0] < before]
        self.measure_from, self.gain_checks = state["measure_from"], [tuple(g) for g in state["gain_checks"]]

    def record(self, step: int, rollout_s: float, train_s: float, step_s: float) -> None:
        self.times.append((step, rollout_s, train_s))
        self.step_times.append((step, step_s))

    def settled(self, step: int, moving: bool) -> bool:
        """The control loop may decide after ``step``: no switch under way (``moving``),
        the last one's batches are measured, and a switch now would be measured before the
        run ends."""
        measured = step - self.measure_from + 1 >= MEASURED_STEPS
        return not moving and measured and step + 2 < self.steps

    def means(self) -> tuple[list[int], float, float]:
        """The steps of the window, their mean batch rollout time and training time."""
        window = [t for t in self.times if t[0] >= self.measure_from][-GAIN_STEPS:]
        return ([t[0] for t in window], statistics.fmean(t[1] for t in window),
                statistics.fmean(t[2] for t in window))

    def switched(self, version: int, record: dict) -> None:
        """A layout change was applied at ``version``: the batches in flight across it
        carry its pause, so the window starts after them; its gain is measured later."""
        self.gain_checks.append((version, record))
        self.measure_from = version + 1 + self.max_staleness

    def realised_gains(self, final: bool = False) -> list[dict]:
        """The switches with GAIN_STEPS steps measured after them: the step time they saved
        (mean of the GAIN_STEPS steps before against the GAIN_STEPS after, the step that
        carried the switch's pause included), once each. ``final`` (the run ended): also
        those with fewer steps after them, over the steps there are (``steps_after`` says
        how many)."""
        out = []
        for applied_at, record in list(self.gain_checks):
            after = [s for step, s in self.step_times if step >= applied_at][:GAIN_STEPS]
            if len(after) < GAIN_STEPS and not (final and after):
                continue
            before = [s for step, s in self.step_times if step < applied_at][-GAIN_STEPS:]
            self.gain_checks.remove((applied_at, record))
            if before:
                b, a = statistics.fmean(before), statistics.fmean(after)
                out.append({"direction": record.get("direction", "replan"), "at_step": applied_at,
                            "predicted_gain_s": record.get("predicted_gain_s"), "measured_gain_s": round(b - a, 3),
                            "step_s_before": round(b, 3), "step_s_after": round(a, 3), "steps_after": len(after)})
        return out


def layout_gain(gain: dict) -> dict:
    """One entry of ``layout_gains`` (``summary.json``) from a realised gain of
    :meth:`StepWindow.realised_gains`: the step time the change was predicted to save and
    the step time it saved, s per step."""
    return {"predicted_s": gain["predicted_gain_s"], "realised_s": gain["measured_gain_s"], "at_step": gain["at_step"],
            "direction": gain["direction"], "steps_after": gain["steps_after"]}


@dataclass
class PendingChange:
    """A replan or re-shard the control loop decided, waiting for its moment. One rule, in
    the job (runtime/planning.py) and the simulator (sim/controller.py):

    - from the decision on, no new batch is submitted (``held``: the batches that wait);
    - the change is applied once no batch is in rollout (the queue starts over on the new
      instances), no training step runs and no other layout change is under way;
    - a change that moves training (another shape or other slots: every re-shard) also
      waits until no rolled-out batch waits for training: trajectories routed to the old
      shape's DP replicas could not be trained on the new one; except a change made for
      memory (the current shape cannot hold what comes next), which the batches that wait
      are trained on.
    A re-shard goes the same way as a replan; its pause is the re-shard's."""

    change: Any
    decided_at: float
    moves_training: bool = True
    """The change gives training other slots or another shape (:func:`moves_training`)."""
    held: list[int] = field(default_factory=list)
    """Batches not submitted while the change waits, in order."""

    @property
    def for_memory(self) -> bool:
        return str(getattr(self.change, "reason", "")).startswith("memory")

    def due(self, *, rolling: bool, untrained: bool, training: bool, moving: bool) -> bool:
        """May the change be applied now? ``rolling``: a submitted batch is still in
        rollout; ``untrained``: a rolled-out batch waits for training; ``training``: a step
        runs; ``moving``: another layout change is under way."""
        return not (rolling or training or moving or (untrained and self.moves_training and not self.for_memory))


def moves_training(before: Any, after: Any) -> bool:
    """Whether layout ``after`` gives training other slots or another TP/PP/DP shape than
    ``before`` (both :class:`~libra_hpc.cluster.layout.Layout`)."""
    a, b = before.training, after.training
    return a is None or b is None or (a.slots, a.tp, a.pp, a.dp) != (b.slots, b.tp, b.pp, b.dp)
