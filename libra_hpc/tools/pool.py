"""An elastic pool of units of one resource kind (pure bookkeeping, injected time).

A *unit* is one thing that runs one action at a time: a CPU sandbox slot, one concurrent
request slot of a model-serving endpoint. Units are numbered from 0; a retired unit's
number is reused first, so at most ``max_units`` numbers ever exist (the sandbox executor
maps number ``i`` to the dedicated uid ``uid_base + i``).

Lifecycle: grown at ``t`` → ready at ``t + startup_s`` → busy/idle → retired when idle for
``idle_timeout_s`` while more than ``min_units`` are alive (retirement is dated at the end
of the idle timeout, whenever it is noticed, so held time does not depend on how often the
pool is looked at). *Held* unit-seconds integrate the number of alive units over time:
that is what a cluster would bill for the pool.
"""

from __future__ import annotations

from dataclasses import dataclass


QUARANTINED = "<quarantined>"
"""``Unit.busy`` of a unit taken out of service (not an action id)."""


@dataclass(frozen=True)
class ResourceSpec:
    """One resource kind: its name (``cpu``, ``reward``), bounds and timings (seconds)."""

    name: str
    max_units: int
    min_units: int = 0
    idle_timeout_s: float = 30.0
    startup_s: float = 0.0

    def __post_init__(self):
        if self.max_units < 1 or not 0 <= self.min_units <= self.max_units:
            raise ValueError(f"resource {self.name!r}: need 0 <= min_units ({self.min_units}) <= max_units "
                             f"({self.max_units}) and max_units >= 1")
        if self.idle_timeout_s < 0 or self.startup_s < 0:
            raise ValueError(f"resource {self.name!r}: idle_timeout_s and startup_s must be >= 0")


@dataclass
class Unit:
    index: int
    born: float
    ready_at: float
    busy: str | None = None  # action id
    idle_since: float = 0.0
    bound_to: str | None = None  # trajectory id (dedicated baseline only)


class ElasticPool:
    """Units of one :class:`ResourceSpec`. Invariant: ``len(units) <= spec.max_units``."""

    def __init__(self, spec: ResourceSpec, now: float = 0.0):
        self.spec = spec
        self.units: dict[int, Unit] = {}
        self._held_retired = 0.0
        self.peak = 0
        for _ in range(spec.min_units):  # provisioned before the run: ready at once
            unit = self.grow(now)
            unit.ready_at = unit.idle_since = now

    def grow(self, now: float) -> Unit | None:
        """A new unit (ready after ``startup_s``), or None at ``max_units``."""
        if len(self.units) >= self.spec.max_units:
            return None
        index = next(i for i in range(self.spec.max_units) if i not in self.units)
        unit = Unit(index, born=now, ready_at=now + self.spec.startup_s, idle_since=now + self.spec.startup_s)
        self.units[index] = unit
        self.peak = max(self.peak, len(self.units))
        return unit

    def retire_idle(self, now: float) -> list[int]:
        """Retire units idle (and unbound) for ``idle_timeout_s``, oldest idle first, never
        below ``min_units``; returns their indices."""
        idle = sorted((u for u in self.units.values() if u.busy is None and u.bound_to is None
                       and u.ready_at <= now and now - u.idle_since >= self.spec.idle_timeout_s),
                      key=lambda u: (u.idle_since, u.index))
        retired = []
        for unit in idle[:max(0, len(self.units) - self.spec.min_units)]:
            end = unit.idle_since + self.spec.idle_timeout_s
            self._held_retired += end - unit.born
            del self.units[unit.index]
            retired.append(unit.index)
        return retired

    def next_retirement(self, now: float) -> float | None:
        """When :meth:`retire_idle` will next retire a unit, if nothing else happens (not
        before ``now``); None when no unit is idle or the pool is at ``min_units``."""
        if len(self.units) <= self.spec.min_units:
            return None
        due = [u.idle_since + self.spec.idle_timeout_s for u in self.units.values()
               if u.busy is None and u.bound_to is None and u.ready_at <= now]
        return max(now, min(due)) if due else None

    def free(self, now: float) -> list[Unit]:
        """Ready, idle, unbound units, lowest index first."""
        return sorted((u for u in self.units.values() if u.busy is None and u.bound_to is None and u.ready_at <= now),
                      key=lambda u: u.index)

    def quarantine(self, index: int) -> None:
        """Take unit ``index`` out of service for good (its slot could not be cleaned): it
        stays alive, busy and counted in the held time, so it is never dispatched nor
        retired, and its number is never reused."""
        self.units[index].busy = QUARANTINED

    def quarantined(self) -> list[int]:
        return sorted(i for i, u in self.units.items() if u.busy == QUARANTINED)

    def starting(self, now: float) -> int:
        return sum(1 for u in self.units.values() if u.ready_at > now)

    def next_ready(self, now: float) -> float | None:
        times = [u.ready_at for u in self.units.values() if u.ready_at > now]
        return min(times) if times else None

    def held_seconds(self, now: float) -> float:
        """Unit-seconds held so far (retired units up to their retirement, alive ones up to now)."""
        return self._held_retired + sum(now - u.born for u in self.units.values())
