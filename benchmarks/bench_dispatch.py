"""Data dispatch: rollout outputs straight to the training ranks, against gather-then-scatter.

EARL's figure 4: with one rank gathering every rollout output and scattering it to the
training ranks, dispatch latency grows with context length and that rank carries the whole
batch. Here, under ``mpiexec -n 8`` (the script re-launches itself): ranks 4-7 are rollout
leaders, ranks 0-3 the training world, 2 DP replicas × TP 2 (replica 0 = ranks 0, 1;
replica 1 = ranks 2, 3). Each leader holds about a quarter of a batch of trajectories
(token ids int32 + log-probs float32, lengths drawn log-normal; ``--leaders round_robin``
deals them out regardless of length instead), assigned to replicas by
:func:`libra_hpc.parallel.dispatch.balance` (tokens balanced). Every TP rank of a replica
needs every trajectory of it. The paths are the job's
(:mod:`libra_hpc.parallel.dispatch`):

- ``direct``: each leader sends each trajectory to the ranks of its replica;
- ``gather_scatter``: each leader sends to rank 0 (the training world's first rank), which
  receives the batch and sends each trajectory on to the ranks of its replica.

Messages are pickled objects, as the job sends them (``isend``). Latency: from a barrier to
the last training rank holding its whole share (the median of ``--repeats`` runs, the two
paths interleaved). Bytes: payload bytes in + out of each rank, the largest over ranks, as
counted while sending (and checked against :func:`~libra_hpc.parallel.dispatch.traffic`).

    python benchmarks/bench_dispatch.py [--sizes-mb 1 4 16 64] [--repeats 5] [--units 64] [--leaders balanced]

Prints a table; the last line is JSON with ``latency_ratio`` and ``max_rank_bytes_ratio``
(gather_scatter over direct) at the largest size.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from libra_hpc.parallel.dispatch import (DirectDispatch, GatherScatterDispatch, balance, max_rank_bytes,  # noqa: E402
                                         traffic)

REPLICAS = [[0, 1], [2, 3]]
LEADERS = [4, 5, 6, 7]
HUB = 0
TAG = 0x4001  # the job's TRAJECTORY tag
BYTES_PER_TOKEN = 8  # int32 token id + float32 log-prob


def make_batch(total_bytes: int, units: int, seed: int, leaders: str) -> dict[str, tuple[int, int]]:
    """Trajectory id → (leader, tokens): log-normal lengths scaled to ``total_bytes``.
    ``leaders``: ``balanced`` gives each leader about a quarter of the tokens (as the
    queue's least-load routing of turns does in the job); ``round_robin`` deals the
    trajectories out in turn, whatever their length."""
    import random

    rng = random.Random(seed)
    raw = [rng.lognormvariate(0.0, 0.8) for _ in range(units)]
    scale = total_bytes / BYTES_PER_TOKEN / sum(raw)
    tokens = {f"t{i:03d}": max(1, round(r * scale)) for i, r in enumerate(raw)}
    if leaders == "balanced":
        where = balance(tokens, len(LEADERS))
        return {uid: (LEADERS[where[uid]], n) for uid, n in tokens.items()}
    return {uid: (LEADERS[i % len(LEADERS)], n) for i, (uid, n) in enumerate(tokens.items())}


def payload(uid: str, tokens: int):
    import numpy as np

    return {"tid": uid, "tokens": np.arange(tokens, dtype=np.int32), "logprobs": np.zeros(tokens, dtype=np.float32)}


def nbytes(p: dict) -> int:
    return int(p["tokens"].nbytes + p["logprobs"].nbytes)


def one_run(comm, dispatcher, batch: dict[str, tuple[int, int]], dest: dict[str, int]) -> dict:
    """Move ``batch`` once; this rank's elapsed seconds, bytes in and out, and what it got."""
    from mpi4py import MPI

    rank = comm.Get_rank()
    mine = {uid: payload(uid, n) for uid, (leader, n) in batch.items() if leader == rank}
    paths = {uid: dispatcher.path(leader, REPLICAS[dest[uid]]) for uid, (leader, _) in batch.items()}
    expect = [uid for uid in batch if any(rank in hop.dests for hop in paths[uid])]
    forwards = {uid: hop.dests for uid in batch for hop in paths[uid][1:] if hop.source == rank}
    got, sent_bytes, got_bytes, sends = [], 0, 0, []
    comm.Barrier()
    started = time.perf_counter()
    for uid, p in mine.items():  # a leader: the first hop of each of its trajectories
        for d in paths[uid][0].dests:
            sends.append(comm.isend(p, dest=d, tag=TAG))
            sent_bytes += nbytes(p)
    status = MPI.Status()
    for _ in expect:
        p = comm.recv(source=MPI.ANY_SOURCE, tag=TAG, status=status)
        got.append(p["tid"])
        got_bytes += nbytes(p)
        for d in forwards.get(p["tid"], ()):  # the hub: on to the replica's ranks
            sends.append(comm.isend(p, dest=d, tag=TAG))
            sent_bytes += nbytes(p)
    received = time.perf_counter() - started
    MPI.Request.Waitall(sends)
    return {"elapsed_s": max(received, time.perf_counter() - started), "in": got_bytes, "out": sent_bytes,
            "got": sorted(got), "expected": sorted(expect)}


def mpi_part(args) -> None:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    if comm.Get_size() != 8:
        raise SystemExit(f"bench_dispatch: needs 8 ranks (4 leaders → 2 DP replicas × TP 2), got {comm.Get_size()}")
    dispatchers = [DirectDispatch(), GatherScatterDispatch(hub=HUB)]
    rows = []
    for size_mb in args.sizes_mb:
        batch = make_batch(int(size_mb * (1 << 20)), args.units, seed=int(size_mb * 10), leaders=args.leaders)
        dest = balance({uid: n for uid, (_, n) in batch.items()}, len(REPLICAS))
        times: dict[str, list[float]] = {d.name: [] for d in dispatchers}
        bytes_: dict[str, int] = {}
        for _ in range(args.repeats):
            for d in dispatchers:
                out = one_run(comm, d, batch, dest)
                if out["got"] != out["expected"]:
                    raise SystemExit(f"rank {comm.Get_rank()} ({d.name}): got {len(out['got'])} trajectories, "
                                     f"expected {len(out['expected'])} (each once)")
                elapsed = comm.allreduce(out["elapsed_s"], op=MPI.MAX)
                moved = comm.allgather({"in": out["in"], "out": out["out"]})
                times[d.name].append(elapsed)
                bytes_[d.name] = max_rank_bytes(dict(enumerate(moved)))
                predicted = traffic(d, [(leader, REPLICAS[dest[uid]], n * BYTES_PER_TOKEN)
                                        for uid, (leader, n) in batch.items()])
                if bytes_[d.name] != max_rank_bytes(predicted):
                    raise SystemExit(f"{d.name}: measured {bytes_[d.name]} B through one rank, "
                                     f"traffic() says {max_rank_bytes(predicted)}")
        loads = [sum(n for uid, (_, n) in batch.items() if dest[uid] == r) for r in range(len(REPLICAS))]
        rows.append({"size_mb": size_mb, "units": len(batch), "replica_tokens": loads,
                     "longest_tokens": max(n for _, n in batch.values()),
                     **{f"{name}_s": statistics.median(ts) for name, ts in times.items()},
                     **{f"{name}_max_rank_mb": b / (1 << 20) for name, b in bytes_.items()}})
    if comm.Get_rank() == 0:
        print("MPI_RESULT " + json.dumps(rows), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--units", type=int, default=64, help="trajectories per batch")
    parser.add_argument("--leaders", choices=("balanced", "round_robin"), default="balanced",
                        help="how the batch's trajectories are spread over the leaders that produced them")
    parser.add_argument("--mpi-part", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mpi_part:
        return mpi_part(args)
    command = ["mpiexec", "-n", "8", sys.executable, "-m", "mpi4py", str(Path(__file__).resolve()), "--mpi-part",
               "--repeats", str(args.repeats), "--units", str(args.units), "--leaders", args.leaders,
               "--sizes-mb", *[str(s) for s in args.sizes_mb]]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1200, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("MPI_RESULT ")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"the MPI part failed (exit {done.returncode}):\n{done.stdout}\n{done.stderr}")
    rows = json.loads(lines[-1].removeprefix("MPI_RESULT "))
    print(f"8 ranks: leaders {LEADERS} ({args.leaders}) → DP replicas {REPLICAS} (TP 2); gather rank {HUB}; "
          f"median of {args.repeats}")
    print(f"{'batch MB':>8} {'trajs':>5} {'direct ms':>10} {'gather ms':>10} {'latency x':>9} "
          f"{'direct max MB':>13} {'gather max MB':>13} {'bytes x':>7} {'replica tokens':>16}")
    for r in rows:
        print(f"{r['size_mb']:>8g} {r['units']:>5} {r['direct_s'] * 1e3:>10.1f} {r['gather_scatter_s'] * 1e3:>10.1f} "
              f"{r['gather_scatter_s'] / r['direct_s']:>9.2f} {r['direct_max_rank_mb']:>13.1f} "
              f"{r['gather_scatter_max_rank_mb']:>13.1f} "
              f"{r['gather_scatter_max_rank_mb'] / r['direct_max_rank_mb']:>7.2f} {str(r['replica_tokens']):>16}")
    last = rows[-1]
    print(json.dumps({"ranks": 8, "leaders": args.leaders, "size_mb": last["size_mb"], "direct_ms": round(last["direct_s"] * 1e3, 2),
                      "gather_scatter_ms": round(last["gather_scatter_s"] * 1e3, 2),
                      "latency_ratio": round(last["gather_scatter_s"] / last["direct_s"], 3),
                      "max_rank_bytes_ratio": round(last["gather_scatter_max_rank_mb"] / last["direct_max_rank_mb"], 3),
                      "replica_token_spread": max(last["replica_tokens"]) - min(last["replica_tokens"]),
                      "longest_tokens": last["longest_tokens"]}))


if __name__ == "__main__":
    main()
