"""Follow a running job: print its events as they are written, until it ends."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TextIO
from collections.abc import Callable

from libra_hpc.metrics.runlog import read_jsonl


def format_event(event: dict) -> str:
    """One line for a person watching the run."""
    kind = event["kind"]
    head = f"[{event.get('elapsed_s', 0):8.2f}s] {kind}"
    if kind == "world_started":
        emulated = " (emulated nodes)" if event.get("emulated_nodes") else ""
        return f"{head}: {event['world_size']} ranks on {event['nodes']} nodes × {event['gpus_per_node']}{emulated}, {event.get('backend')}"
    if kind in ("layout_planned", "layout_applied"):
        gpus, train = event["gpus"], event.get("training") or {}
        return (f"{head}: v{event['version']} training {gpus['training']} GPUs (TP{train.get('tp')}×PP{train.get('pp')}×DP{train.get('dp')}), "
                f"rollout {gpus['rollout']} GPUs as TP {event['rollout_tp']} — {event['reason']}")
    if kind == "group_check":
        state = "ok" if event["ok"] else "FAILED"
        return f"{head}: step {event['step']} {state}, {len(event['groups'])} groups"
    if kind == "hybrid":
        gain = "" if event.get("predicted_gain_s") is None else f" (predicted gain {event['predicted_gain_s']} s/step)"
        state = "refused" if event.get("refused") else f"{event.get('from_state')} → {event['state']}"
        return f"{head}: hybrid replica {event.get('replica')} {state}: {event.get('reason')}{gain}"
    if kind == "progress":
        return f"{head}: {event['line']}"
    if kind == "eval":
        return f"{head}: held-out success ({event['phase']}) {event['success']} on {event['prompts']} prompts"
    if kind == "trained_trajectories":
        return f"{head}: {len(event['tids'])} trajectories trained ({len(set(event['tids']))} distinct)"
    if kind == "load":
        return f"{head}: {event['tokens']} tokens generated, queues {event['queue']}, {event['active']} trajectories active"
    if kind == "failure":
        error = " | ".join(str(event.get("error")).splitlines())
        return f"{head}: rank {event.get('rank')}: {error}"
    rest = {k: v for k, v in event.items() if k not in ("t", "elapsed_s", "kind")}
    return f"{head}: {rest}" if rest else head


def follow(events_path: Path, finished: Callable[[], bool], out: TextIO, poll_s: float = 0.5,
           tty: bool | None = None) -> list[dict]:
    """Print new events until ``finished()`` is true, then the rest; returns all events.
    A phase's progress (the warm start, the engines' start, an evaluation, the steps) is a
    bar on a terminal, one line per tenth elsewhere (:class:`ProgressView`; ``tty``
    overrides ``out.isatty()``)."""
    from libra_hpc.metrics.progress import ProgressView

    view = ProgressView(out, tty)
    shown = 0
    try:
        while True:
            done = finished()
            events = read_jsonl(events_path)
            for event in events[shown:]:
                if not view.show(event, f"[{event.get('elapsed_s', 0):8.2f}s]"):
                    view.print(format_event(event))
            shown = len(events)
            if done:
                return events
            time.sleep(poll_s)
    finally:
        view.close()
