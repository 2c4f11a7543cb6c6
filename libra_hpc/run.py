"""Rank-side entry point: ``srun --mpi=pmi2 python -m libra_hpc.run --config X``
(or under ``mpiexec``). Rank 0 runs the controller, every other rank a GPU slot; the
MPI world is the control plane (:mod:`libra_hpc.cluster.world`), torch worlds are the
roles' own (:mod:`libra_hpc.runtime.worker`)."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from libra_hpc.cluster.env import ProcessEnv, set_rank_defaults
from libra_hpc.config import ConfigError, ExperimentConfig, dump_config, load_config
from libra_hpc.metrics.runlog import run_folder

set_rank_defaults()  # before any rank loads torch (nothing above does)

log = logging.getLogger("libra_hpc.run")
ABORT_GRACE_S = 2.0
_LEFT: list[float] = []
EXIT_REPORT_S = 8.0  # a rank not gone this long after its end dumps its threads' stacks to stderr
PART_TIMEOUT_S = 60.0  # every rank at the end of its loop within this, or the world is ended


def log_folder(cfg: ExperimentConfig, env: ProcessEnv, given: str | None) -> Path:
    """``<logging.dir>/<job name>-<job id>``, the same folder sbatch's ``%x-%j`` names."""
    if given:
        return Path(given)
    return run_folder(cfg.logging.dir, env.job_name or cfg.cluster.job_name, env.job_id or "nojob")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m libra_hpc.run", description=__doc__)
    parser.add_argument("--config", help="experiment YAML (default: built-in defaults)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a field")
    parser.add_argument("--log-dir", help="log folder (default: <logging.dir>/<job name>-<job id>)")
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.set)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    env = ProcessEnv.read()

    from libra_hpc.cluster.world import World  # MPI init happens here, after the config is known to be good
    from libra_hpc.metrics.runlog import RunLog
    from libra_hpc.runtime.check import run_controller
    from libra_hpc.runtime.signals import StopRequest, install_fault_signals
    from libra_hpc.runtime.worker import run_worker

    from mpi4py import MPI

    rank = MPI.COMM_WORLD.Get_rank()
    stop = StopRequest().install()  # every rank: Slurm's USR2 must not kill workers either
    install_fault_signals()  # soak runs only (LIBRA_FAULTS=1)
    logging.basicConfig(level=cfg.logging.level, format=f"%(asctime)s [rank {rank}] %(name)s: %(message)s")
    runlog = None
    beats = []
    folder = log_folder(cfg, env, args.log_dir)  # the same on every rank (the heartbeats go there)
    try:
        if rank == 0:
            runlog = RunLog(folder, dump_config(cfg))
            stop.watch(folder, batch_shell=env.job_id is not None)
            handler = logging.FileHandler(folder / "controller.log")
            handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s"))
            logging.getLogger().addHandler(handler)
        world = World.connect(env, cfg.cluster.nodes, cfg.cluster.gpus_per_node, cfg.cluster.torch_backend)
        _remove_stale_shm(world, runlog)
        if cfg.job.heartbeat_timeout_s > 0:
            beats = _start_heartbeats(world, cfg, folder, runlog)
        if cfg.job.mode == "check":
            if world.rank == 0:
                log.info("controller up: %d ranks, log folder %s (cluster check)", world.size, runlog.folder)
                run_controller(world, cfg, runlog, stop)
            else:
                run_worker(world)
        else:
            run_job(world, cfg, runlog, stop)
        world.close()
    except BaseException as exc:  # noqa: BLE001 - any failure on any rank must stop the whole world
        log.exception("rank %d failed", rank)
        watchdog = next((b for b in beats if hasattr(b, "check_processes")), None)
        if watchdog is not None and (dead := watchdog.check_processes()) is not None:
            watchdog.on_lost(dead)  # the error came from a rank's death: name the rank (aborts)
        if runlog is not None:
            runlog.event("failure", rank=rank, error=f"{type(exc).__name__}: {exc}")
        else:
            # Give the controller a moment to record a failure it may share (Abort kills
            # every rank at once); a controller blocked on us loses only this delay.
            time.sleep(ABORT_GRACE_S)
        MPI.COMM_WORLD.Abort(1)
    finally:
        for beat in beats:
            beat.close()
        if beats:
            from libra_hpc.runtime.heartbeat import ignore_failure_notice

            ignore_failure_notice()
        if runlog is not None:
            runlog.close()
    _report_a_slow_exit(rank)
    return 0


def _report_a_slow_exit(rank: int) -> None:
    """A rank still alive ``EXIT_REPORT_S`` after its end prints its threads' stacks to
    stderr (``job.out``; the "leaving" line names the rank's main thread as the stacks do)."""
    import faulthandler
    import threading

    _LEFT.append(time.monotonic())
    log.info("rank %d (main thread 0x%016x): leaving", rank, threading.get_ident())
    faulthandler.dump_traceback_later(EXIT_REPORT_S, exit=False)


def exit_rank(code: int) -> None:
    """The rank process's end (``python -m libra_hpc.run``): once the world has parted
    (:func:`_part`: no message in flight), the processes this rank started and that are
    still there are killed (a vLLM worker, a tool's sandbox), ``MPI_Finalize`` runs, the
    ``/dev/shm`` segments no live process holds any more are removed (a TP worker that
    vLLM stopped with SIGTERM leaves its own; :mod:`libra_hpc.cluster.shm`'s rules, as
    at the start), and the process ends without the interpreter's teardown, which on a
    loaded node took 8-12 s (torch's and vLLM's objects and threads) and does nothing the
    job needs: the logs, the run log and every file are closed by then. Before MPI
    started (a bad config): a plain exit."""
    import os

    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is None or not mpi.Is_initialized() or mpi.Is_finalized():
        sys.exit(code)
    rank = mpi.COMM_WORLD.Get_rank()
    reaped = _reap_children()
    took = time.monotonic() - _LEFT[0] if _LEFT else 0.0
    log.info("rank %d: MPI_Finalize %.1f s after leaving%s, then the process ends", rank, took,
             f" ({reaped} child process(es) killed)" if reaped else "")
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    mpi.Finalize()
    try:  # what the engines' workers could not unlink (a TP worker stopped by SIGTERM); the last rank out gets all
        from libra_hpc.cluster.shm import remove_stale

        remove_stale()
    except OSError:
        pass
    os._exit(code)


def _reap_children() -> int:
    """Kill (SIGKILL) every process this one started that is still alive, and wait for
    them (at most 5 s); how many there were."""
    try:
        import psutil
    except ImportError:
        return 0
    children = psutil.Process().children(recursive=True)
    for child in children:
        try:
            child.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(children, timeout=5)
    return len(children)


def _remove_stale_shm(world, runlog) -> None:
    """Once per node (rank 0 on its own, the first rank of every other node): remove the
    ``/dev/shm`` segments a killed job of this user left (:mod:`libra_hpc.cluster.shm`)."""
    place = None if world.rank == 0 else world.topology.place_of(world.rank)
    if place is not None and (world.topology.emulated or place.slot.node == 0 or place.slot.gpu != 0):
        return
    from libra_hpc.cluster.shm import remove_stale

    try:
        removed, freed = remove_stale()
    except OSError as exc:  # never a reason not to run
        log.warning("rank %d: /dev/shm not cleaned: %s", world.rank, exc)
        return
    if removed:
        where = "the controller's node" if place is None else f"node {place.slot.node}"
        log.info("rank %d: removed %d stale /dev/shm segments (%.1f MB) on %s", world.rank, len(removed),
                 freed / 1e6, where)
        if runlog is not None:
            runlog.event("leftovers_removed", what=removed[:20], count=len(removed), bytes=freed,
                         why="/dev/shm segments of processes that are gone")


def _start_heartbeats(world, cfg: ExperimentConfig, folder: Path, runlog) -> list:
    """This rank's heartbeat; on rank 0 also the watchdog over the workers, which ends
    the world when one falls silent (:mod:`libra_hpc.runtime.heartbeat`)."""
    import os
    import threading

    from mpi4py import MPI

    from libra_hpc.runtime.heartbeat import Heartbeat, Watchdog, describe_lost, install_failure_notice
    from libra_hpc.runtime.resume import ask_requeue, requeue_refusal

    install_failure_notice()
    where = folder / "heartbeats"
    job = cfg.job
    slot = "controller" if world.rank == 0 else str(world.topology.place_of(world.rank).slot)
    beats = [Heartbeat(where, world.rank, job.heartbeat_s, job.heartbeat_timeout_s, slot=slot).start()]
    if world.rank != 0:
        return beats

    def describe(rank: int) -> dict:
        place = world.topology.place_of(rank)
        return {"slot": str(place.slot), "node": place.slot.node}

    said = threading.Lock()

    def lost(what: dict) -> None:
        if not said.acquire(blocking=False):  # the watchdog and the main thread's error path both saw it:
            time.sleep(ABORT_GRACE_S)  # the first one writes the events and aborts; do not abort before it
            return
        line = describe_lost(what)
        refusal = requeue_refusal(os.environ, cfg.cluster.requeue, cfg.cluster.max_requeues)
        # the events first: the world may be torn down any moment now
        runlog.event("rank_lost", **what, line=line, requeue=refusal is None,
                     **({"requeue_refused": refusal} if refusal else {}))
        runlog.event("failure", rank=what["rank"], error=f"RankLost: {line}")
        if refusal is None:
            ask_requeue(folder, f"job {os.environ['SLURM_JOB_ID']}: {line}")
        log.error("%s; ending the job", line)
        MPI.COMM_WORLD.Abort(1)

    beats.append(Watchdog(where, world.workers, describe, job.heartbeat_s, job.heartbeat_timeout_s, lost,
                          progress_timeout_s=job.progress_timeout_s).start())
    return beats


def run_job(world, cfg: ExperimentConfig, runlog, stop) -> None:
    """The RL job (``job.mode: rl``): rank 0 the controller, the others their roles."""
    from mpi4py import MPI

    data = MPI.COMM_WORLD.Dup()  # the data plane's own communicator (collective, once)
    unsent: list = []
    if world.rank == 0:
        from libra_hpc.runtime.controller import JobController

        log.info("controller up: %d ranks, log folder %s", world.size, runlog.folder)
        controller = JobController(world, cfg, runlog, stop)
        summary = controller.run()
        _write_report(runlog, summary)
        runlog.event("shutdown", steps=summary["steps"], of=cfg.rl.steps, completed=summary["completed"])
        if controller.checkpoints.abandoned:
            # ranks still in the abandoned step would not see `stop` before the time limit
            log.warning("ending the world now: the step in flight was abandoned (job.stop_grace_s)")
            MPI.COMM_WORLD.Abort(0)
    else:
        from libra_hpc.runtime.job import run_job_worker

        unsent = run_job_worker(world, data, cfg)
    _part(world, data, unsent, runlog)
    data.Free()


def _part(world, data, unsent: list, runlog) -> None:
    """Every rank: the world's last exchange (:mod:`libra_hpc.cluster.parting`), so that
    ``MPI_Finalize`` has no send left to wait on. A rank that never arrives ends the world
    (``MPI_Abort``) rather than leaving it hanging: the summary is written by then."""
    from mpi4py import MPI

    from libra_hpc.cluster.parting import part

    parting = part(world.comm, [world.comm, data], unsent, timeout_s=PART_TIMEOUT_S)
    if parting.complete:
        log.info("rank %d: %s", world.rank, parting.line())
        return
    log.error("rank %d: %s; ending the world", world.rank, parting.line())
    if runlog is not None:
        runlog.event("parting_timed_out", waited_s=round(parting.waited_s, 1), line=parting.line())
    MPI.COMM_WORLD.Abort(0)


def _write_report(runlog, summary: dict) -> None:
    import json

    try:
        from libra_hpc.metrics.report import write_report
    except ImportError:
        (runlog.folder / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True))
        return
    write_report(runlog.folder, summary)


if __name__ == "__main__":
    exit_rank(main())
