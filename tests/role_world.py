"""MPI worlds for tests/test_role_worlds.py: ``mpiexec -n 13 python -m mpi4py tests/role_world.py SCENARIO OUT [MODEL]``.

The default world shape (controller + 6 emulated nodes × 2 slots) and the default layout
(``layout_from_config(ExperimentConfig())``: training on n0g0, rollout instances on the
rest, node 5 the hybrid pool). Rank 0 is the controller: it drives the workers with the
runtime's own control plane (``World.command`` / ``World.reports``) and the workers run
the runtime's own loop (``libra_hpc.runtime.worker.Worker``) with a few test verbs added.
Rank 0 writes OUT/result.json.

``idle``: after the first layout, rank 0 measures the CPU time every worker uses over
``MEASURE_S`` while they wait for their next command (the runtime's wait), then while they
wait in ``comm.bcast`` (MPICH's blocking wait, the control: it must show up as busy).

``engines``: the training rank steps a Megatron engine (tiny model) in its own torch
world while the rollout leader of instance 1 starts a vLLM engine and generates; then the
hybrid pool is lent to training: the training world is rebuilt over 3 ranks, which step
again at DP=3 (the same global batch: the same loss); the leader's engine, untouched,
generates again. The other ranks only wait.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # libra_hpc without an installed package

MEASURE_S = 3.0
TIMEOUT_S = 900.0
ROWS, SEQ = 6, 24  # the global batch: DP=1 and DP=3 both split it evenly


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, in seconds (from /proc/PID/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_fractions(pids: dict[int, int], seconds: float) -> dict[int, float]:
    """rank → share of one core each process used over ``seconds`` of wall time."""
    before = {r: cpu_seconds(p) for r, p in pids.items()}
    start = time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - start
    return {r: round((cpu_seconds(p) - before[r]) / wall, 4) for r, p in pids.items()}


def connect():
    from libra_hpc.cluster.env import ProcessEnv
    from libra_hpc.cluster.layout import layout_from_config
    from libra_hpc.cluster.world import World
    from libra_hpc.config import ExperimentConfig

    cfg = ExperimentConfig()
    world = World.connect(ProcessEnv.read(), cfg.cluster.nodes, cfg.cluster.gpus_per_node, cuda=False)
    return world, layout_from_config(cfg)


# ------------------------------------------------------------------------------ idle

def _pid(worker, command) -> int:
    return os.getpid()


def _bcast_wait(worker, command) -> dict:
    worker.world.comm.bcast(None, root=0)  # MPICH polls while it waits here
    return {}


def scenario_idle(out: Path) -> None:
    world, layout = connect()
    if world.rank != 0:
        from libra_hpc.runtime.worker import Worker

        Worker(world, {"pid": _pid, "bcast_wait": _bcast_wait}).run()
        return
    world.command({"op": "step", "step": 0, "layout": layout})
    world.apply(layout)
    checks = world.reports(timeout_s=TIMEOUT_S)
    world.command({"op": "pid"})
    pids = dict(zip(world.workers, world.reports(timeout_s=TIMEOUT_S)))
    time.sleep(1.0)  # let the last reports' senders settle into their wait
    waiting = cpu_fractions(pids, MEASURE_S)
    world.command({"op": "bcast_wait"})
    time.sleep(0.5)
    spinning = cpu_fractions(pids, MEASURE_S)
    world.comm.bcast("go", root=0)
    world.reports(timeout_s=TIMEOUT_S)
    world.command({"op": "stop"})
    out.joinpath("result.json").write_text(json.dumps({
        "waiting": waiting, "bcast": spinning, "checks_ok": all(r["mpi_sum"] == r["size"] for r in checks),
        "training_torch": [r.get("torch_sum") for r in checks if r["role"] == "training"],
        "cores": os.cpu_count(), "world_size": world.size}))


# --------------------------------------------------------------------------- engines

def _batch(vocab: int):
    import torch

    from libra_hpc.engines.train.loss import PolicyBatch

    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, vocab, (ROWS, SEQ), generator=gen)
    mask = torch.ones(ROWS, SEQ - 1)
    mask[:, :4] = 0
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.25, 0.75, 1.0])[:, None].expand(ROWS, SEQ - 1).contiguous()
    return PolicyBatch(tokens, mask, advantages)


def _train(model: Path):
    def train(worker, command) -> dict:
        """One step of a fresh engine on this DP rank's share of the global batch."""
        import torch
        import torch.distributed as dist

        from libra_hpc.engines.train.engine import MegatronTrainEngine

        torch.set_num_threads(1)  # two cores for thirteen ranks
        engine = worker.own(MegatronTrainEngine(model, tp=1, pp=1, lr=1e-4, micro_batch_size=1))
        place = engine.placement
        share = ROWS // place.dp
        stats = engine.train_step(_batch(engine.shape.vocab_size).slice(place.dp_rank * share,
                                                                        (place.dp_rank + 1) * share))
        return {"rank": worker.world.rank, "dp": place.dp, "dp_rank": place.dp_rank, "loss": stats.loss,
                "grad_norm": stats.grad_norm, "tokens": stats.tokens, "torch_world": dist.get_world_size(),
                "torch_rank": dist.get_rank(), "trainings_started": worker.trainings_started,
                "engine": id(engine)}
    return train


def _generate(model: Path):
    def generate(worker, command) -> dict:
        """Start the instance's engine on the first call (owned by the rollout role), then
        generate greedily from fixed prompts."""
        import torch.distributed as dist

        from libra_hpc.engines.rollout import VllmRolloutEngine

        saved = dict(os.environ)
        engine = getattr(worker, "test_engine", None)
        if engine is None:
            assert not dist.is_initialized(), "a rollout rank started a torch world before vLLM"
            engine = worker.test_engine = worker.own(VllmRolloutEngine(model, tp=1, dtype="float32", seed=0,
                                                                       max_model_len=256, kv_cache_gib=0.25))
            worker.engines_started = getattr(worker, "engines_started", 0) + 1
        outs = engine.generate([[1, 5, 9, 13], [2, 4, 6]], max_tokens=8, temperature=0.0)
        result = {"rank": worker.world.rank, "engine": id(engine), "engines_started": worker.engines_started,
                  "tokens": [o.tokens for o in outs], "group": worker.handle.group.name,
                  "formed_at": worker.handle.formed_at, "vllm_torch_world": dist.get_world_size()}
        os.environ.clear()  # vLLM edits the environment of its process: keep ours as it was
        os.environ.update(saved)
        return result
    return generate


def _torch_state(worker, command) -> dict:
    return {"rank": worker.world.rank, "torch_imported": "torch" in sys.modules,
            "role": worker.handle.group.role}


def scenario_engines(out: Path, model: Path) -> None:
    world, layout = connect()
    if world.rank != 0:
        from libra_hpc.runtime.worker import Worker

        Worker(world, {"train": _train(model), "generate": _generate(model), "torch_state": _torch_state}).run()
        return
    from libra_hpc.cluster.layout import lend_hybrid_to_training

    result: dict = {"world_size": world.size}
    leader = world.topology.rank_of(layout.rollout_instances[0].slots[0])

    def round_(name: str, new_layout) -> None:
        start = time.perf_counter()
        world.command({"op": "step", "step": name, "layout": new_layout})
        world.apply(new_layout)
        checks = world.reports(timeout_s=TIMEOUT_S)
        trainers = [r["rank"] for r in checks if r["role"] == "training"]
        # both engines at once: the trainers step while the leader starts vLLM / generates
        world.command({"op": "train"}, ranks=trainers)
        world.command({"op": "generate"}, ranks=[leader])
        trained = world.reports(trainers, timeout_s=TIMEOUT_S)
        generated = world.reports([leader], timeout_s=TIMEOUT_S)[0]
        result[name] = {"checks": checks, "train": trained, "generate": generated,
                        "seconds": round(time.perf_counter() - start, 2)}

    round_("before", layout)
    round_("after", lend_hybrid_to_training(layout, reason="test: lend the hybrid pool"))
    world.command({"op": "torch_state"})
    result["torch_state"] = world.reports(timeout_s=TIMEOUT_S)
    result["leader"] = leader
    world.command({"op": "stop"})
    out.joinpath("result.json").write_text(json.dumps(result))


def main() -> None:
    from mpi4py import MPI

    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s [rank {MPI.COMM_WORLD.Get_rank()}] "
                                                      "%(name)s: %(message)s")
    scenario, out = sys.argv[1], Path(sys.argv[2])
    start = time.perf_counter()
    if scenario == "idle":
        scenario_idle(out)
    elif scenario == "engines":
        scenario_engines(out, Path(sys.argv[3]))
    else:
        raise SystemExit(f"unknown scenario {scenario!r}: idle or engines")
    print(f"rank {MPI.COMM_WORLD.Get_rank()} done in {time.perf_counter() - start:.1f} s", flush=True)


if __name__ == "__main__":
    main()
