"""A tool-sandbox worker on another node: ``python -m libra_hpc.tools.worker SPEC_JSON``.

Started by :class:`~libra_hpc.tools.remote.SlurmSandboxRunner` through ``srun`` (one worker
per unit of the ``cpu`` pool), it holds one :class:`~libra_hpc.tools.sandbox.Sandbox` slot of
its node and runs the calls it is sent, one at a time. Protocol, one JSON object per line:

- the worker's first line: ``{"ready": true, "node": str, "host": str, "isolation": str}``,
  or ``{"ready": false, "node": str, "error": str}`` when no sandbox can be made here
  (then it exits 1);
- each request on stdin: ``{"code": str, "tool": str}`` (Python) or
  ``{"argv": [str, ...], "tool": str}`` (a command);
- each reply on stdout: ``{"ok": true, "result": {...}}`` (:func:`result_to_json`) or
  ``{"ok": false, "error": str}`` for a request it could not run (malformed, or the
  sandbox failed; the worker goes on with the next request), with ``"leak": true`` when
  processes of the call survived SIGKILL (the worker exits: its slot must not run again).

End of stdin ends the worker (releasing its slot). SPEC_JSON: :func:`worker_spec`.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import sys
from typing import Any, TextIO

from libra_hpc.cluster.env import ProcessEnv
from libra_hpc.scheduler.types import ToolState
from libra_hpc.tools.isolation import SandboxLimits
from libra_hpc.tools.procs import SlotLeak
from libra_hpc.tools.sandbox import ClassifyRules, ToolResult, first_free_sandbox

log = logging.getLogger(__name__)


def worker_spec(limits: SandboxLimits, *, uid_base: int, slots: int, isolation: str, python: str,
                rules: ClassifyRules, lock_dir: str) -> str:
    """The worker's command-line argument: everything its Sandbox needs, as JSON."""
    return json.dumps({"limits": dataclasses.asdict(limits), "uid_base": uid_base, "slots": slots,
                       "isolation": isolation, "python": python, "lock_dir": lock_dir,
                       "rules": {"size_thresholds": list(rules.size_thresholds),
                                 "error_markers": list(rules.error_markers)}})


def result_to_json(result: ToolResult) -> dict:
    return dataclasses.asdict(result)


def result_from_json(data: dict) -> ToolResult:
    """Inverse of :func:`result_to_json`; KeyError/TypeError on a malformed record."""
    return ToolResult(**{**data, "state": ToolState(**data["state"])})


def serve(spec: dict, stdin: TextIO, stdout: TextIO) -> int:
    """Answer requests until end of input; the exit status."""
    node = ProcessEnv.read()
    where = node.node_name or node.hostname
    try:
        sandbox = first_free_sandbox(SandboxLimits(**spec["limits"]), spec["uid_base"], spec["slots"],
                                     isolation=spec["isolation"], python=spec["python"], lock_dir=spec["lock_dir"],
                                     rules=ClassifyRules(tuple(spec["rules"]["size_thresholds"]),
                                                         tuple(spec["rules"]["error_markers"])))
    except (RuntimeError, ValueError, OSError) as exc:
        _say(stdout, {"ready": False, "node": where, "error": f"no tool sandbox on {where}: {exc}"})
        return 1
    try:
        _say(stdout, {"ready": True, "node": where, "host": node.hostname, "isolation": sandbox.isolation})
        for line in stdin:
            try:
                reply = {"ok": True, "result": result_to_json(_run(sandbox, json.loads(line)))}
            except SlotLeak as exc:  # its processes survive: this worker must not run another call
                _say(stdout, {"ok": False, "leak": True, "error": f"sandbox slot on {where} leaked processes: {exc}"})
                return 1
            except (ValueError, TypeError, KeyError, RuntimeError, OSError) as exc:
                reply = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            _say(stdout, reply)
        return 0
    finally:
        sandbox.close()


def _run(sandbox, request: Any) -> ToolResult:
    if not isinstance(request, dict):
        raise ValueError(f"request must be a JSON object, got {type(request).__name__}")
    if isinstance(request.get("argv"), list) and all(isinstance(a, str) for a in request["argv"]):
        return sandbox.run_argv(request["argv"], tool=str(request.get("tool", "shell")))
    if isinstance(request.get("code"), str):
        return sandbox.run_python(request["code"], tool=str(request.get("tool", "python")))
    raise ValueError(f"request needs 'code' (a string) or 'argv' (a list of strings); keys given: {sorted(request)}")


def _say(stdout: TextIO, message: dict) -> None:
    stdout.write(json.dumps(message) + "\n")
    stdout.flush()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m libra_hpc.tools.worker SPEC_JSON", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    return serve(json.loads(args[0]), sys.stdin, sys.stdout)


if __name__ == "__main__":
    sys.exit(main())
