"""The fixed splits Libra is measured against, over the planner's own decision space
(libra_hpc/sim/policies.py says what each policy is; libra_hpc/sim/search.py finds the
candidates and simulates them).

- :func:`hindsight`: ``static_hindsight``: the search's top plans on every batch of the run
  and every layout Libra applied, each simulated over the whole run; the best is the run.
- :func:`pilot`: ``static_pilot``: the plan on the first batches, run as it is.
- :func:`phased`: ``phase_static``: per window of ``search.phase_window`` steps, the
  candidates of that window (its top plans, Libra's layouts, ``static_hindsight``'s split
  and the previous window's) simulated on the window's batches alone; the best becomes the
  window's split, except that the previous window's is kept when the best saves no more
  than ``costs.reconfig_s`` of simulated time over the window (a change costs at least that
  pause, and the drain on top). The whole run then goes through the windows' splits, each
  change drained and paused as Libra's replans are (libra_hpc/sim/controller.py).
- :func:`late`: ``phase_static_late``: ``phase_static``'s splits, each change requested
  ``search.phase_lag`` steps after its window's first step: what the phased gain keeps
  when the change waits to be seen (a policy that reacts to what it measured sees a new
  regime only once a step of it has run). Not a bound: a measured reference for the bar
  a reactive policy is held to against ``phase_static``, which changes on time.
"""

from __future__ import annotations

import logging

from libra_hpc.cluster.layout import Layout
from libra_hpc.planner.costs import TrainShape
from libra_hpc.sim.context import Context, describe
from libra_hpc.sim.controller import PolicyRun
from libra_hpc.sim.policies import PILOT_STEPS, SETUPS, PolicySetup, control_loop
from libra_hpc.sim.recorder import Recorder
from libra_hpc.sim.search import (Candidate, StepsFrom, as_candidate, best_simulated, candidate_row, pilot_plan,
                                  rank, simulate_all, split_key, top_plans)

log = logging.getLogger(__name__)


def prior_turns(ctx: Context) -> list[tuple[int, ...]]:
    """The per-turn tokens Libra's first bucket limits are placed on (its prior): a fixed
    split's C-MLFQ buckets start from the same."""
    return control_loop(ctx, SETUPS["static_hindsight"]).prior_turns()


def applied_candidates(applied: list[tuple[Layout, TrainShape]]) -> list[Candidate]:
    """Libra's layouts (hybrid replicas lent counted as training) as fixed-split candidates."""
    return [(f"libra applied: {describe(layout, train)}", layout, train) for layout, train in applied]


def hindsight(ctx: Context, setup: PolicySetup, steps: int,
              applied: list[tuple[Layout, TrainShape]]) -> tuple[Candidate, Recorder, list[dict]]:
    """``static_hindsight``: the best simulated of the search's top plans on the whole run
    and Libra's applied layouts (``applied``; none when Libra did not run)."""
    plans = top_plans(ctx, range(steps), ctx.cfg.search.top_plans)
    candidates = [as_candidate(ctx, p, f"search #{i + 1}") for i, p in enumerate(plans)]
    return best_simulated(ctx, setup, candidates + applied_candidates(applied), steps, prior_turns(ctx))


def pilot(ctx: Context, setup: PolicySetup, steps: int) -> tuple[Candidate, Recorder]:
    """``static_pilot``: the plan on the first ``PILOT_STEPS`` batches, fixed for the run."""
    cand = as_candidate(ctx, pilot_plan(ctx, PILOT_STEPS), f"pilot on steps 0..{PILOT_STEPS - 1}")
    rec = PolicyRun(ctx, setup, cand[1], cand[2], steps, initial_turns=prior_turns(ctx)).run()
    return cand, rec


Schedule = list[tuple[int, Candidate]]
"""A phased run's splits: (first step, split) for its first window and every change."""


def phased(ctx: Context, setup: PolicySetup, steps: int, window: int,
           extra: list[Candidate]) -> tuple[Recorder, list[dict], Schedule]:
    """``phase_static`` (see the module docstring): its run, a row per window (first step,
    the split run there, whether it changed, every candidate's simulated tokens/s) and its
    schedule (for :func:`late`)."""
    chosen, rows = phase_schedule(ctx, setup, steps, window, extra)
    rec = run_schedule(ctx, setup, steps, chosen)
    log.info("phase_static: %d windows of %d steps, %d changes", len(rows), window, len(chosen) - 1)
    return rec, rows, chosen


def late(ctx: Context, setup: PolicySetup, steps: int, chosen: Schedule, lag: int) -> Recorder:
    """``phase_static_late``: the schedule ``chosen`` with every change requested ``lag``
    steps later (one past the run's last step: not made)."""
    return run_schedule(ctx, setup, steps, [(first + lag if i else first, cand) for i, (first, cand) in enumerate(chosen)])


def run_schedule(ctx: Context, setup: PolicySetup, steps: int, chosen: Schedule) -> Recorder:
    """One run through a schedule's splits, each change drained and paused as Libra's are."""
    (_, (_, layout, train)), later = chosen[0], chosen[1:]
    phases = {first: (cand[1], cand[2]) for first, cand in later if first < steps}
    return PolicyRun(ctx, setup, layout, train, steps, initial_turns=prior_turns(ctx), phases=phases).run()


def phase_schedule(ctx: Context, setup: PolicySetup, steps: int, window: int,
                   extra: list[Candidate]) -> tuple[Schedule, list[dict]]:
    """The hindsight-best split per window of ``window`` steps (the module docstring's
    ``phase_static``) and a row per window."""
    turns = prior_turns(ctx)
    chosen: list[tuple[int, Candidate]] = []
    rows: list[dict] = []
    for first in range(0, steps, window):
        n = min(window, steps - first)
        plans = top_plans(ctx, range(first, first + n), ctx.cfg.search.top_plans)
        prev = chosen[-1][1] if chosen else None
        candidates = ([as_candidate(ctx, p, f"steps {first}..{first + n - 1} search #{i + 1}")
                       for i, p in enumerate(plans)] + extra + ([prev] if prev else []))
        runs = simulate_all(StepsFrom(ctx, first), setup, candidates, n, turns)
        best, best_rec = max(runs, key=lambda r: rank(r[1]))
        if prev is not None and split_key(*best[1:]) != split_key(*prev[1:]):
            kept = next(rec for cand, rec in runs if split_key(*cand[1:]) == split_key(*prev[1:]))
            saved = kept.summary["sim_time_s"] - best_rec.summary["sim_time_s"]
            if rank(kept)[:2] == rank(best_rec)[:2] and saved <= ctx.cfg.costs.reconfig_s:
                best = prev
        changed = prev is None or split_key(*best[1:]) != split_key(*prev[1:])
        if changed:
            chosen.append((first, best))
        rows.append({"first_step": first, "steps": n, "split": best[0], "changed": changed and prev is not None,
                     "candidates": [candidate_row(c, r, split_key(*c[1:]) == split_key(*best[1:])) for c, r in runs]})
    return chosen, rows
