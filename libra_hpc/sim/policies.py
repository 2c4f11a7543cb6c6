"""The policies compared, by registered name, and Libra's planning loop.

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

import logging
import math
from collections import deque
from dataclasses import dataclass, replace
from typing import Literal

from libra_hpc.planner.gate import GateOptions, ReplanGate
from libra_hpc.planner.prior import prior_lengths
from libra_hpc.planner.search import Plan, PlanError, PlannerOptions, RLBatch, plan, reprice
from libra_hpc.sim.context import Allocation, Context, length_profile
from libra_hpc.sim.workload import Trajectory

log = logging.getLogger(__name__)


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


class Planner:
    """Libra's planning loop for one run: the plan search on the observed length window,
    the replanning gate, and the allocation (with its hybrid pool) a plan becomes."""

    def __init__(self, ctx: Context, setup: PolicySetup):
        self.ctx, self.setup = ctx, setup
        p = ctx.cfg.planner
        self.global_batch = ctx.cfg.batch_size
        self.window: deque[Trajectory] = deque(maxlen=p.window)
        if setup.clairvoyant:
            gate = GateOptions(every_steps=1, margin_s=0.0, confirm_checks=1, min_dwell_steps=0)
        else:
            gate = GateOptions(every_steps=p.every_steps, margin_s=p.margin_s, confirm_checks=p.confirm_checks,
                               min_dwell_steps=p.min_dwell_steps)
        self.gate = ReplanGate(gate)
        tps = ctx.tps
        if setup.single_tp:
            tps = (self._best_single_tp(),)
        self.options = PlannerOptions(rollout_tps=tps, min_rollout_gpus=p.min_rollout_gpus, refine_top=6)
        self.min_gap = 1 if setup.clairvoyant else max(1, gate.every_steps // 5)
        self.last_check = -(10 ** 9)
        self.considered: list[dict] = []

    def _prior(self):
        pr = self.ctx.cfg.planner.prior
        return prior_lengths(prompt_tokens=pr.prompt_tokens, gen_tokens_median=pr.gen_tokens_median,
                             tail_shape=pr.tail_shape, turns=pr.turns, tool_s_per_turn=pr.tool_s_per_turn,
                             seq_len=self.ctx.cfg.rl.seq_len, batch_size=self.global_batch,
                             seed=self.ctx.cfg.seed)

    def _best_single_tp(self) -> int:
        best = None
        for tp in self.ctx.tps:
            try:
                r = self._plan(self._prior(), PlannerOptions(rollout_tps=(tp,),
                                                             min_rollout_gpus=self.ctx.cfg.planner.min_rollout_gpus))
            except PlanError:
                continue
            if best is None or r.plan.objective < best[0]:
                best = (r.plan.objective, tp)
        if best is None:
            raise PlanError("no single rollout TP size gives a plan for the prior")
        return best[1]

    def step_objective(self, t_train: float, t_rollout: float) -> float:
        """Steady-state step time of the simulated pipeline with staleness ``k``: training
        step ``s`` ends at max(end(s - k - 1) + T_rollout, end(s - 1)) + T_train, so a step
        takes max(T_train, (T_rollout + T_train) / (k + 1)) (k = 0: their sum)."""
        k = self.ctx.cfg.rl.max_staleness
        return max(t_train, (t_rollout + t_train) / (k + 1))

    def _plan(self, lengths, options: PlannerOptions | None = None):
        """The better of plan()'s asynchronous and synchronous searches on ``lengths`` under
        :meth:`step_objective` (adaptation: plan()'s async objective max(T_train,
        T_rollout) assumes one batch in flight; with overlapping batches the step is a mix
        of both objectives, and the sync search minimises T_train + T_rollout, the
        rollout-bound case). Its ``plan.objective`` is replaced by the step objective.
        Training sequences are packed to the profile's mean length, as the simulated
        training step is costed."""
        c = self.ctx.cfg.cluster
        batch = RLBatch(self.global_batch, math.ceil(lengths.mean_seq_tokens))
        best = None
        for mode in ("async", "sync"):
            r = plan(self.ctx.model, self.ctx.hw, c.nodes, c.gpus_per_node, lengths, batch, mode=mode,
                     options=options or self.options, calibration=self.ctx.cal)
            obj = self.step_objective(r.plan.t_train, r.plan.t_rollout)
            if best is None or obj < best[0]:
                best = (obj, replace(r, plan=replace(r.plan, objective=obj)))
        return best[1]

    def initial_lengths(self) -> list[tuple[int, ...]]:
        """Per-turn generated tokens the first bucket limits are placed on (the prior's,
        each trajectory cut into ``prior.turns`` equal turns; batch 0's for the
        clairvoyant planner)."""
        if self.setup.clairvoyant:
            return [t.turns for t in self.ctx.batch(0)]
        prior, n = self._prior(), max(1, self.ctx.cfg.planner.prior.turns)
        return [(max(1, round(g / n)),) * n for g, c in zip(prior.gen, prior.count) for _ in range(c)]

    def initial(self) -> Allocation:
        """The first allocation: from the prior (clairvoyant: from batch 0's true lengths)."""
        lengths = length_profile(self.ctx.batch(0), self.global_batch) if self.setup.clairvoyant else self._prior()
        result = self._plan(lengths)
        self.considered.append({"step": 0, "kind": "initial_plan", "plan": result.plan.describe(),
                                "objective_s": result.plan.objective})
        return self.ctx.plan_allocation(result.plan, self.setup.hybrid)

    def observe(self, finished: list[Trajectory]) -> None:
        self.window.extend(finished)

    def consider(self, step: int, current: Allocation, pressure: dict) -> Allocation | None:
        """At the end of batch ``step``'s rollout: a new allocation when the gate applies a
        better plan, else None. The plan is for the next batch (clairvoyant: its true lengths)."""
        if not self.setup.replan or not self.window or current.plan is None:
            return None
        if step - self.last_check < self.min_gap or not self.gate.due(step, pressure):
            return None  # pressure checks at most every every_steps // 5 steps (each costs a plan search)
        self.last_check = step
        nxt = step + 1
        if self.setup.clairvoyant:
            if nxt >= self.ctx.cfg.rl.steps:
                return None
            lengths = length_profile(self.ctx.batch(nxt), self.global_batch)
        else:
            lengths = length_profile(list(self.window), self.global_batch)
        try:
            candidate = self._plan(lengths)
        except PlanError as exc:
            log.warning("replan at step %d found no plan: %s", step, exc)
            return None
        if same_plan(candidate.plan, current.plan):  # nothing would change: no drain, no reconfiguration
            self.considered.append({"step": step, "kind": "replan_check", "apply": False,
                                    "reason": "the best plan is the current one", "candidate": candidate.plan.describe()})
            return None
        c = self.ctx.cfg.cluster
        now_plan = reprice(current.plan, self.ctx.model, self.ctx.hw, c.gpus_per_node, lengths, self.ctx.cal,
                           RLBatch(self.global_batch, math.ceil(lengths.mean_seq_tokens)))  # as _plan's
        now_plan = replace(now_plan, objective=self.step_objective(now_plan.t_train, now_plan.t_rollout))
        decision = self.gate.consider(step, now_plan.objective, candidate, self.ctx.cfg.costs.reconfig_s, pressure,
                                      current=current.plan)
        self.considered.append({"step": step, "kind": "replan_check", "trigger": decision.trigger,
                                "apply": decision.apply, "reason": decision.reason,
                                "current_objective_s": now_plan.objective, "candidate": candidate.plan.describe(),
                                "candidate_objective_s": candidate.plan.objective})
        if not decision.apply:
            return None
        return self.ctx.plan_allocation(candidate.plan, self.setup.hybrid)



def same_plan(a: Plan, b: Plan) -> bool:
    """Two plans with the same training shape and the same rollout instances per TP size:
    applying one over the other would only permute slots (a drain and a reconfiguration
    for nothing), so the simulator keeps the current plan."""
    return a.train == b.train and a.train_gpus == b.train_gpus and a.rollout_counts == b.rollout_counts
