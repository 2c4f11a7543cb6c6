"""The training TP table the cost model gives for a GPU profile (EARL's selector, on GPUs).

On CPU every TP size above 1 is slower (``benchmarks/bench_engines.py``), so a measured CPU
table says TP 1 everywhere; the table a GPU cluster would use comes from the hardware and
model profiles through the training cost model (``planner/reshard.py`` ``tp_options``, the
prices the job's selector chooses from). For each context length (tokens per packed
sequence; memory is checked at ``--headroom`` × it, as ``planner.memory_headroom`` does):
each TP size's predicted step on the same GPUs (``-``: does not fit, even with
recomputation), and the one :func:`libra_hpc.parallel.selector.choose_by_cost` picks.

    python benchmarks/bench_tp_table.py [--model qwen3-14b] [--hardware a800-80g] [--gpus 8] [--pp 1]
                                        [--batch 128]

Prints the table, the rows in ``parallel.training_tp_by_context`` form, and a JSON line.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from libra_hpc.parallel.selector import choose_by_cost  # noqa: E402
from libra_hpc.planner.costs import Calibration, TrainShape  # noqa: E402
from libra_hpc.planner.profiles import load_hardware, load_model  # noqa: E402
from libra_hpc.planner.reshard import tp_options  # noqa: E402

CONTEXTS = (2048, 4096, 8192, 12288, 16384, 24576, 32768, 49152, 65536, 98304, 131072)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-14b")
    parser.add_argument("--hardware", default="a800-80g")
    parser.add_argument("--gpus", type=int, default=8, help="training GPUs (TP × PP × DP)")
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--batch", type=int, default=128, help="sequences per optimizer step")
    parser.add_argument("--headroom", type=float, default=1.25)
    args = parser.parse_args()
    model, hw = load_model(args.model), load_hardware(args.hardware)
    base = TrainShape(tp=1, pp=args.pp, dp=args.gpus // args.pp, micro_batch=1, global_batch=args.batch, seq_len=4096)
    rows = []
    for context in CONTEXTS:
        options = tp_options(model, hw, base, math.ceil(args.headroom * context), context, Calibration())
        choice = choose_by_cost({tp: s for tp, (s, _) in options.items()}, None, 0.0)
        rows.append((context, {tp: s for tp, (s, _) in options.items()}, choice))
    fitting = [(c, sec, ch) for c, sec, ch in rows if ch.fits]
    # A table's TP size may not shrink as contexts grow (TpTable): where the cheapest size
    # goes down again (recomputation switched on at the smaller size first changes the
    # price), the table keeps the smallest size still best at some longer context.
    envelope = [min(ch.tp for _, _, ch in fitting[i:]) for i in range(len(fitting))]
    table, current = {}, None
    for (context, _, _), tp in zip(fitting, envelope):
        if tp != current:
            table[context if table else 0] = current = tp
    tps = sorted(rows[0][1])
    print(f"{model.name} on {hw.name}: {args.gpus} training GPUs, PP {args.pp}, {args.batch} sequences a step; "
          f"predicted seconds per step")
    print(f"{'context':>8} " + " ".join(f"{'TP' + str(tp):>9}" for tp in tps) + "  cheapest   table  table's cost")
    worst = 0.0
    for i, (context, seconds, choice) in enumerate(rows):
        cells = " ".join(f"{seconds[tp]:>9.1f}" if math.isfinite(seconds[tp]) else f"{'-':>9}" for tp in tps)
        if not choice.fits:
            print(f"{context:>8} {cells}  none fits")
            continue
        tp = envelope[i]
        over = seconds[tp] / seconds[choice.tp] - 1.0
        worst = max(worst, over)
        print(f"{context:>8} {cells}  {'TP' + str(choice.tp):>8}  {'TP' + str(tp):>6}  {over:+.0%}")
    print(f"parallel.training_tp_by_context: {table}")
    print(json.dumps({"model": model.name, "hardware": hw.name, "gpus": args.gpus, "pp": args.pp,
                      "table": {str(k): v for k, v in table.items()}, "table_worst_over_cheapest": round(worst, 3),
                      "largest_fitting_context": max((c for c, _, _ in fitting), default=None)}))


if __name__ == "__main__":
    main()
