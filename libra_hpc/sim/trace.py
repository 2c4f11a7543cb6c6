"""Trajectory traces as JSONL: what a live run records per finished trajectory, and replay.

Record format, one JSON object per line (one trajectory), all keys required::

    {"step": 12,                 # RL step whose batch the trajectory belongs to (int >= 0)
     "prompt_id": "p381",        # prompt (GRPO group) identifier (non-empty str)
     "sample": 3,                # index within its group (int >= 0)
     "prompt_tokens": 1502,      # prompt tokens (int >= 1)
     "turns": [                  # generation segments in order, at least one
        {"gen_tokens": 611,      # tokens generated in this turn (int >= 1)
         "tool": {"name": "bash", "latency_s": 2.4, "status": "failure", "output_tokens": 380}},
        {"gen_tokens": 95, "tool": null}]}   # the last turn has no tool call, the others one

``status`` is ``success``, ``failure`` or ``timeout``; ``latency_s`` is the wall time of the
call in seconds (>= 0); ``output_tokens`` the tokens its output added to the context (>= 0).
Blank lines are skipped. A bad line raises :class:`TraceError` with the file, line number
and field. :func:`write_trace` writes the same format (the simulator's ``--write-trace``).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

from libra_hpc.envs.synthetic import ToolCall, Trajectory

STATUSES = ("success", "failure", "timeout")


class TraceError(ValueError):
    """A trace file or line that does not follow the record format."""


def to_record(t: Trajectory) -> dict:
    turns = [{"gen_tokens": g, "tool": ({"name": c.tool, "latency_s": c.latency_s, "status": c.status,
                                         "output_tokens": c.output_tokens} if c is not None else None)}
             for g, c in zip(t.turns, (*t.calls, None))]
    return {"step": t.step, "prompt_id": t.prompt_id, "sample": t.sample, "prompt_tokens": t.prompt_tokens,
            "turns": turns}


def write_trace(path: str | Path, trajectories: Iterable[Trajectory]) -> int:
    """Write ``trajectories`` as JSONL; returns the count."""
    n = 0
    with open(path, "w", encoding="utf-8") as f:
        for t in trajectories:
            f.write(json.dumps(to_record(t), separators=(",", ":")) + "\n")
            n += 1
    return n


def from_record(record: object, where: str) -> Trajectory:
    """One record as a Trajectory; TraceError names ``where`` and the field."""
    if not isinstance(record, dict):
        raise TraceError(f"{where}: a record must be a JSON object, got {type(record).__name__}")
    missing = {"step", "prompt_id", "sample", "prompt_tokens", "turns"} - record.keys()
    extra = record.keys() - {"step", "prompt_id", "sample", "prompt_tokens", "turns"}
    if missing or extra:
        raise TraceError(f"{where}: missing keys {sorted(missing)}, unknown keys {sorted(extra)}")
    step, sample = _int(record, "step", where, 0), _int(record, "sample", where, 0)
    prompt_tokens = _int(record, "prompt_tokens", where, 1)
    pid = record["prompt_id"]
    if not isinstance(pid, str) or not pid:
        raise TraceError(f"{where}: prompt_id must be a non-empty string, got {pid!r}")
    turns = record["turns"]
    if not isinstance(turns, list) or not turns:
        raise TraceError(f"{where}: turns must be a non-empty list")
    gens, calls = [], []
    for i, turn in enumerate(turns):
        at = f"{where}: turns[{i}]"
        if not isinstance(turn, dict) or turn.keys() != {"gen_tokens", "tool"}:
            raise TraceError(f"{at} must be an object with exactly gen_tokens and tool")
        gens.append(_int(turn, "gen_tokens", at, 1))
        tool, last = turn["tool"], i == len(turns) - 1
        if last != (tool is None):
            raise TraceError(f"{at}.tool: " + ("the last turn has no tool call (null)" if last
                                               else "every turn but the last ends in a tool call"))
        if tool is not None:
            calls.append(_call(tool, f"{at}.tool"))
    return Trajectory(f"s{step}/{pid}/{sample}", pid, step, sample, prompt_tokens, tuple(gens), tuple(calls))


def _call(tool: object, at: str) -> ToolCall:
    if not isinstance(tool, dict) or tool.keys() != {"name", "latency_s", "status", "output_tokens"}:
        raise TraceError(f"{at} must be an object with exactly name, latency_s, status, output_tokens")
    name, status, latency = tool["name"], tool["status"], tool["latency_s"]
    if not isinstance(name, str) or not name or "|" in name:
        raise TraceError(f"{at}.name: non-empty string without '|', got {name!r}")
    if status not in STATUSES:
        raise TraceError(f"{at}.status: {status!r}, allowed {STATUSES}")
    if isinstance(latency, bool) or not isinstance(latency, int | float) or not 0 <= latency < float("inf"):
        raise TraceError(f"{at}.latency_s: a finite number of seconds >= 0, got {latency!r}")
    return ToolCall(name, float(latency), status, _int(tool, "output_tokens", at, 0))


def _int(d: dict, key: str, where: str, minimum: int) -> int:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
        raise TraceError(f"{where}.{key}: an integer >= {minimum}, got {v!r}")
    return v


def read_trace(path: str | Path) -> list[Trajectory]:
    """Every record of a JSONL trace, in file order."""
    out = []
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise TraceError(f"{path}: cannot read the trace: {exc.strerror}") from None
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{path}:{n}: not JSON ({exc.msg})") from None
        out.append(from_record(record, f"{path}:{n}"))
    if not out:
        raise TraceError(f"{path}: the trace has no record")
    return out


class TraceWorkload:
    """Replays a trace: step ``s`` gets the trajectories recorded for the trace's ``s``-th
    step (steps in ascending order, cycling when the run is longer than the trace)."""

    def __init__(self, trajectories: list[Trajectory]):
        by_step: dict[int, list[Trajectory]] = defaultdict(list)
        for t in trajectories:
            by_step[t.step].append(t)
        self.steps = [by_step[s] for s in sorted(by_step)]
        self.prompts = sorted({t.prompt_id for t in trajectories})

    def batch(self, step: int) -> list[Trajectory]:
        recorded = self.steps[step % len(self.steps)]
        if step < len(self.steps):
            return list(recorded)
        return [Trajectory(f"s{step}/{t.prompt_id}/{t.sample}", t.prompt_id, step, t.sample, t.prompt_tokens,
                           t.turns, t.calls) for t in recorded]
