"""Run a scenario: every configured policy from its best configuration, on the same batches."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from libra_hpc.sim.config import SimConfig
from libra_hpc.planner.control import length_profile
from libra_hpc.sim.bound import run_bound
from libra_hpc.sim.context import Context, critical_path_s, describe, samples_of
from libra_hpc.sim.controller import PolicyRun
from libra_hpc.sim.policies import SETUPS, control_loop
from libra_hpc.sim.recorder import Recorder
from libra_hpc.sim.search import search_async_static, search_colocated
from libra_hpc.envs.synthetic import summary

log = logging.getLogger(__name__)

FAIR_BOTH_WAYS = ("async_static", "oracle_best")
"""Searched static splits: with ``rl.partial_rollout`` each runs with partial rollout on and
off and keeps the better (the baseline Libra is measured against is the best static
policy, not a handicapped one)."""


@dataclass
class ScenarioResult:
    cfg: SimConfig
    runs: dict[str, Recorder]
    searches: dict[str, list[dict]] = field(default_factory=dict)
    initial: dict[str, str] = field(default_factory=dict)
    workload: dict = field(default_factory=dict)
    bound: dict = field(default_factory=dict)
    """The physical bound of the run (libra_hpc/sim/bound.py run_bound)."""
    wall_s: float = 0.0

    def ratio(self, a: str, b: str) -> float | None:
        """Throughput (tokens/s) of policy ``a`` over policy ``b``; None if either is missing
        or ran out of memory before the last step."""
        if a not in self.runs or b not in self.runs or self.oom(a) or self.oom(b):
            return None
        return self.runs[a].summary["tokens_per_s"] / self.runs[b].summary["tokens_per_s"]

    def oom(self, name: str) -> dict | None:
        """Where policy ``name`` ran out of memory (step, shape, sequence tokens, why), or None."""
        return self.runs[name].summary.get("out_of_memory") if name in self.runs else None

    def vs_bound(self, name: str) -> float | None:
        """The bound's time over policy ``name``'s simulated time (1.0: at the bound)."""
        if name not in self.runs or not self.bound or self.oom(name):
            return None
        return self.bound["bound_s"] / self.runs[name].summary["sim_time_s"]


def run_policy(ctx: Context, name: str, steps: int | None = None,
               searched: dict | None = None) -> tuple[Recorder, list[dict], str]:
    """One policy: its starting layout (search, or the control loop's first decision), then
    the run. ``searched`` memoises the asynchronous search (``async_static`` and
    ``oracle_best`` share it)."""
    setup = SETUPS[name]
    steps = steps or ctx.cfg.rl.steps
    control, table, colocated = None, [], name == "colocated"
    searched = {} if searched is None else searched
    if colocated:
        layout, train, table = search_colocated(ctx)
    elif name in ("async_static", "oracle_best"):
        if "async" not in searched:
            searched["async"] = search_async_static(ctx)
        layout, train, table = searched["async"]
    else:
        control = control_loop(ctx, setup)
        first = control.initial(length_profile(samples_of(ctx.batch(0)), ctx.cfg.batch_size) if setup.clairvoyant else None)
        layout, train = first.layout, first.plan.train
    start = describe(layout, train, control.pool if control else None, colocated)
    log.info("%s starts with %s", name, start)
    rec = PolicyRun(ctx, setup, layout, train, steps, control, colocated=colocated).run()
    if name in FAIR_BOTH_WAYS and ctx.cfg.rl.partial_rollout:
        # a fair baseline: the static split gets the better of partial rollout on and off
        other = PolicyRun(ctx, setup, layout, train, steps, None, colocated=colocated, partial=False).run()
        tried = {"partial_on_tokens_per_s": rec.summary["tokens_per_s"],
                 "partial_off_tokens_per_s": other.summary["tokens_per_s"]}
        if other.summary["tokens_per_s"] > rec.summary["tokens_per_s"]:
            rec = other
        rec.summary.update(tried)
    s = rec.summary
    log.info("%s: %.0f tokens/s, median step %.1f s, %d events in %.1f s", name, s["tokens_per_s"],
             s["step_s_median"], s["events"], s["wall_s"])
    return rec, table, start


def run_scenario(cfg: SimConfig, policies: list[str] | None = None) -> ScenarioResult:
    """Every policy of ``policies`` (default: the scenario's) on the same workload."""
    t0 = time.perf_counter()
    ctx = Context(cfg)
    result = ScenarioResult(cfg, {})
    for name, step in (("first_step", 0), ("last_step", cfg.rl.steps - 1)):
        batch = ctx.batch(step)
        result.workload[name] = {**summary(batch), "critical_path_s": critical_path_s(ctx, batch)}
    result.bound = run_bound(ctx)
    searched: dict = {}
    for name in policies or cfg.policies:
        rec, table, initial = run_policy(ctx, name, searched=searched)
        result.runs[name] = rec
        result.initial[name] = initial
        if table:
            result.searches[name] = table
    result.wall_s = time.perf_counter() - t0
    return result
