"""The worker loop (ranks ≥ 1): wait for the controller's next command (sleeping, not
polling), do it in the role the current layout gives this GPU slot, report.

Commands (dicts sent with tag ``COMMAND``, see :mod:`libra_hpc.cluster.messages`):

- ``{"op": "step", "step": s, "layout": Layout | None}``: take the layout if one is given,
  then run the group check; the report says what the group's collectives returned;
- ``{"op": "stop"}``: close this rank's role state and return (no report);
- any op in ``ops`` (a caller's own verbs, e.g. a test's ``train``): ``ops[op](worker,
  command)`` and its return value is the report.

What a role holds across commands: a training rank its :class:`TrainingWorld` (the torch
default group over exactly the training ranks, and the engines built on it), started when
the rank joins the training group and rebuilt when that group changes; a rollout rank the
engines it was given with :meth:`Worker.own` (a vLLM instance on its leader: vLLM makes
its own torch world), kept as long as its instance keeps its members. Rollout ranks start
no torch world and do not import torch for it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from libra_hpc.cluster.world import GroupHandle, World

log = logging.getLogger(__name__)

Op = Callable[["Worker", dict], Any]


class Worker:
    """One GPU slot's rank: its group in the current layout and what its role holds."""

    def __init__(self, world: World, ops: dict[str, Op] | None = None):
        self.world = world
        self.ops = dict(ops or {})
        self.training: Any = None  # engines.train.parallel.TrainingWorld while this rank trains
        self.trainings_started = 0
        self._rollout_owned: list[Any] = []

    @property
    def handle(self) -> GroupHandle | None:
        return self.world.handle

    def run(self) -> None:
        """Serve commands until ``stop``."""
        while True:
            # No heartbeat note here: a check's steps build its torch worlds, start-up work, so
            # its beats keep saying heartbeat.STARTING and keep the start-up grace.
            command = self.world.next_command()
            op = command["op"]
            if op == "stop":
                self.close()
                return
            if op == "step":
                self.world.report(self.step(command))
            elif op in self.ops:
                self.world.report(self.ops[op](self, command))
            else:
                raise ValueError(f"rank {self.world.rank}: unknown command op {op!r} (known: step, stop, "
                                 f"{', '.join(sorted(self.ops)) or 'no others'})")

    def step(self, command: dict) -> dict:
        """Apply the command's layout (if any), then check this rank's group."""
        start = time.perf_counter()
        if command.get("layout") is not None:
            self.apply(command["layout"])
        apply_s = time.perf_counter() - start
        report = {**self.check(), "apply_s": round(apply_s, 4)}
        log.debug("step %s: %s rank %d", command.get("step"), report["group"], report["group_rank"])
        return report

    def apply(self, layout) -> GroupHandle:
        """Take ``layout``: form this rank's group if it changed, then bring the role state
        along: a training rank whose group changed (or that just joined training) gets a
        new torch world; a rank that left its group closes what it held there."""
        before = self.handle
        handle = self.world.apply(layout)
        changed = before is None or handle.formed_at == layout.version
        if changed:
            self._close_role_state()
        if handle.group.role == "training" and self.training is None:
            self._start_training(handle)
        return handle

    def check(self) -> dict:
        """The group check (collective over the group): MPI all-reduce for every rank, and
        for training ranks an all-reduce over their torch world."""
        report = self.world.probe()
        if self.training is not None:
            total, seconds = self.training.check()
            report.update(torch_sum=total, torch_ms=round(seconds * 1e3, 3), torch_world=self.training.size,
                          trainings_started=self.trainings_started)
        return report

    def own(self, engine: Any) -> Any:
        """Tie ``engine`` (anything with ``shutdown()``) to this rank's current role: it is
        shut down when the role's group changes (training: before the torch world goes)."""
        if self.handle is None:
            raise RuntimeError(f"rank {self.world.rank}: own() before the first layout")
        if self.training is not None:
            return self.training.own(engine)
        self._rollout_owned.append(engine)
        return engine

    def close(self) -> None:
        self._close_role_state()
        self.world.close()

    def _start_training(self, handle: GroupHandle) -> None:
        from libra_hpc.engines.train.parallel import TrainingWorld

        place = self.world.topology.place_of(self.world.rank)
        self.training = TrainingWorld(handle.comm, backend=self.world.backend, device_index=place.device_index)
        self.trainings_started += 1
        log.info("rank %d: training torch world %d started (%d ranks, %s)", self.world.rank, self.trainings_started,
                 self.training.size, self.training.backend)

    def _close_role_state(self) -> None:
        while self._rollout_owned:
            self._rollout_owned.pop().shutdown()
        if self.training is not None:
            self.training.close()
            self.training = None


def run_worker(world: World, ops: dict[str, Op] | None = None) -> None:
    Worker(world, ops).run()
