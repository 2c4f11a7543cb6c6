"""Does the planner's training cost model, fitted on a few measured steps, predict the others?

    PYTHONPATH=. python scripts/gpu_calibration.py [--shape wide] [--dtype bfloat16] [--out DIR]

Issue 30 (item 4) on the hardware the planner is written for: one process, the Megatron-Core
engine on the first GPU (on a machine without one, the CPU path with its shims), the
``wide`` model of ``scripts/gpu_check.py``. It times GRPO steps (``prepare_batch`` +
``grpo_step``, one warm-up, then ``--repeats``) over a grid of batch sizes and sequence
lengths, turns each into the timing record the job's planner fits (``TimingRecord("train",
TrainingCost(...).components(), seconds)``, on the hardware profile ``--hardware``), fits the
calibration on the points marked for fitting (the smallest and largest batch at each
length: ``fit_calibration``, the job's own fit) and predicts the rest. It prints a table and
one final line ``GPU_CALIBRATION {json}`` with every point's predicted over measured time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))


def measure(args) -> list[dict]:
    """Seconds per GRPO step at each (groups, length) of the grid (2 samples a group)."""
    import torch

    from gpu_check import SHAPES, _OneRank, _sync, _trajectories
    from libra_hpc.config import RLConfig
    from libra_hpc.engines.tiny import build_tiny_model
    from libra_hpc.engines.train.engine import MegatronTrainEngine
    from libra_hpc.engines.train.parallel import TrainingWorld
    from libra_hpc.rl import grpo_step, prepare_batch

    cuda = torch.cuda.is_available()
    model = build_tiny_model(Path(args.models or tempfile.mkdtemp(prefix="gpu_cal_")) / args.shape, seed=0,
                             **SHAPES[args.shape])
    world = TrainingWorld(_OneRank(), device_index=0 if cuda else None)
    engine = MegatronTrainEngine(model, tp=1, lr=1e-5, micro_batch_size=args.mbs, seed=0,
                                 dtype=getattr(torch, args.dtype))
    world.own(engine)
    rl = RLConfig(loss_aggregation="seq_mean_token_sum", max_staleness=1000)  # timing only: any version trains
    points = []
    for length in args.lengths:
        for groups in args.groups:
            batch, report = prepare_batch(_trajectories(engine, groups, 2, length, seed=groups * 7 + length),
                                          rl, train_version=engine.steps, pad_id=0, rows_multiple=args.mbs)
            times = []
            for _ in range(args.repeats + 1):
                _sync(cuda)
                t = time.perf_counter()
                grpo_step(engine, batch)
                _sync(cuda)
                times.append(time.perf_counter() - t)
            point = {"groups": groups, "length": length, "mbs": args.mbs, "sequences": report.sequences,
                     "width": len(batch.tokens[0]),
                     "step_s": statistics.median(times[1:]), "spread": (max(times[1:]) - min(times[1:])) / min(times[1:])}
            print("measured", json.dumps(point), flush=True)
            points.append(point)
    return points


def fit_and_predict(points: list[dict], args) -> dict:
    """The job's training records for ``points``; fitted on the smallest and largest batch
    at each length, every point predicted."""
    from libra_hpc.planner.calibration import TimingRecord, fit_calibration
    from libra_hpc.planner.costs import TrainingCost, TrainShape
    from libra_hpc.planner.profiles import load_hardware, load_model

    from gpu_check import SHAPES

    hf = {"hidden_size": "hidden_size", "intermediate_size": "intermediate_size", "num_hidden_layers": "num_layers",
          "num_attention_heads": "num_heads", "num_key_value_heads": "num_kv_heads", "head_dim": "head_dim"}
    model = load_model("tiny").model_copy(update={"name": args.shape,
                                                  **{hf[k]: v for k, v in SHAPES[args.shape].items()}})
    hw = load_hardware(args.hardware)
    records = []
    for p in points:
        shape = TrainShape(1, 1, 1, p.get("mbs", args.mbs), p["sequences"], p["width"], uneven=True)
        records.append(TimingRecord("train", TrainingCost(model, hw, shape).components(), p["step_s"]))
    by_length: dict[int, list[int]] = {}
    for i, p in enumerate(points):
        if p.get("source", 0) == 0:  # fitted on the first run's points only
            by_length.setdefault(p["length"], []).append(i)
    fitted_on = sorted({i for idx in by_length.values() for i in (min(idx, key=lambda j: points[j]["sequences"]),
                                                                   max(idx, key=lambda j: points[j]["sequences"]))})
    cal = fit_calibration([records[i] for i in fitted_on])
    rows = []
    for i, (p, r) in enumerate(zip(points, records)):
        predicted = cal.time("train", r.components)
        rows.append({**p, "predicted_s": round(predicted, 5), "ratio": round(predicted / p["step_s"], 3),
                     "fitted": i in fitted_on})
    held = [r["ratio"] for r in rows if not r["fitted"]]
    return {"calibration": cal.note, "points": rows, "held_out_ratio_min": min(held, default=math.nan),
            "held_out_ratio_max": max(held, default=math.nan),
            "held_out_within_0.8_1.25": sum(0.8 <= x <= 1.25 for x in held), "held_out": len(held)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="wide", choices=("tiny", "wide"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--hardware", default="h200-141g", help="hardware profile the cost model prices on")
    ap.add_argument("--groups", default="4,8,16,32,64", help="GRPO groups (2 samples each) per batch")
    ap.add_argument("--lengths", default="256,512,1024", help="sequence lengths (each drawn in [L/2, L])")
    ap.add_argument("--mbs", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", default="")
    ap.add_argument("--out", default=os.environ.get("OUT", ""))
    ap.add_argument("--points", default="", help="refit the points of earlier runs' gpu_calibration.json (comma-"
                    "separated: fitted on the first file's smallest and largest batches, all predicted)")
    args = ap.parse_args()
    args.groups = [int(x) for x in args.groups.split(",")]
    args.lengths = [int(x) for x in args.lengths.split(",")]
    started = time.perf_counter()
    points = ([{**p, "source": k} for k, f in enumerate(args.points.split(","))
               for p in json.loads(Path(f).read_text())["points"]] if args.points else measure(args))
    result = fit_and_predict(points, args)
    print(f"{'mbs':>4} {'groups':>6} {'length':>6} {'seqs':>5} {'width':>5} {'measured s':>10} {'predicted s':>11} "
          f"{'ratio':>6}  fit")
    for r in result["points"]:
        print(f"{r.get('mbs', args.mbs):>4} {r['groups']:>6} {r['length']:>6} {r['sequences']:>5} {r['width']:>5} {r['step_s']:>10.4f} "
              f"{r['predicted_s']:>11.4f} {r['ratio']:>6.2f}  {'x' if r['fitted'] else ''}")
    print(result["calibration"])
    result["wall_s"] = round(time.perf_counter() - started, 1)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gpu_calibration.json").write_text(json.dumps(result, indent=1))
    print("GPU_CALIBRATION " + json.dumps({k: v for k, v in result.items() if k != "points"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
