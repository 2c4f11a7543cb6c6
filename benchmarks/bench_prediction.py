"""How well the live planner predicted a finished run's steps, per term, and what its
training fit would have predicted with other half-lives (issue 30, item 4).

Reads a run's log folder (``logs/<job>-<id>/``): ``metrics.jsonl`` (each step's
``planner_terms``: [predicted, measured] seconds) and the newest checkpoint's planner state
(``checkpoints/step-*/state.json``: the training timing records the job's fit used).

1. Per term (step, rollout, training, training's tail), over the last 10 priced steps: the
   mean of predicted/measured (the step's is ``planner_predicted_over_measured``), its
   geometric mean, steps inside 0.8–1.25, the worst step (``libra_hpc.metrics.prediction``).
2. The step's mean again with the measured rollout, or the measured training tail, in place
   of the predicted one (on steps where that side set the prediction): how much of the
   step's miss each side carries.
3. The training term replayed on the checkpoint's records: for each step k with a record,
   the per-pass time the fit on records before k predicts (``fit_calibration(...,
   before=k, half_life=h)``) over the measured one, for several half-lives (the job's
   ``FIT_HALF_LIFE`` among them; ``none``: every record alike); mean over all steps and over
   the last 10, and the log-spread of the in-hindsight fit on every record (the noise no
   half-life removes).

    python benchmarks/bench_prediction.py logs/libra-local-20261207-112608

Prints tables; the last line is JSON (``step_mean``, per-term means, ``with_measured_*``,
``train_replay``: half-life → [mean over all, mean over the last 10], ``train_log_spread``).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from libra_hpc.metrics.prediction import LAST, by_term  # noqa: E402
from libra_hpc.metrics.runlog import read_jsonl  # noqa: E402
from libra_hpc.planner.calibration import DEFAULT, TimingRecord, fit_calibration  # noqa: E402
from libra_hpc.runtime.planning import FIT_HALF_LIFE  # noqa: E402

HALF_LIVES = (0.5, 1.0, 2.0, 4.0, None)


def with_measured(rows: list[dict], side: str) -> float | None:
    """The last steps' mean predicted/measured step with ``side``'s measured seconds in place
    of its predicted ones where that side set the step's prediction (``rollout_s``: every
    step not set by training alone; ``train_tail_s``: the same steps, the tail's part)."""
    ratios = []
    for r in rows:
        t = r.get("planner_terms") or {}
        if not all(k in t for k in ("step_s", "train_s", "train_tail_s", "rollout_s")) or not t["step_s"][1]:
            continue
        (p, m), train, (tail, tail_m), (roll, roll_m) = t["step_s"], t["train_s"][0], t["train_tail_s"], t["rollout_s"]
        if abs(p - train) > 1e-3:  # set by the rollout side: submitted + rollout - previous end + tail
            p = max(train, p - roll + roll_m) if side == "rollout_s" else max(train, p - tail + tail_m)
        ratios.append(p / m)
    return round(statistics.fmean(ratios[-LAST:]), 3) if ratios else None


def train_records(folder: Path) -> list[TimingRecord]:
    states = sorted(folder.glob("checkpoints/step-*/state.json"))
    if not states:
        sys.exit(f"{folder}: no checkpoints/step-*/state.json (the training records are kept in checkpoints)")
    rows = json.loads(states[-1].read_text())["planner"]["records"]["train"]
    return [TimingRecord(kind, comps, measured, step) for kind, comps, measured, step in rows]


def replay(records: list[TimingRecord], half_life: float | None) -> dict[int, float]:
    """Step -> predicted/measured per pass, the fit on the records before that step."""
    out = {}
    for r in records:
        if any(q.step < r.step for q in records):
            cal = fit_calibration(records, DEFAULT, before=r.step, half_life=half_life)
            out[r.step] = cal.time("train", r.components) / r.measured_s
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", type=Path, help="the run's log folder")
    args = ap.parse_args()
    logging.disable(logging.INFO)  # each fit logs its note
    rows = [r for r in read_jsonl(args.run / "metrics.jsonl") if r.get("kind", "step") == "step"]
    terms = by_term(rows)
    if not terms:
        sys.exit(f"{args.run}: no step row has planner_terms (was the planner on?)")
    print(f"{args.run}: the last {LAST} priced steps")
    print(f"{'term':14s} {'mean':>6s} {'geo':>6s} {'in band':>8s}  worst step")
    for term, t in terms.items():
        print(f"{term:14s} {t['mean']:6.3f} {t['geometric']:6.3f} {t['in_band']:>3d} of {t['steps']:<2d}  "
              f"{t['worst'][0]} ({t['worst'][1]})")
    swaps = {side: with_measured(rows, side) for side in ("rollout_s", "train_tail_s")}
    for side, value in swaps.items():
        print(f"step mean with the measured {side}: {value}")
    records = train_records(args.run)
    hindsight = fit_calibration(records, DEFAULT)
    spread = statistics.stdev(math.log(r.measured_s / hindsight.time("train", r.components)) for r in records)
    print(f"\ntraining per pass, replayed on {len(records)} records (the job's half-life: {FIT_HALF_LIFE}); "
          f"log-spread of the in-hindsight fit {spread:.3f}")
    print(f"{'half-life':>9s} {'all':>6s} {'last 10':>8s}  per step")
    out = {}
    for h in HALF_LIVES:
        ratios = replay(records, h)
        last = list(ratios.values())[-LAST:]
        out["none" if h is None else str(h)] = [round(statistics.fmean(ratios.values()), 3),
                                                round(statistics.fmean(last), 3)]
        print(f"{'none' if h is None else h:>9} {out['none' if h is None else str(h)][0]:6.3f} "
              f"{out['none' if h is None else str(h)][1]:8.3f}  " + " ".join(f"{x:.2f}" for x in ratios.values()))
    print(json.dumps({"run": str(args.run), "step_mean": terms["step_s"]["mean"],
                      **{f"{t}_mean": v["mean"] for t, v in terms.items()},
                      **{f"with_measured_{k}": v for k, v in swaps.items()},
                      "train_replay": out, "train_log_spread": round(spread, 3)}))


if __name__ == "__main__":
    main()
