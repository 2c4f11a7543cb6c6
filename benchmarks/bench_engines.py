"""Engines on the tiny model: rollout tokens/s (one and two vLLM instances), Megatron
training step time at TP=1 and TP=2, and training → rollout weight sync time.

    python benchmarks/bench_engines.py [--steps 10] [--batch 8] [--seq 256] [--sync-mib 64 512]
                                       [--skip-rollout]

* rollout: ``rollout_tokens_per_s`` from benchmarks/bench_engines_rollout.py (one process
  per instance, the machine's cores split between them).
* training: ``mpiexec -n TP`` ranks, each with cores/TP torch threads, run
  ``MegatronTrainEngine.train_step`` on a fixed batch of ``--batch`` sequences of ``--seq``
  tokens (micro-batches of 4, every token trained, GRPO advantages, old log-probs given);
  2 warm-up steps, then the median and min of ``--steps`` steps; also the forward-only
  log-prob pass and the HF export (TP gather + conversion).
* sync: 3 ranks: 0-1 train at TP=2, 2 is a vLLM leader. Each round: barrier, then the
  holder streams ``iter_hf`` (TP gather + conversion per layer) into ``push_weights``
  while the leader's ``update_weights`` consumes ``pull_weights``; the leader's score() is
  checked against the trained log-probs. Sync time = the slower of the two sides. Then raw push
  bandwidth between two ranks for ``--sync-mib`` payloads (256 MiB buckets), which is what
  a real model's sync would move.

Numbers are for this machine only (a 2-core VM shared with other jobs: the load average is
printed). The GPU path (NCCL, CUDA tensors) is the same code and is not measured here.
Prints a table; the last line is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing
sys.path.insert(0, str(ROOT / "benchmarks"))


# ----------------------------------------------------------------- MPI worker side

def _batch(vocab: int, batch: int, seq: int):
    import torch

    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vocab, (batch, seq), generator=gen)
    advantages = torch.linspace(-1, 1, batch)[:, None].expand(batch, seq - 1).contiguous()
    return tokens, torch.ones(batch, seq - 1), advantages


def _engine(comm, model: str, tp: int):
    from libra_hpc.engines.train.engine import MegatronTrainEngine
    from libra_hpc.engines.train.parallel import start_torch_world

    start_torch_world(comm)
    return MegatronTrainEngine(model, tp=tp, lr=1e-6, micro_batch_size=4)


def worker_train(args) -> dict | None:
    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    from libra_hpc.engines.train.loss import PolicyBatch

    comm = MPI.COMM_WORLD
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // comm.Get_size()))
    engine = _engine(comm, args.model, comm.Get_size())
    tokens, mask, advantages = _batch(engine.shape.vocab_size, args.batch, args.seq)
    old = engine.logprobs(tokens)
    batch = PolicyBatch(tokens, mask, advantages, old_logprobs=old)
    times = []
    for step in range(args.steps + 2):
        dist.barrier()
        stats = engine.train_step(batch)
        if step >= 2:
            times.append(stats.seconds)
    dist.barrier()
    start = time.perf_counter()
    engine.logprobs(tokens)
    forward_s = time.perf_counter() - start
    dist.barrier()
    start = time.perf_counter()
    engine.export_hf()
    export_s = time.perf_counter() - start
    engine.shutdown()
    return {"tp": comm.Get_size(), "step_s_median": statistics.median(times), "step_s_min": min(times),
            "tokens_per_step": args.batch * (args.seq - 1), "logprobs_s": forward_s, "export_s": export_s,
            "threads_per_rank": torch.get_num_threads()}


def _polite_barrier(comm) -> None:
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.002)


def worker_sync(args) -> dict | None:
    import torch
    from mpi4py import MPI

    from libra_hpc.engines.sync import pull_weights, push_weights

    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    torch.set_num_threads(1)
    train_comm = comm.Split(0 if rank < 2 else 1, rank)
    sync_comm = comm.Split(0 if rank in (0, 2) else MPI.UNDEFINED, rank)
    rounds = 3
    if rank < 2:
        engine = _engine(train_comm, args.model, 2)
        tokens, mask, advantages = _batch(engine.shape.vocab_size, 4, 32)
        from libra_hpc.engines.train.loss import PolicyBatch

        report = {"push_s": [], "bytes": 0}
        for _ in range(rounds):
            engine.train_step(PolicyBatch(tokens, mask, advantages))
            if rank == 0:  # the holder streams: TP gather + conversion + send, layer by layer
                _polite_barrier(sync_comm)
                stats = push_weights(sync_comm, engine.iter_hf(), root=0)
                comm.send(engine.logprobs(tokens), dest=2)
                report["push_s"].append(stats.seconds)
                report["bytes"] = stats.bytes
            else:  # its TP peer takes part in the gathers
                engine.export_hf()
                engine.logprobs(tokens)
        engine.shutdown()
        if rank == 1:
            return None
        for mib in args.sync_mib:  # raw bandwidth, holder → leader
            payload = {"w": torch.ones(mib << 18)}  # float32: 4 bytes × 2^18 = 1 MiB per unit
            _polite_barrier(sync_comm)
            report[f"push_{mib}mib_s"] = push_weights(sync_comm, payload, root=0).seconds
        report.update(comm.recv(source=2))
        return report
    from libra_hpc.engines.rollout import VllmRolloutEngine

    engine = VllmRolloutEngine(args.model, tp=1, dtype="float32", seed=0)
    tokens, _, _ = _batch(engine.vocab_size, 4, 32)
    update_s, worst = [], 0.0
    for _ in range(rounds):
        _polite_barrier(sync_comm)
        start = time.perf_counter()
        engine.update_weights(pull_weights(sync_comm, root=0))
        update_s.append(time.perf_counter() - start)
        trained = comm.recv(source=0)
        scored = torch.tensor(engine.score(tokens.tolist()))
        worst = max(worst, (scored - trained).abs().max().item())
    engine.shutdown()
    for _ in args.sync_mib:
        _polite_barrier(sync_comm)
        for _ in pull_weights(sync_comm, root=0):
            pass
    comm.send({"pull_and_update_s": update_s, "rollout_vs_trained_max": worst}, dest=0)
    return None


# --------------------------------------------------------------------- driver side

def _mpi(ranks: int, worker: str, args, timeout: int = 900) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = ["mpiexec", "-n", str(ranks), sys.executable, "-m", "mpi4py", __file__, "--worker", worker,
               "--out", out.name, "--model", str(args.model), "--steps", str(args.steps), "--batch", str(args.batch),
               "--seq", str(args.seq), "--sync-mib", *map(str, args.sync_mib)]
        done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        if done.returncode != 0:
            raise RuntimeError(f"bench_engines: {worker} world failed ({done.returncode}):\n{done.stdout[-3000:]}"
                               f"\n{done.stderr[-3000:]}")
        return json.loads(Path(out.name).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--sync-mib", type=int, nargs="*", default=[64, 512])
    parser.add_argument("--skip-rollout", action="store_true")
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the tiny model)")
    parser.add_argument("--worker", choices=["train", "sync"], help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # keep the table readable (children inherit it)
    if args.worker:
        result = {"train": worker_train, "sync": worker_sync}[args.worker](args)
        if result is not None:
            Path(args.out).write_text(json.dumps(result))
        return
    from libra_hpc.engines.tiny import build_tiny_model

    args.model = args.model or str(build_tiny_model(Path(tempfile.gettempdir()) / "libra_hpc_bench_tiny"))
    headline: dict = {}
    if not args.skip_rollout:
        from bench_engines_rollout import rollout_tokens_per_s

        print("rollout (vLLM, TP 1 per instance, 32 prompts × 64 tokens → ≤128 new, per instance)")
        print(f"{'instances':>9} {'tokens':>7} {'wall s':>7} {'tokens/s':>9}")
        for n in (1, 2):
            r = rollout_tokens_per_s(args.model, n)
            print(f"{n:>9} {r['tokens']:>7} {r['wall_s']:>7.2f} {r['tokens_per_s']:>9.0f}")
            headline[f"rollout_tokens_per_s_{n}"] = round(r["tokens_per_s"], 1)
    print(f"\ntraining (Megatron-Core, gloo, fp32; batch {args.batch} × {args.seq} tokens, micro-batch 4)")
    print(f"{'TP':>3} {'threads/rank':>12} {'step s (median)':>16} {'step s (min)':>13} {'tokens/s':>9} "
          f"{'logprobs s':>11} {'export s':>9}")
    for tp in (1, 2):
        r = _mpi(tp, "train", args)
        print(f"{tp:>3} {r['threads_per_rank']:>12} {r['step_s_median']:>16.3f} {r['step_s_min']:>13.3f} "
              f"{r['tokens_per_step'] / r['step_s_median']:>9.0f} {r['logprobs_s']:>11.3f} {r['export_s']:>9.3f}")
        headline[f"train_step_s_tp{tp}"] = round(r["step_s_median"], 4)
    r = _mpi(3, "sync", args)
    print(f"\nweight sync, TP=2 holder → 1 vLLM leader over MPI ({r['bytes'] / 2**20:.1f} MiB of fp32 weights), "
          "median of 3 rounds")
    print(f"{'export+push s':>14} {'leader pull+update s':>21} {'max |Δlogprob| after':>21}")
    median = statistics.median
    print(f"{median(r['push_s']):>14.4f} {median(r['pull_and_update_s']):>21.4f} {r['rollout_vs_trained_max']:>21.2e}")
    if args.sync_mib:
        print(f"{'payload MiB':>11} {'push s':>8} {'GB/s':>6}")
        for mib in args.sync_mib:
            s = r[f"push_{mib}mib_s"]
            print(f"{mib:>11} {s:>8.3f} {mib * 2**20 / s / 1e9:>6.2f}")
            headline[f"sync_push_{mib}mib_s"] = round(s, 4)
    headline.update({"sync_tiny_s": round(max(median(r["push_s"]), median(r["pull_and_update_s"])), 4),
                     "sync_rollout_vs_trained_max": r["rollout_vs_trained_max"],
                     "cores": len(os.sched_getaffinity(0)), "load_average": round(os.getloadavg()[0], 2)})
    print(json.dumps(headline))


if __name__ == "__main__":
    main()
