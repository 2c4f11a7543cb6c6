"""What rank 0 builds before its loop starts: the policy the run starts from (the cached
or freshly built warm start) and the C-MLFQ queue service on a layout's buckets."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any


def warm_start(cfg: Any, task: Any, orchestrator: Any, runlog: Any) -> tuple[Path, float]:
    """The policy the run starts from, and the seconds spent building it (0 cached):
    ``job.eval_checkpoint`` if set, else the warm start keyed by its inputs under
    ``job.cache_dir`` (built on a miss), else the base model."""
    from libra_hpc.engines.tiny import resolve_model
    from libra_hpc.metrics.progress import PhaseProgress
    from libra_hpc.rl.warmstart import build_warmstart, fingerprint

    if cfg.job.eval_checkpoint:
        return Path(cfg.job.eval_checkpoint), 0.0
    cache = Path(cfg.job.cache_dir).expanduser() if cfg.job.cache_dir else Path.home() / ".cache" / "libra_hpc"
    base = resolve_model(cfg.model, cache_dir=cache)
    if not cfg.job.warmstart:
        return base, 0.0
    spec = fingerprint(base, task, getattr(cfg.tasks, cfg.rl.task).model_dump(), cfg.warmstart)
    warm = cache / f"warmstart-{spec['fingerprint']}"
    if (warm / "build.json").is_file():
        runlog.event("warmstart", path=str(warm), cached=True)
        return warm, 0.0
    import torch

    torch.set_num_threads(max(cfg.job.torch_threads, 2))
    started = time.perf_counter()
    runlog.event("warmstart", path=str(warm), cached=False, demonstrations=cfg.warmstart.demonstrations)
    bar: list = []

    def tick(step: int, total: int, note: str) -> None:
        if not bar:
            bar.append(PhaseProgress("warm start", total, lambda fields: runlog.event("progress", **fields),
                                     unit="steps"))
        bar[0].update(step, note)

    build_warmstart(warm, base, task, spec, cfg.warmstart, orchestrator,
                    progress=lambda line: runlog.event("progress", line=line), tick=tick)
    return warm, time.perf_counter() - started


def queue_service(cfg: Any, roles: Any, runlog: Any) -> tuple[Any, Any]:
    """A C-MLFQ queue service (and its router) on ``roles``' rollout buckets; the buckets
    are logged (``buckets``)."""
    from libra_hpc.scheduler.routers import router_from_config
    from libra_hpc.scheduler.service import QueueService

    s = cfg.scheduler
    buckets = roles.buckets(s.bucket_token_limits)
    router = router_from_config(s, buckets, seed=cfg.rl.seed)
    runlog.event("buckets", policy=s.policy, buckets={b.name: {"tp": b.tp, "token_limit": b.token_limit,
                                                               "instances": list(b.instances)} for b in buckets})
    service = QueueService(router, lease_s=s.lease_s, max_batch=s.max_batch, size_thresholds=s.size_thresholds,
                           error_markers=s.error_markers, buckets=buckets)
    return service, router
