"""The live side of action-level orchestration: real units run the scheduler's dispatches.

:class:`ToolOrchestrator` wraps one pure :class:`~libra_hpc.tools.scheduling.ActionScheduler`
(either policy) with a wall clock, a thread per running action and one *runner* per resource
kind. Scheduling is event-driven: every submission, completion and unit start-up calls
``dispatch`` under one lock; no polling loop.

Runners (the pluggable resource kinds) implement ``run(unit, payload) -> result``:
:class:`SandboxRunner` (CPU sandboxes; unit ``i`` is a :class:`Sandbox` slot with uid
``uid_base + i``), :class:`~libra_hpc.tools.remote.SlurmSandboxRunner` (the same sandboxes
in workers that ``srun`` starts on other nodes, ``tools.placement: slurm``) and
``EndpointRunner`` in endpoint.py (a model-serving HTTP endpoint, e.g. a reward model; unit
``i`` is one concurrent request slot). A runner may also have ``release(unit)``, called when
the pool retires a unit (a remote worker gives its allocation back), and ``close()``, called
by :meth:`ToolOrchestrator.close`.

A runner that raises :class:`~libra_hpc.tools.isolation.SandboxUnavailable` (no sandbox can
start on this host: bwrap missing or failing its probe, the interpreter not runnable
inside) marks its resource kind unusable for the orchestrator's life: that action, every
action of the kind still queued and every later submission of it fail at once with the
reason, instead of waiting for units that can never run them.
"""

from __future__ import annotations

import logging
import math
import sys
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, InvalidStateError
from typing import Any, Protocol

from libra_hpc.tools.isolation import SandboxLimits, SandboxUnavailable
from libra_hpc.tools.procs import SlotLeak
from libra_hpc.tools.remote import SlurmSandboxRunner, srun_argv
from libra_hpc.tools.sandbox import (
    DEFAULT_LIMITS,
    DEFAULT_RULES,
    ClassifyRules,
    Sandbox,
)
from libra_hpc.tools.scheduling import ActionScheduler, Dispatch
from libra_hpc.tools.slots import DEFAULT_LOCK_DIR
from libra_hpc.tools.worker import worker_spec

log = logging.getLogger(__name__)


class Runner(Protocol):
    def run(self, unit: int, payload: Any) -> Any:
        """Execute one action on unit ``unit``; may raise (the action's future gets the error)."""


class SandboxRunner:
    """CPU sandboxes. ``payload``: Python source (str) or ``{"argv": [...]}`` / ``{"code": "..."}``
    with an optional ``"tool"`` name (default ``python`` / ``shell``)."""

    def __init__(self, limits: SandboxLimits = DEFAULT_LIMITS, *, uid_base: int = 200000, isolation: str = "auto",
                 python: str = "", rules: ClassifyRules = DEFAULT_RULES, lock_dir: str = DEFAULT_LOCK_DIR):
        self._make = lambda unit: Sandbox(limits, uid=uid_base + unit, isolation=isolation, python=python, rules=rules,
                                          lock_dir=lock_dir)
        self._slots: dict[int, Sandbox] = {}
        self._lock = threading.Lock()

    def slot(self, unit: int) -> Sandbox:
        with self._lock:
            if unit not in self._slots:
                self._slots[unit] = self._make(unit)
            return self._slots[unit]

    def close(self) -> None:
        """Release every slot uid this runner holds."""
        with self._lock:
            for sandbox in self._slots.values():
                sandbox.close()
            self._slots.clear()

    def run(self, unit: int, payload: Any):
        sandbox = self.slot(unit)
        if isinstance(payload, str):
            return sandbox.run_python(payload)
        if "argv" in payload:
            return sandbox.run_argv(payload["argv"], tool=payload.get("tool", "shell"))
        return sandbox.run_python(payload["code"], tool=payload.get("tool", "python"))


class ToolOrchestrator:
    """Submit tool calls; get futures. Thread-safe. ``clock``: monotonic seconds."""

    def __init__(self, scheduler: ActionScheduler, runners: Mapping[str, Runner],
                 clock: Callable[[], float] = time.monotonic):
        missing = set(scheduler.pools) - set(runners)
        if missing:
            raise ValueError(f"no runner for resource kinds {sorted(missing)} (runners given: {sorted(runners)})")
        self.scheduler = scheduler
        self.runners = dict(runners)
        self.clock = clock
        self.t0 = clock()
        self._lock = threading.Lock()
        self._futures: dict[str, tuple[Future, Any]] = {}
        self._threads: set[threading.Thread] = set()
        self._timer: threading.Timer | None = None
        self._timer_due = math.inf
        self._closed = False
        self._unavailable: dict[str, str] = {}  # resource kind -> why no unit of it can run anything
        scheduler.on_retire = self._release_unit
        self.records: list[dict] = []  # one per completed action: times relative to t0

    def _now(self) -> float:
        return self.clock() - self.t0

    def submit(self, trajectory: str, tool: str, resource: str, payload: Any,
               expected_s: float | None = None) -> Future:
        """Queue one tool call; the future resolves to the runner's result (or fails at
        once with :class:`SandboxUnavailable` when ``resource`` cannot run anything)."""
        future: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("orchestrator is closed")
            why = self._unavailable.get(resource)
            if why is not None:
                future.set_exception(SandboxUnavailable(why))
                return future
            action = self.scheduler.new_action(trajectory, tool, resource, self._now(), expected_s)
            self._futures[action.aid] = (future, payload)
            self._dispatch_locked()
        return future

    def end_trajectory(self, trajectory: str) -> None:
        with self._lock:
            self.scheduler.end_trajectory(trajectory, self._now())
            self._dispatch_locked()

    def held_seconds(self) -> float:
        with self._lock:
            return self.scheduler.held_seconds(self._now())

    def close(self, timeout_s: float = 60.0) -> None:
        """Wait for running actions (queued ones still run), then stop accepting work."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                busy = bool(self._futures)
                threads = list(self._threads)
            if not busy:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"orchestrator close: {len(self._futures)} actions still pending after {timeout_s} s")
            for thread in threads:
                thread.join(timeout=0.05)
            time.sleep(0.01)
        with self._lock:
            self._closed = True
            if self._timer is not None:
                self._timer.cancel()
        for runner in self.runners.values():
            close = getattr(runner, "close", None)
            if close is not None:
                close()  # e.g. remote workers give their Slurm allocations back

    # ------------------------------------------------------------------ internals
    def _dispatch_locked(self) -> None:
        now = self._now()
        dispatches = self.scheduler.dispatch(now)
        while dispatches:
            cancelled = [d for d in dispatches if not self._futures[d.action.aid][0].set_running_or_notify_cancel()]
            for dispatch in cancelled:  # Future.cancel() won before the dispatch: never run it
                self.scheduler.complete(dispatch.action.aid, now, observe=False)
                del self._futures[dispatch.action.aid]
            self._start_threads([d for d in dispatches if d not in cancelled])
            dispatches = self.scheduler.dispatch(now) if cancelled else []  # their units are free again
        wakes = [t for t in (self.scheduler.next_wakeup(now), self.scheduler.next_retirement(now)) if t is not None]
        wake = min(wakes, default=math.inf)
        if wake < self._timer_due and not self._closed:  # a unit gets ready, or an idle one retires, then
            if self._timer is not None:
                self._timer.cancel()
            self._timer_due = wake
            self._timer = threading.Timer(max(0.0, wake - now), self._wake)
            self._timer.daemon = True
            self._timer.start()

    def _release_unit(self, resource: str, unit: int) -> None:
        """The pool retired ``unit`` (called under the lock): a runner that holds something
        per unit (:meth:`SlurmSandboxRunner.release`) gives it back."""
        release = getattr(self.runners[resource], "release", None)
        if release is not None:
            release(unit)

    def _start_threads(self, dispatches: list[Dispatch]) -> None:
        for dispatch in dispatches:
            future, payload = self._futures[dispatch.action.aid]
            thread = threading.Thread(target=self._execute, args=(dispatch, future, payload), daemon=True,
                                      name=f"tool-{dispatch.action.resource}-{dispatch.unit}")
            self._threads.add(thread)
            thread.start()

    def _wake(self) -> None:
        with self._lock:
            self._timer, self._timer_due = None, math.inf
            self._dispatch_locked()

    def _execute(self, dispatch: Dispatch, future: Future, payload: Any) -> None:
        action = dispatch.action
        result = error = None
        quarantine = False
        dropped: list[tuple[Future, Any]] = []
        try:
            result = self.runners[action.resource].run(dispatch.unit, payload)
        except SandboxUnavailable as err:  # every action of this kind would fail the same way
            log.error("tool %s (action %s): no %s sandbox can start, failing its actions: %s", action.tool,
                      action.aid, action.resource, err)
            error = err
        except SlotLeak as err:  # its processes survive: the unit must never run another action
            log.error("tool %s (action %s): %s unit %d quarantined: %s", action.tool, action.aid, action.resource,
                      dispatch.unit, err)
            error, quarantine = err, True
        except Exception as err:  # noqa: BLE001 - handed to the caller through the future, not swallowed
            log.warning("tool %s (action %s, %s unit %d) raised %s", action.tool, action.aid, action.resource,
                        dispatch.unit, err)
            error = err
        with self._lock:
            done = self._now()
            self.scheduler.complete(action.aid, done)
            if quarantine:
                self.scheduler.quarantine(action.resource, dispatch.unit)
            if isinstance(error, SandboxUnavailable):
                self._unavailable.setdefault(action.resource, str(error))
                dropped = [self._futures.pop(a.aid) for a in self.scheduler.drop_queued(action.resource)]
            self.records.append({"aid": action.aid, "trajectory": action.trajectory, "tool": action.tool,
                                 "resource": action.resource, "unit": dispatch.unit, "submitted": action.submitted_at,
                                 "started": dispatch.started_at, "done": done})
            del self._futures[action.aid]
            self._threads.discard(threading.current_thread())
            self._dispatch_locked()
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
        for queued, _payload in dropped:
            try:
                queued.set_exception(SandboxUnavailable(self._unavailable[action.resource]))
            except InvalidStateError:  # the caller cancelled it meanwhile
                pass


class ChaosRunner:
    """Fault injection around a runner (``tools.chaos``): each call, drawn from a seeded
    generator, fails (raises :class:`InjectedFault`) with ``fail_rate``, or holds its unit
    for ``hang_s`` and then fails with ``hang_rate``; the rest run as usual. Thread-safe."""

    def __init__(self, inner: Runner, fail_rate: float, hang_rate: float, hang_s: float, seed: int = 0):
        import random

        if fail_rate + hang_rate > 1:
            raise ValueError(f"tools.chaos: fail_rate {fail_rate} + hang_rate {hang_rate} > 1")
        self.inner, self.fail_rate, self.hang_rate, self.hang_s = inner, fail_rate, hang_rate, hang_s
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.injected = {"fail": 0, "hang": 0}

    def run(self, unit: int, payload: Any) -> Any:
        with self._lock:
            draw = self._rng.random()
        if draw < self.fail_rate:
            self.injected["fail"] += 1
            raise InjectedFault("tools.chaos: injected failure")
        if draw < self.fail_rate + self.hang_rate:
            self.injected["hang"] += 1
            time.sleep(self.hang_s)
            raise InjectedFault(f"tools.chaos: injected hang of {self.hang_s:g} s")
        return self.inner.run(unit, payload)

    def close(self) -> None:
        close = getattr(self.inner, "close", None)
        if close is not None:
            close()


class InjectedFault(RuntimeError):
    """A tool call made to fail by ``tools.chaos``."""


def limits_from_config(tools) -> SandboxLimits:
    """SandboxLimits from a ``tools`` config section."""
    return SandboxLimits(wall_time_s=tools.wall_time_s, cpu_time_s=tools.cpu_time_s, memory_mb=tools.memory_mb,
                         max_processes=tools.max_processes, max_file_mb=tools.max_file_mb,
                         max_open_files=tools.max_open_files, workdir_mb=tools.workdir_mb,
                         output_limit_bytes=tools.output_limit_bytes, call_memory_mb=tools.call_memory_mb)


def cpu_runner_from_config(tools, rules: ClassifyRules = DEFAULT_RULES) -> Runner:
    """The ``cpu`` resource's runner for ``tools.placement``: sandboxes on this host, or
    workers started through ``srun`` (remote.py), each holding one sandbox slot of its node."""
    limits = limits_from_config(tools)
    if tools.placement == "local":
        return SandboxRunner(limits, uid_base=tools.uid_base, isolation=tools.isolation, python=tools.python,
                             rules=rules, lock_dir=tools.lock_dir)
    spec = worker_spec(limits, uid_base=tools.uid_base, slots=tools.max_workers, isolation=tools.isolation,
                       python=tools.python, rules=rules, lock_dir=tools.lock_dir)
    worker = [sys.executable, "-m", "libra_hpc.tools.worker", spec]
    argv = srun_argv(worker, partition=tools.slurm_partition, cpus=tools.slurm_cpus_per_unit,
                     time_limit=tools.slurm_time_limit, extra=tools.slurm_args)
    return SlurmSandboxRunner(argv, wall_time_s=tools.wall_time_s)


def orchestrator_from_config(tools, scheduler_cfg=None, clock: Callable[[], float] = time.monotonic, *,
                             extra: Mapping[str, Runner] | None = None,
                             extra_units: int = 8) -> ToolOrchestrator:
    """The orchestrator an experiment's ``tools`` section describes: a ``cpu`` sandbox pool
    and, when ``tools.reward_endpoint`` is set, a ``reward`` endpoint resource.
    ``scheduler_cfg`` (the ``scheduler`` section) gives the ToolState size classes and error markers.
    ``extra``: in-process runners of further resource kinds (a task's ``runners()``, e.g.
    ``search``), each a pool of ``extra_units`` concurrent calls."""
    from libra_hpc.tools.endpoint import EndpointRunner
    from libra_hpc.tools.pool import ResourceSpec
    from libra_hpc.tools.scheduling import DurationEstimator, make_scheduler

    rules = ClassifyRules() if scheduler_cfg is None else ClassifyRules(
        tuple(scheduler_cfg.size_thresholds), tuple(scheduler_cfg.error_markers))
    resources = [ResourceSpec("cpu", tools.max_workers, tools.min_workers, tools.idle_timeout_s)]
    runners: dict[str, Runner] = {"cpu": cpu_runner_from_config(tools, rules)}
    if tools.reward_endpoint:
        resources.append(ResourceSpec("reward", tools.reward_concurrency, 0, tools.idle_timeout_s))
        runners["reward"] = EndpointRunner(tools.reward_endpoint, timeout_s=tools.wall_time_s)
    for kind, runner in (extra or {}).items():
        if kind in runners:
            raise ValueError(f"orchestrator: the task's runner {kind!r} clashes with a resource of the tools section")
        resources.append(ResourceSpec(kind, extra_units, 0, tools.idle_timeout_s))
        runners[kind] = runner
    chaos = tools.chaos
    if chaos.fail_rate or chaos.hang_rate:
        runners = {kind: ChaosRunner(runner, chaos.fail_rate, chaos.hang_rate, tools.call_timeout_s + 5.0,
                                     seed=chaos.seed + k) for k, (kind, runner) in enumerate(sorted(runners.items()))}
    scheduler = make_scheduler(tools.policy, resources, quotas=tools.quotas, now=0.0, aging_rate=tools.aging_rate,
                               estimator=DurationEstimator(tools.expected_s, tools.default_expected_s))
    return ToolOrchestrator(scheduler, runners, clock)
