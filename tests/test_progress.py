"""Progress of the job's long phases (libra_hpc/metrics/progress.py): what rank 0 writes
(thinned out on an injected clock) and what the watcher shows (bars on a terminal, one line
per tenth elsewhere)."""

from __future__ import annotations

import io
import json

import pytest

from libra_hpc.cluster.follow import follow
from libra_hpc.metrics.progress import PhaseProgress, ProgressView


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_a_phase_writes_its_start_its_end_and_at_most_one_event_per_percent_and_interval():
    clock, out = Clock(), []
    bar = PhaseProgress("warm start", 1750, out.append, unit="steps", min_interval_s=2.0, clock=clock)
    for step in range(1, 1751):
        clock.t += 0.4
        bar.update(step, f"loss {1 / step:.3f}")
    assert out[0]["done"] == 0 and out[-1]["done"] == 1750 and out[-1]["total"] == 1750
    assert all(e["phase"] == "warm start" and e["unit"] == "steps" for e in out)
    done = [e["done"] for e in out]
    assert done == sorted(set(done))
    assert len({100 * d // 1750 for d in done}) == len(done)  # never two in the same percent
    # 0.4 s a step, 2 s apart at least: every 5th step at most (101 percents would allow more)
    assert all(b - a >= 5 for a, b in zip(done[1:-1], done[2:-1]))
    assert out[-1]["line"] == "warm start: 1750/1750 steps, loss 0.001"


def test_a_phase_without_steps_is_refused():
    with pytest.raises(ValueError, match="total must be at least 1"):
        PhaseProgress("evaluation", 0, print)


def events(phase: str, total: int) -> list[dict]:
    return [{"kind": "progress", "phase": phase, "done": d, "total": total, "line": f"{phase}: {d}/{total}"}
            for d in range(total + 1)]


def test_off_a_terminal_a_phase_is_one_line_per_tenth_and_no_carriage_return():
    out = io.StringIO()
    view = ProgressView(out, tty=False)
    assert all(view.show(e, "[t]") for e in events("warm start", 1750))
    assert not view.show({"kind": "eval", "phase": "warmstart"}, "[t]")
    lines = out.getvalue().splitlines()
    assert len(lines) == 11 and lines[0].endswith("0/1750 (0%)") and lines[-1].endswith("1750/1750 (100%)")
    assert "\r" not in out.getvalue()


def test_on_a_terminal_a_phase_is_a_bar_and_other_lines_print_above_it():
    out = io.StringIO()
    view = ProgressView(out, tty=True)
    for e in events("RL steps", 4)[:3]:
        view.show(e, "[t]")
    assert view.bars  # open, two of four steps done
    view.print("[t] eval: held-out success")
    view.show({**events("RL steps", 4)[4], "say": True, "line": "step 4/4: reward 0.8"}, "[t]")
    text = out.getvalue()
    assert "RL steps" in text and "\r" in text and "4/4" in text
    assert "held-out success" in text and "step 4/4: reward 0.8" in text
    assert not view.bars  # closed at its total


def test_follow_prints_the_steps_numbers_and_a_tenth_of_the_warm_start(tmp_path):
    path = tmp_path / "events.jsonl"
    rows = events("warm start", 100) + [{"kind": "progress", "line": "step 1/2: reward 0.5", "phase": "RL steps",
                                         "done": 1, "total": 2, "say": True},
                                        {"kind": "shutdown", "steps": 2}]
    path.write_text("".join(json.dumps({"t": 0, "elapsed_s": 1.0, **r}) + "\n" for r in rows))
    out = io.StringIO()
    follow(path, lambda: True, out, tty=False)
    lines = out.getvalue().splitlines()
    assert sum("warm start" in line for line in lines) == 11
    assert any("step 1/2: reward 0.5" in line for line in lines) and "shutdown" in lines[-1]
