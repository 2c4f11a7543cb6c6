"""Tool orchestration: ARL-Tangram's action-level scheduling against sandbox-per-trajectory.

    python benchmarks/bench_tools.py [--trajectories 512] [--cpu 32] [--real-trajectories 16] [--quick]

Workload: the shared synthetic workload (libra_hpc/envs/synthetic.py) of the paper's SWE
scenario (configs/sim/a800-swe.yaml: ``bash``, ``python`` and ``editor`` tools, log-normal
latencies with medians 4, 2 and 0.3 s, hangs that cost the tool's 120/60/10 s time limit),
its first RL steps replayed as rollout waves (libra_hpc.tools.replay.make_trace): the
trajectories of a step start together (a burst), each alternates LLM turns (its turn
tokens at 40 tokens/s, no tool resource needed) with its tool calls on the CPU sandboxes,
and ends with one 1.5 s ``reward`` call on a model-serving endpoint resource. A step has
``--trajectories / 2`` trajectories (prompts of 8 samples). Expected durations come from
per-tool moving averages seeded with the scenario's medians; tangram's aging rate is 0.05
(a 20 s action ages past a fresh 0.5 s one after ~390 s of waiting).

Both policies run behind the same scheduler interface with the same capacities:
``tangram`` (any free unit, shortest virtual deadline first, elastic pool with a 10 s idle
timeout) and ``dedicated`` (a CPU sandbox bound to a trajectory from its first tool call to
its end; the endpoint shared FIFO, since binding both deadlocks).

1. Simulated clock (scale): the pure scheduler replayed over the trace with a 1 s sandbox
   start-up; capacity sweep 1× and 0.5× of ``--cpu``; and the over-provisioned baseline
   (one sandbox per trajectory of a wave: no queueing for a sandbox at all) against
   tangram at 1×, which is the resource-saving comparison.
2. Real sandboxes (short run on this host): the live orchestrator runs bwrap sandboxes
   (``time.sleep`` snippets of the trace's durations scaled by ``--real-scale``) and a
   local HTTP scorer; trajectory threads sleep through their LLM turns. The same scaled
   trace is also replayed on the simulated clock, to show how far the simulation is from
   the real executor.

ACT (action completion time) = completion − submission of one tool call (queueing
included). Held = unit-seconds the resource pools kept alive (busy or idle, until retired).
Ratios are baseline / tangram: above 1 means tangram is better.
Prints tables; the last line is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from dataclasses import replace
from pathlib import Path

from libra_hpc.envs.synthetic import SyntheticWorkload
from libra_hpc.sim.config import load_sim_config
from libra_hpc.tools.endpoint import EndpointRunner, serve_scorer
from libra_hpc.tools.isolation import SandboxLimits
from libra_hpc.tools.orchestrator import SandboxRunner, ToolOrchestrator
from libra_hpc.tools.pool import ResourceSpec
from libra_hpc.tools.replay import (
    ToolCall,
    TraceShape,
    TrajectoryTrace,
    make_trace,
    percentile,
    replay,
)
from libra_hpc.tools.scheduling import DurationEstimator, make_scheduler

POLICIES = ("dedicated", "tangram")
AGING = 0.05
SCENARIO = load_sim_config(Path(__file__).resolve().parents[1] / "configs/sim/a800-swe.yaml")
SHAPE = TraceShape(waves=2)
PRIORS = {t.name: t.latency_s.median for t in SCENARIO.workload.tools} | {"reward": SHAPE.reward_s}


def workload(trajectories_per_wave: int, seed: int) -> SyntheticWorkload:
    """The scenario's workload with about ``trajectories_per_wave`` trajectories per RL step
    (whole groups of ``rl.group_size``)."""
    prompts = max(1, round(trajectories_per_wave / SCENARIO.rl.group_size))
    rl = SCENARIO.rl.model_copy(update={"prompts_per_step": prompts})
    return SyntheticWorkload(SCENARIO.workload, rl, seed, SCENARIO.training.seq_len)


def scheduler(policy: str, cpu: int, reward: int, startup_s: float, idle_s: float, scale: float = 1.0):
    specs = [ResourceSpec("cpu", cpu, idle_timeout_s=idle_s, startup_s=startup_s),
             ResourceSpec("reward", reward, idle_timeout_s=idle_s, startup_s=startup_s)]
    priors = {tool: s * scale for tool, s in PRIORS.items()}
    return make_scheduler(policy, specs, estimator=DurationEstimator(priors), aging_rate=AGING)


def simulated(trace, cpu: int, reward: int) -> dict:
    rows = {}
    for policy in POLICIES:
        result = replay(scheduler(policy, cpu, reward, startup_s=1.0, idle_s=10.0), trace)
        rows[policy] = {"mean": result.mean_act, "p99": result.p99_act, "held": result.held_s,
                        "busy": result.busy_s, "makespan": result.makespan_s}
    return rows


def scaled(trace, scale: float):
    return [TrajectoryTrace(t.tid, t.start_s * scale, tuple(ToolCall(c.gap_s * scale, c.tool, c.resource,
                                                                     c.duration_s * scale) for c in t.calls),
                            t.tail_s * scale) for t in trace]


def real_run(trace, policy: str, cpu: int, reward: int, uid_base: int, scorer_url: str, scale: float) -> dict:
    runners = {"cpu": SandboxRunner(SandboxLimits(wall_time_s=30.0), uid_base=uid_base),
               "reward": EndpointRunner(scorer_url)}
    orch = ToolOrchestrator(scheduler(policy, cpu, reward, startup_s=0.0, idle_s=0.5, scale=scale), runners)
    failures = []

    def trajectory(t: TrajectoryTrace):
        time.sleep(t.start_s)
        try:
            for call in t.calls:
                time.sleep(call.gap_s)
                payload = ({"seconds": call.duration_s} if call.resource == "reward"
                           else {"code": f"import time; time.sleep({call.duration_s:.4f})", "tool": call.tool})
                try:
                    result = orch.submit(t.tid, call.tool, call.resource, payload).result(timeout=300)
                except Exception as err:  # noqa: BLE001 - reported below; e.g. no sandbox can start here
                    failures.append((t.tid, f"{type(err).__name__}: {err}"))
                    return
                if call.resource == "cpu" and result.state.status != "success":
                    failures.append((t.tid, result.stderr[-200:]))
            time.sleep(t.tail_s)
        finally:
            orch.end_trajectory(t.tid)  # also after a failure: a dedicated unit must not stay bound

    threads = [threading.Thread(target=trajectory, args=(t,)) for t in trace]
    start = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.monotonic() - start
    held = orch.held_seconds()
    orch.close()
    if failures:
        raise RuntimeError(f"{len(failures)} sandboxed calls failed, e.g. {failures[0]}")
    acts = [r["done"] - r["submitted"] for r in orch.records]
    return {"mean": sum(acts) / len(acts), "p99": percentile(acts, 99), "held": held, "wall": wall, "n": len(acts)}



def sandbox_overhead(uid: int, runs: int = 10) -> float:
    """Median wall seconds of a sandboxed call that does nothing (bwrap + interpreter start, reaping)."""
    sandbox = SandboxRunner(SandboxLimits(), uid_base=uid).slot(0)
    walls = sorted(sandbox.run_python("pass").wall_s for _ in range(runs))
    return walls[len(walls) // 2]


def slow_scorer(payload):
    time.sleep(payload["seconds"])
    return {"reward": 1.0}


def show(title: str, rows: dict, keys=("mean", "p99", "held")) -> None:
    print(f"\n== {title} ==")
    print(f"  {'policy':10s} {'mean ACT s':>10s} {'p99 ACT s':>10s} {'held unit-s':>12s}" +
          ("" if "busy" not in rows[POLICIES[0]] else f" {'busy unit-s':>12s} {'makespan s':>11s}"))
    for policy in POLICIES:
        r = rows[policy]
        extra = "" if "busy" not in r else f" {r['busy']:12.1f} {r['makespan']:11.1f}"
        print(f"  {policy:10s} {r['mean']:10.2f} {r['p99']:10.2f} {r['held']:12.1f}{extra}")
    d, t = rows["dedicated"], rows["tangram"]
    print(f"  ratios (dedicated / tangram): mean ACT {d['mean'] / t['mean']:.2f}x, p99 ACT {d['p99'] / t['p99']:.2f}x, "
          f"held {d['held'] / t['held']:.2f}x (tangram holds {100 * (1 - t['held'] / d['held']):.0f}% less)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=512)
    parser.add_argument("--cpu", type=int, default=32, help="CPU sandbox capacity at 1x (both policies)")
    parser.add_argument("--reward", type=int, default=4, help="reward endpoint concurrency")
    parser.add_argument("--real-trajectories", type=int, default=16)
    parser.add_argument("--real-cpu", type=int, default=4)
    parser.add_argument("--real-scale", type=float, default=0.05, help="time scale of the real run's trace")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smaller simulated trace, no real run")
    args = parser.parse_args()
    shape = SHAPE
    trace = make_trace(workload((128 if args.quick else args.trajectories) // shape.waves, args.seed), shape)
    print(f"trace: {len(trace)} trajectories in {shape.waves} waves, {sum(len(t.calls) for t in trace)} tool calls")

    t0 = time.perf_counter()
    sim = simulated(trace, args.cpu, args.reward)
    show(f"simulated clock, {args.cpu} CPU sandboxes (1x), {args.reward} reward slots", sim,)
    half = simulated(trace, max(1, args.cpu // 2), args.reward)
    show(f"simulated clock, {max(1, args.cpu // 2)} CPU sandboxes (0.5x)", half)
    per_wave = -(-len(trace) // shape.waves)
    over = replay(scheduler("dedicated", per_wave, args.reward, startup_s=1.0, idle_s=10.0), trace)
    print(f"\n== over-provisioned baseline: dedicated with {per_wave} CPU sandboxes (one per trajectory of a wave) ==")
    print(f"  dedicated  mean ACT {over.mean_act:.2f} s, p99 {over.p99_act:.2f} s, held {over.held_s:.1f} unit-s; "
          f"tangram at {args.cpu}: mean ACT {sim['tangram']['mean']:.2f} s, held {sim['tangram']['held']:.1f} "
          f"({100 * (1 - sim['tangram']['held'] / over.held_s):.0f}% less)")
    print(f"  (all simulations: {time.perf_counter() - t0:.2f} s)")
    out = {"act_ratio": sim["dedicated"]["mean"] / sim["tangram"]["mean"],
           "p99_act_ratio": sim["dedicated"]["p99"] / sim["tangram"]["p99"],
           "held_ratio": sim["dedicated"]["held"] / sim["tangram"]["held"],
           "held_saving": 1 - sim["tangram"]["held"] / sim["dedicated"]["held"],
           "act_ratio_half_capacity": half["dedicated"]["mean"] / half["tangram"]["mean"],
           "held_saving_vs_overprovisioned": 1 - sim["tangram"]["held"] / over.held_s,
           "act_ratio_vs_overprovisioned": over.mean_act / sim["tangram"]["mean"],
           "source": "simulated clock", "trajectories": len(trace), "cpu_units": args.cpu}

    if not args.quick:
        small = scaled(make_trace(workload(args.real_trajectories, args.seed), replace(shape, waves=1)),
                       args.real_scale)
        server = serve_scorer(slow_scorer)
        try:
            real = {policy: real_run(small, policy, args.real_cpu, args.reward, 230000, server.url,
                                     args.real_scale) for policy in POLICIES}
        finally:
            server.close()
        overhead = sandbox_overhead(230100)
        print(f"\n  one trivial sandboxed call (python -I -c pass in bwrap), median of 10: {overhead:.3f} s")
        show(f"real bwrap sandboxes, {args.real_trajectories} trajectories, {args.real_cpu} sandboxes, "
             f"time x{args.real_scale}", real)
        predicted = {policy: replay(scheduler(policy, args.real_cpu, args.reward, 0.0, 0.5, args.real_scale), small)
                     for policy in POLICIES}
        print("  same scaled trace on the simulated clock: " + ", ".join(
            f"{p} mean ACT {predicted[p].mean_act:.3f} s held {predicted[p].held_s:.1f}" for p in POLICIES))
        out.update({"real_act_ratio": real["dedicated"]["mean"] / real["tangram"]["mean"],
                    "real_p99_act_ratio": real["dedicated"]["p99"] / real["tangram"]["p99"],
                    "real_held_ratio": real["dedicated"]["held"] / real["tangram"]["held"],
                    "real_tangram_mean_act_s": real["tangram"]["mean"], "sandbox_overhead_s": overhead})
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in out.items()}))


if __name__ == "__main__":
    main()
