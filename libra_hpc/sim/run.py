"""Run a scenario: every configured policy from its best configuration, on the same batches."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from libra_hpc.envs.synthetic import summary
from libra_hpc.planner.control import length_profile
from libra_hpc.sim import baselines
from libra_hpc.sim.bound import run_bound, violations
from libra_hpc.sim.config import SimConfig, policy_name
from libra_hpc.sim.context import Context, critical_path_s, describe, samples_of
from libra_hpc.sim.controller import PolicyRun
from libra_hpc.sim.policies import SETUPS, control_loop
from libra_hpc.sim.recorder import Recorder
from libra_hpc.sim.search import search_colocated

log = logging.getLogger(__name__)

RUN_FIRST = ("libra", "static_hindsight", "phase_static")
"""Policies whose runs others use: ``static_hindsight`` tries every layout Libra applied,
``phase_static`` and ``static_true_lengths`` take ``static_hindsight``'s split,
``phase_static_late`` ``phase_static``'s schedule."""


@dataclass
class ScenarioResult:
    cfg: SimConfig
    runs: dict[str, Recorder]
    searches: dict[str, list[dict]] = field(default_factory=dict)
    """Per policy, the candidates its split was chosen from (``phase_static``: per window)."""
    initial: dict[str, str] = field(default_factory=dict)
    workload: dict = field(default_factory=dict)
    bound: dict = field(default_factory=dict)
    """The physical bound of the run (libra_hpc/sim/bound.py run_bound)."""
    wall_s: float = 0.0

    def completed(self, name: str) -> int:
        """Steps policy ``name`` completed (all of them unless it ran out of memory)."""
        return self.runs[name].summary["steps"] if name in self.runs else 0

    def failed_steps(self, name: str) -> int | None:
        """Steps policy ``name`` did not complete (it ran out of memory before them); None
        when it did not run."""
        return self.cfg.rl.steps - self.completed(name) if name in self.runs else None

    def ratio(self, a: str, b: str) -> float | None:
        """Throughput (tokens/s) of policy ``a`` over policy ``b``. When either ran out of
        memory, over the steps both completed: ``b``'s time to finish steps 0..m-1 over
        ``a``'s (they generated the same tokens). None if either is missing or completed
        no step."""
        if a not in self.runs or b not in self.runs:
            return None
        if not (self.oom(a) or self.oom(b)):
            return self.runs[a].summary["tokens_per_s"] / self.runs[b].summary["tokens_per_s"]
        m = min(self.completed(a), self.completed(b))
        if m == 0:
            return None
        return self.time_to(b, m - 1) / self.time_to(a, m - 1)

    def time_to(self, name: str, step: int) -> float:
        """Simulated seconds until policy ``name`` finished training steps 0..``step``."""
        return next(r["t_end"] for r in self.runs[name].rows if r["step"] == step)

    def oom(self, name: str) -> dict | None:
        """Where policy ``name`` ran out of memory (step, shape, sequence tokens, why), or None."""
        return self.runs[name].summary.get("out_of_memory") if name in self.runs else None

    def vs_bound(self, name: str) -> float | None:
        """The bound's time over policy ``name``'s simulated time (1.0: at the bound); for a
        policy that ran out of memory, over the steps it completed. None without a step."""
        if name not in self.runs or not self.bound or not self.completed(name):
            return None
        last = self.completed(name) - 1
        return self.bound["cumulative_s"][last] / self.time_to(name, last)

    def bound_violations(self) -> dict[str, list[int]]:
        """Per policy, the steps k at which it completed steps 0..k before the bound's
        cumulative time (libra_hpc/sim/bound.py ``violations``): each a failure of the bound."""
        return {n: violations(self.bound, rec.rows) for n, rec in self.runs.items()} if self.bound else {}


def run_policy(ctx: Context, name: str, steps: int | None = None,
               memo: dict | None = None) -> tuple[Recorder, list[dict], str]:
    """One policy: its starting layout (a search, the control loop's first decision, or a
    baseline's choice: libra_hpc/sim/baselines.py), then the run. ``memo`` carries what
    later policies take from earlier ones: Libra's applied layouts (``libra_applied``) and
    ``static_hindsight``'s split (``hindsight``)."""
    name = policy_name(name)
    setup = SETUPS[name]
    steps = steps or ctx.cfg.rl.steps
    memo = {} if memo is None else memo
    control, table, colocated = None, [], setup.start == "colocated"
    if setup.start == "hindsight":
        rec, table, start = _hindsight(ctx, setup, steps, memo)
    elif setup.start == "pilot":
        (start, layout, train), rec = baselines.pilot(ctx, setup, steps)
    elif setup.start in ("phased", "phased_late"):
        rec, table, start = _phased(ctx, setup, steps, memo)
    else:
        if colocated:
            layout, train, table = search_colocated(ctx)
        else:
            control = control_loop(ctx, setup)
            first = control.initial(length_profile(samples_of(ctx.batch(0)), ctx.cfg.batch_size)
                                    if setup.clairvoyant or setup.known_start else None)
            layout, train = first.layout, first.plan.train
        start = describe(layout, train, control.pool if control else None, colocated)
        run = PolicyRun(ctx, setup, layout, train, steps, control, colocated=colocated)
        rec = run.run()
        if name == "libra":
            memo["libra_applied"] = run.applied
    log.info("%s starts with %s", name, start)
    s = rec.summary
    log.info("%s: %.0f tokens/s, median step %.1f s, %d events in %.1f s", name, s["tokens_per_s"],
             s["step_s_median"], s["events"], s["wall_s"])
    return rec, table, start


def _phased(ctx: Context, setup, steps: int, memo: dict) -> tuple[Recorder, list[dict], str]:
    """``phase_static``, or ``phase_static_late`` on its schedule (found here if it has not run)."""
    window = ctx.cfg.search.phase_window
    if "phased" not in memo:
        extra = baselines.applied_candidates(memo.get("libra_applied", []))
        if "hindsight" in memo:
            extra.append(memo["hindsight"])
        own = SETUPS["phase_static"]
        memo["phased_run"], memo["phased_table"], memo["phased"] = baselines.phased(ctx, own, steps, window, extra)
    table = memo["phased_table"]
    start = f"windows of {window} steps, first: {table[0]['split']}"
    if setup.start == "phased_late":
        lag = ctx.cfg.search.phase_lag
        return baselines.late(ctx, setup, steps, memo["phased"], lag), [], f"{start}; each change {lag} step(s) late"
    return memo["phased_run"], table, start


def _hindsight(ctx: Context, setup, steps: int, memo: dict) -> tuple[Recorder, list[dict], str]:
    """``static_hindsight`` (and ``static_true_lengths`` on its split). With
    ``rl.partial_rollout`` the chosen split also runs with it off and keeps the better: the
    baseline is the best fixed policy, not a handicapped one."""
    table: list[dict] = []
    if "hindsight" not in memo or setup.name == "static_hindsight":
        own = SETUPS["static_hindsight"]
        memo["hindsight"], rec, table = baselines.hindsight(ctx, own, steps, memo.get("libra_applied", []))
    start, layout, train = memo["hindsight"]
    turns = baselines.prior_turns(ctx)
    if setup.name != "static_hindsight":
        rec = PolicyRun(ctx, setup, layout, train, steps, initial_turns=turns).run()
    if ctx.cfg.rl.partial_rollout:
        other = PolicyRun(ctx, setup, layout, train, steps, partial=False, initial_turns=turns).run()
        tried = {"partial_on_tokens_per_s": rec.summary["tokens_per_s"],
                 "partial_off_tokens_per_s": other.summary["tokens_per_s"]}
        if other.summary["tokens_per_s"] > rec.summary["tokens_per_s"]:
            rec = other
        rec.summary.update(tried)
    return rec, table, start


def run_scenario(cfg: SimConfig, policies: list[str] | None = None) -> ScenarioResult:
    """Every policy of ``policies`` (default: the scenario's) on the same workload; Libra
    and ``static_hindsight`` run first (:data:`RUN_FIRST`), the results keep the order asked."""
    t0 = time.perf_counter()
    ctx = Context(cfg)
    result = ScenarioResult(cfg, {})
    for name, step in (("first_step", 0), ("last_step", cfg.rl.steps - 1)):
        batch = ctx.batch(step)
        result.workload[name] = {**summary(batch), "critical_path_s": critical_path_s(ctx, batch)}
    result.bound = run_bound(ctx)
    names = [policy_name(n) for n in (policies or cfg.policies)]
    order = sorted(names, key=lambda n: RUN_FIRST.index(n) if n in RUN_FIRST else len(RUN_FIRST))
    memo: dict = {}
    for name in order:
        rec, table, initial = run_policy(ctx, name, memo=memo)
        result.runs[name] = rec
        result.initial[name] = initial
        if table:
            result.searches[name] = table
    result.runs = {n: result.runs[n] for n in names}
    result.initial = {n: result.initial[n] for n in names}
    result.wall_s = time.perf_counter() - t0
    return result
