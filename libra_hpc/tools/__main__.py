"""Run one snippet in the tool sandbox from the command line, or say how this host isolates.

    python -m libra_hpc.tools --probe                 # which isolation mode, and why
    python -m libra_hpc.tools -c "print(1 + 1)"       # run code; prints the result as JSON
    python -m libra_hpc.tools snippet.py --wall-time 5

Limits take their defaults from the ``tools`` section of ``--config`` (default: the
embedded default). Exit status: 0 when the snippet's state is ``success``, 1 otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path

from libra_hpc.config import load_config
from libra_hpc.tools.isolation import bwrap_problem
from libra_hpc.tools.orchestrator import limits_from_config
from libra_hpc.tools.sandbox import ClassifyRules, first_free_sandbox


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m libra_hpc.tools", description=__doc__.splitlines()[0])
    parser.add_argument("file", nargs="?", help="Python file to run (else -c or stdin)")
    parser.add_argument("-c", dest="code", help="Python code to run")
    parser.add_argument("--config", help="experiment YAML whose tools section gives the limits")
    parser.add_argument("--wall-time", type=float, help="override tools.wall_time_s")
    parser.add_argument("--probe", action="store_true", help="only report the isolation mode this host supports")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    cfg = load_config(args.config)
    tools = cfg.tools
    python = tools.python or sys.executable
    uid = tools.uid_base if os.geteuid() == 0 else None
    if args.probe:
        problem = bwrap_problem(python, uid)
        print(json.dumps({"bwrap": problem is None, "why_not": problem, "runs_as_root": uid is not None,
                          "configured": tools.isolation}))
        return 0
    code = args.code if args.code is not None else (Path(args.file).read_text() if args.file else sys.stdin.read())
    limits = limits_from_config(tools)
    if args.wall_time is not None:
        limits = dataclasses.replace(limits, wall_time_s=args.wall_time)
    rules = ClassifyRules(tuple(cfg.scheduler.size_thresholds), tuple(cfg.scheduler.error_markers))
    sandbox = first_free_sandbox(limits, tools.uid_base, tools.max_workers, isolation=tools.isolation,
                                 python=tools.python, rules=rules, lock_dir=tools.lock_dir)
    try:
        result = sandbox.run_python(code)
    finally:
        sandbox.close()
    out = dataclasses.asdict(result)
    out["state"] = result.state.key()
    print(json.dumps(out, indent=1))
    return 0 if result.state.status == "success" else 1


if __name__ == "__main__":
    sys.exit(main())
