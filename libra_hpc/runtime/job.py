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

    def report(self, message: dict) -> None:
        message = {**message, "role": self.role, "rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
        self.comm.send(message, dest=CONTROLLER, tag=REPORT)


def run_job_worker(world: Any, data: Any, cfg: Any) -> None:
    start = world.next_command()
    if start["op"] == "stop":
        return
    job = Job(world, data, cfg, start)
    try:
        _run_role(job, start)
    except BaseException as exc:
        log.exception("rank %d (%s on %s) failed", job.rank, job.role, job.slot)
        job.report({"op": "error", "slot": job.slot, "error": f"{type(exc).__name__}: {exc}",
                    "traceback": traceback.format_exc(limit=8)})
        raise


def _run_role(job: Any, start: dict) -> None:
    from libra_hpc.runtime.worker import Worker

    worker = Worker(job.world)
    started = time.perf_counter()
    handle = worker.apply(job.roles.layout)  # forms this rank's group; trainers start their torch world
    place = job.world.topology.place_of(job.rank)
    device = "cpu" if place.device_index is None else "cuda"
    try:
        if job.role == "trainer":
            import torch

            from libra_hpc.engines.train.engine import MegatronTrainEngine
            from libra_hpc.runtime.trainer import Trainer

            torch.set_num_threads(job.cfg.job.torch_threads)
            engine = worker.own(MegatronTrainEngine.from_config(job.warm, job.cfg.model, job.cfg.training,
                                                                seed=job.cfg.rl.seed))
            job.report({"op": "ready", "start_s": round(time.perf_counter() - started, 2)})
            Trainer(job, engine).run()
        elif job.role == "leader":
            from libra_hpc.engines.rollout.vllm_engine import VllmRolloutEngine
            from libra_hpc.runtime.rollout import RolloutLeader

            instance = job.roles.instance_of(job.rank)
            engine = worker.own(VllmRolloutEngine.from_config(job.warm, job.cfg.model, job.cfg.rollout, job.cfg.training,
                                                              instance=job.roles.groups[instance], device=device,
                                                              seed=job.cfg.rl.seed + instance))
            job.report({"op": "ready", "start_s": round(time.perf_counter() - started, 2)})
            RolloutLeader(job, engine, instance).run()
        else:
            job.report({"op": "ready", "start_s": round(time.perf_counter() - started, 2)})
            command = job.world.next_command()
            if command["op"] != "stop":
                raise ValueError(f"rank {job.rank} (rollout member): unexpected command {command['op']!r}")
    finally:
        worker.close()
