"""What the controller writes down: a step's metrics row and progress line (:class:`StepLog`,
which holds only where they go), the run's ``summary.json``, the export's index."""

from __future__ import annotations

import json
import logging
import resource
import statistics
from pathlib import Path
from typing import Any

from libra_hpc.metrics import prediction

log = logging.getLogger(__name__)


class StepLog:
    """Where a step's row goes: ``metrics.jsonl``, TensorBoard (``logging.tensorboard``) and
    a progress line (events and the log)."""

    def __init__(self, cfg: Any, runlog: Any):
        self.cfg, self.runlog = cfg, runlog
        self.tensorboard = None
        if cfg.logging.tensorboard:
            from libra_hpc.metrics.tensorboard import TensorBoardWriter

            self.tensorboard = TensorBoardWriter(runlog.folder)

    def step(self, b: int, metrics: dict) -> None:
        self.runlog.metric(b, **metrics)
        if self.tensorboard is not None:
            self.tensorboard.scalars(b, metrics)
            self.tensorboard.flush()
        line = progress_line(self.cfg, b, metrics)
        self.runlog.event("progress", line=line, phase="RL steps", done=b + 1, total=self.cfg.rl.steps, say=True)
        log.info(line)

    def load(self, version: int, queue: dict, leader_load: dict) -> None:
        """The instances' load (every few seconds during RL): queue depth, tokens, KV use."""
        self.runlog.event("load", version=version, queue=queue["queued"], active=queue.get("active"),
                          instances={i: {"tokens": m["tokens"], "busy_s": m["busy_s"], "running": m["running"],
                                         "kv": m["kv_usage"]} for i, m in leader_load.items()},
                          tokens=sum(m["tokens"] for m in leader_load.values()))

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()


def step_metrics(cfg: Any, b: int, version: int, record: dict, reports: list[dict], *, step_s: float,
                 queue: dict, migrations: int, idle_rollout_s: float, gpus: dict) -> dict:
    """Step ``b``'s row of ``metrics.jsonl``: ``record`` is the batch tracker's record of the
    step (times, the trajectories' reports), ``reports`` the trainers' ``trained`` reports,
    ``queue`` the queue service's stats, ``migrations`` the service's since the last step."""
    rows = record["rows"]
    rollout_s = record["complete"] - record["submitted"]
    gen = sum(r["gen_tokens"] for r in rows)
    step_reports = [r for r in reports if "tids" in r]
    lags = [b - r["min_version"] for r in rows]
    streamed = ({"streamed_groups": sum(r.get("streamed_groups", 0) for r in step_reports),
                 "stream_s": round(max(r.get("stream_s", 0.0) for r in reports), 3)} if cfg.rl.stream_training else {})
    return dict(
        version=version, reward=round(statistics.fmean(r["reward"] for r in rows), 4),
        trajectories=len(rows), gen_tokens=gen, tokens_per_s=round(gen / max(rollout_s, 1e-9), 1),
        rollout_s=round(rollout_s, 3), train_s=round(max(r["train_s"] for r in reports), 3),
        push_s=round(max(r["push_s"] for r in reports), 3), step_s=round(step_s, 3), gpus=gpus,
        queue_depth=queue["queued"], migrations=migrations, moves=sum(r["migrations"] for r in rows),
        staleness_max=max(lags), staleness_mean=round(statistics.fmean(lags), 3),
        staleness_mix={str(lag): lags.count(lag) for lag in sorted(set(lags))},
        logprob_gap_kl=_sig(reports[0].get("gap_kl", 0.0)), logprob_gap_max=_sig(reports[0].get("gap_max", 0.0)),
        is_capped=round(reports[0].get("is_capped", 0.0), 4),
        tool_calls=sum(r["tool_calls"] for r in rows), tool_s=round(sum(r["tool_s"] for r in rows), 3),
        tool_failures=sum(r.get("tool_failures", 0) for r in rows),
        tool_timeouts=sum(r.get("tool_timeouts", 0) for r in rows),
        turns=round(statistics.fmean(r["turns"] for r in rows), 3),
        idle_s={"rollout": round(idle_rollout_s, 3), "training": round(max(r["wait_s"] for r in reports), 3)},
        loss=reports[0]["loss"], grad_norm=reports[0]["grad_norm"],
        groups=sum(r["groups"] for r in step_reports), groups_filtered=sum(r["filtered_groups"] for r in step_reports),
        dropped_stale=sum(sum(r["dropped_stale"].values()) for r in step_reports),
        forwarded=sum(r.get("forwarded", 0) for r in reports),
        trajectories_by_replica={str(r["replica"]): len(r["tids"]) for r in step_reports}, **streamed,
        scheduler_policy=cfg.scheduler.policy, **record.get("extra", {}))


def progress_line(cfg: Any, b: int, m: dict) -> str:
    return (f"step {b + 1}/{cfg.rl.steps}: reward {m['reward']:.3f}, {m['tokens_per_s']:.0f} tok/s, "
            f"rollout {m['rollout_s']:.1f} s, train {m['train_s']:.1f} s, {m['migrations']} migrations "
            f"({m['moves']} turns moved instance), {m['tool_calls']} tool calls, staleness ≤ {m['staleness_max']}")


def finish_summary(summary: dict, metrics: list[dict], trained: list[str], *, steps: int, completed: bool,
                   submitted: int | None, wall_s: float, reports_dropped: int, tools: Any, planner: Any,
                   migrations: int, dispatch: str, exported: str | None, rss: dict, orchestrator: Any,
                   tracker: dict, total_gpus: int = 0) -> dict:
    """``summary.json``: ``summary`` (the evaluations so far) with the run's books, counts
    and the batch tracker's lines (``tracker``) added. ``planner``: the planner's driver
    (None without one), ``tools``: the tool service (None if it never started)."""
    p = planner
    s = summary
    s.update(steps=steps, wall_s=round(wall_s, 1), **run_totals(metrics, trained, submitted),
             trajectory_reports_dropped=reports_dropped,
             tool_calls=sum(m.get("tool_calls", 0) for m in metrics),  # the trained rollouts' (not the evaluations')
             tool_failures=tools.failures if tools else 0,
             migrations=migrations,
             layouts_applied_by_planner=p.hybrid_applied + p.replans + p.reshards if p else 0,
             replans_applied=p.replans if p else 0, reshards_applied=p.reshards if p else 0,
             dispatch=dispatch, hybrid_switches=p.hybrid_applied if p else 0,
             hybrid_pauses_s=p.pauses if p else [], checkpoint=exported, completed=completed, **tracker)
    if p is not None:
        s.update(planner_predicted_over_measured=predicted_over_measured(metrics), layout_gains=p.finish(),
                 planner_terms_over_measured=prediction.by_term(metrics))
    chaos = [r.injected for r in getattr(orchestrator, "runners", {}).values() if hasattr(r, "injected")]
    if chaos:
        s["tool_faults_injected"] = {k: sum(c[k] for c in chaos) for k in ("fail", "hang")}
    s["peak_rss_mb_by_role"] = rss_by_role(rss)
    s["gpu_seconds_by_role"] = gpu_seconds_by_role(metrics, total_gpus, wall_s)
    if s.get("eval_success_final") is not None and s.get("eval_success_warmstart") is not None:
        s["eval_gain"] = round(s["eval_success_final"] - s["eval_success_warmstart"], 4)
    return s


PREDICTION_STEPS = prediction.LAST
"""Steps (the last ones) over which ``planner_predicted_over_measured`` is averaged (and
``planner_terms_over_measured``: each term's, :mod:`libra_hpc.metrics.prediction`)."""


def predicted_over_measured(metrics: list[dict], last: int = PREDICTION_STEPS) -> float | None:
    """Mean over the last ``last`` steps with a planner prediction of predicted / measured
    step time (``planner_predicted_s`` / ``measured_step_s`` of the step rows, steps after
    a layout change included); None when no step has one."""
    ratios = [m["planner_predicted_s"] / m["measured_step_s"] for m in metrics
              if m.get("planner_predicted_s") is not None and m.get("measured_step_s")][-last:]
    return round(statistics.fmean(ratios), 4) if ratios else None


def run_totals(metrics: list[dict], trained: list[str], submitted: int | None) -> dict:
    """The books over the run's step rows and the trained trajectory ids: lost and duplicated
    (``submitted``: trajectories the run had to train, None if it did not finish)."""
    gen = sum(m["gen_tokens"] for m in metrics)
    busy = sum(m["rollout_s"] for m in metrics)
    return {"trajectories_trained": len(trained), "trajectories_duplicated": len(trained) - len(set(trained)),
            "trajectories_lost": None if submitted is None else submitted - len(set(trained)),
            "tokens_per_s": round(gen / busy, 1) if busy else 0.0,
            "tool_timeouts": sum(m.get("tool_timeouts", 0) for m in metrics),  # the model read a timeout
            **off_policy_totals(metrics)}


def _sig(x: float) -> float:
    """``x`` to 4 significant digits (a log-prob gap of fp32 engines can be 1e-9)."""
    return float(f"{x:.4g}")


def off_policy_totals(metrics: list[dict]) -> dict:
    """The rollout-vs-trainer gap over the run's steps (rows from before the gap was logged
    are skipped): the mean of the steps' ``logprob_gap_kl``, the largest ``logprob_gap_max``,
    the trajectories by staleness (policy versions behind the step they trained in)."""
    rows = [m for m in metrics if "logprob_gap_kl" in m]
    if not rows:
        return {}
    mix: dict[str, int] = {}
    for m in rows:
        for lag, n in m.get("staleness_mix", {}).items():
            mix[lag] = mix.get(lag, 0) + n
    return {"logprob_gap_kl_mean": _sig(sum(m["logprob_gap_kl"] for m in rows) / len(rows)),
            "logprob_gap_max": max(m["logprob_gap_max"] for m in rows),
            "staleness_mix": dict(sorted(mix.items(), key=lambda kv: int(kv[0])))}


def gpu_seconds_by_role(metrics: list[dict], total_gpus: int, wall_s: float) -> dict:
    """GPU-seconds as an admin accounts for them: each step's GPUs per role (the step rows'
    ``gpus``) for the step's seconds, the hybrid pool's on whichever side it served; ``idle``
    the rest of ``total_gpus`` × ``wall_s`` (the warm start, engine starts, evaluations,
    the export). A resumed run's rows include the steps of its earlier runs, whose time
    ``wall_s`` (this run's) does not: idle is then at least 0."""
    out = {"training": 0.0, "rollout": 0.0, "hybrid": 0.0}
    for m in metrics:
        gpus, seconds = m.get("gpus") or {}, m.get("step_s") or 0.0
        out["training"] += gpus.get("training", 0) * seconds
        out["rollout"] += gpus.get("rollout", 0) * seconds
        out["hybrid"] += (gpus.get("hybrid_training", 0) + gpus.get("hybrid_rollout", 0)) * seconds
    out["idle"] = max(0.0, total_gpus * wall_s - sum(out.values()))
    return {k: round(v, 1) for k, v in out.items()}


def rss_by_role(rss: dict[str, float]) -> dict:
    """Peak resident memory per role (``rss``: ``role:rank`` → MB), the controller's own too."""
    out = {"controller": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)}
    for key, mb in rss.items():
        role = key.split(":")[0]
        out[role] = max(out.get(role, 0.0), mb)
    return out


def write_export_index(parts: list[dict]) -> None:
    """A pipeline-parallel export is one safetensors file per stage: write the index that
    Hugging Face loaders read (``model.safetensors.index.json``: every weight's file).
    Nothing to do for one stage. Raises RuntimeError when a stage did not report."""
    if not parts or parts[0].get("stages", 1) == 1:
        return
    stages = parts[0]["stages"]
    got = sorted(p["stage"] for p in parts)
    if got != list(range(stages)):
        raise RuntimeError(f"export: stages {got} reported, expected 0..{stages - 1}")
    weight_map: dict[str, str] = {}
    for p in parts:
        weight_map.update(p["weight_map"])
    index = {"metadata": {"total_size": sum(p["bytes"] for p in parts)}, "weight_map": dict(sorted(weight_map.items()))}
    (Path(parts[0]["path"]) / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
