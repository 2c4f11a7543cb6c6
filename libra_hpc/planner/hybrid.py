"""Elastic hybrid pool: GPUs that move between rollout and training without stopping either.

Pure state machine (no torch, no MPI, no wall clock: every input carries ``now`` in
seconds from any monotonic origin). Each input returns the list of :class:`PoolEvent` it
caused; the runtime turns transitions into layout changes and writes every event to
``events.jsonl``.

A :class:`HybridReplica` is one whole training DP replica worth of slots (TP×PP of them).
It joins training as a unit and leaves it as a unit::

          borrow             progress                progress                  progress
 rollout ────────▶ requested ────────▶ fetching_state ────────▶ zero_grad_sync ────────▶ active
  ▲  ▲                 │                    │                         │                   │  │
  │  └─────────────────┴────────────────────┴─────────────────────────┘                   │  │
  │    rollback of the whole replica: timeout, cancel, member failure,                    │  │
  │    release while none is active                                                       │  │
  ├────────────────────────────────── member failure ─────────────────────────────────────┘  │
  │                                                                               release    │
  └─────────── progress (drained), timeout, member failure ─────────── releasing ◀───────────┘

- ``rollout``: lent to rollout (the default); counts toward :meth:`HybridPool.rollout_gpus`.
- ``requested``: taken off the rollout side; its rollout instances drain their leases.
- ``fetching_state``: receiving weights and optimizer shards from the core training group.
- ``zero_grad_sync``: takes part in one step with zero gradients so that its state and the
  DP all-reduce line up with the core group before it contributes real gradients.
- ``active``: a training DP replica; counts toward :meth:`HybridPool.training_gpus`.
- ``releasing``: finishing its last training step before going back to rollout (a DP
  member cannot leave in the middle of a gradient all-reduce).

The core training group is never part of the pool and no transition waits for it: joining
runs beside the core group's steps (the runtime reports each finished phase through
:meth:`HybridPool.progress`), so the pool can never block training, and
``training_gpus() == training_core_gpus + active replicas × replica_size`` always holds.
Joining and releasing replicas count on neither side.

Rules:
- ``borrow`` takes the lowest-id replica on the rollout side, only if the rollout side keeps
  at least ``min_rollout_gpus`` afterwards.
- ``release`` gives back the most recently activated active replica (LIFO: the longest
  serving ones have the best-warmed state); with none active it rolls back the most recently
  requested joining replica (it has not contributed yet, so that is the cheapest give-back).
- A timeout, a cancel, or any member's failure in a joining phase rolls the whole replica
  back to ``rollout``; a member failure while active or releasing does the same. Timeouts
  are applied by :meth:`HybridPool.tick` and at the start of every other input, so outcomes
  do not depend on how often ``tick`` is called.

Illegal inputs, one policy:
- an input that is legal in *some* state but not the current one (borrow with nothing to
  lend or below the minimum, release with nothing lent, progress/cancel/fail that races a
  rollback) returns a single *refusal* event (``refused=True``, ``from_state == to_state``)
  with the reason, and changes nothing — such races are normal in a distributed runtime;
- an input that can never be right (unknown replica id, a slot that is not a member of the
  replica, time going backwards, a malformed pool) raises :class:`HybridPoolError`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Literal

from libra_hpc.cluster.layout import Layout, Slot, lend_hybrid_to_training

State = Literal["rollout", "requested", "fetching_state", "zero_grad_sync", "active", "releasing"]
STATES: tuple[State, ...] = ("rollout", "requested", "fetching_state", "zero_grad_sync", "active", "releasing")
JOINING: tuple[State, ...] = ("requested", "fetching_state", "zero_grad_sync")
NEXT_PHASE: dict[State, State] = {
    "requested": "fetching_state",
    "fetching_state": "zero_grad_sync",
    "zero_grad_sync": "active",
    "releasing": "rollout",
}


class HybridPoolError(ValueError):
    """An input that can never be right (unknown replica, non-member slot, time backwards)."""


@dataclass(frozen=True)
class PhaseTimeouts:
    """Seconds a replica may stay in each transient phase before it is rolled back to rollout."""

    requested: float = 60.0
    """Rollout instances of the replica drain their leased work."""
    fetching_state: float = 300.0
    """Weights and optimizer shards arrive from the core group."""
    zero_grad_sync: float = 120.0
    """One zero-gradient step aligns the replica with the core group's DP all-reduce."""
    releasing: float = 300.0
    """The replica finishes its last training step (forced back to rollout after this)."""

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if not (value > 0 and math.isfinite(value)):
                raise HybridPoolError(f"PhaseTimeouts.{name}: {value!r} s, must be a positive finite number")

    def of(self, state: State) -> float | None:
        return getattr(self, state) if state in NEXT_PHASE else None


@dataclass(frozen=True)
class HybridReplica:
    """One DP replica of hybrid slots (TP×PP of them, Megatron order) and its pool state.

    ``since`` is the time it entered ``state``; ``activated_at`` the time it last became
    active (release order), ``requested_at`` the time of its last borrow.
    """

    rid: int
    slots: tuple[Slot, ...]
    state: State = "rollout"
    since: float = 0.0
    requested_at: float | None = None
    activated_at: float | None = None

    @property
    def size(self) -> int:
        return len(self.slots)


@dataclass(frozen=True)
class PoolEvent:
    """One transition (or refusal) of the pool; ``replica`` is None for a refusal that
    concerns no particular replica (e.g. nothing to borrow)."""

    time: float
    replica: int | None
    from_state: State | None
    to_state: State | None
    reason: str
    refused: bool = False

    @property
    def changed(self) -> bool:
        return not self.refused and self.from_state != self.to_state

    def to_dict(self) -> dict:
        """Plain data for events.jsonl."""
        return {"kind": "hybrid_refused" if self.refused else "hybrid_transition", **asdict(self)}


class HybridPool:
    """The hybrid replicas, their states and the side sizes (see the module docstring).

    ``rollout_core_gpus``: rollout GPUs outside the pool; ``training_core_gpus``: the core
    training group's GPUs; ``min_rollout_gpus``: the rollout side (core + hybrid replicas in
    ``rollout``) never drops below this; ``now``: the clock's start (seconds).
    """

    def __init__(self, replicas: Sequence[HybridReplica], *, min_rollout_gpus: int, rollout_core_gpus: int,
                 training_core_gpus: int = 0, timeouts: PhaseTimeouts | None = None, now: float = 0.0) -> None:
        reps = list(replicas)
        ids = [r.rid for r in reps]
        if len(set(ids)) != len(ids):
            raise HybridPoolError(f"HybridPool: duplicate replica ids in {ids}")
        sizes = {r.size for r in reps}
        if len(sizes) > 1:
            raise HybridPoolError(f"HybridPool: replicas must all be one DP replica (TP×PP slots); sizes {sorted(sizes)}")
        if 0 in sizes:
            raise HybridPoolError("HybridPool: a replica has no slots")
        seen: dict[Slot, int] = {}
        for r in reps:
            for s in r.slots:
                if s in seen:
                    raise HybridPoolError(f"HybridPool: slot {s} is in replicas {seen[s]} and {r.rid}")
                seen[s] = r.rid
            if r.state != "rollout":
                raise HybridPoolError(f"HybridPool: replica {r.rid} starts in {r.state!r}; every replica starts in 'rollout'")
        for name, value in (("min_rollout_gpus", min_rollout_gpus), ("rollout_core_gpus", rollout_core_gpus),
                            ("training_core_gpus", training_core_gpus)):
            if value < 0:
                raise HybridPoolError(f"HybridPool.{name}: {value}, must be >= 0")
        if not math.isfinite(now):
            raise HybridPoolError(f"HybridPool.now: {now!r} is not finite")
        self.min_rollout_gpus = min_rollout_gpus
        self.rollout_core_gpus = rollout_core_gpus
        self.training_core_gpus = training_core_gpus
        self.timeouts = timeouts or PhaseTimeouts()
        self.now = now
        self._by_id = {r.rid: replace(r, since=now) for r in sorted(reps, key=lambda r: r.rid)}
        if self.rollout_gpus() < min_rollout_gpus:
            raise HybridPoolError(
                f"HybridPool: min_rollout_gpus={min_rollout_gpus} but the rollout side has only "
                f"{self.rollout_gpus()} GPUs ({rollout_core_gpus} core + pool)")

    def __repr__(self) -> str:
        states = ", ".join(f"{r.rid}:{r.state}" for r in self._by_id.values())
        return f"HybridPool(t={self.now}, rollout={self.rollout_gpus()}, training={self.training_gpus()}, [{states}])"

    @classmethod
    def restored(cls, replicas: Sequence[HybridReplica], **kwargs) -> HybridPool:
        """A pool whose replicas are in recorded states (a checkpoint's): built as a new
        pool (every replica on the rollout side, the constructor's invariants checked),
        then each replica put back in its state and times. ``kwargs``: the constructor's."""
        pool = cls([HybridReplica(r.rid, r.slots) for r in replicas], **kwargs)
        pool._by_id = {r.rid: r for r in sorted(replicas, key=lambda r: r.rid)}
        return pool

    @classmethod
    def from_layout(cls, layout: Layout, *, min_rollout_gpus: int, timeouts: PhaseTimeouts | None = None,
                    now: float = 0.0) -> HybridPool:
        """The replicas are the DP replicas :func:`lend_hybrid_to_training` makes of the
        layout's hybrid slots (one source of truth for their Megatron order); every replica
        must be a union of whole rollout instances, so lending one stops no other."""
        train = layout.training
        if train is None:
            raise HybridPoolError(f"layout v{layout.version} has no training group to lend replicas to")
        size = train.tp * train.pp
        hybrid_groups = [g for g in layout.rollout_instances if g.hybrid]
        lent = sorted(s for g in hybrid_groups for s in g.slots)
        if len(lent) % size:
            raise HybridPoolError(f"layout v{layout.version}: {len(lent)} hybrid rollout slots do not form whole replicas of TP×PP = {size}")
        grown = lend_hybrid_to_training(layout, reason="hybrid replica shapes").training
        replicas = [HybridReplica(r, grown.replica_slots(train.dp + r)) for r in range(grown.dp - train.dp)]
        for g in hybrid_groups:
            owners = {r.rid for r in replicas if set(g.slots) & set(r.slots)}
            if len(owners) > 1:
                raise HybridPoolError(f"layout v{layout.version}: {g.name} {[str(s) for s in g.slots]} straddles hybrid replicas {sorted(owners)}")
        core_rollout = sum(len(g.slots) for g in layout.rollout_instances if not g.hybrid)
        return cls(replicas, min_rollout_gpus=min_rollout_gpus, rollout_core_gpus=core_rollout,
                   training_core_gpus=len(train.slots), timeouts=timeouts or PhaseTimeouts(), now=now)

    # ------------------------------------------------------------------ queries
    @property
    def replica_size(self) -> int:
        return next(iter(self._by_id.values())).size if self._by_id else 0

    def replica(self, rid: int) -> HybridReplica:
        try:
            return self._by_id[rid]
        except KeyError:
            raise HybridPoolError(f"unknown hybrid replica {rid!r}; the pool has {sorted(self._by_id)}") from None

    def all_replicas(self) -> list[HybridReplica]:
        return list(self._by_id.values())

    def in_state(self, *states: State) -> list[HybridReplica]:
        return [r for r in self._by_id.values() if r.state in states]

    def training_replicas(self) -> list[HybridReplica]:
        """Active replicas, in activation order."""
        return sorted(self.in_state("active"), key=lambda r: (r.activated_at, r.rid))

    def joining(self) -> list[HybridReplica]:
        return self.in_state(*JOINING)

    def rollout_gpus(self) -> int:
        return self.rollout_core_gpus + sum(r.size for r in self.in_state("rollout"))

    def training_gpus(self) -> int:
        return self.training_core_gpus + sum(r.size for r in self.in_state("active"))

    def deadline(self, rid: int) -> float | None:
        r = self.replica(rid)
        limit = self.timeouts.of(r.state)
        return None if limit is None else r.since + limit

    def snapshot(self) -> dict:
        """Plain data for events.jsonl."""
        return {
            "time": self.now,
            "replica_size": self.replica_size,
            "min_rollout_gpus": self.min_rollout_gpus,
            "rollout_gpus": self.rollout_gpus(),
            "training_gpus": self.training_gpus(),
            "replicas": [{"id": r.rid, "state": r.state, "since": r.since, "deadline": self.deadline(r.rid),
                          "slots": [str(s) for s in r.slots]} for r in self._by_id.values()],
        }

    # ------------------------------------------------------------------ inputs
    def tick(self, now: float) -> list[PoolEvent]:
        """Roll back every replica whose phase has outlived its timeout."""
        self._advance(now)
        expired = sorted((d, rid) for rid in self._by_id if (d := self.deadline(rid)) is not None and now >= d)
        events = []
        for deadline, rid in expired:
            r = self._by_id[rid]
            why = (f"timeout: {r.state} took longer than {self.timeouts.of(r.state)} s "
                   f"(entered at t={r.since}, deadline t={deadline})")
            events.append(self._move(rid, "rollout", now, why))
        return events

    def borrow(self, now: float, reason: str) -> list[PoolEvent]:
        """Lend a replica to training: request the lowest-id rollout-side replica."""
        events = self.tick(now)
        candidates = self.in_state("rollout")
        if not candidates:
            return events + [self._refuse(None, now, f"borrow refused ({reason}): no hybrid replica is on the rollout "
                                          f"side ({len(self.joining())} joining, {len(self.in_state('active'))} active, "
                                          f"{len(self.in_state('releasing'))} releasing)")]
        r = candidates[0]
        left = self.rollout_gpus() - r.size
        if left < self.min_rollout_gpus:
            return events + [self._refuse(r.rid, now, f"borrow refused ({reason}): lending replica {r.rid} would leave "
                                          f"{left} rollout GPUs < min_rollout_gpus={self.min_rollout_gpus}")]
        return events + [self._move(r.rid, "requested", now, f"borrow: {reason}")]

    def release(self, now: float, reason: str) -> list[PoolEvent]:
        """Rollout is the bottleneck: the last activated replica starts releasing; with none
        active, the last requested joining replica rolls back. The core group is never touched."""
        events = self.tick(now)
        active = self.training_replicas()
        if active:
            return events + [self._move(active[-1].rid, "releasing", now, f"release: {reason}")]
        joining = sorted(self.joining(), key=lambda r: (r.requested_at, r.rid))
        if joining:
            return events + [self._move(joining[-1].rid, "rollout", now, f"release (join abandoned): {reason}")]
        return events + [self._refuse(None, now, f"release refused ({reason}): no hybrid replica is lent to training; "
                                      f"the core group ({self.training_core_gpus} GPUs) is never released")]

    def progress(self, rid: int, now: float) -> list[PoolEvent]:
        """The runtime reports that replica ``rid`` finished its current phase."""
        self.replica(rid)
        events = self.tick(now)
        r = self._by_id[rid]
        if r.state not in NEXT_PHASE:
            return events + [self._refuse(rid, now, f"progress refused: replica {rid} is {r.state}, not joining or releasing")]
        nxt = NEXT_PHASE[r.state]
        return events + [self._move(rid, nxt, now, f"progress: {r.state} finished")]

    def cancel(self, rid: int, now: float, reason: str) -> list[PoolEvent]:
        """Abort a join: the replica goes back to rollout."""
        self.replica(rid)
        events = self.tick(now)
        r = self._by_id[rid]
        if r.state not in JOINING:
            return events + [self._refuse(rid, now, f"cancel refused ({reason}): replica {rid} is {r.state}, not joining"
                                          + ("; use release()" if r.state == "active" else ""))]
        return events + [self._move(rid, "rollout", now, f"cancel in {r.state}: {reason}")]

    def fail(self, rid: int, member: Slot, now: float, reason: str) -> list[PoolEvent]:
        """A member slot of replica ``rid`` failed: the whole replica rolls back to rollout
        (whatever the phase; on the rollout side the queue's leases handle it instead)."""
        r = self.replica(rid)
        if member not in r.slots:
            raise HybridPoolError(f"slot {member} is not a member of hybrid replica {rid} ({[str(s) for s in r.slots]})")
        events = self.tick(now)
        r = self._by_id[rid]
        if r.state == "rollout":
            return events + [self._refuse(rid, now, f"fail on {member} ({reason}): replica {rid} is already on the "
                                          "rollout side; the rollout queue's leases handle it")]
        return events + [self._move(rid, "rollout", now, f"member {member} failed in {r.state}: {reason}")]

    def decide(self, now: float, t_train: float, t_rollout: float, margin: float = 0.1) -> list[PoolEvent]:
        """Policy: borrow when training is slower than rollout by more than ``margin``
        (a fraction: ``t_train > t_rollout × (1 + margin)``), release when rollout is slower
        by the same margin, otherwise hold (no events besides expired timeouts). While a
        replica is joining or releasing, a training bottleneck holds too: its effect is not
        measured yet, and borrowing again would overshoot. (Not the control loop's policy,
        which prices each move by the cost models: ``HybridLending.decide``; the pool's
        own tests drive its state machine with this one.)"""
        if margin < 0 or t_train < 0 or t_rollout < 0:
            raise HybridPoolError(f"decide: margin={margin}, t_train={t_train}, t_rollout={t_rollout} must be >= 0")
        if t_train > t_rollout * (1 + margin):
            events = self.tick(now)
            if self.joining() or self.in_state("releasing"):
                return events
            return events + self.borrow(now, f"training is the bottleneck: t_train={t_train:.3g} s > "
                                             f"t_rollout={t_rollout:.3g} s × (1 + {margin})")
        if t_rollout > t_train * (1 + margin):
            events = self.tick(now)
            if self.in_state("releasing"):  # its effect is not measured yet: do not overshoot
                return events
            return events + self.release(now, f"rollout is the bottleneck: t_rollout={t_rollout:.3g} s > "
                                              f"t_train={t_train:.3g} s × (1 + {margin})")
        return self.tick(now)

    # ------------------------------------------------------------------ internals
    def _advance(self, now: float) -> None:
        if not math.isfinite(now):
            raise HybridPoolError(f"time {now!r} is not finite")
        if now < self.now:
            raise HybridPoolError(f"time went backwards: now={now} s after t={self.now} s; pass a monotonic clock")
        self.now = now

    def _move(self, rid: int, to: State, now: float, reason: str) -> PoolEvent:
        """The only place a state changes: one event per change."""
        r = self._by_id[rid]
        updates: dict = {"state": to, "since": now}
        if to == "requested":
            updates["requested_at"] = now
        if to == "active":
            updates["activated_at"] = now
        self._by_id[rid] = replace(r, **updates)
        return PoolEvent(now, rid, r.state, to, reason)

    def _refuse(self, rid: int | None, now: float, reason: str) -> PoolEvent:
        state = None if rid is None else self._by_id[rid].state
        return PoolEvent(now, rid, state, state, reason, refused=True)


def replay_states(events: Iterable[PoolEvent], initial: dict[int, State]) -> dict[int, State]:
    """The replica states a stream of events leads to (for checking logs and tests)."""
    states = dict(initial)
    for e in events:
        if e.changed:
            if states.get(e.replica) != e.from_state:
                raise HybridPoolError(f"event at t={e.time}: replica {e.replica} was {states.get(e.replica)}, event says {e.from_state}")
            states[e.replica] = e.to_state
    return states
