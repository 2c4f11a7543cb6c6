"""What one simulated run measured: per-step rows, the allocation over time, queue samples,
plan and hybrid-pool events, and the summary the report compares.

Per step ``j`` (recorded when training step ``j`` ends): ``t_end`` (s since the start),
``step_s`` (since the previous step ended), ``rollout_start`` (when batch ``j`` was
submitted), ``rollout_s`` (batch ``j``'s rollout makespan),
``train_s``, ``gen_tokens``, ``trajectories``, ``rollout_gpus``/``train_gpus`` (during that
batch / that step), ``rollout_busy`` (share of the rollout GPU-seconds of the batch's
makespan during which an instance had something to decode or prefill: the long tail shows
as a low share), ``train_busy`` (training seconds over the step interval), ``migrations``
and ``queue_max`` (most turns waiting for an instance at a sample: queued in the service
or leased and waiting inside an instance).

Summary extras: ``step_s_mean`` (simulated time / steps: with staleness the step times
alternate, so the median alone misleads), ``prefill_share`` (prefill GPU-seconds over busy
rollout GPU-seconds), ``prefix_hit_rate`` (turns after a tool return that ran where the
trajectory's KV prefix was, so only the tool output was prefilled), ``steals`` (turns an
idle instance took from a neighbouring bucket), ``planned_step_s`` (planned policies: the
step time the planner predicted for its initial plan, to set against ``step_s_mean``),
``predicted_step_s`` (planned policies: the mean, over the replanning checks, of the step
time the planner's cost models predicted for the running plan on the lengths observed by
then, before the measured scale the gate weighs plans with: ``model_step_s`` of each check).
"""

from __future__ import annotations

import math
import statistics

from libra_hpc.planner.hybrid import PoolEvent


class Recorder:
    def __init__(self, policy: str):
        self.policy = policy
        self.rows: list[dict] = []
        self.timeline: list[dict] = []  # allocation changes: t, rollout_gpus, train_gpus, why
        self.queue_samples: list[tuple[float, int, int]] = []  # (t, queued turns, running sequences)
        self.events: list[dict] = []
        self.summary: dict = {}

    def allocation(self, now: float, described: str, why: str, train_gpus: int, rollout_gpus: int) -> None:
        """The GPUs serving rollout and training from ``now`` (colocated: both all GPUs);
        ``described``: the layout in one line (libra_hpc/sim/context.py describe)."""
        entry = {"t": now, "rollout_gpus": rollout_gpus, "train_gpus": train_gpus, "why": why,
                 "describe": described}
        if self.timeline and all(self.timeline[-1][k] == entry[k] for k in ("rollout_gpus", "train_gpus", "describe")):
            return
        self.timeline.append(entry)
        self.events.append({"kind": "allocation", **entry})

    def hybrid(self, e: PoolEvent) -> None:
        self.events.append(e.to_dict())

    def queue(self, now: float, queued: int, running: int) -> None:
        self.queue_samples.append((now, queued, running))

    def step(self, j: int, now: float, step_s: float, info: dict, colocated_gpus: int | None) -> None:
        rollout_s = info["end"] - info["start"]
        gpus = info["rollout_gpus"]
        busy = info["busy_gpu_s"] / (gpus * rollout_s) if gpus and rollout_s > 0 else 0.0
        self.rows.append({"step": j, "t_end": now, "step_s": step_s, "rollout_start": info["start"],
                          "rollout_s": rollout_s, "train_s": info["train_s"],
                          "gen_tokens": info["gen_tokens"], "trajectories": info["trajectories"],
                          "rollout_gpus": gpus, "train_gpus": info["train_gpus"], "rollout_busy": busy,
                          "train_busy": min(1.0, info["train_s"] / step_s) if step_s > 0 else 1.0,
                          "colocated": colocated_gpus is not None, "migrations": info["migrations"],
                          "queue_max": info["queue_max"], "max_lag": info.get("max_lag")})

    def finish(self, end: float, wall_s: float, fired: int, counts: dict, considered: list[dict]) -> None:
        rows = self.rows
        tokens = sum(r["gen_tokens"] for r in rows)
        steps = sorted(r["step_s"] for r in rows)
        replans = sum(1 for e in self.events if e["kind"] == "allocation" and e["why"].startswith("replan"))
        self.events.extend({"kind": "plan", **c} for c in considered)
        self.summary = {
            "policy": self.policy, "steps": len(rows), "sim_time_s": end,
            "tokens_per_s": tokens / end if end > 0 else 0.0,
            "trajectories_per_s": sum(r["trajectories"] for r in rows) / end if end > 0 else 0.0,
            "step_s_mean": end / len(rows) if rows else 0.0,
            "step_s_median": statistics.median(steps) if steps else 0.0, "step_s_p90": _rank(steps, 0.9),
            "rollout_s_mean": _mean([r["rollout_s"] for r in rows]) or 0.0,
            "train_s_mean": _mean([r["train_s"] for r in rows]) or 0.0,
            "rollout_busy_mean": _mean([r["rollout_busy"] for r in rows]) or 0.0,
            "train_busy_mean": _mean([r["train_busy"] for r in rows]) or 0.0,
            "migrations": sum(r["migrations"] for r in rows), "turns": counts.get("turns", 0),
            "replans": replans,
            "hybrid_transitions": sum(1 for e in self.events if e["kind"] == "hybrid_transition"),
            "queue_max": max((r["queue_max"] for r in rows), default=0),
            "prefill_share": counts["prefill_gpu_s"] / counts["busy_gpu_s"] if counts.get("busy_gpu_s") else 0.0,
            "prefix_hit_rate": counts["cache_hits"] / counts["later_turns"] if counts.get("later_turns") else 0.0,
            "steals": counts.get("steals", 0),
            "planned_step_s": next((c["objective_s"] for c in considered if c.get("kind") == "initial_plan"), None),
            "predicted_step_s": _mean([c["model_step_s"] for c in considered
                                       if c.get("model_step_s") not in (None, math.inf)]),
            "events": fired, "wall_s": wall_s,
        }


def _mean(values: list[float]) -> float | None:
    return statistics.fmean(values) if values else None


def _rank(values: list[float], q: float) -> float:
    return values[max(0, math.ceil(q * len(values)) - 1)] if values else 0.0
