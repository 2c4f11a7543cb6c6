"""A rollout instance: continuous batching, one decode step at a time, without one event per step.

The instance runs a batch of ``b`` sequences; every decode step emits one token for each of
them and lasts ``step_s(b, C)``, the planner's cost model at the batch and the KV tokens
``C`` it holds. The step time is constant while the batch does not change, so the instance
jumps from one change to the next: to the step at which the next sequence finishes its
turn (each sequence knows the instance step count it finishes at), to the step boundary
after a new turn arrives (arrivals join at step boundaries, as in vLLM), or after
``resync_steps`` steps (the KV context grows by ``b`` tokens per step and the step time is
re-priced). This is exact for step-by-step batching with a step time fixed between
re-pricings; the only approximation is that context growth inside one segment of at most
``resync_steps`` steps is priced at the segment's start.

Joining costs a prefill stall: the instance computes, in one batched prefill, the new
tokens of every admitted sequence (attention per sequence: the stall of k sequences joining
together is the sum of their compute, not that of one sequence of their total length) (the whole context for a first turn, a migrated turn or a turn that ran
elsewhere before; only the tool output otherwise, the prefix being cached) and decodes
nothing meanwhile. Admission: at most ``seats`` sequences, and the KV tokens they reserve
(their context plus the whole turn they will generate) fit in the KV capacity — no
preemption; a sequence alone always runs. Leased turns that do not fit wait in the
instance's local queue, in order.

Units: seconds, tokens. Pure: the instance reports finished turns to whoever drives it.
"""

from __future__ import annotations

import heapq
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from libra_hpc.planner.costs import RolloutCost

log = logging.getLogger(__name__)


class StepModel(Protocol):
    """How long the engine takes: decode steps, prefills, and how many KV tokens fit."""

    kv_capacity: int

    def step_s(self, batch: int, context_tokens: float) -> float:
        """Seconds of one decode step of ``batch`` sequences holding ``context_tokens``."""

    def prefill_s(self, tokens: int) -> float:
        """Seconds to prefill ``tokens`` new tokens of one sequence."""

    def prefill_batch_s(self, tokens: list[int]) -> float:
        """Seconds to prefill several sequences at once, ``tokens[i]`` new tokens each
        (attention is per sequence: k sequences of s tokens are not one of k·s)."""


class CostStepModel:
    """The planner's roofline cost model of one instance shape (libra_hpc.planner.costs)."""

    QUANTUM = 256
    """KV tokens per memo cell: the context is rounded to this (a relative error below
    1e-3 on a step at any realistic context) so step times are computed once per cell."""

    def __init__(self, cost: RolloutCost):
        if cost.infeasible:
            raise ValueError(f"rollout instance cannot run: {cost.infeasible}")
        self.cost = cost
        self.kv_capacity = cost.kv_capacity_tokens
        self._steps: dict[tuple[int, int], float] = {}

    def step_s(self, batch: int, context_tokens: float) -> float:
        key = (batch, int(context_tokens) // self.QUANTUM)
        value = self._steps.get(key)
        if value is None:
            value = self._steps[key] = self.cost.decode_step_s(batch, key[1] * self.QUANTUM + self.QUANTUM / 2)
        return value

    def prefill_s(self, tokens: int) -> float:
        return self.cost.prefill_s(tokens) if tokens else 0.0

    def prefill_batch_s(self, tokens: list[int]) -> float:
        """One batched prefill: the cost model's components summed over the sequences
        (matmul and attention FLOPs, all-reduce bytes), the weights read and the
        collectives' latency paid once."""
        parts = [self.cost.prefill_components(n) for n in tokens if n]
        if not parts:
            return 0.0
        total = dict(parts[0])
        for c in parts[1:]:
            total["compute_s"] += c["compute_s"]
            total["comm_s"] += c["comm_s"]
        return self.cost.cal.time("prefill", total)


@dataclass
class ConstantStepModel:
    """A fixed step time and per-token prefill time (hand-computable tests)."""

    step: float
    prefill_per_token: float = 0.0
    kv_capacity: int = 1 << 40

    def step_s(self, batch: int, context_tokens: float) -> float:
        return self.step

    def prefill_s(self, tokens: int) -> float:
        return tokens * self.prefill_per_token

    def prefill_batch_s(self, tokens: list[int]) -> float:
        return sum(tokens) * self.prefill_per_token


@dataclass(eq=False)
class Run:
    """One turn of one trajectory on an instance."""

    lease: int
    tid: str
    context: int  # KV tokens before the turn (prompt, earlier turns, tool outputs)
    tokens: int  # tokens this turn generates
    prefill: int  # tokens to prefill on joining
    done_at: int = 0  # the instance's step count at which the turn is complete
    payload: object = field(default=None, repr=False)  # the driver's own state


class RolloutInstance:
    """One vLLM-like instance of TP ``tp`` (module docstring). Times only grow.

    Driver protocol: :meth:`offer` hands leased turns to the instance; :meth:`wake_plan`
    says when it next needs to act (time, step target); :meth:`wake` (at that time)
    returns the turns finished then. ``version`` changes whenever the plan changes, so an
    outdated wake-up can be told apart and ignored."""

    def __init__(self, iid: int, tp: int, model: StepModel, *, seats: int, resync_steps: int = 256):
        if seats < 1 or resync_steps < 1:
            raise ValueError(f"instance {iid}: seats={seats} and resync_steps={resync_steps} must be >= 1")
        self.iid, self.tp, self.model = iid, tp, model
        self.seats, self.resync = seats, resync_steps
        self.running: list[tuple[int, int, Run]] = []  # heap of (done_at, seq, run)
        self.waiting: deque[Run] = deque()
        self.steps = 0  # decode steps completed
        self.t_sync = 0.0  # time at which `steps` were complete (and any prefill stall ended)
        self.dt = 0.0  # current step time
        self.context = 0  # KV tokens of the running sequences at t_sync
        self.reserved = 0  # KV tokens the running sequences reserve (context + their whole turn)
        self.version = 0
        self.wake_at: tuple[float, int] | None = None
        self._seq = 0
        self.busy_s = 0.0  # seconds with something running or prefilling
        self.tokens = 0  # tokens generated
        self.prefilled = 0  # tokens prefilled
        self.prefill_busy_s = 0.0  # seconds of busy_s spent prefilling

    @property
    def load(self) -> int:
        return len(self.running) + len(self.waiting)

    @property
    def free_seats(self) -> int:
        return self.seats - self.load

    # ------------------------------------------------------------------ driver API
    def offer(self, runs: list[Run], now: float) -> None:
        """Leased turns arrive at ``now``: they join at the next step boundary."""
        self.waiting.extend(runs)
        if not runs:
            return
        if not self.running and now >= self.t_sync:  # idle: join now
            self._sync_idle(now)
            self._plan_wake(now, self.steps)
            return
        boundary, target = self._boundary(now)
        if self.wake_at is None or boundary < self.wake_at[0]:
            self._plan_wake(boundary, target)

    def wake(self, now: float, target: int) -> list[Run]:
        """At a planned wake-up: advance to step ``target``, retire finished turns, admit
        waiting ones (prefill stall), re-price the step and plan the next wake-up."""
        self.wake_at = None
        self._advance(now, target)
        done = []
        while self.running and self.running[0][0] <= self.steps:
            _, _, run = heapq.heappop(self.running)
            self.context -= run.context + run.tokens
            self.reserved -= run.context + run.tokens
            done.append(run)
        self._admit(now)
        self._replan(now)
        return done

    # ---------------------------------------------------------------- internals
    def _sync_idle(self, now: float) -> None:
        self.t_sync = max(self.t_sync, now)

    def _boundary(self, now: float) -> tuple[float, int]:
        """The first step boundary at or after ``now`` and the step count there."""
        if now <= self.t_sync or not self.running:
            return max(now, self.t_sync), self.steps
        k = int((now - self.t_sync) / self.dt)
        t = self.t_sync + k * self.dt
        if t < now - 1e-12:
            k += 1
            t = self.t_sync + k * self.dt
        return t, self.steps + k

    def _advance(self, now: float, target: int) -> None:
        n = target - self.steps
        if n < 0:
            raise AssertionError(f"instance {self.iid}: wake-up for step {target} after step {self.steps}")
        if self.running:
            b = len(self.running)
            self.busy_s += now - self.t_sync if n else 0.0
            self.context += b * n
            self.tokens += b * n
        self.steps = target
        self.t_sync = max(self.t_sync, now)

    def _admit(self, now: float) -> None:
        stall: list[int] = []
        cap = self.model.kv_capacity
        while self.waiting and len(self.running) < self.seats:
            run = self.waiting[0]
            need = run.context + run.tokens
            if self.running and self.reserved + need > cap:
                break
            self.waiting.popleft()
            run.done_at = self.steps + run.tokens
            heapq.heappush(self.running, (run.done_at, self._seq, run))
            self._seq += 1
            self.context += run.context
            self.reserved += need
            if run.prefill:
                stall.append(run.prefill)
        if stall:
            seconds = self.model.prefill_batch_s(stall)
            self.prefilled += sum(stall)
            self.busy_s += seconds
            self.prefill_busy_s += seconds
            self.t_sync = now + seconds

    def _replan(self, now: float) -> None:
        if not self.running:
            self.dt = 0.0
            if self.waiting:  # nothing runs yet something waits: cannot happen (a sequence alone always runs)
                raise AssertionError(f"instance {self.iid}: {len(self.waiting)} turns wait on an empty batch")
            return
        b = len(self.running)
        self.dt = self.model.step_s(b, self.context)
        n = min(self.running[0][0] - self.steps, self.resync)
        self._plan_wake(self.t_sync + n * self.dt, self.steps + n)

    def _plan_wake(self, time: float, target: int) -> None:
        self.version += 1
        self.wake_at = (time, target)
