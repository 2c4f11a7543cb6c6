"""Partial (tail-decoupled) rollout in the live job: the controller's batch tracker
(:class:`TailDecoupledBatches`, the other implementation of :class:`~.batches.BatchTracker`).

With ``rl.partial_rollout`` a training step does not wait for the slowest trajectories of
its batch. The decision rule is :class:`libra_hpc.rl.partial.TailDecoupler`'s, the same
the simulator runs, with the GRPO *group* as its unit (advantages compare the samples of
one prompt, so a group trains whole or not at all):

- every group gets a *version floor* when it is submitted: the policy its first token can
  come from at the earliest (leaders start a turn of batch ``b`` only on weights ≥
  ``b - rl.max_staleness``), so the floor of batch ``b`` is ``max(0, b - k)``;
- step ``j`` trains the first ``rl.prompts_per_step`` finished groups whose floor is within
  the bound (``j - floor ≤ k``), oldest first, from whichever batches they came;
- a group still running that could not train any later step is *regenerated*, if the
  waste budget allows (``rl.partial_waste_budget``) and it was not regenerated before:
  its unfinished trajectories are aborted at their next turn boundary (the leaders' ``abort``
  command), its finished ones are discarded at the trainers, and its prompt goes back into
  the queue as a new group (same key, ids tagged ``~r1``, ``~r2`` …) whose floor is the current
  version. Otherwise the step waits for it, as whole-trajectory rollout would.

Nothing is lost or trained twice: every trajectory of a regenerated group ends in exactly
one ``traj`` (finished before the abort reached it: routed nowhere) or ``aborted`` report,
and each key is trained once. The tokens wasted and the lengths trained against the
lengths generated go in the step log and the summary (``partial_rollout``).
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from libra_hpc.rl.partial import TailDecoupler, p90
from libra_hpc.parallel.dispatch import Route
from libra_hpc.runtime.batches import group_dispatch
from libra_hpc.runtime.episodes import group_of, trajectory_id
from libra_hpc.runtime.state import JobState, StepStart


class TailDecoupledBatches:
    """The groups in flight, the step decisions and the regenerations of one job."""

    def __init__(self, rl: Any, state: JobState, sampler: Any):
        self.rl, self.s, self.sampler = rl, state, sampler
        self.k, self.size = rl.max_staleness, rl.group_size
        self.decoupler = TailDecoupler(rl.prompts_per_step, rl.max_staleness, rl.partial_waste_budget)
        self.groups: dict[str, dict] = {}  # key (the group id it was first submitted under) → its record
        self.key_of: dict[str, str] = {}  # live group id → key
        self.aborting: dict[str, str] = {}  # tid of a regenerated group → key, until its end is reported
        self.steps: dict[int, dict] = {}  # step → the record step_record returns
        self.dispatch = group_dispatch(rl)  # where each group trains, placed when whole (runtime/batches.py)
        self.untrained_work: dict[int, float] = {}  # DP replica → work placed there and not trained yet
        self.finished_lengths: list[int] = []  # generated tokens of every trajectory that finished
        self.trained_lengths: list[int] = []
        self.aborted_count = 0
        self.late_finishes = 0  # a regenerated group's trajectory that finished before its abort arrived
        self.abandoned = 0  # aborts still outstanding when the run stopped at a checkpoint (gone with its world)
        self.kept: list[dict] | None = None  # a resumed run's groups in flight, relaunched when it begins
        self.drawn = 0  # batches drawn from the prompt stream so far (the next batch's index)

    # ------------------------------------------------------------------ submission

    def begin(self, version: int) -> None:
        if self.kept is None:
            for b in range(version, min(version + self.k + 1, self.rl.steps)):
                self.submit(b)
            return
        for g in self.kept:  # the checkpoint's groups in flight, generated again from scratch
            self._launch(g["key"], g["batch"], g["pid"], floor=max(g["floor"], version), tag=g["tag"])
            self.groups[g["key"]]["regenerations"] = g["regenerations"]
        self.kept = None
        # and the batches a run at this version has in flight that were not drawn when the
        # checkpoint was taken (a step's checkpoint is saved before the step's next batch is
        # drawn: without this a resumed run lacked one batch and its last step waited forever)
        for b in range(self.drawn, min(version + self.k + 1, self.rl.steps)):
            self.submit(b)

    def submit(self, b: int) -> None:
        prompts = self.sampler.next(self.rl.prompts_per_step, lambda: f"training batch {b}")
        self.drawn = max(self.drawn, b + 1)
        for prompt in prompts:
            self._launch(f"b{b}/{prompt.pid}", b, prompt.pid, floor=max(0, b - self.k), tag="")

    def _launch(self, key: str, b: int, pid: str, floor: int, tag: str) -> None:
        live = f"b{b}/{pid}{tag}"
        tids = [trajectory_id(b, pid + tag, s) for s in range(self.size)]
        self.groups[key] = {"live": live, "pid": pid, "floor": floor, "submitted": time.perf_counter(),
                            "pending": set(tids), "rows": [],
                            "regenerations": self.groups[key]["regenerations"] + 1 if key in self.groups else 0}
        self.key_of[live] = key
        self.decoupler.started(key, floor)
        for tid in tids:
            self.s.service.submit(tid, pid)

    # ------------------------------------------------------------------ reports

    def finished(self, message: dict, source: int, open_replicas: list[int]) -> tuple[list[Route], bool]:
        """A trajectory finished (``traj``) at leader ``source``: routed nowhere if its group
        was regenerated meanwhile; else with its group, once the group is whole and placed
        (placed on the replica of least untrained work)."""
        tid = message["tid"]
        self.decoupler.generated(message["gen_tokens"])
        self.finished_lengths.append(message["gen_tokens"])
        if tid in self.aborting:
            del self.aborting[tid]
            self.late_finishes += 1
            self.decoupler.stats.wasted_tokens += message["gen_tokens"]
            return [(source, tid, None)], False
        key = self.key_of[group_of(tid)]
        group = self.groups[key]
        routes = self.dispatch.finished(group["live"], source, tid, message["tokens"], message["reward"],
                                        self.untrained_work, open_replicas)
        group["rows"].append(message)
        group["pending"].discard(tid)
        if group["pending"]:
            return routes, False
        self.decoupler.finish(key, sum(r["gen_tokens"] for r in group["rows"]), time.perf_counter())
        return routes, True

    def place_held_at(self, leaders: list[int], open_replicas: list[int]) -> list[Route]:
        """``leaders`` leave rollout: the groups with a finished member held there are placed now."""
        return [r for g in self.dispatch.held_at(leaders) for r in self.dispatch.place(g, self.untrained_work,
                                                                                       open_replicas)]

    def reported(self, tid: str) -> bool:
        """``tid`` finished already (counted, or its group trained or regenerated and it is
        not one whose abort is awaited): a second report of it is a copy."""
        if tid in self.aborting:
            return False
        key = self.key_of.get(group_of(tid))
        return key is None or tid not in self.groups[key]["pending"]

    def aborted(self, message: dict, source: int) -> None:
        """A trajectory of a regenerated group ended at a leader (``aborted``)."""
        tid = message["tid"]
        if self.aborting.pop(tid, None) is None:
            raise RuntimeError(f"rank {source} aborted trajectory {tid}, which no regeneration asked for")
        self.aborted_count += 1
        self.decoupler.generated(message["gen_tokens"])
        self.decoupler.stats.wasted_tokens += message["gen_tokens"]

    def stream(self, state: JobState) -> None:
        """Groups of several batches train together: nothing trains ahead."""
        return None

    # ------------------------------------------------------------------ steps

    def start(self, step: int) -> StepStart | None:
        """Whether step ``step`` starts now: the groups each replica trains, the groups
        the trainers discard and the trajectories the leaders abort, or None (wait)."""
        decision = self.decoupler.decide(step, self._tokens_so_far)
        if decision is None:
            return None
        out = StepStart({})
        for key in decision.regenerate:
            out.discard.append(self._regenerate(key, step, out.abort, out.nowhere))
        for key in decision.resubmit:
            out.discard.append(self._regenerate(key, step, None, out.nowhere))
        rows: list[dict] = []
        submitted = time.perf_counter()
        for key in decision.train:
            group = self.groups.pop(key)
            submitted = min(submitted, group["submitted"])
            del self.key_of[group["live"]]
            dest, work, held = self.dispatch.forget(group["live"])
            if dest is None or held:  # a finished group was placed whole when its last member finished
                raise RuntimeError(f"group {group['live']} trains step {step} but was never placed on a replica")
            out.groups.setdefault(dest, []).append(group["live"])
            rows += group["rows"]
            self.untrained_work[dest] -= work
            self.trained_lengths += [r["gen_tokens"] for r in group["rows"]]
        stats = self.decoupler.stats
        self.steps[step] = {
            "submitted": submitted, "complete": time.perf_counter(), "rows": rows,
            "extra": {"partial": {"regenerated": len(decision.regenerate) + len(decision.resubmit),
                                  "batches": sorted({int(r["tid"].split("/", 1)[0][1:]) for r in rows}),
                                  "wasted_share": round(stats.wasted_share, 4), "waits": stats.waits}}}
        return out

    def _regenerate(self, key: str, step: int, abort: list[str] | None, nowhere: list[tuple[int, str]]) -> str:
        """Resubmit group ``key``'s prompt; what still runs of it (``abort`` given: it was
        running) goes on ``abort``, its finished members still at their leaders (it was
        never placed) on ``nowhere``. The group id the trainers discard."""
        group = self.groups[key]
        old = group["live"]
        del self.key_of[old]
        done = sum(r["gen_tokens"] for r in group["rows"])
        dest, work, held = self.dispatch.forget(old)
        nowhere += held
        if dest is not None:
            self.untrained_work[dest] -= work
        if abort is not None:
            self.decoupler.aborted(key, done)  # the rest of the waste arrives with the aborted reports
            pending = sorted(group["pending"])
            self.aborting.update(dict.fromkeys(pending, key))
            abort += pending
        b = step + self.k  # leaders start its turns on policy ≥ step: the floor is the current version
        self._launch(key, b, group["pid"], floor=step, tag=f"~r{group['regenerations'] + 1}")
        self.s.runlog.event("regenerated", step=step, group=old, again_as=self.groups[key]["live"],
                            finished=len(group["rows"]), running=len(group["pending"]) if abort is not None else 0,
                            tokens_wasted_so_far=done)
        return old

    def _tokens_so_far(self, key: str) -> int:
        """What regenerating running group ``key`` would waste: its finished trajectories'
        tokens and, for each one still running, the mean length of a finished trajectory
        (what it has is not known until it stops)."""
        group = self.groups[key]
        mean = statistics.fmean(self.finished_lengths) if self.finished_lengths else 0.0
        return sum(r["gen_tokens"] for r in group["rows"]) + round(mean * len(group["pending"]))

    def step_record(self, step: int) -> dict:
        return self.steps.pop(step)

    # ------------------------------------------------------------------ checkpoint

    def _parts(self, key: str) -> tuple[int, str]:
        """(batch, tag) of group ``key``'s live id ``b<batch>/<pid><tag>``."""
        group = self.groups[key]
        head, rest = group["live"].split("/", 1)
        return int(head[1:]), rest[len(group["pid"]):]

    def in_flight_tids(self) -> list[str]:
        """Every trajectory id of the groups not trained yet."""
        out = []
        for key, group in sorted(self.groups.items()):
            b, tag = self._parts(key)
            out += [trajectory_id(b, group["pid"] + tag, s) for s in range(self.size)]
        return out

    def checkpoint(self, version: int) -> dict:
        """Every group drawn so far is trained or kept: the stream goes on after the last
        prompt drawn, and the groups not trained yet are generated again from scratch on
        resume, under the same ids; the counters the summary reports go on."""
        stats = self.decoupler.stats
        groups = []
        for key, group in sorted(self.groups.items()):
            b, tag = self._parts(key)
            groups.append({"key": key, "batch": b, "pid": group["pid"], "tag": tag, "floor": group["floor"],
                           "regenerations": group["regenerations"]})
        return {"sampler": self.sampler.state(), "regenerate": self.in_flight_tids(),
                "partial": {"groups": groups, "drawn": self.drawn,
                            "regenerated_keys": sorted(self.decoupler.regenerated),
                            "stats": {"generated_tokens": stats.generated_tokens, "wasted_tokens": stats.wasted_tokens,
                                      "regenerated": stats.regenerated, "waits": stats.waits},
                            "finished_lengths": list(self.finished_lengths),
                            "trained_lengths": list(self.trained_lengths),
                            "aborted_count": self.aborted_count, "late_finishes": self.late_finishes,
                            "abandoned": self.abandoned + len(self.aborting)}}

    def restore(self, saved: dict) -> None:
        """The stream's position and the counters as saved; the groups in flight are
        relaunched by :meth:`begin` (their tokens then come from the resumed policy at the
        earliest: their floor)."""
        self.sampler.restore(saved["sampler"])
        state = saved["partial"]
        stats = self.decoupler.stats
        for name, value in state["stats"].items():
            setattr(stats, name, value)
        self.decoupler.regenerated = set(state["regenerated_keys"])
        self.finished_lengths, self.trained_lengths = list(state["finished_lengths"]), list(state["trained_lengths"])
        self.aborted_count, self.late_finishes = state["aborted_count"], state["late_finishes"]
        self.abandoned = state["abandoned"]
        self.kept = state["groups"]
        # a checkpoint of an earlier release has no count: its newest group's batch is the last drawn
        self.drawn = state.get("drawn", max((g["batch"] + 1 for g in self.kept), default=0))

    # ------------------------------------------------------------------ state

    def rolling(self) -> bool:
        """A group has a trajectory running, or a regenerated trajectory has not ended yet
        (a leader may still hold its state)."""
        return bool(self.aborting) or any(g["pending"] for g in self.groups.values())

    def untrained(self) -> bool:
        return any(not g["pending"] for g in self.groups.values())

    def untrained_on(self, replica: int) -> bool:
        return any(self.dispatch.dest.get(g["live"]) == replica for g in self.groups.values())

    def summary(self, metrics: list[dict]) -> dict:
        stats = self.decoupler.stats
        generated_p90 = p90(self.finished_lengths)
        return {"partial_rollout": {
            "regenerated": stats.regenerated, "aborted_trajectories": self.aborted_count,
            "late_finishes": self.late_finishes, "unresolved_aborts": len(self.aborting),
            "aborts_gone_with_a_stopped_world": self.abandoned,
            "waits": stats.waits, "generated_tokens": stats.generated_tokens,
            "wasted_tokens": stats.wasted_tokens, "dropped_token_share": round(stats.wasted_share, 4),
            "trained_p90_over_generated_p90": round(p90(self.trained_lengths) / generated_p90, 3)
            if generated_p90 else None}}
