"""The elastic hybrid pool's lending policy (pure): which way it moves a replica, and the
lend on trial (:class:`HybridLending`).

The control loop prices each move (``ControlLoop.hybrid_gain``): the pipelined step with
training at 1/DP and the rollout's makespan from the rollout cost model on the instances
left. The pool moves a replica the way that is predicted to save the most, when that is
more than ``hybrid_margin`` of the step: not only when training is the slower side, since
with staleness k a step is (makespan + training) / (k + 1) while rollout is longer, and a
shorter training step shortens it. The prediction can still be wrong where the rollout's
tail binds (its makespan set by a few long trajectories, and streamed training
overlapping it): the pool then lent and released on alternate checks. So a lend is on trial: once the
replica has trained through two measured rollouts, a step (the slower of training and the
rollout side) longer than before the lend by more than ``hybrid_margin`` sends it back,
and later borrows need a training/rollout ratio above the one it was lent at by that
margin. Units: seconds, GPUs.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from libra_hpc.planner.hybrid import HybridPool, PoolEvent


class HybridLending:
    """The pool's gate with the lend on trial (see the module docstring). State: the
    replica on trial and the balance a borrow must now exceed; the pool it decides for
    is passed in (the control loop owns it)."""

    def __init__(self, margin: float):
        self.margin = margin
        """``hybrid_margin``: a move must be predicted to save this share of the step."""
        self.trial: dict | None = None
        """The last replica lent to training, on trial until two rollouts with it active are
        measured: ``rid``, ``step``, ``before_s`` (the step's slower side before the lend),
        ``ratio`` (training/rollout then), ``measured``."""
        self.floor: float | None = None
        """After a lend that made the step slower: the training/rollout ratio a borrow must
        now exceed."""

    def held(self, t_train: float, t_roll: float) -> bool:
        """True when a lend at this training/rollout balance is held: one at a balance no
        heavier on training made the step slower."""
        return self.floor is not None and t_train <= t_roll * self.floor

    def moves(self, t_train: float, t_roll: float, gain: Callable[[str], float | None],
              can_grow: Callable[[], bool]) -> dict[str, float]:
        """The moves :meth:`decide` weighs and what each is predicted to save: none while a
        lend is on trial (it is judged by what it did, and a second lend would replace its
        trial, so that the first was never judged), else a release, and a borrow while one
        more replica fits training's memory and no lend at this balance made the step
        slower; a move that no replica can make (``gain`` None) is left out."""
        if self.trial is not None:
            return {}
        gains = {"release": gain("release")}
        if can_grow() and not self.held(t_train, t_roll):
            gains["borrow"] = gain("borrow")
        return {d: g for d, g in gains.items() if g is not None}

    def decide(self, pool: HybridPool, step: int, now: float, t_train: float, t_roll: float,
               gain: Callable[[str], float | None],
               can_grow: Callable[[], bool]) -> tuple[list[PoolEvent] | None, list[dict]]:
        """Borrow or release a hybrid replica (the pool's events), or hold. ``gain(direction)``
        (``borrow`` or ``release``): the step time that move is predicted to save, None when
        no replica can move that way. The move predicted to save the most is made when it
        saves more than the margin's share of the step (``max(t_train, t_roll)``; ``t_roll``:
        the rollout side); a borrow only while one more replica fits training's memory
        (``can_grow``) and no lend at this balance made the step slower (:meth:`held`).
        While a replica joins or releases, nothing moves (its effect is not measured yet).
        A lend is judged by what it did (:meth:`_judge`): while it is on trial the pool makes
        no move on a prediction (a prediction that a lend paid and one, a batch later, that
        it does not made the pool flap on a800-swe-drift-mirror: 11614 tokens/s against
        11697; a second lend would replace the first's trial).
        Also returns the ``considered`` records of the check; the events are None when no
        move was possible (:meth:`moves` empty)."""
        release, notes = self._judge(pool, step, t_train, t_roll)
        if release is not None:
            return pool.release(now, release), notes
        if pool.joining() or pool.in_state("releasing"):
            return pool.tick(now), notes
        moves = self.moves(t_train, t_roll, gain, can_grow)
        if not moves:
            return None, notes
        direction = max(moves, key=lambda d: moves[d])
        if moves[direction] <= self.margin * max(t_train, t_roll):
            return pool.tick(now), notes
        why = f"predicted to save {moves[direction]:.3g} s a step (> {self.margin:g} × {max(t_train, t_roll):.3g} s)"
        if direction == "release":
            return pool.release(now, why), notes
        events = pool.borrow(now, why)
        lent = [e.replica for e in events if e.changed and e.to_state == "requested"]
        if lent:
            self.trial = {"rid": lent[-1], "step": step, "before_s": max(t_train, t_roll),
                          "ratio": t_train / t_roll if t_roll > 0 else math.inf, "measured": 0}
        return events, notes

    def _judge(self, pool: HybridPool, step: int, t_train: float, t_roll: float) -> tuple[str | None, list[dict]]:
        """The verdict on the replica on trial once it has trained through two measured
        rollouts: the reason to send it back (the step got slower by more than the
        margin), else None; and the ``considered`` record of the verdict."""
        trial = self.trial
        if trial is None:
            return None, []
        if all(r.rid != trial["rid"] for r in pool.training_replicas()):
            if all(r.rid != trial["rid"] for r in pool.joining()):
                self.trial = None  # rolled back or released meanwhile: no verdict
            return None, []
        trial["measured"] += 1
        if trial["measured"] < 2:
            return None, []
        self.trial = None
        after = max(t_train, t_roll)
        worse = after > trial["before_s"] * (1 + self.margin)
        reason = (f"replica {trial['rid']} lent at step {trial['step']}: the step's slower side took "
                  f"{after:.3g} s against {trial['before_s']:.3g} s before the lend")
        note = {"step": step, "kind": "hybrid_trial", "apply": worse, "reason": reason,
                "replica": trial["rid"], "before_s": trial["before_s"], "after_s": after}
        if not worse:
            return None, [note]
        self.floor = trial["ratio"] * (1 + self.margin)
        return f"lending made the step slower ({reason})", [note]

    def state_dict(self) -> dict:
        """The trial and the floor as plain data."""
        return {"trial": None if self.trial is None else dict(self.trial), "floor": self.floor}

    def load_state_dict(self, state: dict) -> None:
        self.trial = None if state["trial"] is None else dict(state["trial"])
        self.floor = state["floor"]
