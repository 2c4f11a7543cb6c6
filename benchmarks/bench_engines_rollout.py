"""Rollout throughput of the tiny model on one and on two vLLM instances (CPU here).

    python benchmarks/bench_engines_rollout.py [--instances 1 2] [--prompts 32] [--max-tokens 128]

Each instance is its own process holding one in-process ``VllmRolloutEngine`` (TP 1),
as each rollout rank holds one in the runtime: vLLM keeps its parallel state in module
globals, so two engines cannot share a process. Each engine computes on one torch thread
(``cpu_threads=1``, see VllmRolloutEngine); processes are not pinned to cores (pinned, a
shared machine's other load on that core stalls the instance). Every
instance starts its engine and runs one warm-up batch; then, ``--rounds`` times, all wait
at a barrier and generate ``--prompts`` random prompts of ``--prompt-len`` tokens with up
to ``--max-tokens`` new tokens each (temperature 1; the random tiny model rarely emits an
end-of-turn token, so most sequences run to the cap). A round's throughput = its generated
tokens / (last instance's end − first instance's start), prefill included; the median
round is reported.

``rollout_tokens_per_s(model_path, instances)`` is what benchmarks/bench_engines.py
imports. Prints a table; the last line is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing as mp
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing


def _instance(model_path: str, barrier, results, prompts: int, prompt_len: int,
              max_tokens: int, rounds: int, seed: int) -> None:
    """One rollout instance (a spawned process): start, warm up, wait, generate, report."""
    logging.basicConfig(level=logging.WARNING)
    from libra_hpc.engines.rollout import VllmRolloutEngine

    started = time.perf_counter()
    engine = VllmRolloutEngine(model_path, max_model_len=prompt_len + max_tokens + 1, kv_cache_gib=0.5, seed=seed)
    start_s = time.perf_counter() - started
    rng = random.Random(seed)
    batch = [[rng.randrange(7, engine.vocab_size) for _ in range(prompt_len)] for _ in range(prompts)]
    engine.generate(batch[:4], max_tokens=8, seed=seed)  # warm-up
    report = {"start_s": start_s, "rounds": []}
    for r in range(rounds):
        barrier.wait()
        t0 = time.time()
        out = engine.generate(batch, max_tokens=max_tokens, temperature=1.0, seed=seed + 1000 * r)
        report["rounds"].append((sum(len(g.tokens) for g in out), t0, time.time()))
    engine.shutdown()
    results.put(report)


def rollout_tokens_per_s(model_path: str | os.PathLike, instances: int, *, prompts: int = 32, prompt_len: int = 64,
                         max_tokens: int = 128, rounds: int = 3, seed: int = 0) -> dict:
    """Generated tokens per second of ``instances`` concurrent TP-1 instances of the model
    at ``model_path``, one process each (spawned): the median over ``rounds`` batches (all
    instances start each round together), with per-instance details."""
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(instances), ctx.Queue()
    procs = [ctx.Process(target=_instance, args=(str(model_path), barrier, results, prompts, prompt_len,
                                                  max_tokens, rounds, seed + i)) for i in range(instances)]
    for p in procs:
        p.start()
    reports = [results.get(timeout=600) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        if p.exitcode != 0:
            raise RuntimeError(f"bench_engines_rollout: instance process {p.pid} exited with {p.exitcode}")
    per_round = []
    for r in range(rounds):
        done = [rep["rounds"][r] for rep in reports]
        tokens, wall = sum(d[0] for d in done), max(d[2] for d in done) - min(d[1] for d in done)
        per_round.append((tokens / wall, tokens, wall, [d[0] / (d[2] - d[1]) for d in done]))
    rate, tokens, wall, per_instance = sorted(per_round)[len(per_round) // 2]
    return {"instances": instances, "tokens": tokens, "wall_s": wall, "tokens_per_s": rate,
            "per_instance_tokens_per_s": per_instance, "rounds_tokens_per_s": [p[0] for p in per_round],
            "engine_start_s": [rep["start_s"] for rep in reports]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the tiny model)")
    args = parser.parse_args()
    from libra_hpc.engines.tiny import build_tiny_model

    model = args.model or build_tiny_model(Path(tempfile.gettempdir()) / "libra_hpc_bench_tiny")
    rows = [rollout_tokens_per_s(model, n, prompts=args.prompts, prompt_len=args.prompt_len,
                                 max_tokens=args.max_tokens, rounds=args.rounds) for n in args.instances]
    print(f"rollout, tiny model, {args.prompts} prompts × {args.prompt_len} tokens → ≤{args.max_tokens} new "
          f"per instance, {len(os.sched_getaffinity(0))} cores, load average {os.getloadavg()[0]:.1f}")
    print(f"{'instances':>9} {'tokens':>7} {'wall s':>7} {'tokens/s':>9} {'per instance tok/s':>19} "
          f"{'rounds tok/s':>20} {'start s':>10}")
    for r in rows:
        per = ", ".join(f"{x:.0f}" for x in r["per_instance_tokens_per_s"])
        each = ", ".join(f"{x:.0f}" for x in r["rounds_tokens_per_s"])
        start = ", ".join(f"{x:.1f}" for x in r["engine_start_s"])
        print(f"{r['instances']:>9} {r['tokens']:>7} {r['wall_s']:>7.2f} {r['tokens_per_s']:>9.0f} {per:>19} "
              f"{each:>20} {start:>10}")
    print(json.dumps({f"rollout_tokens_per_s_{r['instances']}": round(r["tokens_per_s"], 1) for r in rows}
                     | {"instances_are": "processes", "load_average": round(os.getloadavg()[0], 2)}))


if __name__ == "__main__":
    main()
