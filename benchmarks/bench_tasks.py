"""The agentic tasks' length signal: what C-MLFQ routes on, with the noisy scripted solvers.

    python benchmarks/bench_tasks.py [--episodes 200] [--units 2] [--seed 0]

Each task (libra_hpc/envs/: ``arithmetic`` on the real bwrap sandboxes, ``search`` on its
in-process runner, both through the live ToolOrchestrator) is rolled out by its noisy
solver (libra_hpc/envs/solvers.py) on ``--episodes`` training prompts, 8 episodes at a
time. Reported per task: generated tokens per trajectory (p10, p50, p90 and p90/p10;
tokens = characters / 4), the mean tokens generated after a turn whose tool return failed
(an error, a malformed call, no search results or a timeout) and after one whose calls
all succeeded, their ratio, the counts of each, and the solver's success rate. The issue's
bar: p90/p10 >= 4 and failure/success >= 2 per task. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from libra_hpc.envs import ArithmeticTask, SearchTask
from libra_hpc.envs.solvers import ArithmeticSolver, SearchSolver, length_signal, run_episode, tokens
from libra_hpc.tools.isolation import SandboxLimits
from libra_hpc.tools.orchestrator import SandboxRunner, ToolOrchestrator
from libra_hpc.tools.pool import ResourceSpec
from libra_hpc.tools.scheduling import make_scheduler


def measure(task, solver, episodes: int, units: int, uid_base: int) -> dict:
    extra = task.runners()
    specs = [ResourceSpec("cpu", units, idle_timeout_s=5.0)] + [ResourceSpec(k, 8) for k in extra]
    runners = {"cpu": SandboxRunner(SandboxLimits(wall_time_s=5.0), uid_base=uid_base), **extra}
    orch = ToolOrchestrator(make_scheduler("tangram", specs), runners)
    start = time.monotonic()
    try:
        with ThreadPoolExecutor(8) as pool:
            done = list(pool.map(lambda ip: run_episode(task, ip[1], solver, orch, f"{task.name}-{ip[0]}"),
                                 enumerate(task.splits.train[:episodes])))
    finally:
        orch.close()
    signal = length_signal(done)
    signal["p50"] = statistics.median(sum(tokens(t) for t in e.generated) for e in done)
    signal["wall_s"] = time.monotonic() - start
    return signal


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=200)
    parser.add_argument("--units", type=int, default=2, help="CPU sandbox units")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    n = args.episodes
    cases = [("arithmetic", ArithmeticTask(seed=args.seed, train_prompts=n, heldout_prompts=50),
              ArithmeticSolver(seed=args.seed)),
             ("search", SearchTask(seed=args.seed, train_prompts=n, heldout_prompts=50), SearchSolver(seed=args.seed))]
    results = {}
    print(f"{'task':<11} {'p10':>6} {'p50':>6} {'p90':>6} {'p90/p10':>8} {'after fail':>10} {'after ok':>9} "
          f"{'ratio':>6} {'fails':>6} {'oks':>6} {'success':>8} {'wall s':>7}")
    for i, (name, task, solver) in enumerate(cases):
        s = results[name] = measure(task, solver, n, args.units, 237000 + 100 * i)
        print(f"{name:<11} {s['p10']:>6.0f} {s['p50']:>6.0f} {s['p90']:>6.0f} {s['p90_over_p10']:>8.2f} "
              f"{s['after_failure']:>10.1f} {s['after_success']:>9.1f} {s['failure_over_success']:>6.2f} "
              f"{s['failed_returns']:>6d} {s['ok_returns']:>6d} {s['success_rate']:>8.2f} {s['wall_s']:>7.1f}")
    print(json.dumps({"episodes": n, "seed": args.seed, **{
        f"{name}_{key}": round(s[key], 3) for name, s in results.items()
        for key in ("p90_over_p10", "failure_over_success", "after_failure", "after_success", "success_rate")}}))


if __name__ == "__main__":
    main()
