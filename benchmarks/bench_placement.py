"""Where whole GRPO groups train: placed at a group's first finish, or once it is whole.

The job routes each GRPO group whole to one DP replica (its advantages need all its
members), and a step waits for the replica with the most work. Three rules, on the
batches of every shipped synthetic scenario (``configs/sim/*.yaml``, their workloads,
models and solve rates), for DP 2, 4 and 8:

- ``first``: the job until 2026-12: a group is placed when its first member finishes, on
  the replica with the fewest tokens placed so far (tokens counted as members arrive);
- ``whole``: the job now (:class:`libra_hpc.parallel.dispatch.GroupDispatch`): placed
  when its last member finishes, on the replica with the least training work, the group's
  own work known (0 when every reward is equal: the trainer leaves it out);
- ``batch``: the job now when nothing trains ahead (``rl.stream_training`` off, or a step
  of several passes): every group placed when the batch is complete, the one of most work
  first (:meth:`~libra_hpc.parallel.dispatch.GroupDispatch.place_all`). A streamed step
  cannot wait for that: it trains groups as they complete.

Work is what a replica computes: each kept sequence's training FLOPs on the scenario's
model (``ModelProfile.sequence_train_flops``). A replica's
``straggle`` is the largest replica's work over an even share: the step time's factor on
GPUs, where the replicas run in parallel. Finish order: a trajectory finishes at its
generated tokens × 20 ms plus its tool seconds after its batch starts (an assumption:
serial chains of one decode stream; every rule sees the same order).

    python benchmarks/bench_placement.py [--batches 20] [--scenarios a800-swe math-code]

Prints a table; the last line is JSON with each rule's median straggle over every scenario,
DP and batch, ``first_over_whole`` and ``first_over_batch``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from libra_hpc.envs.synthetic import SyntheticWorkload, Trajectory  # noqa: E402
from libra_hpc.parallel.dispatch import GroupDispatch, least_loaded, loads_of  # noqa: E402
from libra_hpc.planner.profiles import load_model  # noqa: E402
from libra_hpc.rl.grpo import group_trains  # noqa: E402
from libra_hpc.sim.config import load_sim_config  # noqa: E402

SECONDS_PER_TOKEN = 0.02
DPS = (2, 4, 8)


def keeps(rewards: list) -> bool:
    """The trainer's rule; a workload without rewards trains every group."""
    return any(r is None for r in rewards) or group_trains(rewards)


def straggles(batch: list[Trajectory], dp: int, weigh) -> dict[str, float]:
    """Each rule's largest replica over an even share of the batch's kept work."""
    order = sorted(batch, key=lambda t: (t.gen_tokens * SECONDS_PER_TOKEN + t.tool_time_s, t.tid))
    groups: dict[str, list[Trajectory]] = {}
    for t in batch:
        groups.setdefault(t.tid.rsplit("/", 1)[0], []).append(t)
    work = {g: sum(weigh(t.total_tokens) for t in ms) for g, ms in groups.items() if keeps([t.reward for t in ms])}
    total = sum(work.values())
    if not total:
        return {}
    replicas = range(dp)
    first: dict[str, int] = {}
    tokens: dict[int, float] = {}
    size = len(next(iter(groups.values())))
    whole, at_end = (GroupDispatch(size, weigh=weigh, keep=keeps) for _ in range(2))
    loads: dict[int, float] = {}
    end_loads: dict[int, float] = {}
    for t in order:
        g = t.tid.rsplit("/", 1)[0]
        if g not in first:
            first[g] = least_loaded(tokens, replicas)
        tokens[first[g]] = tokens.get(first[g], 0) + t.total_tokens
        whole.finished(g, 0, t.tid, t.total_tokens, t.reward, loads, replicas)
        at_end.finished(g, 0, t.tid, t.total_tokens, t.reward, end_loads, replicas, place=False)
    at_end.place_all(groups, end_loads, replicas)
    rules = {"first": first, "whole": dict(whole.dest), "batch": dict(at_end.dest)}
    out = {}
    for name, placed in rules.items():
        out[name] = max(loads_of({g: placed[g] for g in work}, work, dp)) * dp / total
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, default=20, help="batches per scenario, spread over its steps")
    ap.add_argument("--scenarios", nargs="*", help="scenario names (default: every synthetic one)")
    args = ap.parse_args()
    paths = sorted((ROOT / "configs" / "sim").glob("*.yaml"))
    rows, every = [], {"first": [], "whole": [], "batch": []}
    print(f"{'scenario':24s} {'DP':>3s} {'seqs':>6s} {'kept':>5s} {'first':>14s} {'whole':>14s} {'batch':>14s}")
    print(f"{'':24s} {'':>3s} {'':>6s} {'':>5s} {'median / p90':>14s} {'median / p90':>14s} {'median / p90':>14s}")
    for path in paths:
        cfg = load_sim_config(path)
        if cfg.workload is None or (args.scenarios and cfg.name not in args.scenarios):
            continue
        weigh = load_model(cfg.model.name).sequence_train_flops
        workload = SyntheticWorkload(cfg.workload, cfg.rl, cfg.rl.seed, cfg.training.seq_len)
        steps = sorted({round(i * (cfg.rl.steps - 1) / max(1, args.batches - 1)) for i in range(args.batches)})
        batches = [workload.batch(s) for s in steps]
        for dp in DPS:
            got = [x for x in (straggles(b, dp, weigh) for b in batches) if x]
            kept = statistics.fmean(
                sum(keeps([t.reward for t in b if t.tid.rsplit("/", 1)[0] == g])
                    for g in {t.tid.rsplit("/", 1)[0] for t in b}) for b in batches)
            cells = {}
            for rule in every:
                values = sorted(x[rule] for x in got)
                every[rule] += values
                cells[rule] = (statistics.median(values), values[int(0.9 * (len(values) - 1))])
            rows.append({"scenario": cfg.name, "dp": dp, **{r: round(c[0], 4) for r, c in cells.items()}})
            print(f"{cfg.name:24s} {dp:3d} {len(batches[0]):6d} {kept:5.1f} "
                  + " ".join(f"{c[0]:6.3f} / {c[1]:5.3f}" for c in cells.values()))
    medians = {rule: round(statistics.median(v), 4) for rule, v in every.items()}
    print(json.dumps({"straggle_median_" + r: m for r, m in medians.items()}
                     | {"first_over_whole": round(medians["first"] / medians["whole"], 4),
                        "first_over_batch": round(medians["first"] / medians["batch"], 4),
                        "batches": args.batches, "cases": len(every["whole"]), "rows": rows}))


if __name__ == "__main__":
    main()
