"""What a finished run leaves in its log folder for people to look at.

``write_report`` reads the folder's ``metrics.jsonl`` and ``events.jsonl`` (runlog.py) and
writes, next to them:

- ``summary.json``: the run's summary dict, pretty-printed with sorted keys;
- ``plots/gpu_allocation.png``, ``throughput.png``, ``reward.png``, ``queues.png``,
  ``prediction.png``;
- ``report.md``: summary table, held-out success, a per-step table, the planner's and the
  hybrid pool's events, the planner's predictions per term, failures, and links to the plots.

Every field of a step row is optional: a run that stopped early, or one written by an
older version, lacks some. A plot draws the series it has (and is not drawn when it has
none); report.md names what is missing instead of failing.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

from libra_hpc.metrics import prediction
from libra_hpc.metrics.runlog import read_jsonl

log = logging.getLogger(__name__)

ROLES = ("training", "rollout", "hybrid_training", "hybrid_rollout")
"""GPU roles of a step row's ``gpus`` dict, in the order plots stack them."""

PER_STEP = (  # (field, column header) of report.md's per-step table after "step"
    ("reward", "reward"), ("tokens_per_s", "tokens/s"), ("rollout_s", "rollout s"),
    ("train_s", "train s"), ("gpus", "GPUs train/rollout"), ("migrations", "migrations"),
    ("staleness_max", "staleness max"), ("logprob_gap_kl", "log-prob gap KL"), ("tool_calls", "tool calls"),
)

PLOT_NEEDS = {  # plot -> the step fields (or events) it is drawn from
    "gpu_allocation.png": "`gpus`",
    "throughput.png": "`tokens_per_s`, `rollout_s`, `train_s` or `step_s`",
    "reward.png": "`reward` or eval events",
    "queues.png": "`queue_depth` or `migrations`",
    "prediction.png": "`planner_terms`",
}

OWN_SECTION = {"planner_terms_over_measured"}
"""Summary keys report.md shows in a section of their own (from the step rows), not in the summary's tables."""
PLANNER_KINDS = ("layout_applied", "plan_considered", "replan", "hybrid")
DASH = "–"


def write_report(folder: Path, summary: dict) -> list[Path]:
    """Write summary.json, the plots and report.md into the run's log ``folder``; return
    the paths written (summary.json first, report.md last)."""
    folder = Path(folder)
    steps = step_rows(read_jsonl(folder / "metrics.jsonl"))
    events = read_jsonl(folder / "events.jsonl")
    summary_path = folder / "summary.json"
    summary_path.write_text(json.dumps(summary, indent=2, sort_keys=True, default=str) + "\n")
    plots = draw_plots(folder / "plots", steps, events)
    report_path = folder / "report.md"
    report_path.write_text(render_markdown(folder.name, summary, steps, events, plots))
    return [summary_path, *(p for p in plots.values() if p is not None), report_path]


def step_rows(metrics: list[dict]) -> list[dict]:
    """The per-step rows of metrics.jsonl (kind "step" with an integer step)."""
    return [r for r in metrics if r.get("kind", "step") == "step" and _is_number(r.get("step"))]


# ---------------------------------------------------------------- reading rows


def _is_number(value: Any) -> bool:
    """A real number worth plotting (bools are flags, not measurements)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def gpus_of(row: dict) -> dict[str, int]:
    """GPUs per role in a step row: its ``gpus`` dict, or the flat ``gpus_<role>`` fields
    older controllers wrote; {} when neither is there."""
    gpus = row.get("gpus")
    if isinstance(gpus, dict):
        return {role: n for role, n in gpus.items() if _is_number(n)}
    return {role: row[f"gpus_{role}"] for role in ROLES if _is_number(row.get(f"gpus_{role}"))}


def _present(row: dict, field: str) -> bool:
    if field == "gpus":
        return bool(gpus_of(row))
    return row.get(field) is not None


def _series(steps: list[dict], field: str) -> tuple[list, list]:
    """(steps, values) of the rows where ``field`` is a number."""
    pairs = [(r["step"], r[field]) for r in steps if _is_number(r.get(field))]
    return [s for s, _ in pairs], [v for _, v in pairs]


def _bucket_series(steps: list[dict], bucket: str) -> tuple[list, list]:
    """(steps, queued turns) of one queue bucket, over the rows that report it."""
    pairs = [(r["step"], r["queue_depth"][bucket]) for r in steps
             if isinstance(r.get("queue_depth"), dict) and _is_number(r["queue_depth"].get(bucket))]
    return [s for s, _ in pairs], [v for _, v in pairs]


def _nearest_step(steps: list[dict], elapsed_s: Any) -> int | None:
    """The step whose row was written closest to ``elapsed_s``; None if none can say."""
    timed = [r for r in steps if _is_number(r.get("elapsed_s"))]
    if not timed or not _is_number(elapsed_s):
        return None
    return min(timed, key=lambda r: abs(r["elapsed_s"] - elapsed_s))["step"]


def eval_points(steps: list[dict], events: list[dict]) -> list[tuple[str, int, float]]:
    """(phase, step, success) of each eval event with a success: the warm start at step 0,
    the others at the step nearest their elapsed time (skipped when there is none)."""
    points = []
    for e in events:
        if e.get("kind") != "eval" or not _is_number(e.get("success")):
            continue
        phase = str(e.get("phase", "eval"))
        step = 0 if phase == "warmstart" else _nearest_step(steps, e.get("elapsed_s"))
        if step is not None:
            points.append((phase, step, e["success"]))
    return points


# ---------------------------------------------------------------- plots


def draw_plots(plots_dir: Path, steps: list[dict], events: list[dict]) -> dict[str, Path | None]:
    """Each plot's path, or None where the run recorded nothing it draws; {} when
    matplotlib (an optional dependency) is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # compute nodes have no display
        from matplotlib.figure import Figure  # no pyplot: nothing left open in a global registry
    except ImportError:
        log.warning("matplotlib is not installed: report.md without plots (pip install matplotlib)")
        return {}
    drawers = {"gpu_allocation.png": _plot_gpus, "throughput.png": _plot_throughput,
               "reward.png": _plot_reward, "queues.png": _plot_queues, "prediction.png": _plot_prediction}
    paths: dict[str, Path | None] = {}
    for name, draw in drawers.items():
        fig = Figure(figsize=(9, 5), layout="constrained")
        paths[name] = None
        if draw(fig, steps, events):
            plots_dir.mkdir(parents=True, exist_ok=True)
            fig.savefig(plots_dir / name, dpi=100)
            paths[name] = plots_dir / name
    return paths


def _lines(ax, series: dict[str, tuple[list, list]], what: str) -> bool:
    """One line per non-empty (xs, ys) of ``series`` (keyed by label); says on the panel
    when all are empty. True when something was drawn."""
    drawn = False
    for label, (xs, ys) in series.items():
        if xs:
            ax.plot(xs, ys, marker=".", label=label)
            drawn = True
    if drawn:
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, f"{what} not recorded", ha="center", va="center", transform=ax.transAxes)
    return drawn


def _plot_gpus(fig, steps: list[dict], events: list[dict]) -> bool:
    """GPUs per role over elapsed time, stacked; a row's count holds since the row before."""
    rows = [(r["elapsed_s"], gpus_of(r)) for r in steps if _is_number(r.get("elapsed_s")) and gpus_of(r)]
    if not rows:
        return False
    seen = {role for _, g in rows for role in g}
    roles = [r for r in ROLES if r in seen] + sorted(seen - set(ROLES))
    first = next(r for r in steps if _is_number(r.get("elapsed_s")) and gpus_of(r))
    start = max(0.0, first["elapsed_s"] - first["step_s"]) if _is_number(first.get("step_s")) else 0.0
    xs = [start] + [t for t, _ in rows]  # the run's steps; the warm start and engine start before them are marked
    ys = [[g.get(role, 0) for g in [rows[0][1]] + [g for _, g in rows]] for role in roles]
    ax = fig.add_subplot()
    ax.stackplot(xs, ys, labels=roles, step="pre", alpha=0.8)
    _event_markers(ax, [e for e in events if not _is_number(e.get("elapsed_s")) or e["elapsed_s"] >= start])
    ax.set(title="GPUs per role", xlabel="elapsed time (s)", ylabel="GPUs", xlim=(start, xs[-1]))
    if start > 0:
        ax.text(0.99, 0.02, f"before {start:.0f} s: warm start, engine start and evaluation (not shown)",
                ha="right", va="bottom", fontsize="small", transform=ax.transAxes)
    ax.legend(loc="upper left", fontsize="small")
    return True


def _event_markers(ax, events: list[dict]) -> None:
    """Vertical lines at layout changes (solid) and hybrid-pool events (dotted)."""
    styles = {"layout_applied": ("black", "-", "layout applied"), "hybrid": ("tab:red", ":", "hybrid pool event")}
    labelled = set()
    for e in events:
        kind = e.get("kind")
        if kind in styles and _is_number(e.get("elapsed_s")):
            color, style, label = styles[kind]
            ax.axvline(e["elapsed_s"], color=color, linestyle=style, linewidth=1,
                       label=None if kind in labelled else label)
            labelled.add(kind)


def _plot_throughput(fig, steps: list[dict], events: list[dict]) -> bool:
    """Tokens/s per step above, the step's phase durations below."""
    fields = ("tokens_per_s", "rollout_s", "train_s", "step_s")
    if not any(_series(steps, f)[0] for f in fields):
        return False
    top, bottom = fig.subplots(2, 1, sharex=True)
    _lines(top, {"tokens/s": _series(steps, "tokens_per_s")}, "tokens/s")
    phases = {"rollout": "rollout_s", "train": "train_s", "trained ahead (streamed groups)": "stream_s",
              "whole step": "step_s"}  # stream_s: rl.stream_training only (no line without it)
    _lines(bottom, {label: _series(steps, field) for label, field in phases.items()}, "durations")
    top.set(title="Throughput per step", ylabel="generated tokens/s")
    bottom.set(xlabel="step", ylabel="seconds")
    return True


def _plot_reward(fig, steps: list[dict], events: list[dict]) -> bool:
    """Mean batch reward per step, with held-out success marked at its step."""
    points = eval_points(steps, events)
    if not _series(steps, "reward")[0] and not points:
        return False
    ax = fig.add_subplot()
    xs, ys = _series(steps, "reward")
    if xs:
        ax.plot(xs, ys, marker=".", label="batch mean reward")
    markers = {"warmstart": "s", "final": "*"}
    for phase in dict.fromkeys(p for p, _, _ in points):
        mine = [(s, v) for p, s, v in points if p == phase]
        ax.scatter([s for s, _ in mine], [v for _, v in mine], marker=markers.get(phase, "o"),
                   s=90, zorder=3, label=f"held-out success ({phase})")
    ax.set(title="Reward and held-out success", xlabel="step", ylabel="reward; success (fraction)")
    ax.legend(fontsize="small")
    return True


def _plot_queues(fig, steps: list[dict], events: list[dict]) -> bool:
    """Queued turns per bucket per step and, when recorded, migrations per step."""
    buckets = list(dict.fromkeys(b for r in steps if isinstance(r.get("queue_depth"), dict) for b in r["queue_depth"]))
    has_migrations = bool(_series(steps, "migrations")[0])
    if not buckets and not has_migrations:
        return False
    axes = fig.subplots(2 if buckets and has_migrations else 1, 1, sharex=True, squeeze=False)[:, 0]
    if buckets:
        _lines(axes[0], {b: _bucket_series(steps, b) for b in buckets}, "queue depth")
        axes[0].set(title="Queue depth per bucket", ylabel="queued turns")
    if has_migrations:
        _lines(axes[-1], {"migrations": _series(steps, "migrations")}, "migrations")
        axes[-1].set(title="Migrations per step", ylabel="migrations")
    axes[-1].set_xlabel("step")
    return True


def _plot_prediction(fig, steps: list[dict], events: list[dict]) -> bool:
    """The planner's predicted step against the measured one above; below, each term's
    predicted/measured per step on a log scale, the band of :data:`prediction.BAND` shaded."""
    if not prediction.term_ratios(steps, "step_s"):
        return False
    top, bottom = fig.subplots(2, 1, sharex=True)
    pairs = [(r["step"], r["planner_terms"]["step_s"]) for r in steps
             if prediction.term_ratios([r], "step_s")]
    _lines(top, {"predicted": ([k for k, _ in pairs], [p for _, (p, _) in pairs]),
                 "measured": ([k for k, _ in pairs], [m for _, (_, m) in pairs])}, "step times")
    top.set(title="The planner's step time: predicted (fitted on the steps before) and measured",
            ylabel="seconds")
    series = {term.removesuffix("_s").replace("_", " "): prediction.term_ratios(steps, term)
              for term in ("step_s", "rollout_s", "train_s")}
    _lines(bottom, {label: ([k for k, _ in xs], [x for _, x in xs]) for label, xs in series.items()}, "ratios")
    bottom.axhspan(*prediction.BAND, color="tab:green", alpha=0.12)
    bottom.axhline(1.0, color="grey", linewidth=0.8)
    window = [k for k, _ in series["step"]][-prediction.LAST:]
    for ax in (top, bottom):  # the steps summary.json's means are taken over
        ax.axvline(window[0] - 0.5, color="grey", linestyle=":", linewidth=1)
    top.text(window[0] - 0.4, 0.97, f"last {len(window)} steps", transform=top.get_xaxis_transform(),
             va="top", fontsize="small", color="grey")
    bottom.set(yscale="log", xlabel="step", ylabel="predicted / measured")
    ticks = [t for t in (0.1, 0.25, 0.5, *prediction.BAND, 1.0, 2.0, 4.0, 10.0)
             if bottom.get_ylim()[0] <= t <= bottom.get_ylim()[1]]
    bottom.set_yticks(ticks, [f"{t:g}" for t in ticks])
    bottom.minorticks_off()
    return True


# ---------------------------------------------------------------- report.md


def render_markdown(name: str, summary: dict, steps: list[dict], events: list[dict],
                    plots: dict[str, Path | None]) -> str:
    """report.md's text; ``plots`` maps each plot's file name to its path or None."""
    sections = [
        [f"# Run report: {name}", "", f"Scheduler policy: **{scheduler_policy(summary, steps)}**"],
        _summary_section(summary),
        _heldout_section(events),
        _steps_section(steps),
        _planner_section(events),
        _prediction_section(steps),
        _failures_section(events),
        _plots_section(plots),
    ]
    return "\n\n".join("\n".join(lines) for lines in sections if lines) + "\n"


def scheduler_policy(summary: dict, steps: list[dict]) -> str:
    """The summary's ``scheduler_policy``, else the distinct values the step rows carry."""
    if summary.get("scheduler_policy"):
        return str(summary["scheduler_policy"])
    seen = list(dict.fromkeys(str(r["scheduler_policy"]) for r in steps if r.get("scheduler_policy")))
    if not seen:
        return "not recorded"
    return seen[0] if len(seen) == 1 else f"{', '.join(seen)} (changed during the run)"


def fmt(value: Any) -> str:
    """A table cell: floats to 3 significant digits (thousands and up as whole numbers),
    dicts and lists as compact JSON, None as a dash."""
    if value is None:
        return DASH
    if isinstance(value, float):
        if not math.isfinite(value):
            return str(value)
        text = f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"
    elif isinstance(value, (dict, list)):
        text = json.dumps(value, sort_keys=True, default=str)
    else:
        text = str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def _summary_section(summary: dict) -> list[str]:
    """The scalars in one key/value table; each list of records (``hybrid_pauses_s``,
    ``layout_gains``, ...) and each mapping (``partial_rollout``, ...) in a table of its own."""
    if not summary:
        return ["## Summary", "", "No summary values."]
    keys = sorted((k for k in summary if k not in OWN_SECTION), key=str)
    nested = [k for k in keys if isinstance(summary[k], dict) or _records(summary[k])]
    lines = ["## Summary", ""] + _table(["key", "value"], [[fmt(k), fmt(summary[k])] for k in keys if k not in nested])
    for key in nested:
        value = summary[key]
        lines += ["", f"### {key}", ""]
        if isinstance(value, dict):
            lines += _table(["key", "value"], [[fmt(k), fmt(v)] for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))])
        else:
            columns = list(dict.fromkeys(c for row in value for c in row))
            lines += _table(columns, [[fmt(row.get(c)) for c in columns] for row in value])
    return lines


def _records(value: Any) -> bool:
    """A non-empty list of records (dicts)."""
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def _heldout_section(events: list[dict]) -> list[str]:
    """Warm start → final success, the gain, and every eval in a table."""
    evals = [e for e in events if e.get("kind") == "eval"]
    if not evals:
        return ["## Held-out success", "", "No held-out evaluation recorded."]
    warm = next((e for e in reversed(evals) if e.get("phase") == "warmstart"), {})
    final = next((e for e in reversed(evals) if e.get("phase") == "final"), {})
    w, f = warm.get("success"), final.get("success")
    if _is_number(w) and _is_number(f):
        head = f"Warm start **{fmt(w)} → final {fmt(f)}**: gain **{f - w:+.3g}**"
    else:
        head = f"Warm start {fmt(w) if warm else 'not recorded'} → final " + (
            fmt(f) if final else "not recorded (no final eval: the run stopped before it)")
    prompts = final.get("prompts", warm.get("prompts"))
    head += f" on {prompts} prompts." if prompts is not None else "."
    rows = [[fmt(e.get("phase")), fmt(e.get("elapsed_s")), fmt(e.get("success")), fmt(e.get("prompts"))]
            for e in evals]
    return ["## Held-out success", "", head, ""] + _table(["phase", "elapsed s", "success", "prompts"], rows)


def _gpu_cell(row: dict) -> str:
    """Training/rollout GPUs of a step, hybrid GPUs counted with the role they play."""
    g = gpus_of(row)
    if not g:
        return DASH
    train = g.get("training", 0) + g.get("hybrid_training", 0)
    return f"{train}/{g.get('rollout', 0) + g.get('hybrid_rollout', 0)}"


def _steps_section(steps: list[dict]) -> list[str]:
    if not steps:
        return ["## Per step", "", "No step metrics recorded (metrics.jsonl is missing or empty)."]
    rows = [[str(r["step"])] + [_gpu_cell(r) if f == "gpus" else fmt(r.get(f)) for f, _ in PER_STEP]
            for r in steps]
    lines = ["## Per step", ""] + _table(["step"] + [h for _, h in PER_STEP], rows)
    missing = missing_fields(steps)
    return lines + (["", "Missing: " + "; ".join(missing) + "."] if missing else [])


def missing_fields(steps: list[dict]) -> list[str]:
    """For each per-step field some rows lack: which steps lack it, or "not recorded"."""
    notes = []
    for field, _ in PER_STEP:
        lacking = [r["step"] for r in steps if not _present(r, field)]
        if len(lacking) == len(steps):
            notes.append(f"`{field}` not recorded")
        elif lacking:
            notes.append(f"`{field}` at step{'s' * (len(lacking) > 1)} {step_ranges(lacking)}")
    return notes


def step_ranges(steps: list[int]) -> str:
    """[1, 2, 3, 7] -> "1–3, 7"."""
    runs: list[list[int]] = []
    for s in sorted(set(steps)):
        if runs and s == runs[-1][1] + 1:
            runs[-1][1] = s
        else:
            runs.append([s, s])
    return ", ".join(str(a) if a == b else f"{a}–{b}" for a, b in runs)


def _describe(e: dict) -> str:
    """One line for a layout_applied, plan_considered or hybrid event."""
    kind = e.get("kind")
    if kind == "layout_applied":
        gpus = e.get("gpus") if isinstance(e.get("gpus"), dict) else {}
        split = ", ".join(f"{role} {n}" for role, n in gpus.items()) or "GPUs not recorded"
        return f"layout v{e.get('version', '?')} applied ({split}): {e.get('reason', 'no reason given')}"
    if kind == "plan_considered":
        return f"plan considered, {e.get('decision', 'no decision recorded')}: {e.get('reason', 'no reason given')}"
    if kind == "replan":
        return f"replan decided: {e.get('plan', '?')} (the pipeline drains first)"
    direction = f" ({e['direction']})" if e.get("direction") else ""
    return f"hybrid replica {e.get('replica', '?')}: {e.get('state', '?')}{direction}"


def _planner_section(events: list[dict]) -> list[str]:
    chosen = [e for e in events if e.get("kind") in PLANNER_KINDS]
    if not chosen:
        return ["## Planner and hybrid pool", "", "No layout, plan or hybrid-pool events."]
    rows = [[fmt(e.get("elapsed_s")), fmt(_describe(e)), fmt(e.get("predicted_gain_s")), fmt(e.get("pause_s"))]
            for e in chosen]
    header = ["elapsed s", "what", "predicted gain s", "measured pause s"]
    return ["## Planner and hybrid pool", ""] + _table(header, rows)


def _prediction_section(steps: list[dict]) -> list[str]:
    """Each term's predicted/measured over the last priced steps (none without a planner)."""
    terms = prediction.by_term(steps)
    if not terms:
        return []
    low, high = prediction.BAND
    rows = [[f"`{term}`", fmt(t["mean"]), fmt(t["geometric"]), f"{t['in_band']} of {t['steps']}",
             f"{t['worst'][0]} ({fmt(t['worst'][1])})"] for term, t in terms.items()]
    head = (f"What the planner predicted for the layout that ran each step (fitted on the steps before it) "
            f"over what the step measured, the last {prediction.LAST} priced steps; `step_s` is "
            f"`planner_predicted_over_measured`. A mean of ratios reads high when the measured times are noisy: "
            f"the geometric mean less so.")
    header = ["term", "mean", "geometric mean", f"steps in {low}–{high}", "worst step (ratio)"]
    return ["## Planner prediction", "", head, ""] + _table(header, rows)


def _failures_section(events: list[dict]) -> list[str]:
    failures = [e for e in events if e.get("kind") == "failure"]
    if not failures:
        return []
    lines = [f"- at {fmt(e.get('elapsed_s'))} s, rank {e.get('rank', '?')}: "
             + str(e.get("error", "no error recorded")).replace("\n", " ") for e in failures]
    return ["## Failures", ""] + lines


def _plots_section(plots: dict[str, Path | None]) -> list[str]:
    if not plots:
        return ["## Plots", "", "No plots: matplotlib is not installed."]
    lines = ["## Plots", ""]
    for name, path in plots.items():
        if path is None:
            lines.append(f"- {name}: not drawn (no {PLOT_NEEDS[name]} recorded)")
        else:
            lines += [f"![{name[:-4].replace('_', ' ')}](plots/{name})", ""]  # one paragraph each
    return lines[:-1] if lines[-1] == "" else lines
