"""The policies compared, by registered name, and the control loop a planned one runs.

A policy is a :class:`PolicySetup` (how rollout and training share GPUs, which router, what
the planner may do, and how its starting layout is found: ``start``):

- ``colocated``: synchronous RL on all GPUs (rollout, switch, train, switch), the common
  default of open RL stacks; homogeneous instances, least-load routing. Its rollout TP is
  the best by simulated search (libra_hpc/sim/search.py ``search_colocated``).
- ``libra``: the planner (plan search, replanning gate, elastic hybrid pool) and C-MLFQ
  routing over heterogeneous TP buckets.
- ``static_hindsight``: the best fixed split. The planner's own plan search (part-node
  training, mixed rollout TP instances) run once on the lengths of every batch of the run
  (hindsight), then fixed: no replan, no hybrid pool, C-MLFQ routing, the run's streaming
  and partial-rollout options. Chosen by simulated tokens/s among the search's top
  ``search.top_plans`` plans and every layout Libra applied in the same run
  (libra_hpc/sim/search.py ``hindsight_candidates``, ``best_simulated``).
- ``static_pilot``: the split a user fixes after a short pilot: the planner's choice on
  the first ``PILOT_STEPS`` batches, training sized for ``training.seq_len``, then fixed.
  Running out of memory later is reported, not re-planned.
- ``phase_static``: per window of ``search.phase_window`` steps, the split
  ``static_hindsight`` would choose on that window alone; each change pays the relayout
  Libra pays (rollout drains, then ``costs.reconfig_s``). What adaptivity can win at most
  with that window: ``phase_gain`` = phase_static / static_hindsight.
- ``phase_static_late``: ``phase_static``'s splits, each change requested
  ``search.phase_lag`` steps late: what a policy that must first see a new regime could
  keep of the phased gain (``phase_late_share`` = phase_static_late / phase_static).
- ``libra_no_replan``: the initial plan is kept (hybrid pool still on).
- ``libra_no_hybrid``: replanning on, no hybrid pool.
- ``homogeneous_least_load``: the planner restricted to one rollout TP (the best one for
  the prior), least-load routing: no buckets to route between.
- ``length_aware``: ``libra`` with a noisy length predictor instead of causal signals.
- ``libra_true_lengths``: ``libra`` with the true remaining lengths for routing and the next
  batch's true lengths for planning (once called ``oracle``; it inherits Libra's plan
  family, so it is no bound).
- ``static_true_lengths``: true-length routing on ``static_hindsight``'s split (once
  ``oracle_best``).
- ``libra_known_start``: ``libra`` whose first layout is planned on the first batch's
  true lengths instead of ``planner.prior``; everything after as ``libra``. Set against
  ``libra`` it measures what starting on the prior costs (a user who ran a pilot could set
  the prior so).

The old names ``async_static``, ``oracle`` and ``oracle_best`` load as ``static_hindsight``,
``libra_true_lengths`` and ``static_true_lengths`` (libra_hpc/sim/config.py ``ALIASES``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from libra_hpc.planner.control import ControlLoop, ControlOptions
from libra_hpc.planner.options import migration_pricing
from libra_hpc.planner.hybrid import PhaseTimeouts
from libra_hpc.sim.context import Context

HYBRID_TIMEOUTS = PhaseTimeouts(requested=1e6, fetching_state=1e6, zero_grad_sync=1e6, releasing=1e6)
"""The simulator drives every phase to its end itself (no member fails), so timeouts never fire."""


@dataclass(frozen=True)
class PolicySetup:
    name: str
    mode: Literal["sync", "async"]
    router: str
    replan: bool = False
    hybrid: bool = False
    clairvoyant: bool = False
    single_tp: bool = False
    """Planner restricted to one rollout TP (chosen as the best for the prior)."""
    known_start: bool = False
    """The first layout is planned on the first batch's true lengths, not the prior."""
    start: Literal["planned", "colocated", "hindsight", "pilot", "phased", "phased_late"] = "planned"
    """How the layout is found: the control loop (``planned``), the colocated search, the
    hindsight plan search (``static_hindsight``'s split), the pilot's plan, or one hindsight
    split per window (libra_hpc/sim/search.py), or those splits each changed late."""


PILOT_STEPS = 5
"""Batches the ``static_pilot`` user watches before fixing the split."""

SETUPS: dict[str, PolicySetup] = {s.name: s for s in (
    PolicySetup("colocated", "sync", "least_load", start="colocated"),
    PolicySetup("libra", "async", "cmlfq", replan=True, hybrid=True),
    PolicySetup("static_hindsight", "async", "cmlfq", start="hindsight"),
    PolicySetup("static_pilot", "async", "cmlfq", start="pilot"),
    PolicySetup("phase_static", "async", "cmlfq", start="phased"),
    PolicySetup("phase_static_late", "async", "cmlfq", start="phased_late"),
    PolicySetup("libra_no_replan", "async", "cmlfq", replan=False, hybrid=True),
    PolicySetup("libra_no_hybrid", "async", "cmlfq", replan=True, hybrid=False),
    PolicySetup("homogeneous_least_load", "async", "least_load", replan=True, hybrid=True, single_tp=True),
    PolicySetup("length_aware", "async", "length_aware", replan=True, hybrid=True),
    PolicySetup("libra_true_lengths", "async", "oracle", replan=True, hybrid=True, clairvoyant=True),
    PolicySetup("static_true_lengths", "async", "oracle", clairvoyant=True, start="hindsight"),
    PolicySetup("libra_known_start", "async", "cmlfq", replan=True, hybrid=True, known_start=True),
)}


def _policy_setup(ctx: Context, setup: PolicySetup) -> dict:
    """What the simulator adds to the scenario's control options: its reconfiguration
    cost and phase timeouts, and what the policy may do; its router's migrations are priced
    as the scenario's limits say (``scheduler.bucket_limits``: the simulator's rollout
    follows ``share``)."""
    return dict(reconfig_s=ctx.cfg.costs.reconfig_s, hybrid_timeouts=HYBRID_TIMEOUTS, replan=setup.replan,
                hybrid=setup.hybrid, clairvoyant=setup.clairvoyant, single_tp=setup.single_tp,
                length_aware_routing=setup.router in ("oracle", "length_aware"),
                migration=migration_pricing(ctx.cfg, setup.router))


def control_options(ctx: Context, setup: PolicySetup) -> ControlOptions:
    """The control loop's options for one simulated policy: the scenario's (the same
    :meth:`ControlOptions.from_config` as ``launch.py --plan``), the feasible rollout TP
    sizes, the simulator's reconfiguration cost, and what the policy may do."""
    return ControlOptions.from_config(ctx.cfg, ctx.tps, **_policy_setup(ctx, setup))


def control_loop(ctx: Context, setup: PolicySetup) -> ControlLoop:
    """Libra's control loop (libra_hpc/planner/control.py) for a planned policy, built from
    the scenario as the job builds its own (:meth:`ControlLoop.from_config`), on the
    simulator's calibration and rollout TP sizes."""
    return ControlLoop.from_config(ctx.cfg, rollout_tps=ctx.tps, calibration=ctx.cal, **_policy_setup(ctx, setup))
