"""A user's own task, without touching the package: prompts from a JSONL file and a verifier.

``rl.task: mypkg.mytask:make_task`` imports ``mypkg.mytask`` from ``sys.path`` and calls
``make_task(**tasks.plugin)``; it returns a :class:`~libra_hpc.envs.task.Task`, usually a
:class:`JsonlTask` (docs/tasks.md has the full example)::

    # mypkg/mytask.py
    from libra_hpc.envs import JsonlTask, PYTHON_TOOL

    def verify(prompt, answer):          # answer: the text in <answer>...</answer>, or None
        return float(answer is not None and answer.strip() == prompt.answer)

    def make_task(prompts):
        return JsonlTask(prompts, verify, tools=[PYTHON_TOOL])

Each JSONL line: ``{"prompt": "...", "answer": "..."}`` plus optional ``"id"``, ``"split"``
(``train`` or ``heldout``) and ``"meta"`` (an object). Lines without ``split`` go to the
held-out split when their text hash falls in ``heldout_fraction`` (stable across runs and
file orderings); a text given twice is kept once, so the splits never share a prompt.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from libra_hpc.envs.task import Prompt, Splits, Task
from libra_hpc.envs.toolcall import ParsedCall, ToolDef

PYTHON_TOOL = ToolDef("python", "Run a Python snippet in a sandbox and return what it prints.",
                      {"code": "Python source; print the result"})


class JsonlTask(Task):
    """Prompts from ``path``; ``verifier(prompt, answer) -> reward``; tools run in the
    sandbox (payload ``{"code": arguments["code"], "tool": name}`` unless ``payload`` is given)."""

    def __init__(self, path: str | Path, verifier: Callable[[Prompt, str | None], float], *,
                 tools: Sequence[ToolDef] = (), name: str = "custom",
                 system: str = "Answer the question. Give the final answer as <answer>ANSWER</answer>.",
                 payload: Callable[[ParsedCall], Any] | None = None, heldout_fraction: float = 0.1,
                 max_turns: int = 10):
        if not 0.0 <= heldout_fraction < 1.0:
            raise ValueError(f"heldout_fraction must be in [0, 1), got {heldout_fraction}")
        self.name, self.system, self.tools, self.max_turns = name, system, tuple(tools), max_turns
        self._verifier, self._payload = verifier, payload
        self.splits = read_prompts(Path(path), heldout_fraction)

    def verify(self, prompt: Prompt, answer: str | None) -> float:
        return float(self._verifier(prompt, answer))

    def payload(self, call: ParsedCall) -> Any:
        if self._payload is not None:
            return self._payload(call)
        if "code" not in call.arguments:
            raise TypeError(f"tool {call.name!r} has no 'code' argument; give JsonlTask a payload function for it")
        return {"code": str(call.arguments["code"]), "tool": call.name}


def read_prompts(path: Path, heldout_fraction: float) -> Splits:
    """The splits of a JSONL prompt file; errors name the file and line."""
    parts: dict[str, list[Prompt]] = {"train": [], "heldout": []}
    seen: set[str] = set()
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            try:
                row = json.loads(line)
                prompt = Prompt(str(row.get("id", f"{path.stem}-{number}")), str(row["prompt"]), str(row["answer"]),
                                dict(row.get("meta", {})))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
                raise ValueError(f"{where}: a prompt line is a JSON object with 'prompt' and 'answer' ({err})") from err
            split = row.get("split") or ("heldout" if int(prompt.hash, 16) % 10_000 < heldout_fraction * 10_000
                                         else "train")
            if split not in parts:
                raise ValueError(f"{where}: split {split!r} is neither 'train' nor 'heldout'")
            if prompt.hash not in seen:
                seen.add(prompt.hash)
                parts[split].append(prompt)
    if not parts["train"]:
        raise ValueError(f"{path}: no training prompts")
    return Splits(tuple(parts["train"]), tuple(parts["heldout"]))


def load_factory(spec: str) -> Callable[..., Any]:
    """``package.module:Factory`` → the callable (imported from ``sys.path``)."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"rl.task: {spec!r} is not 'package.module:Factory'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ImportError(f"rl.task: cannot import {module_name!r} ({err}); is its folder on PYTHONPATH?") from err
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise AttributeError(f"rl.task: {module_name} has no callable {attr!r}")
    return factory
