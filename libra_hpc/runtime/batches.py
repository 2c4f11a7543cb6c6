"""Which trajectories a training step trains: the controller's batch tracker.

Two ways to fill a step, one interface (:class:`BatchTracker`), chosen by
:func:`tracker_from_config`:

- :class:`WholeBatches` (the default): step ``b`` trains batch ``b`` once all of its
  ``rl.prompts_per_step × rl.group_size`` trajectories are in. A GRPO group goes whole to
  one DP replica (:class:`~libra_hpc.parallel.dispatch.GroupDispatch`); its members wait at
  their leaders until it is placed. With ``rl.stream_training`` (and one pass) the complete
  groups of the step the trainers take next are sent to be trained ahead (``accumulate``),
  so a group is placed when its last member finishes, on the replica with the least
  training work of its batch so far; otherwise nothing trains before the batch is complete,
  and its groups are placed then, the one of most work first (within 4/3 of the optimum).
- :class:`~.partial.TailDecoupledBatches` (``rl.partial_rollout``): a step trains the
  groups that finish first within the staleness bound, from any batch in flight.

A tracker draws the prompts (it owns the prompt stream, so that a checkpoint can say where
the stream stands for what it keeps), puts trajectories into the queue service, books the
reports and answers the controller's questions; the controller sends every command.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from libra_hpc.config_learning import epochs_at
from libra_hpc.parallel.dispatch import GroupDispatch, Route
from libra_hpc.rl.grpo import group_trains
from libra_hpc.runtime.episodes import batch_of, group_of, trajectory_id
from libra_hpc.runtime.state import JobFailed, JobState, StepStart


class BatchTracker(Protocol):
    """What the controller asks of the trajectories in flight (see the module docstring)."""

    dispatch: GroupDispatch
    """Where whole groups train (its ``weigh``: a sequence's training work, set by the controller)."""

    def begin(self, version: int) -> None:
        """Training starts (or resumes) at ``version``: submit what runs first."""

    def submit(self, b: int) -> None:
        """Batch ``b``'s prompts are drawn and its trajectories queued."""

    def reported(self, tid: str) -> bool:
        """``tid`` was reported before (a second report is a copy)."""

    def finished(self, message: dict, source: int, open_replicas: list[int]) -> tuple[list[Route], bool]:
        """A trajectory finished at leader ``source``: the routes to send now ((leader, tid,
        DP replica), replica None: nowhere; its own, its group's once the group is placed, or
        none while the group is not) and whether a step may be ready now."""

    def place_held_at(self, leaders: list[int], open_replicas: list[int]) -> list[Route]:
        """``leaders`` must empty themselves (they leave rollout): the groups with a finished
        member held there are placed now. Their routes."""

    def aborted(self, message: dict, source: int) -> None:
        """A leader stopped a trajectory the tracker asked it to abort."""

    def stream(self, state: JobState) -> tuple[int, dict[int, list[str]]] | None:
        """Groups of the next step to train ahead: (batch, replica → groups), or None."""

    def start(self, step: int) -> StepStart | None:
        """Whether step ``step`` starts now, and on what (None: wait)."""

    def step_record(self, step: int) -> dict:
        """Step ``step`` trained: its ``submitted`` and ``complete`` times, ``rows`` (the
        trajectories' reports) and ``extra`` metrics."""

    def rolling(self) -> bool:
        """A submitted trajectory has not finished (or an aborted one has not ended)."""

    def untrained(self) -> bool:
        """A finished group waits for a training step."""

    def untrained_on(self, replica: int) -> bool:
        """Trajectories routed to DP ``replica`` wait for a training step."""

    def checkpoint(self, version: int) -> dict:
        """What a checkpoint at ``version`` keeps of the prompt stream and the work in flight."""

    def restore(self, state: dict) -> None:
        """The checkpoint's part of :meth:`checkpoint`, before :meth:`begin`."""

    def summary(self, metrics: list[dict]) -> dict:
        """The tracker's lines of ``summary.json`` from the run's step metrics."""


def tracker_from_config(cfg: Any, state: JobState, sampler: Any) -> BatchTracker:
    """The tracker ``rl.partial_rollout`` asks for."""
    if cfg.rl.partial_rollout and not cfg.job.eval_checkpoint:
        from libra_hpc.runtime.partial import TailDecoupledBatches

        return TailDecoupledBatches(cfg.rl, state, sampler)
    return WholeBatches(cfg, state, sampler)


def group_dispatch(rl: Any) -> GroupDispatch:
    """The trackers' placement of whole groups: ``rl.group_size`` members, the trainer's
    ``rl.filter_zero_variance`` rule for which it leaves out, work in tokens until the
    controller weighs sequences by the planner's model (``dispatch.weigh``)."""
    return GroupDispatch(rl.group_size, keep=lambda rewards: group_trains(rewards, rl.filter_zero_variance))


class WholeBatches:
    """Step ``b`` trains batch ``b``, whole."""

    def __init__(self, cfg: Any, state: JobState, sampler: Any):
        self.cfg, self.s, self.sampler = cfg, state, sampler
        self.batches: dict[int, dict] = {}
        self.dispatch = group_dispatch(cfg.rl)
        self.sampler_at: dict[int, dict] = {}  # the prompt stream's position before each batch in flight was drawn

    def begin(self, version: int) -> None:
        for b in range(version, min(version + self.cfg.rl.max_staleness + 1, self.cfg.rl.steps)):
            self.submit(b)

    def submit(self, b: int) -> None:
        self.sampler_at[b] = self.sampler.state()
        prompts = self.sampler.next(self.cfg.rl.prompts_per_step, lambda: f"training batch {b}")
        self.batches[b] = {"submitted": time.perf_counter(), "done": 0, "tids": set(), "work": {}, "rows": [],
                           "groups": {}, "group_done": {}, "streamed": set(), "pids": [p.pid for p in prompts]}
        for p in prompts:
            for k in range(self.cfg.rl.group_size):
                self.s.service.submit(trajectory_id(b, p.pid, k), p.pid)

    def reported(self, tid: str) -> bool:
        batch = self.batches.get(batch_of(tid))
        return batch is None or tid in batch["tids"]

    def finished(self, message: dict, source: int, open_replicas: list[int]) -> tuple[list[Route], bool]:
        tid = message["tid"]
        b, group = batch_of(tid), group_of(tid)
        batch = self.batches[b]
        batch["tids"].add(tid)
        ahead = self.cfg.rl.stream_training and epochs_at(self.cfg.rl.update_epochs, b) == 1
        placed = group in self.dispatch.dest
        routes = self.dispatch.finished(group, source, tid, message["tokens"], message["reward"], batch["work"],
                                        open_replicas, place=ahead)
        if not placed:
            self._book(batch, routes)
        batch["rows"].append(message)
        batch["done"] += 1
        batch["group_done"][group] = batch["group_done"].get(group, 0) + 1
        complete = batch["done"] == self.cfg.batch_size
        if complete:
            batch["complete"] = time.perf_counter()
            routes += self._book(batch, self.dispatch.place_all(list(batch["group_done"]), batch["work"],
                                                                open_replicas))
        return routes, complete

    def _book(self, batch: dict, routes: list[Route]) -> list[Route]:
        """``routes`` of groups just placed: each group in ``batch``'s groups per replica, once."""
        for group, replica in dict.fromkeys((group_of(tid), replica) for _, tid, replica in routes):
            batch["groups"].setdefault(replica, []).append(group)
        return routes

    def place_held_at(self, leaders: list[int], open_replicas: list[int]) -> list[Route]:
        routes: list[Route] = []
        for group in self.dispatch.held_at(leaders):
            batch = self.batches[batch_of(group + "/0")]
            routes += self._book(batch, self.dispatch.place(group, batch["work"], open_replicas))
        return routes

    def aborted(self, message: dict, source: int) -> None:
        raise JobFailed(f"rank {source} reported trajectory {message.get('tid')} aborted, but rl.partial_rollout "
                        "is off: nothing asks for aborts")

    def stream(self, state: JobState) -> tuple[int, dict[int, list[str]]] | None:
        """``rl.stream_training``: the complete groups of the batch the trainers take next,
        not sent yet. Steps of several passes train whole. The step's ``train`` still names
        all its groups: a trainer skips those it accumulated, and trains again those whose
        gradients a relayout took (runtime/trainer.py)."""
        cfg, b = self.cfg, state.next_step()
        if not cfg.rl.stream_training or state.stopping or b >= cfg.rl.steps or b not in self.batches:
            return None
        if epochs_at(cfg.rl.update_epochs, b) > 1:
            return None
        batch = self.batches[b]
        ready = [g for g, n in batch["group_done"].items() if n == cfg.rl.group_size and g not in batch["streamed"]]
        if not ready:
            return None
        by_replica: dict[int, list[str]] = {}
        for g in ready:
            by_replica.setdefault(self.dispatch.dest[g], []).append(g)
        batch["streamed"].update(ready)
        return b, by_replica

    def start(self, step: int) -> StepStart | None:
        batch = self.batches.get(step)
        return StepStart(batch["groups"]) if batch is not None and "complete" in batch else None

    def step_record(self, step: int) -> dict:
        batch = self.batches.pop(step)
        for groups in batch["groups"].values():
            for group in groups:
                self.dispatch.forget(group)
        for old in [k for k in self.sampler_at if k <= step]:
            del self.sampler_at[old]
        return {"submitted": batch["submitted"], "complete": batch["complete"], "rows": batch["rows"], "extra": {}}

    def rolling(self) -> bool:
        return any("complete" not in batch for batch in self.batches.values())

    def untrained(self) -> bool:
        return any("complete" in batch for batch in self.batches.values())

    def untrained_on(self, replica: int) -> bool:
        return any(batch["groups"].get(replica) for batch in self.batches.values())

    def checkpoint(self, version: int) -> dict:
        """Batches ``version, version + 1, ..`` are in flight: they are drawn again on
        resume from the stream's position before ``version`` (``regenerate``: the ids this
        throws away)."""
        return {"sampler": self.sampler_at.get(version, self.sampler.state()),
                "regenerate": sorted(t for b, batch in self.batches.items() if b >= version
                                     for t in self._tids(batch, b))}

    def _tids(self, batch: dict, b: int) -> list[str]:
        return [trajectory_id(b, pid, k) for pid in batch["pids"] for k in range(self.cfg.rl.group_size)]

    def restore(self, state: dict) -> None:
        self.sampler.restore(state["sampler"])

    def summary(self, metrics: list[dict]) -> dict:
        """With ``rl.stream_training``: groups trained ahead of their step, of all."""
        if not self.cfg.rl.stream_training:
            return {}
        return {"streamed_groups": {"streamed": sum(m.get("streamed_groups", 0) for m in metrics),
                                    "of": len(metrics) * self.cfg.rl.prompts_per_step,
                                    "ahead_s": round(sum(m.get("stream_s", 0.0) for m in metrics), 1),
                                    "after_s": round(sum(m["train_s"] for m in metrics), 1)}}
