"""The elastic hybrid pool's lending policy (pure): which way its gate points, what moving
a replica is predicted to save, and the lend on trial (:class:`HybridLending`).

The cost models price a replica lent to training as 1/DP faster training and 1/GPUs
slower rollout. Where the rollout's tail binds (its makespan set by a few long
trajectories, and streamed training overlapping it), taking GPUs from it can cost far
more: the pool then lent and released on alternate checks. So a lend is on trial: once the
replica has trained through two measured rollouts, a step (the slower of training and the
rollout side) longer than before the lend by more than ``hybrid_margin`` sends it back,
and later borrows need a training/rollout ratio above the one it was lent at by that
margin. Units: seconds, GPUs.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from libra_hpc.planner.hybrid import HybridPool, PoolEvent
from libra_hpc.planner.pipeline import moved_times


def hybrid_direction(t_train: float, t_roll: float, margin: float) -> str | None:
    """Which way the pool's gate points: ``borrow`` (training slower than rollout by
    more than ``margin``), ``release`` (the reverse) or None."""
    return "borrow" if t_train > t_roll * (1 + margin) else "release" if t_roll > t_train * (1 + margin) else None


def hybrid_gain(direction: str, t_train: float, t_roll: float, pool: HybridPool | None, dp: int,
                plan_rollout_gpus: int) -> float | None:
    """Seconds per step that lending one more replica (``borrow``) or taking one back
    (``release``) is predicted to save: training time scales with 1/DP, rollout time
    with 1/rollout GPUs, the step is the slower of the two. ``dp``: the running training
    DP (lent replicas included); ``plan_rollout_gpus``: the plan's rollout GPUs (lent
    replicas included). None when there is no replica to move that way."""
    if pool is None:
        return None
    lent = len(pool.training_replicas())
    size = pool.replica_size
    rollout = plan_rollout_gpus - lent * size
    now_s = max(t_train, t_roll)
    if direction == "borrow" and pool.in_state("rollout") and rollout > size:
        return now_s - max(moved_times(t_train, t_roll, dp, rollout, size, 1))
    if direction == "release" and lent and dp > 1:
        return now_s - max(moved_times(t_train, t_roll, dp, rollout, size, -1))
    return None


class HybridLending:
    """The pool's gate with the lend on trial (see the module docstring). State: the
    replica on trial and the balance a borrow must now exceed; the pool it decides for
    is passed in (the control loop owns it)."""

    def __init__(self, margin: float):
        self.margin = margin
        """``hybrid_margin``: borrow when T_train > T_rollout × (1 + margin), release in reverse."""
        self.trial: dict | None = None
        """The last replica lent to training, on trial until two rollouts with it active are
        measured: ``rid``, ``step``, ``before_s`` (the step's slower side before the lend),
        ``ratio`` (training/rollout then), ``measured``."""
        self.floor: float | None = None
        """After a lend that made the step slower: the training/rollout ratio a borrow must
        now exceed."""

    def direction(self, t_train: float, t_roll: float) -> str | None:
        return hybrid_direction(t_train, t_roll, self.margin)

    def held(self, t_train: float, t_roll: float) -> bool:
        """True when a lend at this training/rollout balance is held: one at a balance no
        heavier on training made the step slower."""
        return self.floor is not None and t_train <= t_roll * self.floor

    def decide(self, pool: HybridPool, step: int, now: float, t_train: float, t_roll: float,
               gain: Callable[[str], float | None],
               can_grow: Callable[[], bool]) -> tuple[list[PoolEvent] | None, list[dict]]:
        """Borrow or release a hybrid replica (the pool's events); None (nothing considered)
        when training is the bottleneck but one more replica would not fit its memory
        (``can_grow``). A move that ``gain`` (:func:`hybrid_gain` for the running plan)
        predicts to shorten the step by less than the margin's share of it holds (the
        margin alone would lend a replica whose rollout GPUs are worth more than its
        training, or switch, with the pause that costs, for a sliver). A lend is judged by
        what it did (:meth:`_judge`). Also returns the ``considered`` records of the check."""
        release, notes = self._judge(pool, step, t_train, t_roll)
        if release is not None:
            return pool.release(now, release), notes
        direction = self.direction(t_train, t_roll)
        if direction == "borrow" and not can_grow():
            return None, notes
        if direction == "borrow" and self.held(t_train, t_roll):
            return pool.tick(now), notes  # the balance at which lending made the step slower
        predicted = None if direction is None else gain(direction)
        if predicted is not None and predicted <= self.margin * max(t_train, t_roll):  # None: nothing to move
            return pool.tick(now), notes
        events = pool.decide(now, t_train, t_roll, self.margin)
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
