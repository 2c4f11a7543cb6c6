"""The policies compared, by registered name, and the control loop a planned one runs.

A policy is a :class:`PolicySetup` (how rollout and training share GPUs, which router, what
the planner may do) plus how its allocation is found:

- ``colocated``: synchronous RL on all GPUs (rollout, switch, train, switch), the common
  default of open RL stacks; homogeneous instances, least-load routing. Its rollout TP is
  the best by simulated search (libra_hpc/sim/search.py).
- ``async_static``: disaggregated, asynchronous with bounded staleness, a fixed split; the
  split (training GPUs) and the homogeneous rollout TP are the best by simulated search.
- ``libra``: the planner (plan search, replanning gate, elastic hybrid pool) and C-MLFQ
  routing over heterogeneous TP buckets.
- ``libra_no_replan``: the initial plan is kept (hybrid pool still on).
- ``libra_no_hybrid``: replanning on, no hybrid pool.
- ``homogeneous_least_load``: the planner restricted to one rollout TP (the best one for
  the prior), least-load routing: no buckets to route between.
- ``length_aware``: ``libra`` with a noisy length predictor instead of causal signals.
- ``oracle``: ``libra`` with the true remaining lengths for routing and the next batch's
  true lengths for planning (clairvoyant). It inherits Libra's plan family, bucket limits
  and saturation, so it is not a bound on its own;
- ``oracle_best``: true-length routing on the best searched asynchronous split (the
  ``async_static`` allocation; homogeneous, so routing is least-load among equals). Ratios
  against the oracle use the better of the two (libra_hpc/sim/report.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from libra_hpc.planner.control import ControlLoop, ControlOptions
from libra_hpc.planner.hybrid import PhaseTimeouts
from libra_hpc.sim.context import Context

HYBRID_TIMEOUTS = PhaseTimeouts(requested=1e6, fetching_state=1e6, zero_grad_sync=1e6, releasing=1e6)
"""The simulator drives every phase to its end itself (no member fails), so timeouts never fire."""


@dataclass(frozen=True)
class PolicySetup:
    name: str
    mode: Literal["sync", "async"]
    router: str
    planned: bool = False
    """Allocation from the planner (else the best static one by simulated search)."""
    replan: bool = False
    hybrid: bool = False
    clairvoyant: bool = False
    single_tp: bool = False
    """Planner restricted to one rollout TP (chosen as the best for the prior)."""


SETUPS: dict[str, PolicySetup] = {s.name: s for s in (
    PolicySetup("colocated", "sync", "least_load"),
    PolicySetup("async_static", "async", "least_load"),
    PolicySetup("libra", "async", "cmlfq", planned=True, replan=True, hybrid=True),
    PolicySetup("libra_no_replan", "async", "cmlfq", planned=True, replan=False, hybrid=True),
    PolicySetup("libra_no_hybrid", "async", "cmlfq", planned=True, replan=True, hybrid=False),
    PolicySetup("homogeneous_least_load", "async", "least_load", planned=True, replan=True, hybrid=True,
                single_tp=True),
    PolicySetup("length_aware", "async", "length_aware", planned=True, replan=True, hybrid=True),
    PolicySetup("oracle", "async", "oracle", planned=True, replan=True, hybrid=True, clairvoyant=True),
    PolicySetup("oracle_best", "async", "oracle", clairvoyant=True),
)}


def _policy_setup(ctx: Context, setup: PolicySetup) -> dict:
    """What the simulator adds to the scenario's control options: its reconfiguration
    cost and phase timeouts, and what the policy may do."""
    return dict(reconfig_s=ctx.cfg.costs.reconfig_s, hybrid_timeouts=HYBRID_TIMEOUTS, replan=setup.replan,
                hybrid=setup.hybrid, clairvoyant=setup.clairvoyant, single_tp=setup.single_tp,
                length_aware_routing=setup.router in ("oracle", "length_aware"))


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
