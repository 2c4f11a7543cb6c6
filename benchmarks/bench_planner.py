"""Global resource planner: planning latency at scale, optimality on small clusters.

    python benchmarks/bench_planner.py [--repeats 5] [--quick]

Workload: Qwen3-14B (configs/models/qwen3-14b.yaml) on A800-80G nodes of 8 GPUs
(configs/hardware/a800-80g.yaml), RL batch of 512 trajectories of 8192 training tokens,
a synthetic long-tailed length profile (Pareto generated lengths capped at 30k tokens,
1–6 turns, up to 20 s of tools; 32 buckets), asynchronous objective.

1. Latency: wall time of ``plan()`` at 48, 512 and 4096 GPUs (median of ``--repeats``).
2. Coverage: a plan at every size from 8 to 8192 GPUs (8, 16, 24, 48, then powers of two),
   each checked for the bounds (every slot once, TP groups on one node, minimum GPUs per
   side, a layout that passes ``check_layout``).
3. Optimality: every cluster of 2 to 16 GPUs (1, 2, 4, 8 GPUs per node × 1..16/G nodes),
   Qwen3-4B and Qwen3-14B, short and long profiles, async and sync: ``plan()``'s objective
   against ``exhaustive()``'s (every training shape × every per-node partition). A case
   where neither finds a plan counts as agreeing (``feasible_cases`` have a plan).
4. The budgeted search (hill climb past ``exact_rollout_limit`` vectors, ``refine_top``
   training sizes) against the same search with every count vector and every training
   size refined, at 24–128 GPUs: the relative objective gap.
Prints a table; the last line is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import time

from libra_hpc.cluster.layout import Slot, check_layout
from libra_hpc.planner.costs import LengthProfile, LengthSample
from libra_hpc.planner.exhaustive import exhaustive
from libra_hpc.planner.profiles import load_hardware, load_model
from libra_hpc.planner.search import (
    PlanError,
    PlannerOptions,
    RLBatch,
    plan,
    plan_to_layout,
)

BATCH = RLBatch(global_batch=512, seq_len=8192)
OPTIONS = PlannerOptions()


def profile(scale: float = 1.0, seed: int = 0, n: int = 512) -> LengthProfile:
    rng = random.Random(seed)
    samples = [LengthSample(rng.randint(200, 2000), max(1, int(scale * min(30000, rng.paretovariate(1.2) * 800))),
                            rng.randint(1, 6), rng.uniform(0, 20)) for _ in range(n)]
    return LengthProfile.from_samples(samples, BATCH.global_batch)


def bounds_ok(p, nodes: int, g: int) -> bool:
    slots = sorted(list(p.train_slots) + [s for i in p.rollout for s in i.slots])
    if slots != [Slot(n, i) for n in range(nodes) for i in range(g)]:
        return False
    if p.train_gpus < OPTIONS.min_train_gpus or p.rollout_gpus < OPTIONS.min_rollout_gpus:
        return False
    check_layout(plan_to_layout(p, nodes, g))  # raises on a TP group across nodes
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per size (median reported)")
    parser.add_argument("--quick", action="store_true", help="optimality sweep on Qwen3-4B, async only")
    args = parser.parse_args()
    q14, q4, a800 = load_model("qwen3-14b"), load_model("qwen3-4b"), load_hardware("a800-80g")
    lp = profile()

    print("== planning latency: Qwen3-14B, A800, async ==")
    print(f"{'GPUs':>6} {'ms (median)':>12} {'makespans':>10} {'t_train s':>10} {'t_rollout s':>12}  plan")
    latency = {}
    for gpus in (48, 512, 4096):
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            r = plan(q14, a800, gpus // 8, 8, lp, BATCH, options=OPTIONS)
            times.append(time.perf_counter() - t0)
        latency[gpus] = statistics.median(times) * 1e3
        p = r.plan
        print(f"{gpus:>6} {latency[gpus]:>12.1f} {r.evaluated:>10} {p.t_train:>10.1f} {p.t_rollout:>12.1f}  {p.describe()}")

    print("\n== a plan at every size ==")
    sizes = [8, 16, 24, 48] + [2 ** k for k in range(5, 14)]
    found, bounds = 0, True
    for gpus in sorted(set(sizes)):
        t0 = time.perf_counter()
        p = plan(q14, a800, gpus // 8, 8, lp, BATCH, options=OPTIONS).plan
        ms = (time.perf_counter() - t0) * 1e3
        ok = bounds_ok(p, gpus // 8, 8)
        found += math.isfinite(p.objective)
        bounds &= ok
        print(f"{gpus:>6} GPUs {ms:8.1f} ms  objective {p.objective:8.1f} s  bounds {'ok' if ok else 'BROKEN'}  "
              f"{p.describe()}")

    print("\n== optimality against exhaustive search (<= 16 GPUs) ==")
    models = [q4] if args.quick else [q4, q14]
    modes = ["async"] if args.quick else ["async", "sync"]
    profiles = {"short": profile(0.3, seed=1, n=256), "long": profile(2.0, seed=2, n=256)}
    optimal = total = feasible = 0
    misses = []
    t0 = time.perf_counter()
    for model in models:
        for name, lengths in profiles.items():
            for mode in modes:
                for g in (1, 2, 4, 8):
                    for nodes in range(max(1, 2 // g), 16 // g + 1):  # both sides need a GPU
                        want, _ = exhaustive(model, a800, nodes, g, lengths, BATCH, mode=mode, options=OPTIONS)
                        try:
                            r = plan(model, a800, nodes, g, lengths, BATCH, mode=mode, options=OPTIONS)
                            got = r.plan.objective
                            bounds &= bounds_ok(r.plan, nodes, g)
                        except PlanError:
                            got = math.inf
                        total += 1
                        feasible += math.isfinite(want)
                        same = (math.isinf(want) and math.isinf(got)) or math.isclose(got, want, rel_tol=1e-9)
                        optimal += same
                        if not same:
                            misses.append(f"{model.name} {name} {mode} {nodes}x{g}: plan {got:.4g} vs exhaustive {want:.4g}")
    print(f"{optimal}/{total} cases optimal, {feasible} of them with a plan ({time.perf_counter() - t0:.1f} s)")
    for m in misses:
        print("  MISS", m)

    print("\n== the budgeted search against the exact count-vector search (no hill climb, no refine cap) ==")
    exact_opts = PlannerOptions(exact_rollout_limit=10 ** 7, refine_top=10 ** 6)
    gaps = {}
    for gpus in (24, 48) if args.quick else (24, 48, 64, 128):
        fast = plan(q14, a800, gpus // 8, 8, lp, BATCH, options=OPTIONS).plan.objective
        t1 = time.perf_counter()
        ref = plan(q14, a800, gpus // 8, 8, lp, BATCH, options=exact_opts)
        gaps[gpus] = fast / ref.plan.objective - 1
        print(f"{gpus:>6} GPUs  budgeted {fast:8.2f} s  exact {ref.plan.objective:8.2f} s  gap {gaps[gpus]:+.2%}  "
              f"(exact: {ref.evaluated} makespans, {time.perf_counter() - t1:.1f} s)")
    print(json.dumps({"plan_ms_48": round(latency[48], 2), "plan_ms_512": round(latency[512], 2),
                      "plan_ms_4096": round(latency[4096], 2), "optimal_cases": optimal, "total_cases": total,
                      "feasible_cases": feasible, "max_gap_vs_exact_count_search": round(max(gaps.values()), 4),
                      "plans_found": found, "sizes": len(set(sizes)), "bounds_respected": bounds}))


if __name__ == "__main__":
    main()
