"""The controller (rank 0) of the RL job: one event loop, never holding a token or a weight.

Handlers on the loop (:mod:`.loop`): the C-MLFQ queue (``QUEUE_REQUEST``,
:class:`~libra_hpc.scheduler.mpi_service.QueueHandler`), tool actions on the shared
Tangram pool (``TOOL_REQUEST``, :class:`~.tools.ToolService`) and the ranks' reports
(``REPORT``, :meth:`JobController._report`). What the run goes through:

1. ``starting``: the warm start is built (or found cached) before the loop; every rank
   gets its role (:class:`~.roles.Roles`) and starts its engine, then says ``ready``;
2. ``eval:warmstart``: the leaders score the held-out prompts greedily, a share each;
3. ``rl``: batch ``b`` (``rl.prompts_per_step`` prompts × ``rl.group_size``) goes into the
   queue once policy ``b - rl.max_staleness`` exists; a finished trajectory is routed
   (its whole GRPO group to one DP replica, the one with the fewest tokens of that batch
   so far) and its leader sends it there; when batch ``b`` is complete and step ``b - 1``
   is done, the trainers run step ``b`` and post policy ``b + 1`` to the leaders, who take
   it at their next turn boundary. With ``rl.partial_rollout`` the step's groups are the
   first to finish that the staleness bound allows, from any batch in flight, and groups
   that would outlive the bound are regenerated (:mod:`.partial`);
4. ``eval:final`` once every leader runs the last policy, then ``export`` (the policy as a
   Hugging Face checkpoint), then ``stop``; the report, plots and ``summary.json``.

A failure anywhere (a rank that raises, a report that names an error) ends the job with
the rank's message; the metrics and events written so far stay.
"""

from __future__ import annotations

import logging
import statistics
import time
from pathlib import Path
from typing import Any

from libra_hpc.cluster.layout import layout_from_config
from libra_hpc.config_learning import epochs_at
from libra_hpc.cluster.messages import COMMAND, QUEUE_REQUEST, REPORT
from libra_hpc.runtime.checkpointing import CheckpointDriver
from libra_hpc.runtime.episodes import batch_of, group_of, trajectory_id
from libra_hpc.runtime.heartbeat import stand_down
from libra_hpc.runtime.hybrid import HybridDriver
from libra_hpc.runtime.partial import PartialDriver
from libra_hpc.parallel.dispatch import least_loaded, make_dispatcher
from libra_hpc.runtime.planning import PlannerDriver
from libra_hpc.runtime.roles import Roles, roles_from_layout

log = logging.getLogger(__name__)


class JobFailed(RuntimeError):
    """A rank reported an error; the message names the rank and its role."""


class JobController:
    def __init__(self, world: Any, cfg: Any, runlog: Any, stop: Any):
        self.world, self.cfg, self.runlog, self.stop = world, cfg, runlog, stop
        self.comm = world.comm
        self.phase = "starting"
        self.started = time.perf_counter()
        self.summary: dict[str, Any] = {"scheduler_policy": cfg.scheduler.policy}
        self.ready: set[int] = set()
        self.evals: dict[str, list[dict]] = {}
        self.version = 0
        self.training = False
        self.batches: dict[int, dict] = {}
        self.trained: dict[int, list[dict]] = {}
        self.group_dest: dict[str, int] = {}
        self.leader_version: dict[int, int] = {}
        self.leader_load: dict[int, dict] = {}
        self.idle_rollout_s = 0.0
        self.trained_tids: list[str] = []
        self.duplicate_reports = 0  # trajectories finished twice (an expired lease): the copy dropped
        self.last_step_end = None
        self.exported: str | None = None
        self.rss: dict[str, float] = {}
        self.migrations_seen = self.migrations_before = 0
        self.load_history: list[tuple[float, dict]] = []
        self.tensorboard = None
        if cfg.logging.tensorboard:
            from libra_hpc.metrics.tensorboard import TensorBoardWriter

            self.tensorboard = TensorBoardWriter(runlog.folder)
        self.last_rollout_s = self.last_step_s = 0.0
        self.partial: PartialDriver | None = None
        self.sampler_at: dict[int, dict] = {}  # the prompt stream's position before each batch in flight was drawn
        self.resumed = False

    # ------------------------------------------------------------------ start

    def run(self) -> dict:
        from libra_hpc.envs.registry import task_from_config
        from libra_hpc.rl.rollout import PromptSampler
        from libra_hpc.runtime.loop import EventLoop
        from libra_hpc.runtime.tools import ToolService
        from libra_hpc.scheduler.mpi_service import QueueHandler
        from libra_hpc.tools.orchestrator import orchestrator_from_config

        cfg = self.cfg
        self.runlog.event("world_started", **self.world.topology.describe(), backend=self.world.backend)
        self.task = task_from_config(cfg)
        self.orchestrator = orchestrator_from_config(cfg.tools, cfg.scheduler, extra=self.task.runners())
        try:
            self.warm, build_s = self._warm_start()
            self.summary["warmstart_build_s"] = round(build_s, 1)
            self.layout = self.initial = layout_from_config(cfg)
            self.ids = {g.slots: g.gid for g in self.layout.rollout_instances}
            self.roles: Roles = roles_from_layout(self.layout, self.world.topology.rank_of, self.ids)
            self.planner = None if cfg.job.eval_checkpoint else PlannerDriver(self)
            self.hybrid = None if self.planner is None else HybridDriver(self)
            self.runlog.event("layout_applied", step=0, by="config", **self.layout.summary())
            self.checkpoints = CheckpointDriver(self)
            loaded = self.checkpoints.find()
            self.world.command({"op": "start", "roles": self.roles, "warm": str(self.warm),
                                **self.checkpoints.start_message(loaded)})
            self.sampler = PromptSampler(self.task.splits, seed=cfg.rl.seed)
            self.service = self._queue_service()
            if loaded is not None:
                self.checkpoints.restore(loaded)
                self.resumed = True
            self.partial = PartialDriver(self) if cfg.rl.partial_rollout and not cfg.job.eval_checkpoint else None
            loop = self.loop = EventLoop(self.comm)
            self.queue = QueueHandler(self.comm, self.service)
            loop.on(QUEUE_REQUEST, self.queue.handle, malformed=self.queue.malformed, fatal=True, name="queue request")
            loop.when_idle(lambda now: self.service.maintain(now))  # the service in use (a replan builds another)
            self.tools = ToolService(self.comm, self.orchestrator)
            self.tools.attach(loop)
            loop.on(REPORT, self._report, malformed=self._malformed_report, fatal=True, name="report")
            loop.every(5.0, self._progress, name="progress")
            loop.run(stop_when=lambda: self.phase == "done" or self.checkpoints.stop_now())
            if self.stop and self.phase != "done":
                self.runlog.event("stop_requested", signal=self.stop.signal, phase=self.phase, version=self.version)
                self.checkpoints.after_stop()
        finally:
            stand_down()  # ranks that exit from here on are not lost
            # the last policy posted: leaders take it before they exit, so that no send of it
            # is left unmatched (MPI_Finalize would wait for it)
            self.world.command({"op": "stop", "version": self.version})
            self.orchestrator.close()
        return self._finish()

    def _warm_start(self) -> tuple[Path, float]:
        """The policy the run starts from, and the seconds spent building it (0 cached)."""
        from libra_hpc.engines.tiny import resolve_model
        from libra_hpc.rl.warmstart import build_warmstart, fingerprint

        cfg = self.cfg
        if cfg.job.eval_checkpoint:
            return Path(cfg.job.eval_checkpoint), 0.0
        cache = Path(cfg.job.cache_dir).expanduser() if cfg.job.cache_dir else Path.home() / ".cache" / "libra_hpc"
        base = resolve_model(cfg.model, cache_dir=cache)
        if not cfg.job.warmstart:
            return base, 0.0
        spec = fingerprint(base, self.task, getattr(cfg.tasks, cfg.rl.task).model_dump(), cfg.warmstart)
        warm = cache / f"warmstart-{spec['fingerprint']}"
        if (warm / "build.json").is_file():
            self.runlog.event("warmstart", path=str(warm), cached=True)
            return warm, 0.0
        import torch

        torch.set_num_threads(max(cfg.job.torch_threads, 2))
        started = time.perf_counter()
        self.runlog.event("warmstart", path=str(warm), cached=False, demonstrations=cfg.warmstart.demonstrations)
        build_warmstart(warm, base, self.task, spec, cfg.warmstart, self.orchestrator,
                        progress=lambda line: self.runlog.event("progress", line=f"warm start: {line}"))
        return warm, time.perf_counter() - started

    def _queue_service(self):
        from libra_hpc.scheduler.routers import router_from_config
        from libra_hpc.scheduler.service import QueueService

        s = self.cfg.scheduler
        buckets = self.roles.buckets(s.bucket_token_limits)
        router = self.router = router_from_config(s, buckets, seed=self.cfg.rl.seed)
        self.runlog.event("buckets", policy=s.policy, buckets={b.name: {"tp": b.tp, "token_limit": b.token_limit,
                                                                         "instances": list(b.instances)} for b in buckets})
        return QueueService(router, lease_s=s.lease_s, max_batch=s.max_batch, size_thresholds=s.size_thresholds,
                            error_markers=s.error_markers, buckets=buckets)

    def rebuild_queue(self) -> None:
        """A fresh queue service on the current layout's buckets (a replan applied; nothing
        is in flight). Its migrations add to the ones counted before."""
        self.migrations_before += self.service.stats()["migrations"]
        self.migrations_seen = 0
        self.service = self.queue.service = self._queue_service()

    # ------------------------------------------------------------------ reports

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

    def _on_error(self, message: dict, source: int) -> None:
        raise JobFailed(f"rank {source} ({message.get('role')} on {message.get('slot')}): {message.get('error')}")

    def _on_ready(self, message: dict, source: int) -> None:
        self.ready.add(source)
        if message.get("note"):
            self.runlog.event("warning", rank=source, role=message.get("role"), line=message["note"])
        if len(self.ready) == len(self.world.workers):
            self.runlog.event("ready", start_s=round(time.perf_counter() - self.started, 2))
            if self.resumed:  # the warm start's evaluation is in the checkpoint's summary
                self._begin_rl()
            else:
                self._start_eval("checkpoint" if self.cfg.job.eval_checkpoint else "warmstart")

    def _on_load(self, message: dict, source: int) -> None:
        self.leader_load[message["instance"]] = message
        if self.planner is not None:
            self.planner.load(message)
        self.load_history.append((time.perf_counter(), {i: m["tokens"] for i, m in self.leader_load.items()}))
        del self.load_history[:-500]

    # --- evaluation

    def _start_eval(self, phase: str) -> None:
        n = min(self.cfg.job.eval_prompts, len(self.task.splits.heldout))
        leaders = sorted(self.roles.leaders.items())
        if n == 0:
            return self._eval_done(phase, [])
        self.phase = f"eval:{phase}"
        self.evals[phase] = []
        self._eval_expect = 0
        for k, (_, rank) in enumerate(leaders):
            indices = list(range(k, n, len(leaders)))
            if indices:
                self._send(rank, {"op": "eval", "phase": phase, "indices": indices})
                self._eval_expect += 1
        self.runlog.event("progress", line=f"held-out evaluation ({phase}): {n} prompts on {self._eval_expect} instances")

    def _on_eval(self, message: dict, source: int) -> None:
        got = self.evals[message["phase"]]
        got.append(message)
        if len(got) == self._eval_expect:
            self._eval_done(message["phase"], got)

    def _eval_done(self, phase: str, parts: list[dict]) -> None:
        rewards = [r for p in parts for r in p["rewards"]]
        success = statistics.fmean(rewards) if rewards else None
        self.summary[f"eval_success_{phase}"] = None if success is None else round(success, 4)
        self.summary["eval_prompts"] = len(rewards)
        self.runlog.event("eval", phase=phase, success=success, prompts=len(rewards), version=self.version,
                          wall_s=max((p["wall_s"] for p in parts), default=0.0))
        log.info("held-out success (%s): %s on %d prompts", phase, success, len(rewards))
        if phase == "warmstart" and self.cfg.rl.steps > 0:
            self._begin_rl()
        elif phase in ("warmstart", "checkpoint") or (phase == "final" and not self.cfg.job.export):
            self.phase = "done"
        elif phase == "final":
            self.phase = "export"
            path = str(self.runlog.folder / "checkpoint")
            for rank in self.roles.trainers:
                self._send(rank, {"op": "export", "path": path})
            self._export_expect = len(self.roles.trainers)
            self._export_parts: list[dict] = []

    def _begin_rl(self) -> None:
        """Training starts (or resumes) at the current version: its batch and the ones the
        staleness bound lets run ahead are submitted."""
        self.phase = "rl"
        self.rl_started = time.perf_counter()
        kept = self.checkpoints.partial_state
        if kept is not None:  # partial rollout resumed: the checkpoint's groups in flight, generated again
            self.partial.restore(kept, self.version)
        else:
            for b in range(self.version, min(self.version + self.cfg.rl.max_staleness + 1, self.cfg.rl.steps)):
                self._submit(b)
        if self.version >= self.cfg.rl.steps:  # resumed from the last step's checkpoint
            self._start_eval("final")

    def _on_exported(self, message: dict, source: int) -> None:
        if message.get("path"):
            self.exported = message["path"]
            self._export_parts.append(message)
            self.runlog.event("exported", path=message["path"], tensors=message["tensors"],
                              stage=message.get("stage", 0))
        self._export_expect -= 1
        if self._export_expect == 0:
            write_export_index(self._export_parts)
            self.phase = "done"

    # --- rollout

    def _submit(self, b: int) -> None:
        cfg = self.cfg
        if self.planner is not None and self.planner.holding():  # a replan waits for the pipeline to drain
            self.planner.held.append(b)
            return
        self.sampler_at[b] = self.sampler.state()
        prompts = self.sampler.next(cfg.rl.prompts_per_step, lambda: f"training batch {b}")
        if self.partial is not None:
            return self.partial.submit(b, prompts)
        self.batches[b] = {"submitted": time.perf_counter(), "done": 0, "tids": set(), "tokens": {}, "rows": [],
                           "groups": {}, "pids": [p.pid for p in prompts]}
        for p in prompts:
            for k in range(cfg.rl.group_size):
                self.service.submit(trajectory_id(b, p.pid, k), p.pid)

    def _on_traj(self, message: dict, source: int) -> None:
        if not self._first_report(message, source):
            return
        if self.partial is not None:
            return self.partial.finished(message, source)
        tid = message["tid"]
        b, group = batch_of(tid), group_of(tid)
        batch = self.batches[b]
        batch["tids"].add(tid)
        dest = self.group_dest.get(group)
        if dest is None:
            dest = self.group_dest[group] = self.pick_replica(batch["tokens"])
            batch["groups"].setdefault(dest, []).append(group)
        batch["tokens"][dest] = batch["tokens"].get(dest, 0) + message["tokens"]
        batch["rows"].append(message)
        batch["done"] += 1
        self.service.drain_finished()
        self.route(source, tid, dest)
        done = batch.setdefault("group_done", {})
        done[group] = done.get(group, 0) + 1
        if done[group] == self.cfg.rl.group_size:
            self._stream(b)
        if batch["done"] == self.cfg.batch_size:
            batch["complete"] = time.perf_counter()
            self._maybe_train()

    def pick_replica(self, tokens: dict[int, int]) -> int:
        """The DP replica a new group goes to: of those training may route to (not one the
        hybrid pool is about to return), the one with the fewest ``tokens`` so far
        (:func:`~libra_hpc.parallel.dispatch.least_loaded`)."""
        open_ = [d for d in range(len(self.roles.replicas)) if self.hybrid is None or d not in self.hybrid.no_route]
        return least_loaded(tokens, open_)

    def _first_report(self, message: dict, source: int) -> bool:
        """A trajectory reported a second time is dropped at its leader (``route`` nowhere).
        That happens when a lease expired under a live leader (it stalled past
        ``scheduler.lease_s``, or its instance was unknown to the queue for that long): the
        queue ran the turn again elsewhere and both copies finished. The first report
        counts; its copy may arrive after its batch trained."""
        tid = message["tid"]
        if self.partial is not None:
            seen = self.partial.reported(tid)
        else:
            batch = self.batches.get(batch_of(tid))
            seen = batch is None or tid in batch["tids"]
        if not seen:
            return True
        self.duplicate_reports += 1
        self.runlog.event("warning", rank=source, role="rollout",
                          line=f"trajectory {tid} reported again by rank {source} (instance {message.get('instance')}): "
                               "its lease had expired and the turn ran twice; this copy is dropped")
        self._send(source, {"op": "route", "tid": tid, "dest": [], "replica": None})
        return False

    def route(self, source: int, tid: str, replica: int) -> None:
        """Tell leader ``source`` where trajectory ``tid`` goes: every rank of DP
        ``replica``, by the path of ``parallel.dispatch`` (direct, or through the first
        training rank, which forwards: the ``forward`` hops)."""
        hub = self.roles.replicas[0][0]
        hops = make_dispatcher(self.cfg.parallel.dispatch, hub).path(source, self.roles.replicas[replica])
        self._send(source, {"op": "route", "tid": tid, "dest": list(hops[0].dests), "replica": replica,
                            "forward": [[h.source, list(h.dests)] for h in hops[1:]]})

    def _on_aborted(self, message: dict, source: int) -> None:
        if self.partial is None:
            raise JobFailed(f"rank {source} reported trajectory {message.get('tid')} aborted, but rl.partial_rollout "
                            "is off: nothing asks for aborts")
        self.partial.aborted(message, source)

    def in_flight(self) -> bool:
        """A submitted trajectory is not trained yet (a replan waits for none)."""
        return self.partial.in_flight() if self.partial is not None else bool(self.batches)

    def untrained_on(self, replica: int) -> bool:
        """Trajectories routed to DP ``replica`` wait for a training step."""
        if self.partial is not None:
            return self.partial.untrained_on(replica)
        return any(batch["groups"].get(replica) for batch in self.batches.values())

    def _on_weights_taken(self, message: dict, source: int) -> None:
        self.leader_version[source] = message["version"]
        self.idle_rollout_s += message["idle_s"]
        if self.phase == "rl" and self.version == self.cfg.rl.steps and self._leaders_current():
            self._start_eval("final")

    def _leaders_current(self) -> bool:
        return all(self.leader_version.get(r, 0) >= self.version for r in self.roles.leaders.values())

    # --- training

    def _stream(self, b: int) -> None:
        """``rl.stream_training``: batch ``b``'s complete groups go to their replicas'
        trainers to be trained ahead (``accumulate``), once ``b`` is the next step the
        trainers take (the one they train now, if any, is ``b - 1``: its command is ahead of
        these). Steps of several passes train whole. The step's ``train`` still names all
        its groups: a trainer skips those it accumulated, and trains again those whose
        gradients a relayout took (runtime/trainer.py)."""
        cfg = self.cfg
        if not cfg.rl.stream_training or self.partial is not None or self.stop or b >= cfg.rl.steps:
            return
        if b != self.version + (1 if self.training else 0) or epochs_at(cfg.rl.update_epochs, b) > 1 or b not in self.batches:
            return
        batch = self.batches[b]
        sent = batch.setdefault("streamed", set())
        ready = [g for g, n in batch.get("group_done", {}).items() if n == cfg.rl.group_size and g not in sent]
        if not ready:
            return
        by_replica: dict[int, list[str]] = {}
        for g in ready:
            by_replica.setdefault(self.group_dest[g], []).append(g)
        sent.update(ready)
        for rank in self.roles.trainers:
            self._send(rank, {"op": "accumulate", "batch": b, "groups": by_replica})

    def _maybe_train(self) -> None:
        if self.hybrid is not None:
            self.hybrid._maybe_relayout()  # a waiting relayout goes first once its moment came
        b = self.version
        if self.training or (self.hybrid and self.hybrid.busy()) or b >= self.cfg.rl.steps or self.stop:
            return
        discard: list[str] = []
        if self.partial is not None:
            decided = self.partial.decide(b)
            if decided is None:
                return
            groups, discard = decided
        elif "complete" in self.batches.get(b, {}):
            groups = self.batches[b]["groups"]
        else:
            return
        self.training = True
        leaders = [r for i, r in self.roles.leaders.items() if self.hybrid is None or i not in self.hybrid.leaving]
        for rank in self.roles.trainers:
            self._send(rank, {"op": "train", "batch": b, "groups": groups, "discard": discard, "leaders": leaders})
        self._stream(b + 1)  # the next batch's groups that are complete already

    def _on_trained(self, message: dict, source: int) -> None:
        b = message["batch"]
        reports = self.trained.setdefault(b, [])
        reports.append(message)
        self.trained_tids += message.get("tids", [])
        if len(reports) < len(self.roles.trainers):
            return
        self.training = False
        self.version = b + 1
        rows = self._record_step(b, reports)
        if self.planner is not None:
            self.planner.observe(b, rows, reports, epochs_at(self.cfg.rl.update_epochs, b))
            self.planner.after_step(b, reports)
        for old in [k for k in self.sampler_at if k < self.version]:
            del self.sampler_at[old]
        if self.checkpoints.due() and not (self.hybrid and (self.hybrid.pending or self.hybrid.relaying)):
            self.checkpoints.save()  # before the next train command: the trainers save this version first
        if self.version + self.cfg.rl.max_staleness < self.cfg.rl.steps:
            self._submit(self.version + self.cfg.rl.max_staleness)
        self._maybe_train()
        if self.planner is not None:
            self.planner.maybe_apply()
        if self.version == self.cfg.rl.steps and self._leaders_current():
            self._start_eval("final")

    def _record_step(self, b: int, reports: list[dict]) -> list[dict]:
        if self.partial is not None:
            batch = self.partial.step_record(b)
        else:
            batch = self.batches.pop(b)
            for groups in batch["groups"].values():
                for group in groups:
                    del self.group_dest[group]
        rows = batch["rows"]
        now = time.perf_counter()
        step_s = now - (self.last_step_end or self.rl_started)
        self.last_step_end = now
        rollout_s = batch["complete"] - batch["submitted"]
        self.last_rollout_s, self.last_step_s = rollout_s, step_s
        gen = sum(r["gen_tokens"] for r in rows)
        stats = self.service.stats()
        lags = [b - r["min_version"] for r in rows]
        metrics = dict(
            version=self.version, reward=round(statistics.fmean(r["reward"] for r in rows), 4),
            trajectories=len(rows), gen_tokens=gen, tokens_per_s=round(gen / max(rollout_s, 1e-9), 1),
            rollout_s=round(rollout_s, 3), train_s=round(max(r["train_s"] for r in reports), 3),
            push_s=round(max(r["push_s"] for r in reports), 3), step_s=round(step_s, 3),
            gpus=self._gpus(),
            queue_depth=stats["queued"], migrations=stats["migrations"] - self.migrations_seen,
            moves=sum(r["migrations"] for r in rows),
            staleness_max=max(lags), staleness_mean=round(statistics.fmean(lags), 3),
            tool_calls=sum(r["tool_calls"] for r in rows), tool_s=round(sum(r["tool_s"] for r in rows), 3),
            tool_failures=sum(r.get("tool_failures", 0) for r in rows),
            tool_timeouts=sum(r.get("tool_timeouts", 0) for r in rows),
            turns=round(statistics.fmean(r["turns"] for r in rows), 3),
            idle_s={"rollout": round(self.idle_rollout_s, 3), "training": round(max(r["wait_s"] for r in reports), 3)},
            loss=reports[0]["loss"], grad_norm=reports[0]["grad_norm"],
            groups=sum(r["groups"] for r in reports if "tids" in r),
            groups_filtered=sum(r["filtered_groups"] for r in reports if "tids" in r),
            dropped_stale=sum(sum(r["dropped_stale"].values()) for r in reports if "tids" in r),
            forwarded=sum(r.get("forwarded", 0) for r in reports),
            **({"streamed_groups": sum(r.get("streamed_groups", 0) for r in reports if "tids" in r),
                "stream_s": round(max(r.get("stream_s", 0.0) for r in reports), 3)} if self.cfg.rl.stream_training else {}),
            scheduler_policy=self.cfg.scheduler.policy, **({"partial": batch["partial"]} if "partial" in batch else {}))
        self.idle_rollout_s = 0.0
        self.migrations_seen = stats["migrations"]
        self.runlog.metric(b, **metrics)
        if self.tensorboard is not None:
            self.tensorboard.scalars(b, metrics)
            self.tensorboard.flush()
        line = (f"step {b + 1}/{self.cfg.rl.steps}: reward {metrics['reward']:.3f}, {metrics['tokens_per_s']:.0f} tok/s, "
                f"rollout {rollout_s:.1f} s, train {metrics['train_s']:.1f} s, {metrics['migrations']} migrations "
                f"({metrics['moves']} turns moved instance), "
                f"{metrics['tool_calls']} tool calls, staleness ≤ {metrics['staleness_max']}")
        self.runlog.event("progress", line=line)
        log.info(line)
        return rows

    # ------------------------------------------------------------------ helpers

    def _gpus(self) -> dict:
        """GPUs per role now; hybrid slots counted on the side they serve."""
        hybrid = self.layout.hybrid
        train = set(self.layout.training.slots)
        roll = set(self.layout.slots_of("rollout"))
        return {"training": len(train - hybrid), "rollout": len(roll - hybrid),
                "hybrid_training": len(train & hybrid), "hybrid_rollout": len(roll & hybrid)}

    # --- the hybrid pool (HybridDriver does the work)

    def _on_checkpointed(self, message: dict, source: int) -> None:
        self.checkpoints.checkpointed(message)

    def batch_tids(self, b: int) -> list[str]:
        """Every trajectory id submitted for batch ``b`` (in flight)."""
        return [trajectory_id(b, pid, k) for pid in self.batches[b]["pids"] for k in range(self.cfg.rl.group_size)]

    def _on_left(self, message: dict, source: int) -> None:
        self.hybrid.left(message, source)

    def _on_relaid(self, message: dict, source: int) -> None:
        self.hybrid.relaid(message, source)

    def _send(self, rank: int, message: dict) -> None:
        self.comm.send(message, dest=rank, tag=COMMAND)

    def _progress(self) -> None:
        if self.phase != "rl":
            return
        loads = self.leader_load.values()
        stats = self.service.stats()
        self.runlog.event("load", version=self.version, queue=stats["queued"],
                          active=stats.get("active"), instances={i: {"tokens": m["tokens"], "busy_s": m["busy_s"],
                                                                     "running": m["running"], "kv": m["kv_usage"]}
                                                                 for i, m in self.leader_load.items()},
                          tokens=sum(m["tokens"] for m in loads))

    def _finish(self) -> dict:
        s = self.summary
        submitted = self.cfg.rl.steps * self.cfg.batch_size if self.phase == "done" and not self.cfg.job.eval_checkpoint else None
        trained = self.trained_tids
        s.update(steps=self.version, wall_s=round(time.perf_counter() - self.started, 1),
                 trajectories_trained=len(trained), trajectories_duplicated=len(trained) - len(set(trained)),
                 trajectory_reports_dropped=self.duplicate_reports,
                 trajectories_lost=None if submitted is None else submitted - len(set(trained)),
                 tool_calls=self.tools.calls if hasattr(self, "tools") else 0,
                 tool_failures=self.tools.failures if hasattr(self, "tools") else 0,
                 migrations=self.migrations_before + self.service.stats()["migrations"] if hasattr(self, "service") else 0,
                 layouts_applied_by_planner=(self.hybrid.applied + self.planner.replans + self.planner.reshards)
                 if self.hybrid else 0,
                 replans_applied=self.planner.replans if self.planner else 0,
                 reshards_applied=self.planner.reshards if self.planner else 0,
                 dispatch=self.cfg.parallel.dispatch,
                 hybrid_switches=self.hybrid.applied if self.hybrid else 0,
                 hybrid_pauses_s=self.hybrid.pauses if self.hybrid else [], checkpoint=self.exported,
                 completed=self.phase == "done")
        metrics = [m for m in _read(self.runlog.folder / "metrics.jsonl") if m.get("kind") == "step"]
        gen = sum(m["gen_tokens"] for m in metrics)
        busy = sum(m["rollout_s"] for m in metrics)
        s["tokens_per_s"] = round(gen / busy, 1) if busy else 0.0
        s["tool_timeouts"] = sum(m.get("tool_timeouts", 0) for m in metrics)  # the model read a timeout
        if self.cfg.rl.stream_training and self.partial is None:  # groups trained ahead of their step, of all
            s["streamed_groups"] = {"streamed": sum(m.get("streamed_groups", 0) for m in metrics),
                                    "of": len(metrics) * self.cfg.rl.prompts_per_step,
                                    "ahead_s": round(sum(m.get("stream_s", 0.0) for m in metrics), 1),
                                    "after_s": round(sum(m["train_s"] for m in metrics), 1)}
        chaos = [r.injected for r in getattr(getattr(self, "orchestrator", None), "runners", {}).values()
                 if hasattr(r, "injected")]
        if chaos:
            s["tool_faults_injected"] = {k: sum(c[k] for c in chaos) for k in ("fail", "hang")}
        s["peak_rss_mb_by_role"] = self._rss_by_role()
        if self.partial is not None:
            s["partial_rollout"] = self.partial.summary()
        if s.get("eval_success_final") is not None and s.get("eval_success_warmstart") is not None:
            s["eval_gain"] = round(s["eval_success_final"] - s["eval_success_warmstart"], 4)
        self.runlog.event("trained_trajectories", tids=trained)
        if self.tensorboard is not None:
            self.tensorboard.close()
        return s

    def _rss_by_role(self) -> dict:
        import resource

        out = {"controller": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
        for key, mb in self.rss.items():
            role = key.split(":")[0]
            out[role] = max(out.get(role, 0.0), mb)
        return out


def _read(path: Path) -> list[dict]:
    from libra_hpc.metrics.runlog import read_jsonl

    return read_jsonl(path)


def write_export_index(parts: list[dict]) -> None:
    """A pipeline-parallel export is one safetensors file per stage: write the index that
    Hugging Face loaders read (``model.safetensors.index.json``: every weight's file).
    Nothing to do for one stage. Raises RuntimeError when a stage did not report."""
    import json

    if not parts or parts[0].get("stages", 1) == 1:
        return
    stages = parts[0]["stages"]
    got = sorted(p["stage"] for p in parts)
    if got != list(range(stages)):
        raise RuntimeError(f"export: stages {got} reported, expected 0..{stages - 1}")
    weight_map: dict[str, str] = {}
    for p in parts:
        weight_map.update(p["weight_map"])
    index = {"metadata": {"total_size": sum(p["bytes"] for p in parts)}, "weight_map": dict(sorted(weight_map.items()))}
    (Path(parts[0]["path"]) / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
