"""Cluster simulator: every policy on the paper scenario, and the speed of the simulated clock's event heap.

    python benchmarks/bench_sim.py [--config configs/sim/a800-swe.yaml] [--steps N] [--out DIR] [--partial] [--stream]
                                   [--phase-window W]
    python benchmarks/bench_sim.py --engine     # SimClock's heapq loop vs the alternatives considered

Runs the scenario (48 A800-80G, Qwen3-14B, SWE-style agent, 100 RL steps by default) for
every policy of the scenario file, prints the comparison table and the critical-path floor
of the batches (the serial time of the longest trajectory alone on the fastest instance
shape: no policy's rollout can beat it), and writes the report folder. The last line is one
JSON object: libra_vs_colocated, libra_vs_static_hindsight, libra_vs_static_pilot,
libra_vs_phase_static (throughput ratios; over the steps both completed when one ran out of
memory), phase_gain (phase_static over static_hindsight: what a split changed every
``search.phase_window`` steps can win), libra_vs_phase_static_late and phase_late_share
(phase_static_late over phase_static: what of it a policy keeps when every change waits
``search.phase_lag`` steps), static_pilot_failed_steps (steps the pilot's split
could not run), libra_vs_true_lengths (the better of ``libra_true_lengths`` and
``static_true_lengths``, named by true_lengths_used), known_start_vs_static_hindsight
(``libra_known_start``, Libra planned first on the first batch's true lengths, over the
hindsight split; None unless it ran),
libra_vs_bound (the lower bound's time over Libra's: libra_hpc/sim/bound.py), bound_violations
(steps k at which any policy finished steps 0..k before the bound's cumulative time: 0
unless the bound is wrong),
Libra's trained_p90_over_generated_p90 and dropped_token_share (partial rollout's guards:
1.0 and 0.0 without it), libra_predicted_over_simulated (the planner's predicted step on
observed lengths over the simulated one),
bound_step_s and the floor that binds, sim_wall_s (wall time of the whole comparison), and
per policy tokens/s, distance to the bound, the tail's slowdown (mean batch makespan over
its critical path) and sim wall seconds.
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import json
import queue
import random
import time

from libra_hpc.sim.config import load_sim_config
from libra_hpc.sim.context import Context, critical_path_s
from libra_hpc.sim.report import ratios, table, tail_ratio, write_outputs
from libra_hpc.sim.run import run_scenario


def engine_bench(live: int, n: int = 200_000) -> dict:
    """push+pop pairs per second with ``live`` events pending, three priority queues."""
    rng = random.Random(0)
    out = {}
    heap = [(rng.random(), 0, i, None) for i in range(live)]
    heapq.heapify(heap)
    t0 = time.perf_counter()
    for i in range(n):
        t, k, _, e = heapq.heappop(heap)
        heapq.heappush(heap, (t + rng.random(), k, live + i, e))
    out["heapq"] = n / (time.perf_counter() - t0)
    lst = sorted((rng.random(), 0, i) for i in range(live))
    t0 = time.perf_counter()
    for i in range(n):
        t, k, _ = lst.pop(0)
        bisect.insort(lst, (t + rng.random(), k, live + i))
    out["bisect_sorted_list"] = n / (time.perf_counter() - t0)
    pq: queue.PriorityQueue = queue.PriorityQueue()
    for i in range(live):
        pq.put((rng.random(), 0, i))
    t0 = time.perf_counter()
    for i in range(n):
        t, k, _ = pq.get()
        pq.put((t + rng.random(), k, live + i))
    out["queue_PriorityQueue"] = n / (time.perf_counter() - t0)
    return out


def critical_path(cfg) -> dict:
    """Per sample batch: the floor of its rollout makespan (libra_hpc.sim.context.critical_path_s), s."""
    ctx = Context(cfg)
    return {step: round(critical_path_s(ctx, ctx.batch(step)), 1)
            for step in (0, cfg.rl.steps // 2, cfg.rl.steps - 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/sim/a800-swe.yaml")
    parser.add_argument("--steps", type=int, help="override rl.steps")
    parser.add_argument("--out", default="logs/bench-sim", help="report folder")
    parser.add_argument("--engine", action="store_true", help="only the event-queue micro-benchmark")
    parser.add_argument("--stream", action="store_true",
                        help="rl.stream_training=true (asynchronous policies train each group as it finishes)")
    parser.add_argument("--partial", action="store_true",
                        help="rl.partial_rollout=true (asynchronous policies; the static split keeps the better of on/off)")
    parser.add_argument("--phase-window", type=int, help="override search.phase_window (phase_static's steps per window)")
    args = parser.parse_args()
    if args.engine:
        print(f"{'live events':>12} {'heapq':>12} {'bisect list':>12} {'PriorityQueue':>14}  (push+pop pairs/s)")
        rows = {}
        for live in (1_000, 10_000, 100_000):
            r = engine_bench(live, n=50_000 if live >= 100_000 else 200_000)
            rows[live] = {k: round(v) for k, v in r.items()}
            print(f"{live:>12} {r['heapq']:>12.0f} {r['bisect_sorted_list']:>12.0f} {r['queue_PriorityQueue']:>14.0f}")
        print(json.dumps({"engine_pairs_per_s": rows}))
        return
    overrides = {**({"rl.steps": args.steps} if args.steps else {}), **({"rl.partial_rollout": True} if args.partial else {}),
                 **({"rl.stream_training": True} if args.stream else {}),
                 **({"search.phase_window": args.phase_window} if args.phase_window else {})}
    cfg = load_sim_config(args.config, overrides or None)
    t0 = time.perf_counter()
    result = run_scenario(cfg)
    wall = time.perf_counter() - t0
    write_outputs(result, args.out)
    floor = critical_path(cfg)
    print(f"== {cfg.name}: {cfg.cluster.nodes}×{cfg.cluster.gpus_per_node} {cfg.cluster.hardware}, "
          f"{cfg.model.name}, {cfg.rl.steps} steps, seed {cfg.rl.seed} ==")
    print("\n".join(table(result)))
    print(f"critical-path floor of one batch's rollout (s) at steps {list(floor)}: {list(floor.values())}")
    print(f"report: {args.out}/report.md")
    r = ratios(result)
    libra = result.runs["libra"].summary if "libra" in result.runs else {}
    print(json.dumps({**{k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()},
                      "sim_wall_s": round(wall, 1), "steps": cfg.rl.steps, "critical_path_s": floor,
                      "bound_step_s": round(result.bound["bound_step_s"], 1), "bound_binding": result.bound["binding"],
                      **{k: round(libra[k], 3) for k in ("trained_p90_over_generated_p90", "dropped_token_share")
                         if k in libra},
                      "partial_rollout": cfg.rl.partial_rollout, "stream_training": cfg.rl.stream_training,
                      "policies": {n: {"tokens_per_s": round(rec.summary["tokens_per_s"], 1),
                                       "vs_bound": None if result.vs_bound(n) is None else round(result.vs_bound(n), 3),
                                       "out_of_memory_step": (result.oom(n) or {}).get("step"),
                                       "tail_over_critical_path": None if tail_ratio(result, n) is None
                                       else round(tail_ratio(result, n), 3),
                                       "wall_s": round(rec.summary["wall_s"], 1)} for n, rec in result.runs.items()}}))


if __name__ == "__main__":
    main()
