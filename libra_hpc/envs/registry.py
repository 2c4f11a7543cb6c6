"""The task an experiment trains on: ``rl.task`` (a built-in name or ``package.module:Factory``)."""

from __future__ import annotations

from typing import Any

from libra_hpc.envs.arithmetic import ArithmeticTask
from libra_hpc.envs.plugin import load_factory
from libra_hpc.envs.search import SearchTask
from libra_hpc.envs.task import Task

TASKS: dict[str, type[Task]] = {"arithmetic": ArithmeticTask, "search": SearchTask}
"""Built-in tasks by name; each is configured by its ``tasks.<name>`` section."""


def make_task(spec: str, *, seed: int = 0, options: dict[str, Any] | None = None) -> Task:
    """Task ``spec``: a name of :data:`TASKS` (built with ``seed`` and ``options``, its
    config section's fields) or ``package.module:Factory`` (called with ``options``)."""
    options = dict(options or {})
    if spec in TASKS:
        return TASKS[spec](seed=seed, **options)
    if ":" not in spec:
        raise ValueError(f"rl.task: unknown task {spec!r}; built-in tasks are {sorted(TASKS)}, "
                         "or give 'package.module:Factory'")
    task = load_factory(spec)(**options)
    missing = [a for a in ("splits", "tools", "verify", "episode") if not hasattr(task, a)]
    if missing:
        raise TypeError(f"rl.task: {spec} returned {type(task).__name__}, not a Task (it lacks {', '.join(missing)})")
    return task


def task_from_config(cfg) -> Task:
    """The task of an experiment config (``rl.task``, ``rl.seed``, ``tasks``)."""
    spec = cfg.rl.task
    options = getattr(cfg.tasks, spec).model_dump() if spec in TASKS else dict(cfg.tasks.plugin)
    task = make_task(spec, seed=cfg.rl.seed, options=options)
    task.call_timeout_s = cfg.tools.call_timeout_s
    return task
