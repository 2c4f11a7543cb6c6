"""``python -m libra_hpc.sim --config configs/sim/<scenario>.yaml --out logs/sim-<name>``

Runs every policy of the scenario (or ``--policies``), writes the output folder
(libra_hpc/sim/report.py) and prints the comparison table. ``--set KEY=VALUE`` overrides
any field as ``launch.py --set`` does (values are YAML). ``--write-trace FILE`` writes
the scenario's workload as a JSONL trace (libra_hpc/sim/trace.py) instead of simulating.
"""

from __future__ import annotations

import argparse
import logging
import sys

from libra_hpc.config import ConfigError, load_config
from libra_hpc.sim.config import POLICIES, SimConfig
from libra_hpc.sim.context import Context
from libra_hpc.sim.report import ratios, table, write_outputs
from libra_hpc.sim.run import run_scenario
from libra_hpc.sim.trace import TraceError, write_trace


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m libra_hpc.sim", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="scenario YAML (configs/sim/*.yaml)")
    parser.add_argument("--out", help="output folder (default: logs/sim-<scenario name>)")
    parser.add_argument("--policies", help=f"comma-separated subset of {','.join(POLICIES)}")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a field, e.g. --set rl.steps=6 (repeatable; values are YAML)")
    parser.add_argument("--steps", type=int, help="shortcut for --set rl.steps=N")
    parser.add_argument("--seed", type=int, help="shortcut for --set rl.seed=N")
    parser.add_argument("--phase-window", type=int, help="shortcut for --set search.phase_window=W (phase_static)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument("--write-trace", metavar="FILE", help="write the workload as a JSONL trace and exit")
    parser.add_argument("--log-level", default="WARNING", choices=["DEBUG", "INFO", "WARNING", "ERROR"])
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    names = [p.strip() for p in args.policies.split(",") if p.strip()] if args.policies else None
    try:
        cfg = load_config(args.config, args.set, schema=SimConfig,
                          **{"rl.steps": args.steps, "rl.seed": args.seed, "policies": names,
                             "search.phase_window": args.phase_window})
        if args.write_trace:
            ctx = Context(cfg)
            n = write_trace(args.write_trace, (t for s in range(cfg.rl.steps) for t in ctx.batch(s)))
            print(f"wrote {n} trajectories of {cfg.rl.steps} steps to {args.write_trace}")
            return 0
        result = run_scenario(cfg)
    except (ConfigError, TraceError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    report = write_outputs(result, args.out or f"logs/sim-{cfg.name}", plots=not args.no_plots)
    print("\n".join(table(result)))
    print(", ".join(f"{k} = {v:.2f}" if isinstance(v, float) else f"{k} = {v}" for k, v in ratios(result).items()
                    if v is not None))
    print(f"report: {report}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
