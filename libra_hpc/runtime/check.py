"""The cluster check (``job.mode: check``), rank 0's side: before a long run, see that the
MPI world, every group's communicator and the training ranks' torch worlds work, and that
they survive the layout changes the hybrid pool makes.

No planner and no RL: the layouts are the config's scripted ones, the initial layout, the
hybrid pool lent to training at ``planner.borrow_at_step`` and given back at
``planner.return_at_step`` (the RL job, libra_hpc/runtime/controller.py, moves the pool by
cost). Each step is one control round over the MPI control plane
(:class:`~libra_hpc.cluster.world.World`): send every worker the step's command (with a
new layout when it changes), let every group run its check collective (MPI; training
ranks also their torch world, rebuilt when the training group changes), collect one
report per worker and record it (``group_check`` events, one metrics row per step).
"""

from __future__ import annotations

import logging
import time

from libra_hpc.cluster.layout import Layout, layout_from_config, lend_hybrid_to_training, return_hybrid_to_rollout
from libra_hpc.cluster.world import World
from libra_hpc.config import ExperimentConfig
from libra_hpc.metrics.runlog import RunLog
from libra_hpc.runtime.heartbeat import stand_down
from libra_hpc.runtime.signals import StopRequest

log = logging.getLogger(__name__)


class GroupCheckError(RuntimeError):
    """A group's check collective returned the wrong sum: its communicator is broken."""


def next_layout(cfg: ExperimentConfig, step: int, current: Layout, initial: Layout) -> Layout | None:
    """The layout to switch to before ``step``, or None to keep the current one."""
    if step == cfg.planner.borrow_at_step and current.hybrid:
        return lend_hybrid_to_training(current, reason=f"planner.borrow_at_step={step}: lend the hybrid pool to training")
    if step == cfg.planner.return_at_step and current.hybrid:
        return return_hybrid_to_rollout(current, initial, reason=f"planner.return_at_step={step}: hybrid pool back to rollout")
    return None


def run_controller(world: World, cfg: ExperimentConfig, runlog: RunLog, stop: StopRequest) -> None:
    runlog.event("world_started", **world.topology.describe(), backend=world.backend)
    initial = layout = layout_from_config(cfg)
    runlog.event("layout_planned", **layout.summary())
    steps_done = 0
    for step in range(cfg.rl.steps):
        if stop:
            runlog.event("stop_requested", step=step, signal=stop.signal, reason="Slurm's time-limit warning")
            break
        start = time.perf_counter()
        new = layout if step == 0 else next_layout(cfg, step, layout, initial)
        world.command({"op": "step", "step": step, "layout": new})
        if new is not None:
            world.apply(new)
            layout = new
        reports = world.reports()
        if new is not None:
            apply_s = max(r["apply_s"] for r in reports)
            runlog.event("layout_applied", step=step, apply_s=apply_s, **new.summary())
            log.info("step %d: layout v%d applied in %.3f s (%s)", step, new.version, apply_s, new.reason)
        _check(reports, step, runlog)
        runlog.metric(
            step,
            step_s=round(time.perf_counter() - start, 4),
            layout_version=layout.version,
            gpus_training=len(layout.slots_of("training")),
            gpus_rollout=len(layout.slots_of("rollout")),
            rollout_instances=len(layout.rollout_instances),
            probe_ms_max=max(r.get("torch_ms", r["mpi_ms"]) for r in reports),
        )
        steps_done = step + 1
    stand_down()  # ranks that exit from here on are not lost
    world.command({"op": "stop"})
    runlog.event("shutdown", steps=steps_done, of=cfg.rl.steps, final_layout_version=layout.version)


def _check(reports: list[dict], step: int, runlog: RunLog) -> None:
    """Every rank's group all-reduce over MPI, and on training ranks over their torch
    world, must equal its group's size."""
    groups: dict[str, list[dict]] = {}
    for report in reports:
        groups.setdefault(report["group"], []).append(report)
    bad = [r for r in reports
           if r["mpi_sum"] != r["size"] or (r["role"] == "training" and r.get("torch_sum") != r["size"])]
    runlog.event(
        "group_check",
        step=step,
        ok=not bad,
        groups={name: _group_summary(rs) for name, rs in sorted(groups.items())},
    )
    if bad:
        raise GroupCheckError(f"step {step}: check collective failed on {bad}")


def _group_summary(reports: list[dict]) -> dict:
    summary = {"size": reports[0]["size"], "ranks": sorted(r["rank"] for r in reports),
               "formed_at": reports[0]["formed_at"], "mpi_ms_max": max(r["mpi_ms"] for r in reports)}
    if "torch_ms" in reports[0]:
        summary.update(torch_ms_max=max(r["torch_ms"] for r in reports), torch_world=reports[0]["torch_world"])
    return summary
