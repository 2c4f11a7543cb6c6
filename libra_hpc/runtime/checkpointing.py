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
from typing import Any

from libra_hpc.cluster.messages import COMMAND
from libra_hpc.runtime.resume import CheckpointStore, Loaded, ask_requeue, requeue_refusal, restart_count

log = logging.getLogger(__name__)


class CheckpointDriver:
    def __init__(self, controller: Any):
        self.c = controller
        cfg = controller.cfg.job
        self.store = CheckpointStore(controller.runlog.folder, keep=cfg.checkpoint_keep)
        self.every = cfg.checkpoint_every_steps
        self.pending: dict | None = None
        self.saved_version: int | None = None
        self.partial_state: dict | None = None  # a resumed run's partial-rollout groups, relaunched when it starts

    # ------------------------------------------------------------------ resume

    def find(self) -> Loaded | None:
        """The newest checkpoint of this log folder that verifies; the ones that do not
        are logged (``checkpoint_rejected``) and skipped."""
        if self.c.cfg.job.eval_checkpoint:
            return None
        loaded, rejected = self.store.latest()
        for path, why in rejected:
            log.warning("checkpoint %s rejected: %s", path, why)
            self.c.runlog.event("checkpoint_rejected", path=str(path), reason=why)
        if loaded is not None and ("partial" in loaded.state) != bool(self.c.cfg.rl.partial_rollout):
            raise ValueError(f"{loaded.path}: written with rl.partial_rollout="
                             f"{str('partial' in loaded.state).lower()}; resume with the configuration that wrote it")
        if loaded is not None and loaded.version > self.c.cfg.rl.steps:
            raise ValueError(f"{loaded.path}: checkpoint at version {loaded.version}, past rl.steps="
                             f"{self.c.cfg.rl.steps}: raise rl.steps or start in another log folder")
        return loaded

    def start_message(self, loaded: Loaded | None) -> dict:
        """What ``start`` tells the ranks: which checkpoint the trainers load, the version
        they send the rollout engines."""
        if loaded is None:
            return {}
        return {"resume": {"checkpoint": str(loaded.path / "train"), "rng": str(loaded.path / "rng"),
                           "version": loaded.version, "fresh_leaders": sorted(self.c.roles.leaders.values())}}

    def restore(self, loaded: Loaded) -> None:
        """The controller's state as saved, and the metric rows of the steps redone gone."""
        c, state = self.c, loaded.state
        c.version = loaded.version
        c.sampler.restore(state["sampler"])
        c.trained_tids = list(state["trained_tids"])
        c.summary.update(state["summary"])
        c.migrations_before = state.get("migrations", 0)
        self.partial_state = state.get("partial")
        router = state.get("router")
        if router is not None and hasattr(c.router, "load_state_dict"):
            c.router.load_state_dict(router)
        dropped = c.runlog.rewind_metrics(loaded.version)
        self.saved_version = loaded.version
        c.runlog.event("resumed", version=loaded.version, path=str(loaded.path), metric_rows_dropped=dropped,
                       regenerate=len(state.get("regenerate", [])),
                       restart_count=restart_count(os.environ),
                       saved_at=state.get("saved_at"))
        log.info("resumed from %s at version %d (%d metric rows of later steps dropped)", loaded.path,
                 loaded.version, dropped)

    # ------------------------------------------------------------------ saving

    def due(self) -> bool:
        """A periodic checkpoint is due at the version just reached."""
        v = self.c.version
        return (self.every > 0 and v % self.every == 0 and 0 < v < self.c.cfg.rl.steps
                and self.saved_version != v and self.pending is None)

    def save(self) -> None:
        c = self.c
        v = c.version
        stage = self.store.staging(v)
        partial = c.partial is not None  # every group drawn so far is trained or kept in the checkpoint
        state = {"sampler": c.sampler.state() if partial else c.sampler_at.get(v, c.sampler.state()),
                 "trained_tids": list(c.trained_tids),
                 "summary": {k: c.summary[k] for k in ("eval_success_warmstart", "eval_prompts", "warmstart_build_s")
                             if k in c.summary},
                 "migrations": c.migrations_before + c.service.stats()["migrations"],
                 "router": c.router.state_dict() if hasattr(c.router, "state_dict") else None,
                 "regenerate": c.partial.in_flight_tids() if partial
                 else sorted(t for b in c.batches if b >= v for t in c.batch_tids(b)),
                 "saved_at": time.time(), "layout": c.layout.summary(),
                 **({"partial": c.partial.state()} if partial else {})}
        self.pending = {"version": v, "stage": stage, "state": state, "waiting": len(c.roles.trainers),
                        "started": time.perf_counter()}
        command = {"op": "checkpoint", "path": str(stage / "train"), "rng": str(stage / "rng"), "version": v}
        for rank in c.roles.trainers:
            c.comm.send(command, dest=rank, tag=COMMAND)
        c.runlog.event("progress", line=f"checkpoint at version {v}: saving")

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
        self.c.runlog.event("checkpoint_saved", version=p["version"], path=str(path), bytes=size,
                            trainers_s=round(p["train_s"], 3), total_s=round(time.perf_counter() - p["started"], 3),
                            kept=self.store.versions())

    # ------------------------------------------------------------------ stop

    def stop_now(self) -> bool:
        """After the stop signal: True once the run may end. A step in progress finishes,
        then (``job.checkpoint_on_stop``) the state at that version is saved."""
        c = self.c
        if not c.stop:
            return False
        if c.phase != "rl":
            return True
        if c.training or self.pending is not None or (c.hybrid is not None and c.hybrid.relaying):
            # a step, a save or a training world re-forming finishes first, also the first
            # step: trainers that post a policy nobody takes would hold the world's exit
            return False
        if not c.cfg.job.checkpoint_on_stop or c.version == 0 or self.saved_version == c.version:
            return True
        self.save()
        return False

    def after_stop(self) -> None:
        """The run stopped early: under Slurm, ask for a requeue while requeues are left
        (from the checkpoint just saved, or from the start when the stop came before the
        first step); else say how to resume by hand."""
        c = self.c
        folder = c.runlog.folder
        why = requeue_refusal(os.environ, c.cfg.cluster.requeue, c.cfg.cluster.max_requeues)
        if why is None:
            job, restarts = os.environ["SLURM_JOB_ID"], restart_count(os.environ)
            start = "the start" if self.saved_version is None else self.store.path(self.saved_version)
            ask_requeue(folder, f"job {job}: stopped by {c.stop.signal} at version {c.version}; resume from {start}")
            c.runlog.event("requeue_requested", job=job, restart_count=restarts, version=self.saved_version)
            return
        c.runlog.event("requeue_not_requested", reason=why, version=self.saved_version,
                       resume_by_hand=f"python launch.py --resume {folder}")
