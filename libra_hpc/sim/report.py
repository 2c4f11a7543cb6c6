"""A scenario's output folder: metrics and events as JSONL, summary.json, report.md, plots.

    <out>/config.yaml                 the scenario as run (after overrides)
    <out>/summary.json                per policy summary, throughput ratios, workload shape
    <out>/metrics-<policy>.jsonl      one object per RL step (libra_hpc/sim/recorder.py)
    <out>/events-<policy>.jsonl       allocations, plans considered, hybrid-pool transitions
    <out>/queue-<policy>.jsonl        queue depth and running sequences, sampled
    <out>/report.md                   comparison table, ratios, searches, assumptions
    <out>/allocation.png, throughput.png, step_cdf.png   (when matplotlib is installed)
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import yaml

from libra_hpc.sim.run import ScenarioResult

log = logging.getLogger(__name__)

ASSUMPTIONS = (
    ("Decode step time is the planner's roofline cost model (libra_hpc/planner/costs.py, default calibration: "
    "70% of HBM bandwidth, 2 ms per-step overhead) at the running batch and its KV tokens, held constant between "
    "changes of the batch and re-priced at least every `costs.resync_steps` steps."),
    ("Joining sequences stall the instance for their prefill (the cost model's FLOP-bound prefill). A turn that runs "
    "where the trajectory's previous turn ran prefills only the tool output (prefix cache); a first turn, a "
    "migrated turn or a turn on another instance recomputes the whole context."),
    ("KV admission by reservation: a sequence joins only if its context plus its whole turn fits the instance's KV "
    "capacity beside the running ones (no preemption; a sequence alone always runs); at most "
    "`costs.max_num_seqs` sequences per instance."),
    ("Training step time is the planner's Megatron cost model at the batch's mean (packed) sequence length; no "
    "stragglers, no failures. Asynchronous policies pull new weights once per new version "
    "(`costs.weight_sync_s`, default: bf16 weights over one inter-node link)."),
    ("Asynchronous policies keep trajectories whole (no partial rollouts): batch i starts when training step "
    "i - k - 1 is done (k = `rl.max_staleness`); colocated pays `costs.colocate_switch_s` per step. With "
    "`rl.stream_training` the trainers work through each GRPO group of the batch they take next as it finishes "
    "(its share of the step's time, at its own mean length), one after another, and the step ends when the "
    "rest is done."),
    ("A plan change drains rollout and then stalls `costs.reconfig_s`; a hybrid replica drains its instances, "
    "fetches the training state (`costs.hybrid_fetch_s`, default: weights + gradients + Adam shard over one "
    "inter-node link), joins with one zero-gradient step."),
    ("Tool calls run on an unbounded sandbox pool unless `costs.tool_slots` is set; tool outputs are 4 characters "
    "per token for the size classes the scheduler sees."),
    ("Bucket token limits follow the layout's GPU shares (`scheduler.bucket_limits: share`) unless fixed, placed on "
    "the remaining output tokens after a tool return (what C-MLFQ compares). An instance is saturated for routing "
    "at `scheduler.saturation` × its decode knee (the batch at which a step takes twice a lone sequence's). An idle "
    "instance whose bucket has nothing queued takes queued turns of a neighbouring bucket (longer level first; "
    "counted as migrations): a simulator extension, the live service drains queues only within a bucket."),
    ("Sequences admitted together prefill in one batch: the cost model's per-sequence compute summed (attention "
    "is quadratic per sequence), weights read once."),
    ("The Libra plan's hybrid node: a rollout instance there may not span two training replicas; when the plan "
    "predicts training may bind, wider instances on that node are re-split to the widest TP that forms the pool."),
    ("Fixed splits search Libra's own decision space (part-node training, mixed rollout TP instances, C-MLFQ "
    "routing, the run's streaming and partial-rollout options): `static_hindsight` is the best simulated of the "
    "plan search's top `search.top_plans` plans on every batch of the run and every layout Libra applied (a lent "
    "hybrid replica counted as training); `static_pilot` the plan on the first 5 batches with training sized for "
    "`training.seq_len`; `phase_static` the same choice per window of `search.phase_window` steps, each change "
    "drained and paused `costs.reconfig_s` as Libra's replans are (kept when it saves no more than that pause "
    "in the window's simulation); `phase_static_late` runs those splits with each change requested "
    "`search.phase_lag` steps after its window begins (a measured reference for a policy that must see a "
    "regime before it answers it, not a bound). A policy that runs out of memory is compared over the steps both "
    "completed."),
    ("`libra_true_lengths` routes and plans with true lengths on Libra's plan family; `static_true_lengths` routes "
    "with true lengths on `static_hindsight`'s split; libra_vs_true_lengths uses the better of the two. Neither "
    "is an optimum. `libra_known_start` is Libra with its first layout planned on the first batch's true lengths "
    "instead of `planner.prior` (what starting on the prior costs)."),
    ("The simulated pipeline overlaps up to k + 1 batches, so plans are searched and valued at the pipelined step "
    "max(T_train, (T_rollout + T_train) / (k + 1)), with streamed training "
    "max(T_train, (T_rollout + T_train / groups) / (k + 1)) (plan()'s `pipelined` mode; "
    "libra_hpc/planner/pipeline.py pipelined_step_s)."),
    ("The workload is synthetic (libra_hpc/envs/synthetic.py); every number in the scenario file says whether it is "
    "sourced or an assumption."),
)


def write_outputs(result: ScenarioResult, out: str | Path, plots: bool = True) -> Path:
    """Write every file of the output folder; returns the report path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(result.cfg.model_dump(mode="json"), sort_keys=False))
    for name, rec in result.runs.items():
        _jsonl(out / f"metrics-{name}.jsonl", rec.rows)
        _jsonl(out / f"events-{name}.jsonl", rec.events)
        _jsonl(out / f"queue-{name}.jsonl", [{"t": t, "queued": q, "running": r} for t, q, r in rec.queue_samples])
    summary = {"scenario": result.cfg.name, "seed": result.cfg.rl.seed, "wall_s": result.wall_s,
               "ratios": ratios(result), "workload": result.workload, "initial": result.initial,
               "bound": result.bound, "vs_bound": {n: result.vs_bound(n) for n in result.runs},
               "bound_violations": result.bound_violations(),
               "tail_over_critical_path": {n: tail_ratio(result, n) for n in result.runs},
               "policies": {n: r.summary for n, r in result.runs.items()}, "searches": result.searches}
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    images = make_plots(result, out) if plots else []
    path = out / "report.md"
    path.write_text(render(result, images))
    return path


def ratios(result: ScenarioResult) -> dict:
    """Libra's throughput over each yardstick (:meth:`ScenarioResult.ratio`: over the steps
    both completed when one ran out of memory), ``phase_gain`` (``phase_static`` over
    ``static_hindsight``: what adaptivity can win with that window), ``phase_late_share``
    (``phase_static_late`` over ``phase_static``: what of it is left when every change
    waits ``search.phase_lag`` steps), Libra's distance to
    the bound, its predicted over simulated step, and the steps ``static_pilot`` could not
    run, and ``bound_violations`` (steps at which any policy beat the bound: 0 unless the
    bound is wrong), ``known_start_vs_static_hindsight`` (``libra_known_start``, Libra
    started on the first batch's true lengths, over the hindsight split: what is left of
    Libra's gap once the prior is not in it). The true-length yardstick is the better (higher tokens/s) of
    ``libra_true_lengths`` and ``static_true_lengths``; ``true_lengths_used`` names it."""
    known = [n for n in ("libra_true_lengths", "static_true_lengths") if n in result.runs]
    best = max(known, key=lambda n: result.runs[n].summary["tokens_per_s"]) if known else None
    return {"libra_vs_colocated": result.ratio("libra", "colocated"),
            "libra_vs_static_hindsight": result.ratio("libra", "static_hindsight"),
            "libra_vs_static_pilot": result.ratio("libra", "static_pilot"),
            "libra_vs_phase_static": result.ratio("libra", "phase_static"),
            "phase_gain": result.ratio("phase_static", "static_hindsight"),
            "libra_vs_phase_static_late": result.ratio("libra", "phase_static_late"),
            "phase_late_share": result.ratio("phase_static_late", "phase_static"),
            "libra_vs_true_lengths": result.ratio("libra", best) if best else None, "true_lengths_used": best,
            "known_start_vs_static_hindsight": result.ratio("libra_known_start", "static_hindsight"),
            "libra_vs_bound": result.vs_bound("libra"),
            "libra_predicted_over_simulated": _predicted_ratio(result, "libra"),
            "static_pilot_failed_steps": result.failed_steps("static_pilot"),
            "bound_violations": sum(len(v) for v in result.bound_violations().values())}


def tail_ratio(result: ScenarioResult, name: str) -> float | None:
    """How much longer than its critical path a batch's rollout took under policy ``name``:
    the mean over steps of the batch's makespan (the chain that set it, from submission to
    its last trajectory) over its critical path (that longest trajectory alone on the
    fastest instance: libra_hpc/sim/bound.py). 1.0: the tail ran as if alone."""
    if name not in result.runs or not result.bound:
        return None
    floors = [r["critical_path_s"] for r in result.bound["steps"]]
    ratios = [row["rollout_s"] / floors[row["step"]] for row in result.runs[name].rows
              if row["step"] < len(floors) and floors[row["step"]] > 0]
    return sum(ratios) / len(ratios) if ratios else None


def _predicted_ratio(result: ScenarioResult, name: str) -> float | None:
    """The planner's mean predicted step on observed lengths over the simulated mean step."""
    s = result.runs[name].summary if name in result.runs else {}
    return s["predicted_step_s"] / s["step_s_mean"] if s.get("predicted_step_s") else None


def _jsonl(path: Path, rows: list[dict]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(row, default=str) + "\n" for row in rows)


def table(result: ScenarioResult) -> list[str]:
    """The comparison table as markdown lines."""
    head = ("| policy | tokens/s | traj/s | step s (mean) | step s (median) | step s (p90) | rollout s | train s | "
            "rollout busy | prefill share | prefix hits | migrations | replans | hybrid moves | tail × | vs bound | "
            "sim wall s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, rec in result.runs.items():
        s = rec.summary
        if result.oom(name):
            o = result.oom(name)
            lines.append(f"| {name} | out of memory at step {o['step']} ({o['shape']}, {o['seq_tokens']}-token "
                         f"sequences) |" + " |" * (head.count("|") - 3))
            continue
        lines.append(f"| {name} | {s['tokens_per_s']:.0f} | {s['trajectories_per_s']:.3f} | {s['step_s_mean']:.0f} | "
                     f"{s['step_s_median']:.0f} | {s['step_s_p90']:.0f} | {s['rollout_s_mean']:.0f} | "
                     f"{s['train_s_mean']:.0f} | {s['rollout_busy_mean']:.2f} | {s['prefill_share']:.2f} | "
                     f"{s['prefix_hit_rate']:.2f} | {s['migrations']} | {s['replans']} | {s['hybrid_transitions']} | "
                     f"{_fmt(tail_ratio(result, name))} | {_fmt(result.vs_bound(name))} | {s['wall_s']:.1f} |")
    if result.bound:
        b = result.bound
        lines.append(f"| *bound* | {_tokens(result) / b['bound_s']:.0f} | | {b['bound_step_s']:.0f} | | | | | | | | | | | "
                     f"1.00 | 1.00 | |")
    return lines


def _fmt(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}"


def _tokens(result: ScenarioResult) -> float:
    """Tokens every policy generates (the same batches): from any run."""
    rec = next((r for n, r in result.runs.items() if not result.oom(n)), next(iter(result.runs.values())))
    return rec.summary["tokens_per_s"] * rec.summary["sim_time_s"]


def bound_section(result: ScenarioResult) -> list[str]:
    """The lower bound (libra_hpc/sim/bound.py): what it is, its two floors, and the steps
    where each binds."""
    b = result.bound
    if not b:
        return []
    rows = b["steps"]
    pick = sorted({0, len(rows) // 2, len(rows) - 1})
    bad = {n: v for n, v in result.bound_violations().items() if v}
    lines = ["## Lower bound", "",
             (f"No policy completes these {len(rows)} steps in less than **{b['bound_s']:.0f} s** "
              f"({b['bound_step_s']:.0f} s per step; the {b['binding']} floor binds at the end), nor steps 0..k in "
              f"less than the cumulative bound of step k (libra_hpc/sim/bound.py lists every assumption). Work floor: "
              f"the rollout and training GPU-seconds of the steps, at the best batch efficiency any policy could reach "
              f"(every decode step full, every token reading only its own context), each prompt and tool output "
              f"prefilled once, training on the cheapest shape on any GPU count, over all "
              f"{result.cfg.cluster.total_gpus} GPUs: {b['work_s']:.0f} s. Chain floor: each batch's longest "
              f"trajectory alone, started no earlier than the staleness bound allows, then its training: "
              f"{b['chain_s']:.0f} s. Steps at which a policy beat the bound: "
              + (", ".join(f"{n} {v}" for n, v in bad.items()) if bad else "none") + "."), "",
             "| step | rollout GPU-s | training GPU-s | work floor s (cumulative) | longest chain s | "
             "chain floor s (cumulative) | bound s (cumulative) |",
             "|---|---|---|---|---|---|---|"]
    for j in pick:
        r = rows[j]
        lines.append(f"| {r['step']} | {r['rollout_gpu_s']:.0f} | {r['train_gpu_s']:.0f} | {r['work_s']:.1f} | "
                     f"{r['chain_floor_s']:.0f} | {r['chain_s']:.0f} | {r['cumulative_s']:.0f} |")
    return lines + [""]


def search_section(name: str, rows: list[dict]) -> list[str]:
    """How policy ``name``'s split was chosen: the colocated search's two stages, a fixed
    split's simulated candidates, or ``phase_static``'s windows."""
    lines = [f"## Search: {name}", ""]
    if rows and "first_step" in rows[0]:
        lines += ["| window | split | changed | candidates (simulated tokens/s) |", "|---|---|---|---|"]
        for w in rows:
            cands = "; ".join(f"{c['tokens_per_s']:.0f}{' (chosen)' if c['chosen'] else ''}" for c in w["candidates"])
            lines.append(f"| {w['first_step']}..{w['first_step'] + w['steps'] - 1} | {_cell(w['split'])} | "
                         f"{'yes' if w['changed'] else ''} | {cands} |")
    elif rows and "tokens_per_s" in rows[0]:
        lines += ["| candidate | simulated tokens/s | simulated s | out of memory at step | chosen |",
                  "|---|---|---|---|---|"]
        lines += [f"| {_cell(row['candidate'])} | {row['tokens_per_s']:.0f} | {row['sim_time_s']:.0f} | "
                  f"{_fmt_int(row['out_of_memory_step'])} | {'yes' if row['chosen'] else ''} |" for row in rows]
    else:
        lines += ["| candidate | middle step s | all sample steps s |", "|---|---|---|"]
        lines += [f"| {row['candidate']} | {row['stage1_s']} | {row.get('score_s', '')} |" for row in rows]
    return lines + [""]


def _cell(text: str) -> str:
    """``text`` in a table cell (a layout's description separates training and rollout with |)."""
    return text.replace("|", "\\|")


def _fmt_int(x: int | None) -> str:
    return "" if x is None else str(x)


def render(result: ScenarioResult, images: list[str]) -> str:
    cfg = result.cfg
    c = cfg.cluster
    intro = (f"{c.nodes} × {c.gpus_per_node} {c.hardware} GPUs, {cfg.model.name}, {cfg.rl.steps} RL steps of "
             f"{cfg.rl.prompts_per_step} prompts × {cfg.rl.group_size} samples, staleness {cfg.rl.max_staleness}, "
             f"seed {cfg.rl.seed}. Workload: {'trace ' + cfg.trace if cfg.trace else 'synthetic'}. "
             f"Simulated in {result.wall_s:.1f} s of wall time.")
    lines = [f"# Simulator report: {cfg.name}", "", intro, "",
             "## Comparison", "", *table(result), ""]
    r = ratios(result)
    lines += [("Throughput ratios (generated tokens/s): "
               + ", ".join(f"{k} = {v:.2f}" for k, v in r.items() if isinstance(v, float))
               + (f" (true lengths: {r['true_lengths_used']})" if r.get("true_lengths_used") else "")
               + (f"; static_pilot failed {r['static_pilot_failed_steps']} steps (out of memory)"
                  if r.get("static_pilot_failed_steps") else "")), ""]
    lines += bound_section(result)
    gap = [(n, rec.summary) for n, rec in result.runs.items() if rec.summary.get("planned_step_s")]
    if gap:
        lines += [("Planner against simulator (planned policies): the step time the planner predicted for its "
                   "initial plan (on the prior), the mean of its predictions for the running plan at the replanning "
                   "checks (on the lengths observed by then), the simulated mean step, and what its cost model "
                   "leaves out most: the prefill share of busy rollout GPU-seconds (re-prefill of the whole context "
                   "when a turn runs where its prefix is not cached) and the prefix-cache hit rate of turns after a "
                   "tool return."), "",
                  "| policy | planned step s (prior) | predicted step s (observed) | simulated mean step s | "
                  "predicted / simulated | prefill share | prefix hits |",
                  "|---|---|---|---|---|---|---|"]
        for n, s in gap:
            pred = s.get("predicted_step_s")
            lines.append(f"| {n} | {s['planned_step_s']:.0f} | {_fmt(pred) if pred is None else f'{pred:.0f}'} | "
                         f"{s['step_s_mean']:.0f} | {_fmt(pred / s['step_s_mean'] if pred else None)} | "
                         f"{s['prefill_share']:.2f} | {s['prefix_hit_rate']:.2f} |")
        lines.append("")
    lines += ["Starting allocation of each policy:", ""]
    lines += [f"- {name}: {desc}" for name, desc in result.initial.items()] + [""]
    w = result.workload
    if w:
        lines += ["## Workload", "", ("| batch | trajectories | gen median | p90 | p99 | p99/median | mean turns | "
                                      "tool failure share | mean tool s | trained share | critical path s |"),
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for k, v in w.items():
            lines.append(f"| {k} | {v['trajectories']} | {v['gen_median']} | {v['gen_p90']} | {v['gen_p99']} | "
                         f"{v['p99_over_median']:.1f} | {v['mean_turns']:.1f} | {v['failure_share']:.2f} | "
                         f"{v['mean_tool_s']:.1f} | {v.get('trained_share', 1.0):.2f} | {v['critical_path_s']:.0f} |")
        lines += ["", ("Critical path: the longest trajectory alone on the fastest instance shape (decode at batch 1, "
                       "tools included), a floor no policy's batch makespan can beat. Trained share: the trajectories "
                       "the step trains (GRPO groups whose rewards are all equal are left out, "
                       "`rl.filter_zero_variance`; 1 where `workload.solve_rate` models no rewards)."), ""]
    for name, rows in result.searches.items():
        lines += search_section(name, rows)
    if images:
        lines += ["## Plots", ""] + [f"![{i}]({i})" for i in images] + [""]
    lines += ["## Assumptions", ""] + [f"- {a}" for a in ASSUMPTIONS] + [""]
    return "\n".join(lines)


def make_plots(result: ScenarioResult, out: Path) -> list[str]:
    """allocation.png, throughput.png, step_cdf.png; [] when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no plots (pip install matplotlib)")
        return []
    names = list(result.runs)
    fig, ax = plt.subplots(figsize=(8, 4))
    for name in names:
        tl = result.runs[name].timeline
        if not tl:
            continue
        end = result.runs[name].summary["sim_time_s"]
        xs = [e["t"] / 3600 for e in tl] + [end / 3600]
        ys = [e["rollout_gpus"] for e in tl] + [tl[-1]["rollout_gpus"]]
        ax.step(xs, ys, where="post", label=name)
    ax.set_xlabel("simulated time (h)")
    ax.set_ylabel("GPUs serving rollout")
    ax.set_title(f"{result.cfg.name}: rollout GPUs over time (the rest train)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "allocation.png", dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(names, [result.runs[n].summary["tokens_per_s"] for n in names])
    ax.set_ylabel("generated tokens/s")
    ax.set_title(f"{result.cfg.name}: throughput per policy")
    ax.tick_params(axis="x", rotation=30, labelsize=7)
    fig.tight_layout()
    fig.savefig(out / "throughput.png", dpi=100)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4))
    for name in names:
        steps = sorted(r["step_s"] for r in result.runs[name].rows)
        ax.plot(steps, [(i + 1) / len(steps) for i in range(len(steps))], label=name)
    ax.set_xlabel("step time (s)")
    ax.set_ylabel("CDF")
    ax.set_title(f"{result.cfg.name}: step-time CDF")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "step_cdf.png", dpi=100)
    plt.close(fig)
    return ["allocation.png", "throughput.png", "step_cdf.png"]
