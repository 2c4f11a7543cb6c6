"""Every rank but the controller: wait for the controller's ``start``, take the role the
layout gives this GPU slot, run that role's loop until ``stop``.

| role | what it holds | its loop |
|---|---|---|
| rollout leader | a vLLM engine of the instance's TP size | :class:`~.rollout.RolloutLeader` |
| rollout member | nothing (its instance's engine spawns the TP workers, or owns the GPU) | waits for ``stop`` |
| trainer | the training torch world and a Megatron-Core engine | :class:`~.trainer.Trainer` |

Any exception is reported to the controller (``error``, naming the rank, role and slot)
before it propagates, so that the job ends with that message, not a hang.
"""

from __future__ import annotations

import logging
import resource
import time
import traceback
from typing import Any

from libra_hpc.cluster.messages import REPORT
from libra_hpc.runtime.heartbeat import note

log = logging.getLogger(__name__)
CONTROLLER = 0


class Job:
    """What every worker rank knows of the job: the communicators, config, roles, task."""

    def __init__(self, world: Any, data: Any, cfg: Any, start: dict):
        from libra_hpc.envs.registry import task_from_config
        from libra_hpc.rl.rollout import TextCodec

        self.world, self.comm, self.data, self.cfg = world, world.comm, data, cfg
        self.rank = world.rank
        self.roles = start["roles"]
        self.warm = start["warm"]
        self.role = self.roles.role_of(self.rank)
        self.slot = str(world.topology.place_of(self.rank).slot)
        self.task = task_from_config(cfg)
        self.codec = TextCodec(self.warm)
        self.prompts = {p.pid: p for p in self.task.splits.train}
        self.heldout = list(self.task.splits.heldout)
        self.unsent: list = []  # send requests a role loop left posted when it stopped (cluster/parting.py)
        self.keep: list = []  # the buffers those sends read from, alive until the parting

    def hand_over(self, requests: list, buffers: list = ()) -> None:
        """A stopping role's posted sends, completed by the world's parting rather than
        waited for here (their receivers may have stopped already)."""
        self.unsent += requests
        self.keep += buffers

    def report(self, message: dict) -> None:
        message = {**message, "role": self.role, "rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
        self.comm.send(message, dest=CONTROLLER, tag=REPORT)


def run_job_worker(world: Any, data: Any, cfg: Any) -> list:
    """This worker rank's part of the job, until ``stop``; returns the send requests its
    roles left posted (for :func:`libra_hpc.cluster.parting.part`)."""
    note("waiting for the controller's start (the warm start, the queue)", waiting=True)
    start = world.next_command()
    if start["op"] == "stop":
        return []
    job = Job(world, data, cfg, start)
    try:
        _run_role(job, start)
    except BaseException as exc:
        log.exception("rank %d (%s on %s) failed", job.rank, job.role, job.slot)
        job.report({"op": "error", "slot": job.slot, "error": f"{type(exc).__name__}: {exc}",
                    "traceback": traceback.format_exc(limit=8)})
        raise
    return job.unsent


def _run_role(job: Any, start: dict) -> None:
    """Take this rank's role, run its loop; after a ``relayout`` (the hybrid pool lent to
    training or given back), take the new role, until ``stop``."""
    import os

    from libra_hpc.runtime.worker import Worker

    worker = Worker(job.world)
    environ = dict(os.environ)  # an in-process vLLM engine writes into it; a trainer here must not see that
    command: dict | None = None
    inbox: dict = {}  # a trainer's groups received and not trained yet, and those to discard: kept
    discarded: set = set()  # across relayouts (the controller may have routed them before the switch)
    try:
        while True:
            started = time.perf_counter()
            note(f"{job.role}: joining its group and starting its engine", role=job.role)
            worker.apply(job.roles.layout)  # forms this rank's group; trainers start their torch world
            if job.role == "trainer":
                command = _train(job, worker, command, inbox, discarded, started,
                                 resume=start.get("resume") if command is None else None)
            elif job.role == "leader":
                command = _roll_out(job, worker, command, started)
                os.environ.clear()
                os.environ.update(environ)
            else:
                job.report({"op": "relaid" if command else "ready", "start_s": round(time.perf_counter() - started, 2)})
                command = _next(job)
            if command is None:
                return
            job.roles, job.role = command["roles"], command["roles"].role_of(job.rank)
    finally:
        worker.close()


def _next(job: Any) -> dict | None:
    """The controller's next command: ``relayout`` (returned) or ``stop`` (None)."""
    note(f"{job.role}: waiting for the controller's next command", waiting=True)
    command = job.world.next_command()
    if command["op"] not in ("stop", "relayout"):
        raise ValueError(f"rank {job.rank} ({job.role}): unexpected command {command['op']!r} between roles")
    return None if command["op"] == "stop" else command


def _train(job: Any, worker: Any, relayout: dict | None, inbox: dict, discarded: set,
           started: float, resume: dict | None = None) -> dict | None:
    import torch

    from libra_hpc.engines.train.checkpoint import load_checkpoint
    from libra_hpc.engines.train.engine import MegatronTrainEngine
    from libra_hpc.runtime.trainer import Trainer

    torch.set_num_threads(job.cfg.job.torch_threads)
    shape = job.roles.layout.training
    engine = worker.own(MegatronTrainEngine.from_config(job.warm, job.cfg.model, job.cfg.training, seed=job.cfg.rl.seed,
                                                        tp=shape.tp, pp=shape.pp))
    trainer = Trainer(job, engine)
    trainer.inbox, trainer.discarded = inbox, discarded
    restore, note = relayout or resume, None
    if restore is not None:  # the state the previous training world (or the job's checkpoint) saved, resharded
        try:
            load_checkpoint(engine, restore["checkpoint"])
        except NotImplementedError as exc:  # the distributed optimizer on CPU: its Adam state cannot load
            if resume is None:
                raise
            load_checkpoint(engine, restore["checkpoint"], with_optimizer=False)
            note = f"resumed with the weights only, the Adam moments restart: {exc}"
        if resume is not None:
            _restore_rng(resume["rng"], job.rank)
        fresh = restore["fresh_leaders"]  # every leader whose engine (re)started (all of them on resume)
        weights = engine.iter_hf()  # collective over the TP group: every trainer iterates
        if trainer.sender is not None and fresh:
            trainer.sender.post(restore["version"], weights, fresh)  # a new engine holds the warm start: send the policy
        else:
            for _ in weights:
                pass
    job.report({"op": "relaid" if relayout else "ready", "start_s": round(time.perf_counter() - started, 2),
                **({"note": note} if note else {})})
    return trainer.run()


def _restore_rng(folder: str, rank: int) -> None:
    """This rank's torch RNG as saved (a rank the checkpoint did not have keeps its seed)."""
    from pathlib import Path

    import torch

    path = Path(folder) / f"rank-{rank}.pt"
    if path.is_file():
        torch.set_rng_state(torch.load(path)["torch"])


def _roll_out(job: Any, worker: Any, relayout: dict | None, started: float) -> dict | None:
    from libra_hpc.engines.rollout.vllm_engine import VllmRolloutEngine
    from libra_hpc.runtime.rollout import RolloutLeader

    place = job.world.topology.place_of(job.rank)
    device = "cpu" if place.device_index is None else "cuda"
    instance = job.roles.instance_of(job.rank)
    engine = worker.own(VllmRolloutEngine.from_config(job.warm, job.cfg.model, job.cfg.rollout, job.cfg.training,
                                                      instance=job.roles.groups[instance], device=device,
                                                      seed=job.cfg.rl.seed + instance))
    job.report({"op": "relaid" if relayout else "ready", "instance": instance,
                "start_s": round(time.perf_counter() - started, 2)})
    if RolloutLeader(job, engine, instance).run() == "stop":
        return None
    return _next(job)
