"""The controller's side of checkpoints and resume (files: :mod:`.resume`).

**Saving.** At a step boundary (every ``job.checkpoint_every_steps`` versions, and once
more when Slurm's time-limit warning has stopped the run), the controller snapshots its
own state for version ``v`` and sends ``checkpoint`` to the training ranks; they write
the Megatron state and their RNG into the staging folder and report ``checkpointed``;
then the controller commits (``state.json``, manifest, rename). Training goes on while
the trainers save: their commands are handled in order, so the next ``train`` waits for
the save on the trainers, not on the controller.

**What a checkpoint does not hold, and why nothing is lost.** Batches ``v, v+1, ..`` are
in flight at version ``v``: their trajectories are not kept. The prompt stream's
position is the one before batch ``v`` was drawn, so a resumed run draws the same
prompts for the same batch indices and generates them again (``regenerate`` in
``state.json`` lists the trajectory ids this throws away). With ``rl.partial_rollout`` the
groups in flight come from several batches: the checkpoint lists each one not trained
yet (batch, prompt, regeneration tag), the resumed run generates them again from scratch
under the same ids, and the stream goes on after the last prompt drawn. The books (trajectories
trained) come back with the checkpoint, so ``summary.json``'s lost and duplicated
counts cover the whole run across restarts.

**Resume.** A job that starts in a log folder holding a checkpoint that verifies loads
it: trainers load the Megatron state (resharded to the layout in force) and send the
policy to every rollout engine as version ``v``; the controller restores its state,
drops the metric rows of steps ``>= v`` (trained again, so each index appears once),
skips the warm-start evaluation (its result is in the checkpoint) and submits batch
``v``. A ``resumed`` event says from where.

**Requeue.** After the stop signal (and its checkpoint), the controller writes ``REQUEUE``
in the log folder when the job runs under Slurm, ``cluster.requeue`` is on and
``SLURM_RESTART_COUNT`` is below ``cluster.max_requeues``; ``sbatch/libra.sh`` then
runs ``scontrol requeue`` for the job (same id, same log folder). MPI cannot shrink a
world in place: a dead rank ends the job, which comes back the same way.
"""

from __future__ import annotations

import logging
import os
import time

from libra_hpc.runtime.resume import (CheckpointStore, Loaded, ask_requeue, remove_leftover_relayouts, requeue_refusal,
                                      restart_count)
from libra_hpc.runtime.state import JobState, Sends

log = logging.getLogger(__name__)


class CheckpointDriver:
    """Checkpoints of one job: which to resume from, when to save, what a stop does. It
    answers with the commands to send; the controller gives it the state to save."""

    def __init__(self, state: JobState):
        self.s = state
        cfg = state.cfg.job
        self.store = CheckpointStore(state.runlog.folder, keep=cfg.checkpoint_keep)
        self.every = cfg.checkpoint_every_steps
        self.pending: dict | None = None
        self.saved_version: int | None = None
        self.stop_seen: dict | None = None
        self.abandoned: float | None = None
        """Seconds after the stop at which the step in flight was given up (``job.stop_grace_s``)."""

    # ------------------------------------------------------------------ resume

    def find(self) -> Loaded | None:
        """The newest checkpoint of this log folder that verifies; the ones that do not
        are logged (``checkpoint_rejected``) and skipped."""
        cfg = self.s.cfg
        if cfg.job.eval_checkpoint:
            return None
        if gone := remove_leftover_relayouts(self.s.runlog.folder):
            self.s.runlog.event("leftovers_removed", what=gone, why="layout changes of a run that did not finish")
        loaded, rejected = self.store.latest()
        for path, why in rejected:
            log.warning("checkpoint %s rejected: %s", path, why)
            self.s.runlog.event("checkpoint_rejected", path=str(path), reason=why)
        if loaded is not None and ("partial" in loaded.state) != bool(cfg.rl.partial_rollout):
            raise ValueError(f"{loaded.path}: written with rl.partial_rollout="
                             f"{str('partial' in loaded.state).lower()}; resume with the configuration that wrote it")
        if loaded is not None and loaded.version > cfg.rl.steps:
            raise ValueError(f"{loaded.path}: checkpoint at version {loaded.version}, past rl.steps="
                             f"{cfg.rl.steps}: raise rl.steps or start in another log folder")
        if loaded is None and (dropped := self.s.runlog.rewind_metrics(0)):
            # an earlier run in this folder stopped before its first checkpoint: the steps start over
            self.s.runlog.event("restarted", metric_rows_dropped=dropped,
                                why="no checkpoint in this log folder: the run starts over from step 0")
            log.info("no checkpoint to resume from: the %d metric rows of an earlier run dropped", dropped)
        return loaded

    def start_message(self, loaded: Loaded | None) -> dict:
        """What ``start`` tells the ranks: which checkpoint the trainers load, the version
        they send the rollout engines."""
        if loaded is None:
            return {}
        return {"resume": {"checkpoint": str(loaded.path / "train"), "rng": str(loaded.path / "rng"),
                           "version": loaded.version, "fresh_leaders": sorted(self.s.roles.leaders.values())}}

    def resumed(self, loaded: Loaded) -> None:
        """The run resumes from ``loaded`` (the controller restored its state from it): the
        metric rows of the steps redone are dropped, and the resume logged."""
        state = loaded.state
        dropped = self.s.runlog.rewind_metrics(loaded.version)
        self.saved_version = loaded.version
        self.s.runlog.event("resumed", version=loaded.version, path=str(loaded.path), metric_rows_dropped=dropped,
                            regenerate=len(state.get("regenerate", [])), restart_count=restart_count(os.environ),
                            saved_at=state.get("saved_at"))
        log.info("resumed from %s at version %d (%d metric rows of later steps dropped)", loaded.path,
                 loaded.version, dropped)

    # ------------------------------------------------------------------ saving

    def due(self) -> bool:
        """A periodic checkpoint is due at the version just reached."""
        v = self.s.version
        return (self.every > 0 and v % self.every == 0 and 0 < v < self.s.cfg.rl.steps
                and self.saved_version != v and self.pending is None)

    def save(self, state: dict) -> Sends:
        """Save the controller's ``state`` at the current version once the trainers saved
        theirs: the commands that ask them."""
        v = self.s.version
        stage = self.store.staging(v)
        self.pending = {"version": v, "stage": stage, "state": {**state, "saved_at": time.time()},
                        "waiting": len(self.s.roles.trainers), "started": time.perf_counter()}
        command = {"op": "checkpoint", "path": str(stage / "train"), "rng": str(stage / "rng"), "version": v}
        self.s.runlog.event("progress", line=f"checkpoint at version {v}: saving")
        return [(rank, command) for rank in self.s.roles.trainers]

    def checkpointed(self, message: dict) -> None:
        p = self.pending
        if p is None or message["version"] != p["version"]:
            raise RuntimeError(f"a trainer reported checkpoint version {message.get('version')}, none was asked "
                               f"for ({p and p['version']})")
        p["waiting"] -= 1
        p["train_s"] = max(p.get("train_s", 0.0), message["save_s"])
        if p["waiting"]:
            return
        path = self.store.commit(p["stage"], p["version"], p["state"])
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        self.pending, self.saved_version = None, p["version"]
        self.s.runlog.event("checkpoint_saved", version=p["version"], path=str(path), bytes=size,
                            trainers_s=round(p["train_s"], 3), total_s=round(time.perf_counter() - p["started"], 3),
                            kept=self.store.versions())

    # ------------------------------------------------------------------ stop

    def on_stop(self, phase: str, relaying: bool) -> str:
        """After the stop signal: ``done`` once the run may end, ``wait`` while a step, a
        save or a re-forming training world finishes (also the first step: trainers that
        post a policy nobody takes would hold the world's exit), ``save`` when the state at
        this version is to be saved first (``job.checkpoint_on_stop``; after the final
        evaluation too, so that a requeued run does not train the steps since the last
        periodic checkpoint again, only evaluates). A held-out evaluation or the export in
        flight is waited for (up to ``job.stop_grace_s``; a final one then completes the run): its episodes' tool calls are served by
        this loop, and a leader left waiting for them kept the world from parting (seen in
        the soak: the parting timed out after 60 s)."""
        s = self.s
        if self.stop_seen is None:  # the first look since the stop came: what was going on
            stats = s.service.stats() if s.service is not None else {}
            self.stop_seen = {"training": s.training, "rollout_turns_running": stats.get("leased", 0),
                              "rollout_trajectories_in_flight": stats.get("active", 0)}
        waited = s.stop.clock() - s.stop.at
        if (phase.startswith("eval:") or phase == "export") and waited <= s.cfg.job.stop_grace_s:
            return "wait"  # the leaders' shares come back first (their tool calls go through this loop)
        if phase in ("eval:final", "export") and self.pending is None and s.cfg.job.checkpoint_on_stop \
                and s.version > 0 and self.saved_version != s.version:
            return "save"  # every step trained: the resumed run only evaluates (it redid the last steps)
        if phase != "rl":
            return "wait" if self.pending is not None else "done"
        if s.training or self.pending is not None or relaying:
            if waited > s.cfg.job.stop_grace_s:  # the limit comes before the step ends: resume from the last save
                self.abandoned = round(waited, 1)
                return "done"
            return "wait"
        if not s.cfg.job.checkpoint_on_stop or s.version == 0 or self.saved_version == s.version:
            return "done"
        return "save"

    def after_stop(self, signal: str, phase: str) -> None:
        """The run stopped early (``stop_requested``, with what was going on when it came):
        under Slurm, ask for a requeue while requeues are left (from the checkpoint just
        saved, or the newest one when the step in flight was abandoned, or from the start
        when the stop came before the first save); else say how to resume by hand."""
        s = self.s
        folder = s.runlog.folder
        s.runlog.event("stop_requested", signal=signal, phase=phase, version=s.version, **(self.stop_seen or {}),
                       **({"abandoned_after_s": self.abandoned} if self.abandoned else {}))
        if self.abandoned:
            log.warning("the step in flight did not end within job.stop_grace_s=%g s of the stop: abandoned",
                        s.cfg.job.stop_grace_s)
        why = requeue_refusal(os.environ, s.cfg.cluster.requeue, s.cfg.cluster.max_requeues)
        if self.abandoned:  # the newest checkpoint on disk, whichever run saved it
            self.saved_version = next(iter(self.store.versions()), None)
        if why is None:
            job, restarts = os.environ["SLURM_JOB_ID"], restart_count(os.environ)
            start = "the start" if self.saved_version is None else self.store.path(self.saved_version)
            ask_requeue(folder, f"job {job}: stopped by {signal} at version {s.version}; resume from {start}")
            s.runlog.event("requeue_requested", job=job, restart_count=restarts, version=self.saved_version)
            return
        s.runlog.event("requeue_not_requested", reason=why, version=self.saved_version,
                       resume_by_hand=f"python launch.py --resume {folder}")
