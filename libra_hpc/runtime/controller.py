"""The controller (rank 0) of the RL job: one event loop, never holding a token or a weight.

Handlers on the loop (:mod:`.loop`): the C-MLFQ queue, tool actions on the shared Tangram pool (:mod:`.tools`)
and the ranks' reports (one ``_on_<op>`` method each). The run: ``starting``, ``eval:warmstart``
(:mod:`.evaluation`), ``rl`` (batches queued within the staleness bound, trajectories routed to their group's
DP replica, a step when the batch tracker, :mod:`.batches`, says so; then :mod:`.planning` may decide a layout
change that :mod:`.relayout` carries out; checkpoints at step boundaries, :mod:`.checkpointing`),
``eval:final``, ``export``, ``done``. The controller owns the job's state (:class:`~.state.JobState`) and is
the only object that sends: its helpers answer with the commands to send."""

from __future__ import annotations

import logging
import time
from typing import Any

from libra_hpc.cluster.layout import layout_from_config
from libra_hpc.cluster.messages import COMMAND, QUEUE_REQUEST, REPORT, Outbox
from libra_hpc.config_learning import epochs_at
from libra_hpc.parallel.dispatch import make_dispatcher
from libra_hpc.runtime import records
from libra_hpc.runtime.batches import tracker_from_config
from libra_hpc.runtime.checkpointing import CheckpointDriver
from libra_hpc.runtime.evaluation import RESUME_KEYS, HeldOut
from libra_hpc.runtime.heartbeat import stand_down
from libra_hpc.runtime.planning import PlannerDriver, resumed_layout
from libra_hpc.runtime.relayout import Relayouts
from libra_hpc.runtime.roles import roles_from_layout
from libra_hpc.runtime.startup import queue_service, warm_start
from libra_hpc.runtime.state import JobFailed, JobState, Sends

log = logging.getLogger(__name__)
__all__ = ["JobController", "JobFailed"]


class JobController:
    def __init__(self, world: Any, cfg: Any, runlog: Any, stop: Any):
        self.world, self.cfg, self.runlog, self.stop = world, cfg, runlog, stop
        self.comm = world.comm
        self.outbox = Outbox(self.comm)  # commands, tool results, queue replies: never waiting for a busy rank
        self.state = JobState(cfg, runlog, world.topology.rank_of, stop=stop)
        self.phase = "starting"
        self.started = time.perf_counter()
        self.summary: dict[str, Any] = {"scheduler_policy": cfg.scheduler.policy}
        self.ready: set[int] = set()
        self.trained: dict[int, list[dict]] = {}
        self.trained_tids: list[str] = []
        self.duplicate_reports = 0  # trajectories finished twice (an expired lease): the copy dropped
        self.idle_rollout_s = 0.0
        self.last_step_end: float | None = None
        self.exported: str | None = None
        self.rss: dict[str, float] = {}
        self.migrations_seen = self.migrations_before = 0
        self.held_routes: list[tuple[int, str, int]] = []  # (leader, tid, replica) finished while a step trains
        self.resumed = False
        self.steplog = records.StepLog(cfg, runlog)

    # ------------------------------------------------------------------ the loop

    def run(self) -> dict:
        from libra_hpc.envs.registry import task_from_config
        from libra_hpc.rl.rollout import PromptSampler
        from libra_hpc.runtime.loop import EventLoop
        from libra_hpc.runtime.tools import ToolService
        from libra_hpc.scheduler.mpi_service import QueueHandler
        from libra_hpc.tools.orchestrator import orchestrator_from_config

        cfg, s = self.cfg, self.state
        self.runlog.event("world_started", **self.world.topology.describe(), backend=self.world.backend)
        self.task = task_from_config(cfg)
        self.heldout = HeldOut(cfg, self.task, self.runlog, self.summary)
        self.orchestrator = orchestrator_from_config(cfg.tools, cfg.scheduler, extra=self.task.runners())
        try:
            self.warm, build_s = warm_start(cfg, self.task, self.orchestrator, self.runlog)
            self.summary["warmstart_build_s"] = round(build_s, 1)
            self.checkpoints = CheckpointDriver(s)
            loaded = self.checkpoints.find()  # resumed: in the layout the checkpoint was saved in
            s.layout, s.initial, s.ids = resumed_layout(loaded and loaded.state, layout_from_config(cfg))
            s.roles = roles_from_layout(s.layout, s.rank_of, s.ids)
            s.service, self.router = queue_service(cfg, s.roles, self.runlog)
            self.batches = tracker_from_config(cfg, s, PromptSampler(self.task.splits, seed=cfg.rl.seed))
            self.relayout = Relayouts(s, self.batches.untrained_on, self.rebuild_queue)
            self.planner = None if cfg.job.eval_checkpoint else PlannerDriver(s, self.relayout)
            if self.planner is not None:  # groups are placed by their training work, attention included
                self.batches.dispatch.weigh = self.planner.model.sequence_train_flops
            self.runlog.event("layout_applied", step=0, by="checkpoint" if loaded else "config", **s.layout.summary())
            self.world.command({"op": "start", "roles": s.roles, "warm": str(self.warm),
                                **self.checkpoints.start_message(loaded)})
            if loaded is not None:
                self._restore(loaded)
            loop = EventLoop(self.comm)
            self.queue = QueueHandler(self.comm, s.service, outbox=self.outbox)
            loop.on(QUEUE_REQUEST, self.queue.handle, malformed=self.queue.malformed, fatal=True, name="queue request")
            loop.when_idle(lambda now: s.service.maintain(now))  # the service in use (a replan builds another)
            loop.when_idle(lambda now: self.outbox.progress() and False)  # forget the sends taken
            self.tools = ToolService(self.outbox, self.orchestrator)
            self.tools.attach(loop)
            loop.on(REPORT, self._report, malformed=self._malformed_report, fatal=True, name="report")
            loop.every(5.0, self._progress, name="progress")
            loop.run(stop_when=lambda: self.phase == "done" or self._stop_now())
            if self.stop and self.phase != "done":
                self.checkpoints.after_stop(self.stop.signal, self.phase)
        finally:
            stand_down()  # ranks that exit from here on are not lost; leaders take the last policy
            self.world.command({"op": "stop", "version": s.version})
            if left := self.outbox.flush(timeout_s=10.0):
                log.warning("messages never taken at the stop (rank: count): %s", left)
            self.orchestrator.close()
        return self._finish()

    def _report(self, message: Any, source: int) -> None:
        if not isinstance(message, dict) or "op" not in message:
            raise JobFailed(f"rank {source} sent a malformed report: {message!r:.200}")
        if "rss_mb" in message:
            key = f"{message.get('role')}:{source}"
            self.rss[key] = max(self.rss.get(key, 0.0), message["rss_mb"])
        handler = getattr(self, f"_on_{message['op']}", None)
        if handler is None:
            raise JobFailed(f"rank {source} sent a report with unknown op {message['op']!r}")
        handler(message, source)

    def _malformed_report(self, source: int, exc: Exception) -> None:
        """A report that does not unpickle: what it said is lost (a finished trajectory,
        a trained step), so the job cannot go on as if it had come."""
        raise JobFailed(f"rank {source} sent a report that could not be read ({exc!r}); "
                        "the job stops rather than wait for what it said")

    def _send(self, rank: int, message: dict) -> None:
        self.outbox.send(message, rank, COMMAND)

    def _send_all(self, sends: Sends) -> None:
        leaving = []
        for rank, message in sends:
            self.outbox.send(message, rank, COMMAND)
            if message.get("op") == "leave":
                leaving.append(rank)
        if leaving:  # a leader leaves once it holds nothing: the groups it holds members of are placed now
            self._send_routes(self.batches.place_held_at(leaving, self.relayout.open_replicas()))

    # ------------------------------------------------------------------ reports

    def _on_error(self, message: dict, source: int) -> None:
        raise JobFailed(f"rank {source} ({message.get('role')} on {message.get('slot')}): {message.get('error')}")

    def _on_ready(self, message: dict, source: int) -> None:
        self.ready.add(source)
        n, of = len(self.ready), len(self.world.workers)
        self.runlog.event("progress", phase="ranks ready", done=n, total=of, unit="ranks", line=f"{n}/{of} ranks ready")
        if message.get("note"):
            self.runlog.event("warning", rank=source, role=message.get("role"), line=message["note"])
        if len(self.ready) == len(self.world.workers):
            self.runlog.event("ready", start_s=round(time.perf_counter() - self.started, 2))
            if self.resumed:  # the warm start's evaluation is in the checkpoint's summary
                self._begin_rl()
            else:
                self._start_eval("checkpoint" if self.cfg.job.eval_checkpoint else "warmstart")

    def _on_load(self, message: dict, source: int) -> None:
        s = self.state
        s.leader_load[message["instance"]] = message
        if self.planner is not None:
            self.planner.load(message)
        s.load_history.append((time.perf_counter(), {i: m["tokens"] for i, m in s.leader_load.items()}))
        del s.load_history[:-500]

    def _on_eval(self, message: dict, source: int) -> None:
        if self.heldout.got(message):
            self._eval_done(message["phase"])

    def _on_exported(self, message: dict, source: int) -> None:
        if message.get("path"):
            self.exported = message["path"]
            self.export_parts.append(message)
            self.runlog.event("exported", path=message["path"], tensors=message["tensors"],
                              stage=message.get("stage", 0))
        self.export_waiting.discard(source)
        if not self.export_waiting:
            records.write_export_index(self.export_parts)
            self.phase = "done"

    def _on_traj(self, message: dict, source: int) -> None:
        """A finished trajectory: routed where its group trains. A second report of it (a
        lease expired under a live leader: the queue ran its turn again elsewhere and both
        copies finished) is routed nowhere; the first counts."""
        tid = message["tid"]
        if self.batches.reported(tid):
            self.duplicate_reports += 1
            self.runlog.event("warning", rank=source, role="rollout",
                              line=f"trajectory {tid} reported again by rank {source} (instance "
                                   f"{message.get('instance')}): its lease had expired and the turn ran twice; "
                                   "this copy is dropped")
            return self._send_routes([(source, tid, None)])
        message["finished_at"] = time.perf_counter()  # the planner's chain records (runtime/planning.py)
        routes, may_train = self.batches.finished(message, source, self.relayout.open_replicas())
        if source in self._leaving_leaders():
            routes += self.batches.place_held_at([source], self.relayout.open_replicas())
        self.state.service.drain_finished()
        self._send_routes(routes)
        self._stream()
        if may_train:
            self._maybe_train()

    def _on_aborted(self, message: dict, source: int) -> None:
        self.batches.aborted(message, source)
        self.state.service.drain_finished()

    def _on_weights_taken(self, message: dict, source: int) -> None:
        self.state.leader_version[source] = message["version"]
        self.idle_rollout_s += message["idle_s"]
        self._maybe_final_eval()

    def _on_trained(self, message: dict, source: int) -> None:
        s, cfg = self.state, self.cfg
        b = message["batch"]
        reports = self.trained.setdefault(b, [])
        reports.append(message)
        self.trained_tids += message.get("tids", [])
        if len(reports) < len(s.roles.trainers):
            return
        s.training, s.version = False, b + 1
        self._release_routes()  # before anything that may change the replicas
        rows = self._record_step(b, reports)
        if self.planner is not None:
            self.planner.observe(b, rows, reports, epochs_at(cfg.rl.update_epochs, b))
            self._send_all(self.planner.after_step(b, reports))
        if self.checkpoints.due() and not self.relayout.moving():
            self._save_checkpoint()  # before the next train command: the trainers save this version first
        if s.version + cfg.rl.max_staleness < cfg.rl.steps:
            self._submit(s.version + cfg.rl.max_staleness)
        if self.planner is not None:  # a waiting replan or re-shard first, at this step boundary
            self._send_all(self.planner.maybe_apply(self.batches.rolling(), self.batches.untrained()))
        self._maybe_train()
        self._maybe_final_eval()

    def _on_checkpointed(self, message: dict, source: int) -> None:
        self.checkpoints.checkpointed(message)

    def _on_left(self, message: dict, source: int) -> None:
        """A rollout instance's leader left its loop for a relayout."""
        instance, for_replan = message["instance"], self.relayout.left(message["instance"])
        self.runlog.event("instance_drained" if for_replan else "hybrid_drained", instance=instance, rank=source,
                          drain_s=message["drain_s"])
        self._send_all(self.relayout.advance() if for_replan else self.planner.left(instance))
        self._maybe_final_eval()  # a leader that left needs no last policy

    def _on_relaid(self, message: dict, source: int) -> None:
        """A rank re-formed in the new layout; once all have, the change is applied."""
        trainers_back, done = self.relayout.relaid(source, self.planner.pool_instances())
        if done is not None:
            for b in self.planner.applied(done):  # a replan's held batches
                self._submit(b)
        if done is not None or trainers_back:
            self._maybe_train()
        self._maybe_final_eval()  # the leaders changed

    # ------------------------------------------------------------------ evaluation

    def _start_eval(self, phase: str) -> None:
        self.phase = f"eval:{phase}"
        sends = self.heldout.start(phase, self.relayout.serving())
        self._send_all(sends)
        if not sends:
            self._eval_done(phase)

    def _eval_done(self, phase: str) -> None:
        self.heldout.result(phase, self.state.version)
        if phase == "warmstart" and self.cfg.rl.steps > 0:
            self._begin_rl()
        elif phase in ("warmstart", "checkpoint") or (phase == "final" and not self.cfg.job.export):
            self.phase = "done"
        elif phase == "final":
            self.phase, self.export_parts = "export", []
            self.export_waiting = set(self.state.roles.trainers)
            for rank in self.export_waiting:
                self._send(rank, {"op": "export", "path": str(self.runlog.folder / "checkpoint")})

    # ------------------------------------------------------------------ rollout and training

    def _begin_rl(self) -> None:
        """Training starts (or resumes) at the current version (the tracker submits what runs first)."""
        self.phase = "rl"
        self.rl_started = time.perf_counter()
        self.batches.begin(self.state.version)
        if self.state.version >= self.cfg.rl.steps:  # resumed from the last step's checkpoint
            self._start_eval("final")

    def _submit(self, b: int) -> None:
        if self.planner is None or not self.planner.hold_batch(b):  # a replan waits for the pipeline to drain
            self.batches.submit(b)

    def _leaving_leaders(self) -> set[int]:
        """The leader ranks of the instances that leave rollout (a lend or a replan)."""
        leaders = self.state.roles.leaders
        return {leaders[i] for i in self.relayout.leaving if i in leaders}

    def _send_routes(self, routes: list[tuple[int, str, int | None]]) -> None:
        """(leader, trajectory, DP replica) from the batch tracker; replica None: nowhere
        (its group was regenerated), the leader drops it."""
        for source, tid, replica in routes:
            if replica is None:
                self._send(source, {"op": "route", "tid": tid, "dest": [], "replica": None})
            else:
                self._route(source, tid, replica)

    def _route(self, source: int, tid: str, replica: int) -> None:
        """Tell leader ``source`` where trajectory ``tid`` goes: every rank of DP ``replica``, by
        ``parallel.dispatch``'s path (direct, or through the first training rank: ``forward``).
        While a step trains, the route waits for its end (:meth:`_release_routes`): trainers
        inside a step take no message, and a leader's sends to them held MPICH's shared-memory
        cells (64 a sender by default, shared by all its receivers) until the leader could
        send nothing, not even its queue requests to rank 0 (every default run: a batch's last
        turns stuck 12-37 s beside the last four-pass step). The trajectory waits at its
        leader instead, which a trainer could not have taken sooner."""
        if self.state.training:
            self.held_routes.append((source, tid, replica))
            return
        replicas = self.state.roles.replicas
        hops = make_dispatcher(self.cfg.parallel.dispatch, replicas[0][0]).path(source, replicas[replica])
        self._send(source, {"op": "route", "tid": tid, "dest": list(hops[0].dests), "replica": replica,
                            "forward": [[h.source, list(h.dests)] for h in hops[1:]]})

    def _release_routes(self) -> None:
        """The routes held while the step trained (:meth:`_route`), in the order they came."""
        held, self.held_routes = self.held_routes, []
        for source, tid, replica in held:
            self._route(source, tid, replica)

    def _stream(self) -> None:
        """``rl.stream_training``: the next step's complete groups are trained ahead."""
        ahead = self.batches.stream(self.state)
        if ahead is not None:
            b, by_replica = ahead
            for rank in self.state.roles.trainers:
                self._send(rank, {"op": "accumulate", "batch": b, "groups": by_replica})

    def _maybe_train(self) -> None:
        s = self.state
        self._send_all(self.relayout.advance())  # a waiting relayout goes first once its moment came
        b = s.version
        if s.training or self.relayout.busy() or b >= self.cfg.rl.steps or self.stop:
            return
        if self.planner is not None and self.planner.holds_training():  # the new shape trains what waits
            self._send_all(self.planner.maybe_apply(self.batches.rolling(), self.batches.untrained()))
            return
        start = self.batches.start(b)
        if start is None:
            return
        s.training = True
        if start.abort:
            for rank in self.relayout.serving().values():
                self._send(rank, {"op": "abort", "tids": start.abort})
        self._send_routes([(leader, tid, None) for leader, tid in start.nowhere])
        leaders = self.relayout.training_leaders()
        for rank in s.roles.trainers:
            self._send(rank, {"op": "train", "batch": b, "groups": start.groups, "discard": start.discard,
                              "leaders": leaders})
        self._stream()  # the next batch's groups that are complete already

    def _maybe_final_eval(self) -> None:
        """The last step is trained and every serving leader runs its policy: evaluate."""
        s = self.state
        if self.phase == "rl" and s.version == self.cfg.rl.steps and all(
                s.leader_version.get(r, 0) >= s.version for r in self.relayout.serving().values()):
            self._start_eval("final")

    def _record_step(self, b: int, reports: list[dict]) -> list[dict]:
        s = self.state
        record = self.batches.step_record(b)
        now = time.perf_counter()
        s.last_step_s, self.last_step_end = now - (self.last_step_end or self.rl_started), now
        s.last_rollout_s = record["complete"] - record["submitted"]
        stats = s.service.stats()
        if self.planner is not None:  # the planner's prediction of this step, before it sees the step
            record.setdefault("extra", {}).update(self.planner.predict(b, record, reports, s.last_step_s, now))
        metrics = records.step_metrics(self.cfg, b, s.version, record, reports, step_s=s.last_step_s, queue=stats,
                                       migrations=stats["migrations"] - self.migrations_seen,
                                       idle_rollout_s=self.idle_rollout_s, gpus=s.gpus())
        self.idle_rollout_s, self.migrations_seen = 0.0, stats["migrations"]
        self.steplog.step(b, metrics)
        return record["rows"]

    def rebuild_queue(self) -> None:
        """A fresh queue service on the layout's buckets (a replan's relayout starts; nothing in flight)."""
        s = self.state
        self.migrations_before += s.service.stats()["migrations"]
        self.migrations_seen = 0
        s.service, self.router = queue_service(self.cfg, s.roles, self.runlog)
        self.queue.service = s.service

    # ------------------------------------------------------------------ checkpoints and stop

    def _save_checkpoint(self) -> None:
        s = self.state
        state = {"trained_tids": list(self.trained_tids),
                 "summary": {k: self.summary[k] for k in RESUME_KEYS if k in self.summary},
                 "migrations": self.migrations_before + s.service.stats()["migrations"],
                 "router": self.router.state_dict() if hasattr(self.router, "state_dict") else None,
                 "layout": s.layout.summary(), **self.batches.checkpoint(s.version),
                 **({"planner": self.planner.state_dict()} if self.planner else {})}
        self._send_all(self.checkpoints.save(state))

    def _restore(self, loaded: Any) -> None:
        """The controller's state as the checkpoint saved it."""
        state = loaded.state
        self.state.version = loaded.version
        self.batches.restore(state)
        self.trained_tids = list(state["trained_tids"])
        self.summary.update(state["summary"])
        self.migrations_before = state.get("migrations", 0)
        if state.get("router") is not None and hasattr(self.router, "load_state_dict"):
            self.router.load_state_dict(state["router"])
        if state.get("planner") is not None and self.planner is not None:
            self.planner.load_state_dict(state["planner"], loaded.version)
        self.checkpoints.resumed(loaded)
        self.resumed = True

    def _stop_now(self) -> bool:
        """After the stop signal: True once the run may end (a step in flight and its save first)."""
        if not self.stop:
            return False
        what = self.checkpoints.on_stop(self.phase, bool(self.relayout.relaying))
        if what == "save":
            self._save_checkpoint()
        return what == "done"

    def _progress(self) -> None:  # every 5 s
        if self.phase == "rl":
            self.steplog.load(self.state.version, self.state.service.stats(), self.state.leader_load)

    def _finish(self) -> dict:
        from libra_hpc.metrics.runlog import read_jsonl

        cfg, done = self.cfg, self.phase == "done"
        metrics = [m for m in read_jsonl(self.runlog.folder / "metrics.jsonl") if m.get("kind") == "step"]
        service = self.state.service
        s = records.finish_summary(
            self.summary, metrics, self.trained_tids, steps=self.state.version, completed=done,
            submitted=cfg.rl.steps * cfg.batch_size if done and not cfg.job.eval_checkpoint else None,
            wall_s=time.perf_counter() - self.started, reports_dropped=self.duplicate_reports,
            tools=getattr(self, "tools", None), planner=getattr(self, "planner", None),
            migrations=self.migrations_before + service.stats()["migrations"] if service else 0,
            dispatch=cfg.parallel.dispatch, exported=self.exported, rss=self.rss,
            orchestrator=getattr(self, "orchestrator", None), total_gpus=cfg.cluster.total_gpus,
            tracker=(self.batches.summary(metrics) if hasattr(self, "batches") else {}))
        self.runlog.event("trained_trajectories", tids=self.trained_tids)
        self.steplog.close()
        return s
