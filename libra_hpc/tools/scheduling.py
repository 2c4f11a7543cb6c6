"""Action-level scheduling of tool calls over elastic resource pools (pure, injected clock).

Every tool call is one :class:`Action` that needs one unit of one resource kind for its
duration. Two policies share one interface (``submit``, ``dispatch``, ``complete``,
``end_trajectory``, ``held_seconds``), chosen by name with :func:`make_scheduler`:

``tangram`` (ARL-Tangram's action-level orchestration). Any free unit of the resource runs
the waiting action with the smallest *virtual deadline* ``submitted_at + expected_s /
aging_rate``: shortest expected action first, with linear aging. Aging makes the order
static (priority ``expected_s - aging_rate * waited`` compares two actions the same way at
every instant), which gives the no-starvation bound: an action ``a`` can only be overtaken
by actions whose virtual deadline is below its own, and those were all submitted before
``a``'s deadline, so finitely many; once they are served ``a`` runs. ``aging_rate`` is in
expected seconds forgiven per second waited (large: FIFO; small: pure shortest-first).
Pools grow while eligible actions wait and shrink after ``idle_timeout_s``.

``dedicated`` (the baseline): a trajectory's first call on a *bound* resource kind (the
CPU sandbox, ``cpu``) binds a unit to the trajectory until :meth:`end_trajectory`; its calls
run only there (FIFO), and trajectories waiting for a unit are bound in arrival order. Held
time then includes the trajectory's LLM turns. Other kinds (a reward-model endpoint) are
shared FIFO, as such services are deployed: binding two kinds per trajectory would
deadlock (A holds the sandbox and waits for the endpoint, B the reverse; the property test
found this).

Both honour per-resource capacity (``max_units``) and per-tool quotas (at most ``n``
concurrent actions of that tool, e.g. an API's rate). Expected durations come from the
caller or from a per-tool moving average of observed durations.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from libra_hpc.tools.pool import ElasticPool, ResourceSpec


@dataclass(frozen=True)
class Action:
    """One tool call. ``aid`` unique; times in seconds of the scheduler's clock."""

    aid: str
    trajectory: str
    tool: str
    resource: str
    expected_s: float
    submitted_at: float


@dataclass(frozen=True)
class Dispatch:
    """Run ``action`` on unit ``unit`` of its resource, from ``started_at``."""

    action: Action
    unit: int
    started_at: float


class DurationEstimator:
    """Expected duration per tool: exponential moving average of observed durations
    (weight ``alpha`` on the newest), starting from ``prior_s`` (per tool) or ``default_s``."""

    def __init__(self, prior_s: Mapping[str, float] | None = None, default_s: float = 1.0, alpha: float = 0.2):
        if not 0 < alpha <= 1 or default_s < 0:
            raise ValueError(f"estimator: need 0 < alpha <= 1 and default_s >= 0, got {alpha}, {default_s}")
        self.means = dict(prior_s or {})
        self.default_s = default_s
        self.alpha = alpha

    def expected(self, tool: str) -> float:
        return self.means.get(tool, self.default_s)

    def observe(self, tool: str, duration_s: float) -> None:
        old = self.means.get(tool)
        self.means[tool] = duration_s if old is None else old + self.alpha * (duration_s - old)


class ActionScheduler:
    """Shared bookkeeping of both policies: pools, quotas, running actions, accounting."""

    name = "base"

    def __init__(self, resources: list[ResourceSpec], quotas: Mapping[str, int] | None = None,
                 estimator: DurationEstimator | None = None, now: float = 0.0):
        if not resources:
            raise ValueError("scheduler: at least one resource kind is needed")
        self.pools = {spec.name: ElasticPool(spec, now) for spec in resources}
        if len(self.pools) != len(resources):
            raise ValueError(f"scheduler: duplicate resource names in {[r.name for r in resources]}")
        self.quotas = dict(quotas or {})
        for tool, limit in self.quotas.items():
            if limit < 1:
                raise ValueError(f"tools.quotas.{tool}: must be >= 1 concurrent actions, got {limit}")
        self.estimator = estimator or DurationEstimator()
        self.running: dict[str, tuple[Dispatch, int]] = {}  # aid -> (dispatch, unit index)
        self.running_per_tool: dict[str, int] = {}
        self.known: set[str] = set()  # ids queued or running (completed ones are forgotten: bounded memory)
        self._ids = itertools.count()
        self.on_retire: Callable[[str, int], None] | None = None
        """Called with (resource, unit) for every unit the pools retire (a runner whose
        units hold something, e.g. a Slurm allocation, gives it back)."""

    # ---------------------------------------------------------------- interface
    def new_action(self, trajectory: str, tool: str, resource: str, now: float,
                   expected_s: float | None = None) -> Action:
        """Build and submit an action (expected duration from the estimator when None)."""
        expected = self.estimator.expected(tool) if expected_s is None else expected_s
        action = Action(f"a{next(self._ids)}", trajectory, tool, resource, expected, now)
        self.submit(action)
        return action

    def submit(self, action: Action) -> None:
        if action.resource not in self.pools:
            raise ValueError(f"action {action.aid} (tool {action.tool!r}) needs resource {action.resource!r}; "
                             f"configured resources are {sorted(self.pools)}")
        if action.aid in self.known:
            raise ValueError(f"action id {action.aid!r} is already queued or running")
        if action.expected_s < 0:
            raise ValueError(f"action {action.aid}: expected_s must be >= 0, got {action.expected_s}")
        self.known.add(action.aid)
        self._enqueue(action)

    def dispatch(self, now: float) -> list[Dispatch]:
        """Start every action that may start at ``now``; marks their units busy."""
        for name, pool in self.pools.items():
            for unit in pool.retire_idle(now):
                if self.on_retire is not None:
                    self.on_retire(name, unit)
        started = []
        for name, pool in self.pools.items():
            started += self._dispatch_resource(name, pool, now)
        return started

    def complete(self, aid: str, now: float, observe: bool = True) -> Action:
        """Mark a running action done at ``now`` (exactly once) and free its unit.
        ``observe=False``: the action did not run (cancelled); its duration is not learnt."""
        if aid not in self.running:
            raise KeyError(f"action {aid!r} is not running (completed twice, or never dispatched)")
        dispatch, index = self.running.pop(aid)
        self.known.discard(aid)
        action = dispatch.action
        unit = self.pools[action.resource].units[index]
        unit.busy, unit.idle_since = None, now
        self.running_per_tool[action.tool] -= 1
        if observe:
            self.estimator.observe(action.tool, now - dispatch.started_at)
        return action

    def end_trajectory(self, trajectory: str, now: float) -> None:
        """The trajectory will submit no more actions (the dedicated policy releases its unit)."""

    def quarantine(self, resource: str, index: int) -> None:
        """Take a (free) unit out of service for good; see ElasticPool.quarantine."""
        self.pools[resource].quarantine(index)

    def drop_queued(self, resource: str) -> list[Action]:
        """Remove every queued (not running) action of ``resource`` and return them, in no
        particular order (the resource cannot run anything: their callers get the error)."""
        dropped = self._drop_queued(resource)
        for action in dropped:
            self.known.discard(action.aid)
        return dropped

    def held_seconds(self, now: float) -> float:
        return sum(pool.held_seconds(now) for pool in self.pools.values())

    def next_wakeup(self, now: float) -> float | None:
        """When a starting unit becomes ready (dispatch may start something then)."""
        times = [t for pool in self.pools.values() if (t := pool.next_ready(now)) is not None]
        return min(times) if times else None

    def next_retirement(self, now: float) -> float | None:
        """When an idle unit is next due to retire (None: none can shrink now)."""
        times = [t for pool in self.pools.values() if (t := pool.next_retirement(now)) is not None]
        return min(times) if times else None

    def queued(self) -> int:
        raise NotImplementedError

    # ---------------------------------------------------------------- helpers
    def _quota_ok(self, tool: str) -> bool:
        limit = self.quotas.get(tool)
        return limit is None or self.running_per_tool.get(tool, 0) < limit

    def _start(self, action: Action, unit, now: float) -> Dispatch:
        unit.busy = action.aid
        dispatch = Dispatch(action, unit.index, now)
        self.running[action.aid] = (dispatch, unit.index)
        self.running_per_tool[action.tool] = self.running_per_tool.get(action.tool, 0) + 1
        return dispatch

    def _enqueue(self, action: Action) -> None:
        raise NotImplementedError

    def _dispatch_resource(self, name: str, pool: ElasticPool, now: float) -> list[Dispatch]:
        raise NotImplementedError

    def _drop_queued(self, resource: str) -> list[Action]:
        raise NotImplementedError


class TangramScheduler(ActionScheduler):
    """Action-level sharing, shortest virtual deadline first (module docstring)."""

    name = "tangram"

    def __init__(self, resources, quotas=None, estimator=None, now: float = 0.0, aging_rate: float = 1.0):
        super().__init__(resources, quotas, estimator, now)
        if aging_rate <= 0:
            raise ValueError(f"tools.aging_rate must be > 0 (0 would allow starvation), got {aging_rate}")
        self.aging_rate = aging_rate
        self.queues: dict[str, list] = {name: [] for name in self.pools}
        self._seq = itertools.count()

    def deadline(self, action: Action) -> float:
        """The static priority key: smaller runs first."""
        return action.submitted_at + action.expected_s / self.aging_rate

    def queued(self) -> int:
        return sum(len(q) for q in self.queues.values())

    def _enqueue(self, action: Action) -> None:
        heapq.heappush(self.queues[action.resource], (self.deadline(action), next(self._seq), action))

    def _drop_queued(self, resource: str) -> list[Action]:
        dropped = [entry[2] for entry in self.queues[resource]]
        self.queues[resource].clear()
        return dropped

    def _dispatch_resource(self, name, pool, now):
        """Pop actions by virtual deadline; quota-blocked ones are skipped (they keep their
        place); an eligible action without a free unit grows the pool (one starting unit
        per waiting eligible action) and waits for it."""
        queue, started, skipped = self.queues[name], [], []
        free = pool.free(now)
        waiting = 0  # eligible actions left waiting for a unit
        while queue:
            entry = heapq.heappop(queue)
            action = entry[2]
            if not self._quota_ok(action.tool):
                skipped.append(entry)
                continue
            if not free:
                waiting += 1
                unit = pool.grow(now) if waiting > pool.starting(now) else None
                if unit is not None and unit.ready_at <= now:
                    waiting -= 1
                    free.append(unit)
                elif unit is None and len(pool.units) >= pool.spec.max_units:
                    skipped.append(entry)
                    break  # full: no later action can get a unit now either
                else:
                    skipped.append(entry)
                    continue
            started.append(self._start(action, free.pop(0), now))
        for entry in skipped:
            heapq.heappush(queue, entry)
        return started


class DedicatedScheduler(ActionScheduler):
    """Baseline: one unit per trajectory for its whole life (module docstring)."""

    name = "dedicated"

    def __init__(self, resources, quotas=None, estimator=None, now: float = 0.0, aging_rate: float = 1.0,
                 bound_kinds: tuple[str, ...] = ("cpu",)):
        super().__init__(resources, quotas, estimator, now)
        self.bound_kinds = set(bound_kinds) & set(self.pools)
        self.bound: dict[tuple[str, str], int] = {}  # (resource, trajectory) -> unit index
        self.per_trajectory: dict[tuple[str, str], deque[Action]] = {}
        self.waiting: dict[str, deque[str]] = {name: deque() for name in self.pools}  # trajectories without a unit
        self.shared: dict[str, deque[Action]] = {name: deque() for name in self.pools if name not in self.bound_kinds}

    def queued(self) -> int:
        return sum(len(q) for q in self.per_trajectory.values()) + sum(len(q) for q in self.shared.values())

    def _enqueue(self, action: Action) -> None:
        if action.resource in self.shared:
            self.shared[action.resource].append(action)
            return
        key = (action.resource, action.trajectory)
        if key not in self.per_trajectory:
            self.per_trajectory[key] = deque()
            if key not in self.bound:
                self.waiting[action.resource].append(action.trajectory)
        self.per_trajectory[key].append(action)

    def end_trajectory(self, trajectory: str, now: float) -> None:
        for name in self.bound_kinds:
            key = (name, trajectory)
            if self.per_trajectory.get(key):
                raise ValueError(f"trajectory {trajectory!r} ended with actions still queued on {name!r}")
            self.per_trajectory.pop(key, None)
            if trajectory in self.waiting[name]:  # its unit was quarantined and no other bound yet
                self.waiting[name].remove(trajectory)
            index = self.bound.pop(key, None)
            if index is not None:
                unit = self.pools[name].units[index]
                if unit.busy is not None:
                    raise ValueError(f"trajectory {trajectory!r} ended while its action {unit.busy} runs")
                unit.bound_to, unit.idle_since = None, now

    def _drop_queued(self, resource: str) -> list[Action]:
        """Also forgets the trajectories waiting for a unit (a later call queues them again);
        bound ones keep their unit until :meth:`end_trajectory`."""
        if resource in self.shared:
            dropped = list(self.shared[resource])
            self.shared[resource].clear()
            return dropped
        dropped = []
        for key, queue in list(self.per_trajectory.items()):
            if key[0] == resource:
                dropped += queue
                queue.clear()
                if key not in self.bound:
                    del self.per_trajectory[key]
        self.waiting[resource].clear()
        return dropped

    def quarantine(self, resource: str, index: int) -> None:
        """Also unbind the unit: its trajectory waits for another one."""
        super().quarantine(resource, index)
        for key, bound_index in list(self.bound.items()):
            if key[0] == resource and bound_index == index:
                del self.bound[key]
                self.pools[resource].units[index].bound_to = None
                if key in self.per_trajectory:
                    self.waiting[resource].appendleft(key[1])

    def _dispatch_resource(self, name, pool, now):
        if name in self.shared:
            return self._dispatch_shared(self.shared[name], pool, now)
        waiting = self.waiting[name]
        free = pool.free(now)
        while waiting:  # bind units to waiting trajectories, in arrival order
            if not free:
                unit = pool.grow(now)
                if unit is None or unit.ready_at > now:
                    break
                free.append(unit)
            trajectory = waiting.popleft()
            unit = free.pop(0)
            unit.bound_to = trajectory
            self.bound[(name, trajectory)] = unit.index
        started = []
        for (resource, trajectory), index in self.bound.items():
            queue = self.per_trajectory.get((resource, trajectory))
            if resource != name or not queue:
                continue
            unit = pool.units[index]
            if unit.busy is None and self._quota_ok(queue[0].tool):
                started.append(self._start(queue.popleft(), unit, now))
        return started

    def _dispatch_shared(self, queue: deque[Action], pool, now):
        """FIFO over any free unit (quota-blocked actions keep their place)."""
        started, kept = [], deque()
        free = pool.free(now)
        while queue:
            action = queue.popleft()
            if not self._quota_ok(action.tool):
                kept.append(action)
                continue
            if not free:
                unit = pool.grow(now) if pool.starting(now) == 0 else None
                if unit is None or unit.ready_at > now:
                    kept.append(action)
                    kept.extend(queue)
                    queue.clear()
                    break
                free.append(unit)
            started.append(self._start(action, free.pop(0), now))
        queue.extend(kept)
        return started


SCHEDULERS = {cls.name: cls for cls in (TangramScheduler, DedicatedScheduler)}


def make_scheduler(policy: str, resources: list[ResourceSpec], *, quotas=None, estimator=None, now: float = 0.0,
                   aging_rate: float = 1.0) -> ActionScheduler:
    """The scheduler registered as ``policy`` (``tools.policy``: tangram or dedicated)."""
    if policy not in SCHEDULERS:
        raise ValueError(f"tools.policy: unknown policy {policy!r}; valid policies are {sorted(SCHEDULERS)}")
    return SCHEDULERS[policy](resources, quotas=quotas, estimator=estimator, now=now, aging_rate=aging_rate)
