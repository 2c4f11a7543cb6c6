"""The held-out evaluations on rank 0 (:class:`HeldOut`): which leader scores which
held-out prompts (greedy, a share each), and what they scored."""

from __future__ import annotations

import logging
import statistics
from typing import Any

from libra_hpc.runtime.state import Sends

log = logging.getLogger(__name__)
PHASE_KEY = {"warmstart": "warmstart", "final": "rl", "checkpoint": "checkpoint"}
"""The suffix of a phase's tool-use keys in ``summary.json`` (``success_tool_rl`` ...)."""
RESUME_KEYS = ("eval_success_warmstart", "eval_prompts", "warmstart_build_s", "success_tool_warmstart",
               "success_no_tool_warmstart", "tool_share_warmstart", "eval_tool_calls")
"""The summary's entries a checkpoint keeps (a resumed run does not evaluate its warm start again)."""


class HeldOut:
    def __init__(self, cfg: Any, task: Any, runlog: Any, summary: dict):
        self.cfg, self.task, self.runlog, self.summary = cfg, task, runlog, summary
        self.parts: dict[str, list[dict]] = {}
        self.expect = 0

    def start(self, phase: str, leaders: dict[int, int]) -> Sends:
        """The ``eval`` commands of ``phase``; none when there is nothing to evaluate (the
        caller then ends the phase at once with :meth:`result`)."""
        n = min(self.cfg.job.eval_prompts, len(self.task.splits.heldout))
        ranks = [rank for _, rank in sorted(leaders.items())]
        self.parts[phase] = []
        sends = [(rank, {"op": "eval", "phase": phase, "indices": list(range(k, n, len(ranks)))})
                 for k, rank in enumerate(ranks) if k < n]
        self.expect = len(sends)
        if sends:
            self.runlog.event("progress", line=f"held-out evaluation ({phase}): {n} prompts on {self.expect} instances")
        return sends

    def got(self, message: dict) -> bool:
        """A leader's share came back: True once the phase is complete."""
        parts = self.parts[message["phase"]]
        parts.append(message)
        self.runlog.event("progress", phase=f"held-out evaluation ({message['phase']})", unit="instances",
                          done=len(parts), total=self.expect,
                          line=f"held-out evaluation ({message['phase']}): {len(parts)}/{self.expect} instances done")
        return len(parts) == self.expect

    def result(self, phase: str, version: int) -> float | None:
        """The phase's success rate, written to the summary and the events."""
        parts = self.parts.get(phase, [])
        rewards = [r for p in parts for r in p["rewards"]]
        success = statistics.fmean(rewards) if rewards else None
        self.summary[f"eval_success_{phase}"] = None if success is None else round(success, 4)
        self.summary["eval_prompts"] = len(rewards)
        self.summary["heldout_entity_overlap"] = self.task.splits.entity_overlap()
        calls = [c for p in parts for c in p.get("tool_calls", [None] * len(p["rewards"]))]
        self.summary.update(tool_use(rewards, calls, PHASE_KEY.get(phase, phase)))
        self.summary["eval_tool_calls"] = self.summary.get("eval_tool_calls", 0) + sum(c or 0 for c in calls)
        self.runlog.event("eval", phase=phase, success=success, prompts=len(rewards), version=version,
                          wall_s=max((p["wall_s"] for p in parts), default=0.0))
        log.info("held-out success (%s): %s on %d prompts", phase, success, len(rewards))
        return success


def tool_use(rewards: list[float], calls: list[int | None], key: str) -> dict:
    """An evaluation's answers split by whether they called a tool: ``success_tool_<key>``
    and ``success_no_tool_<key>`` (mean reward of each side; None when a side is empty)
    and ``tool_share_<key>`` (the share that called one); nothing when the calls were not
    reported."""
    if not rewards or any(c is None for c in calls):
        return {}
    used = [r for r, c in zip(rewards, calls) if c > 0]
    plain = [r for r, c in zip(rewards, calls) if c == 0]
    mean = lambda xs: round(statistics.fmean(xs), 4) if xs else None  # noqa: E731
    return {f"success_tool_{key}": mean(used), f"success_no_tool_{key}": mean(plain),
            f"tool_share_{key}": round(len(used) / len(rewards), 4)}
