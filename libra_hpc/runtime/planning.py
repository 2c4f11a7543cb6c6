"""The planner, live: the controller feeds Libra's control loop (:mod:`libra_hpc.planner.control`,
the decision code the simulator drives too) what the job measures, and carries out what it
decides (:class:`PlannerDriver`).

What the loop is given after each RL step ``b``:

- the lengths of batch ``b``'s trajectories (``observe``: prompt and tool-output tokens,
  generated tokens, turns, tool seconds);
- timing records for the cost models' calibration, refitted every step
  (``fit_calibration``): the training step per optimizer pass against the training cost
  model's components for the shape that ran, and each rollout instance's decode step
  (busy seconds × mean running batch / tokens generated) against the rollout cost
  model's components at that batch and context;
- the rollout makespan and the training step time (``after_rollout``): their means over
  the last steps measured on the current layout (up to three; batches that overlapped a
  switch are left out), since one batch's time varies 2-3× on shared cores.

What it decides, and who carries it out:

- a hybrid-pool transition (borrow, release): :class:`~.hybrid.HybridDriver`;
- a new layout (a replan: the plan search on the observed lengths and the fitted
  calibration beat the current plan by the gate's margin, over ``planner.confirm_checks``
  checks): no new batch goes into the queue; once every batch in flight is trained, the
  rollout instances the new layout drops drain and leave, every rank whose role changes
  re-forms (the training ranks from a checkpoint, resharded to the new shape), the
  queue service starts over on the new layout's buckets (nothing is in flight), and the
  held batches go in. The pipeline bubble is the price, and the gate's
  ``reconfig_s`` (``planner.reconfig_s``) weighs it.

A re-shard (:mod:`libra_hpc.parallel.selector`: training to another TP size on the same
GPUs, for memory or from ``parallel.training_tp_by_context``) goes the same way: its
``tp_reshard`` event says from which TP to which and why; the training ranks save their
checkpoint and load it resharded (the step counter and the optimizer state go with it).

Every decision is an event: ``plan_considered`` (each replan check, with the current and
the candidate plan's predicted step and why it was kept or applied), ``layout_applied``
(``by: planner (replan)``, the pause and the predicted gain), ``calibration`` (what the
fit found).
"""

from __future__ import annotations

import logging
import statistics
import time
from typing import Any

from libra_hpc.planner.control import ControlLoop, ControlOptions, feasible_tps, profiles
from libra_hpc.planner.costs import Calibration, LengthSample, RolloutCost, TimingRecord, TrainingCost, TrainShape, fit_calibration
from libra_hpc.planner.hybrid import PhaseTimeouts
from libra_hpc.planner.search import Plan, RLBatch, reprice
from libra_hpc.planner.search import RolloutInstance as PlanInstance
from libra_hpc.runtime.hybrid import GAIN_STEPS

log = logging.getLogger(__name__)
RECORDS = 256
"""Timing records the calibration is fitted on (the most recent)."""
JOB_TIMEOUTS = PhaseTimeouts(requested=600, fetching_state=900, zero_grad_sync=900, releasing=900)
"""The hybrid pool's phase timeouts in the job: a drain on CPU takes tens of seconds."""


def config_plan(layout: Any, cfg: Any) -> Plan:
    """The plan of the config's layout (training shape, rollout instances in layout order);
    its times are priced when the loop starts on it."""
    t = layout.training
    shape = TrainShape(t.tp, t.pp, t.dp, cfg.training.micro_batch_size, cfg.batch_size, cfg.training.seq_len)
    rollout = tuple(PlanInstance(g.tp, g.slots) for g in layout.rollout_instances)
    return Plan(shape, t.slots, rollout, 0.0, 0.0, 0.0, "async")


class PlannerDriver:
    def __init__(self, controller: Any):
        self.c = controller
        cfg = controller.cfg
        self.model, self.hw = profiles(cfg)
        self.base = Calibration()
        tps = feasible_tps(self.model, self.hw, sorted({g.tp for g in controller.layout.rollout_instances}
                                                       | set(cfg.scheduler.bucket_token_limits)), self.base)
        options = ControlOptions.from_config(cfg, tps, reconfig_s=cfg.planner.reconfig_s, hybrid_timeouts=JOB_TIMEOUTS,
                                             replan=cfg.planner.replan)
        self.control = ControlLoop(self.model, self.hw, options, self.base)
        plan = config_plan(controller.layout, cfg)
        prior = self.control.prior()
        plan = reprice(plan, self.model, self.hw, cfg.cluster.gpus_per_node, prior, self.base,
                       RLBatch(cfg.batch_size, int(prior.mean_seq_tokens)), in_flight=cfg.rl.max_staleness + 1,
                       length_aware=options.length_aware_routing)
        self.control.start(plan, "the config's layout")
        self.records: list[TimingRecord] = []
        self.last_load: dict[int, dict] = {}
        self.running: dict[int, list[int]] = {}
        self.pending = None  # a LayoutChange waiting for the pipeline to drain
        self.held: list[int] = []  # batches not submitted while a replan waits
        self.replans = self.reshards = 0
        self.times: list[tuple[int, float, float]] = []  # (step, batch rollout s, training s)
        self.t0 = time.monotonic()

    def now(self) -> float:
        return time.monotonic() - self.t0

    @property
    def pool(self):
        return self.control.pool

    # ------------------------------------------------------------------ observations

    def load(self, message: dict) -> None:
        """A leader's load report: its running batch is sampled for the decode records."""
        self.running.setdefault(message["instance"], []).append(message["running"])

    def observe(self, b: int, rows: list[dict], reports: list[dict], epochs: int) -> None:
        """Batch ``b`` was trained: its lengths, and the timing records it gives."""
        self.control.observe([LengthSample(r["tokens"] - r["gen_tokens"], r["gen_tokens"], r["turns"], r["tool_s"],
                                           r["tokens"] - r["gen_tokens"] - r.get("prompt_tokens", r["tokens"] - r["gen_tokens"]))
                              for r in rows])  # rows of a checkpoint before prompt_tokens: tool tokens 0
        mean_tokens = statistics.fmean(r["tokens"] for r in rows)
        t = self.c.layout.training
        shape = TrainShape(t.tp, t.pp, t.dp, self.c.cfg.training.micro_batch_size, len(rows), max(1, int(mean_tokens)))
        cal = self.control.cal
        per_pass = max(r["train_s"] + r.get("stream_s", 0.0) for r in reports) / max(1, epochs)  # streamed parts too
        self.records.append(TimingRecord("train", TrainingCost(self.model, self.hw, shape, cal).components(), per_pass))
        for instance, load in self.c.leader_load.items():
            before = self.last_load.get(instance)
            samples = self.running.pop(instance, [])
            self.last_load[instance] = load
            if before is None or not samples:
                continue
            tokens, busy = load["tokens"] - before["tokens"], load["busy_s"] - before["busy_s"]
            batch = statistics.fmean(samples)
            if tokens < 32 or busy <= 0 or batch < 1:
                continue
            tp = self.c.roles.tps.get(instance)
            if tp is None:
                continue
            step_s = busy * batch / tokens
            parts = RolloutCost(self.model, self.hw, tp, cal).decode_components(batch, batch * mean_tokens / 2)
            self.records.append(TimingRecord("decode", parts, step_s))
        del self.records[:-RECORDS]
        self.control.cal = fit_calibration(self.records, self.base)

    # ------------------------------------------------------------------ decisions

    def after_step(self, b: int, reports: list[dict]) -> None:
        """Step ``b`` ended: the loop decides on batch ``b``'s makespan and the step's time."""
        c, hybrid = self.c, self.c.hybrid
        # training's whole work, streamed parts included: what the pipelined step weighs (control.rollout_side_s)
        self.times.append((b, c.last_rollout_s, max(r["train_s"] + r.get("stream_s", 0.0) for r in reports)))
        if hybrid is not None:
            hybrid.after_step(b)
        if self.pending is not None or (hybrid is not None and not hybrid.settled(b)):
            return
        window = [t for t in self.times if hybrid is None or t[0] >= hybrid.measure_from][-GAIN_STEPS:]
        rollout_s, t_train = statistics.fmean(t[1] for t in window), statistics.fmean(t[2] for t in window)
        before = len(self.control.considered)
        assessment = None if hybrid is None else hybrid.assess(t_train, self.control.rollout_side_s(rollout_s))
        if assessment is not None:
            assessment["steps"] = [t[0] for t in window]
        out = self.control.after_rollout(b, self.now(), rollout_s, t_train)
        for considered in self.control.considered[before:]:
            details = {k: v for k, v in considered.items() if k not in ("step", "kind")}
            decision = "applied" if details.get("apply") else "kept"
            c.runlog.event("plan_considered", step=b, what="replan", check=considered.get("kind"), decision=decision,
                           **details)
        if out.change is not None:
            self._hold(out.change)
        elif hybrid is not None and out.pool_decided:
            hybrid.carry_out(out.pool_events, assessment)

    def _hold(self, change: Any) -> None:
        c = self.c
        self.pending = change
        self.decided = time.perf_counter()
        what = "re-shard" if change.reshard else "replan"
        if change.reshard:  # EARL's selector: training to another TP size, the same GPUs
            c.runlog.event("tp_reshard", step=c.version, from_tp=c.layout.training.tp, to_tp=change.plan.train.tp,
                           plan=change.plan.describe(), reason=change.reason)
        else:
            c.runlog.event("replan", step=c.version, plan=change.plan.describe(), reason=change.reason,
                           predicted_gain_s=None if change.gain_s is None else round(change.gain_s, 3),
                           calibration=self.control.cal.note)
        c.runlog.event("progress", line=f"{what} decided at step {c.version}: {change.plan.describe()} "
                                         f"({change.reason}); draining the batches in flight")
        self.maybe_apply()

    def holding(self) -> bool:
        """No new batch goes into the queue: a replan waits for the pipeline to drain."""
        return self.pending is not None

    def maybe_apply(self) -> None:
        """Apply the waiting layout once nothing is in flight (every submitted batch trained)."""
        c = self.c
        if self.pending is None or c.training or c.in_flight() or (c.hybrid is not None and c.hybrid.busy()):
            return
        change = self.pending
        c.hybrid.replace(change, on_done=self._applied)

    def _applied(self, record: dict) -> None:
        c = self.c
        change, self.pending = self.pending, None
        self.control.apply(change)
        if change.reshard:
            self.reshards += 1
        else:
            self.replans += 1
        record.update(predicted_gain_s=None if change.gain_s is None else round(change.gain_s, 3),
                      decided_to_applied_s=round(time.perf_counter() - self.decided, 3))
        c.runlog.event("layout_applied", step=c.version, by="planner (re-shard)" if change.reshard else "planner (replan)",
                       plan=change.plan.describe(),
                       **c.layout.summary(), **record)
        held, self.held = self.held, []
        for b in held:
            c._submit(b)
