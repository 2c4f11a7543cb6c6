"""How far a drifting scenario moves the best fixed split: an estimate of ``phase_gain``.

    python benchmarks/bench_drift.py --config configs/sim/a800-swe-drift.yaml [--window 20]
        [--samples 2] [--keep 4] [--steps N]

For each window of ``--window`` RL steps and for the whole run, the best fixed split
(training GPUs and their fastest Megatron shape, rollout instances as a mix of TP sizes) is
found the way ``sim/search.py`` scores a static split: each candidate's rollout is
*simulated* alone from idle on a few sample steps of its scope (``--samples`` per window,
the same simulated rollout side and least-load router as the search), its training step
costed by the training cost model at the step's mean length, and a step takes the
bounded-staleness pipeline's steady state (``pipelined_step_s``). Candidates are screened
first with the planner's rollout cost model; the best ``--keep`` of each scope are
simulated. The whole-run candidates include every window's best, so the fixed split is
the best of all the splits any window would pick.

Training GPU counts are multiples of 4 (part-node training; the node it leaves partly
holds TP <= 4 instances); a rollout mix gives whole nodes one of two TP sizes (TP ``a`` on
``k`` nodes, TP ``b`` on the rest and on the partial node). A training shape is chosen for
the longest mean (packed) length of its scope, so a fixed split must run the late, long
batches with the shape it chose for them.

Estimate: phase_gain = (run tokens / time of the best phased plan) / (run tokens / time of
the best fixed split). The phased plan gives each window one split among every scope's
best (the fixed one included), chosen by a dynamic programme over the windows in which a
change costs ``costs.reconfig_s`` plus one unoverlapped rollout of the new split from idle
(the drain), a new training shape on the same GPUs ``costs.reshard_s``, so a window keeps
its split when changing does not pay. The fixed split keeps its one training shape. It is *not* the ``phase_static`` policy of
issue 30 (a full simulation of every step); it bounds what such a policy can find among
these splits, with a conservative change cost. Prints a table per window; the last line is
one JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import time
from dataclasses import dataclass

from libra_hpc.planner.costs import TrainShape
from libra_hpc.planner.costs import rollout_makespan as model_makespan
from libra_hpc.planner.pipeline import pipelined_step_s
from libra_hpc.planner.valuation import length_profile
from libra_hpc.sim.config import load_sim_config
from libra_hpc.sim.context import Context, samples_of
from libra_hpc.sim.engine import SimClock
from libra_hpc.sim.rollout import InstanceSpec, RolloutSide
from libra_hpc.sim.training import best_shape, step_s

log = logging.getLogger(__name__)


@dataclass(frozen=True, order=True)
class Split:
    """Training GPUs and rollout instances (their TP sizes, largest first)."""

    train_gpus: int
    rollout: tuple[int, ...]

    def __str__(self) -> str:
        counts: dict[int, int] = {}
        for tp in self.rollout:
            counts[tp] = counts.get(tp, 0) + 1
        return f"train {self.train_gpus} | " + " + ".join(f"{n}xTP{tp}" for tp, n in sorted(counts.items(), reverse=True))


def splits(ctx: Context, quantum: int = 4) -> list[Split]:
    """Every split of the candidate family (module docstring)."""
    g, total = ctx.cfg.cluster.gpus_per_node, ctx.gpus
    out = []
    for n in range(quantum, total - max(1, ctx.cfg.planner.min_rollout_gpus) + 1, quantum):
        partial = (g - n % g) % g
        whole = (total - n - partial) // g
        seen = set()
        for a in ctx.tps:
            for b in ctx.tps:
                if b > a:
                    continue
                for k in ([whole] if a == b else range(1, whole)):
                    tail = min(b, partial) if partial else 0
                    if partial and (tail == 0 or partial % tail):
                        continue
                    tps = [a] * (k * g // a) + [b] * ((whole - k) * g // b) + ([tail] * (partial // tail) if tail else [])
                    key = tuple(sorted(tps, reverse=True))
                    if key and key not in seen and tail in ctx.tps + (0,):
                        seen.add(key)
                        out.append(Split(n, key))
    return out


class Scorer:
    """Step times of splits on sample steps; rollout makespans simulated once and memoised."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.sims = 0
        self._roll: dict[tuple[tuple[int, ...], int], float] = {}
        self._model: dict[tuple[tuple[int, ...], int], float] = {}

    def mean_tokens(self, step: int) -> float:
        return statistics.fmean(t.total_tokens for t in self.ctx.batch(step))

    def gen_tokens(self, step: int) -> int:
        return sum(t.gen_tokens for t in self.ctx.batch(step))

    def shape(self, n: int, steps: list[int]) -> TrainShape | None:
        seq = max(math.ceil(self.mean_tokens(s)) for s in steps)
        return best_shape(self.ctx.model, self.ctx.hw, n, self.ctx.cfg.batch_size, seq, self.ctx.cal)

    def rollout_s(self, tps: tuple[int, ...], step: int) -> float:
        """Simulated makespan of batch ``step`` alone on instances ``tps``, from idle."""
        key = (tps, step)
        if key not in self._roll:
            done: dict[int, float] = {}
            ctx, clock = self.ctx, SimClock()
            side = RolloutSide(ctx.step_models, ctx.cfg.scheduler, ctx.cfg.costs, "least_load", ctx.cfg.rl.seed,
                               lambda batch, now: done.__setitem__(batch, now))
            side.configure(tuple(InstanceSpec(i + 1, tp) for i, tp in enumerate(tps)), 0.0)
            clock.schedule_all(side.submit(step, ctx.batch(step), 0.0))
            clock.run()
            self._roll[key] = done[step]
            self.sims += 1
        return self._roll[key]

    def model_s(self, tps: tuple[int, ...], step: int) -> float:
        """The planner's cost-model makespan (the screen)."""
        key = (tps, step)
        if key not in self._model:
            pools: dict[int, int] = {}
            for tp in tps:
                pools[tp] = pools.get(tp, 0) + 1
            batch = self.ctx.batch(step)
            self._model[key] = model_makespan([(self.ctx.rollout_costs[tp], n) for tp, n in pools.items()],
                                              length_profile(samples_of(batch), len(batch))).makespan_s
        return self._model[key]

    def step_s(self, split: Split, shape: TrainShape, step: int, simulated: bool = True) -> float:
        ctx = self.ctx
        train = step_s(ctx.model, ctx.hw, shape, self.mean_tokens(step), ctx.cal)
        roll = self.rollout_s(split.rollout, step) if simulated else self.model_s(split.rollout, step)
        return pipelined_step_s(train, roll + ctx.weight_sync_s, ctx.cfg.rl.max_staleness, ctx.cfg.rl.stream_groups)


def best_in(scorer: Scorer, candidates: list[Split], steps: list[int], keep: int,
            extra: tuple[Split, ...] = ()) -> list[tuple[float, Split, TrainShape]]:
    """Candidates ranked by mean simulated step time over ``steps`` (screened first)."""
    shapes = {n: scorer.shape(n, steps) for n in {c.train_gpus for c in candidates}}
    screened = sorted((statistics.fmean(scorer.step_s(c, shapes[c.train_gpus], s, simulated=False) for s in steps), c)
                      for c in candidates if shapes[c.train_gpus] is not None)
    chosen = list(dict.fromkeys([c for _, c in screened[:keep]] + list(extra)))
    scored = []
    for c in chosen:
        shape = shapes.get(c.train_gpus) or scorer.shape(c.train_gpus, steps)
        if shape is not None:
            scored.append((statistics.fmean(scorer.step_s(c, shape, s) for s in steps), c, shape))
    return sorted(scored, key=lambda x: x[0])


def estimate(ctx: Context, window: int, samples: int, keep: int) -> dict:
    steps = ctx.cfg.rl.steps
    windows = [(first, min(first + window, steps)) for first in range(0, steps, window)]
    picks = {w: sorted({min(w[1] - 1, w[0] + int((i + 0.5) * (w[1] - w[0]) / samples)) for i in range(samples)})
             for w in windows}
    everything = sorted({s for w in windows for s in picks[w]})
    scorer, candidates = Scorer(ctx), splits(ctx)
    per_window = {w: best_in(scorer, candidates, picks[w], keep) for w in windows}
    fixed = best_in(scorer, candidates, everything, keep, extra=tuple(per_window[w][0][1] for w in windows))
    f_step, f_split, f_shape = fixed[0]
    # Every window may keep any split some scope found best (the fixed one included): its
    # mean step over the window's samples, with the shape chosen for that window.
    pool = list(dict.fromkeys([f_split] + [per_window[w][0][1] for w in windows]))
    times, shapes = {}, {}
    for w in windows:
        for c in pool:
            shape = scorer.shape(c.train_gpus, picks[w])
            if shape is not None:
                shapes[w, c] = shape
                times[w, c] = (w[1] - w[0]) * statistics.fmean(scorer.step_s(c, shape, s) for s in picks[w])
    fixed_times = {w: (w[1] - w[0]) * statistics.fmean(scorer.step_s(f_split, f_shape, s) for s in picks[w])
                   for w in windows}  # the fixed split keeps the shape it chose for the whole run

    def change_s(c: Split, w) -> float:  # the pause and the drain: one rollout of the new split not overlapped
        return ctx.cfg.costs.reconfig_s + scorer.rollout_s(c.rollout, picks[w][0])

    def switch_s(p: Split, c: Split, w, prev_w) -> float:  # same split, another training shape: a re-shard
        if p != c:
            return change_s(c, w)
        return ctx.cfg.costs.reshard_s if shapes[w, c] != shapes[prev_w, c] else 0.0

    # The phased plan: per window one split of the pool, changes paid (dynamic programme over windows).
    best: dict[Split, tuple[float, list[Split]]] = {c: (times[windows[0], c], [c]) for c in pool
                                                    if (windows[0], c) in times}
    for prev_w, w in zip(windows, windows[1:]):
        best = {c: min(((t + times[w, c] + switch_s(p, c, w, prev_w), path + [c]) for p, (t, path) in best.items()),
                       key=lambda x: x[0])
                for c in pool if (w, c) in times}
    phased_time, plan = min(best.values(), key=lambda x: x[0])

    def tokens(w) -> float:  # generated tokens of the window (its sample steps' mean per step)
        return statistics.fmean(scorer.gen_tokens(s) for s in picks[w]) * (w[1] - w[0])

    rows, fixed_time, prev = [], sum(fixed_times.values()), None
    for i, (w, chosen) in enumerate(zip(windows, plan)):
        w_best = min((c for c in pool if (w, c) in times), key=lambda c: times[w, c])
        change = switch_s(prev, chosen, w, windows[i - 1]) if prev is not None else 0.0
        prev = chosen
        rows.append({"window": f"{w[0]}..{w[1] - 1}", "sample_steps": picks[w],
                     "mean_total_tokens": round(statistics.fmean(scorer.mean_tokens(s) for s in picks[w])),
                     "mean_gen_tokens": round(statistics.fmean(scorer.gen_tokens(s) for s in picks[w])
                                              / ctx.cfg.batch_size),
                     "best": str(w_best), "best_train_shape": _shape(scorer.shape(w_best.train_gpus, picks[w])),
                     "best_tokens_per_s": round(tokens(w) / times[w, w_best], 1),
                     "fixed_tokens_per_s": round(tokens(w) / fixed_times[w], 1),
                     "window_gain": round(fixed_times[w] / times[w, w_best], 3),
                     "phased": str(chosen), "change_s": round(change, 1)})
    total = sum(tokens(w) for w in windows)
    return {"scenario": ctx.cfg.name, "steps": steps, "window": window, "fixed": str(f_split),
            "fixed_train_shape": _shape(f_shape), "fixed_tokens_per_s": round(total / fixed_time, 1),
            "phased_tokens_per_s": round(total / phased_time, 1), "phase_gain_est": round(fixed_time / phased_time, 3),
            "windows": rows, "candidates": len(candidates), "rollout_sims": scorer.sims}


def _shape(s: TrainShape) -> str:
    return f"TP{s.tp} PP{s.pp} DP{s.dp} mbs{s.micro_batch}{' recompute' if s.recompute else ''}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/sim/a800-swe-drift.yaml")
    parser.add_argument("--window", type=int, default=20, help="steps per window (issue 30: W=20)")
    parser.add_argument("--samples", type=int, default=2, help="sample steps simulated per window")
    parser.add_argument("--keep", type=int, default=4, help="screened candidates simulated per scope")
    parser.add_argument("--steps", type=int, default=None, help="override rl.steps")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a scenario field")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    import yaml
    overrides = {k: yaml.safe_load(v) for k, v in (a.split("=", 1) for a in args.set)}
    if args.steps:
        overrides["rl.steps"] = args.steps
    ctx = Context(load_sim_config(args.config, overrides))
    t0 = time.perf_counter()
    out = estimate(ctx, args.window, args.samples, args.keep)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    print(f"{out['scenario']}: best fixed split {out['fixed']} ({out['fixed_train_shape']})")
    print("| window | tokens/traj (generated) | best split (train shape) | best tok/s | fixed tok/s | gain | phased plan | change s |")
    print("|---|---|---|---|---|---|---|---|")
    for r in out["windows"]:
        print(f"| {r['window']} | {r['mean_total_tokens']} ({r['mean_gen_tokens']}) | {r['best']} ({r['best_train_shape']}) | "
              f"{r['best_tokens_per_s']} | {r['fixed_tokens_per_s']} | {r['window_gain']} | {r['phased']} | {r['change_s']} |")
    print(f"phase_gain (estimate) {out['phase_gain_est']}: phased {out['phased_tokens_per_s']} tok/s vs fixed "
          f"{out['fixed_tokens_per_s']} tok/s ({out['rollout_sims']} rollout simulations, {out['wall_s']} s)")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
