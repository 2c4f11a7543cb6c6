"""C-MLFQ routing quality on every shipped scenario's workload, with narrow and wide bucket
limits: does the causal router beat the trivial policy it replaces (always the top level)?

For each scenario in configs/sim/ (its synthetic workload, its tool-return classifier),
``--prompts`` prompts × 16 samples, the last 4 of each prompt for testing
(libra_hpc.scheduler.synthetic.evaluate_routing: train on the rest, replay the test
trajectories turn by turn, score each decision after a tool return against the bucket its
true remaining length maps to). Two sets of bucket limits (TP size → tokens):

- narrow, the default ``scheduler.bucket_token_limits``: 1k / 4k / 16k / ∞;
- wide: 4k / 12k / ∞.

Routers: ``cmlfq`` with its self-check off (``self_check=0``: always the causal verdict),
``cmlfq`` as configured by default (the self-check falls back to the top level when the
causal verdicts score worse on the finished trajectories), the top level, and the oracle
(true remaining length; 1.0 by construction, a sanity line).

    python benchmarks/bench_routing.py [--prompts 300] [--seed 0]

Prints a table; the last line is JSON with every accuracy and
``min_checked_minus_top`` (the worst scenario and limit set: the default router's accuracy
minus the top level's).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from libra_hpc.config import SchedulerConfig  # noqa: E402
from libra_hpc.scheduler.routers import router_from_config  # noqa: E402
from libra_hpc.scheduler.synthetic import default_buckets, evaluate_routing, generate, split_by_sample  # noqa: E402
from libra_hpc.sim.config import load_sim_config  # noqa: E402

LIMITS = {"narrow": {1: 1024, 2: 4096, 4: 16384, 8: 1 << 30}, "wide": {1: 4096, 2: 12288, 4: 1 << 30}}
SCENARIOS = ["a800-swe", "search-agent", "math-code", "train-bound", "context-growth", "cmlfq-premise"]
DEFAULT_CHECK = SchedulerConfig().self_check


def router(self_check: int):
    """A factory of the configured cmlfq router (the job's and the simulator's
    construction) with ``self_check``."""
    return lambda buckets: router_from_config(SchedulerConfig(policy="cmlfq", self_check=self_check), buckets)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rows, results = [], {}
    started = time.perf_counter()
    for name in SCENARIOS:
        cfg = load_sim_config(ROOT / "configs" / "sim" / f"{name}.yaml")
        trajectories = generate(cfg.workload, args.prompts, 16, args.seed, seq_len=cfg.training.seq_len,
                                size_thresholds=cfg.scheduler.size_thresholds, error_markers=cfg.scheduler.error_markers)
        train, test = split_by_sample(trajectories, 4)
        for limits_name, limits in LIMITS.items():
            buckets = default_buckets(limits)
            raw = evaluate_routing(router(0), train, test, buckets)
            checked = evaluate_routing(router(DEFAULT_CHECK), train, test, buckets)
            key = f"{name}/{limits_name}"
            results[key] = {"cmlfq_raw": round(raw["bucket_accuracy"], 4), "cmlfq": round(checked["bucket_accuracy"], 4),
                            "top_level": round(raw["top_level_accuracy"], 4), "decisions": raw["decisions"],
                            "migrations_raw": raw["migrations"], "migrations": checked["migrations"]}
            r = results[key]
            rows.append((name, limits_name, r["decisions"], r["top_level"], r["cmlfq_raw"], r["cmlfq"],
                         "yes" if r["cmlfq"] >= r["top_level"] else "NO"))
    print(f"C-MLFQ bucket accuracy after tool returns, {args.prompts} prompts × 16 samples (last 4 tested), "
          f"seed {args.seed}; self-check window {DEFAULT_CHECK} decisions")
    header = ("scenario", "limits", "decisions", "top level", "cmlfq raw", "cmlfq", "cmlfq ≥ top")
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    for line in (header, *rows):
        print("  ".join(str(x).ljust(w) for x, w in zip(line, widths)))
    summary = {"prompts": args.prompts, "seed": args.seed, "self_check": DEFAULT_CHECK,
               "min_checked_minus_top": round(min(r["cmlfq"] - r["top_level"] for r in results.values()), 4),
               "min_raw_minus_top": round(min(r["cmlfq_raw"] - r["top_level"] for r in results.values()), 4),
               "wall_s": round(time.perf_counter() - started, 1), "by_workload": results}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
