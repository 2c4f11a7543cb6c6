"""The one synthetic workload (libra_hpc/envs/synthetic.py): the tool text a worker
reports, and failures whose output grows with the bugs left (failure_output_per_bug)."""

from __future__ import annotations

import statistics
from pathlib import Path

from libra_hpc.envs.synthetic import CHARS_PER_TOKEN, SyntheticWorkload, ToolCall
from libra_hpc.scheduler.state import Classifier
from libra_hpc.sim.config import load_sim_config

PREMISE = load_sim_config(Path(__file__).resolve().parents[1] / "configs" / "sim" / "cmlfq-premise.yaml")
MARKER = "Traceback (most recent call last)"


def test_tool_output_is_what_a_worker_reports_and_classifies_as_the_call():
    classify = Classifier([256, 4096], [MARKER])
    for status, tokens, size in [("success", 10, "S"), ("failure", 100, "M"), ("timeout", 5000, "L"),
                                 ("failure", 2, "S"), ("success", 1024, "L")]:
        text, exit_code, timed_out = ToolCall("bash", 1.0, status, tokens).output([256, 4096], MARKER)
        assert len(text) == max(min(tokens * CHARS_PER_TOKEN, 4096), len(MARKER) if status == "failure" else 0)
        assert (exit_code, timed_out) == (int(status == "failure"), status == "timeout")
        assert text.startswith(MARKER) == (status == "failure")
        state = classify("bash", text, exit_code, timed_out)
        assert (state.size, state.status) == (size, status)


def _failure_outputs(per_bug: float) -> tuple[list[int], list[int]]:
    """Output tokens of bug failures that another failure follows (two or more bugs were
    left) and of the last failure of a trajectory (one bug left)."""
    spec = PREMISE.workload.model_copy(update={"tools": [t.model_copy(update={"failure_output_per_bug": per_bug})
                                                         for t in PREMISE.workload.tools]})
    more, last = [], []
    for t in SyntheticWorkload.groups(spec, 200, 4, 0, PREMISE.training.seq_len).batch(0):
        failures = [c for c in t.calls if c.status == "failure"]
        more += [c.output_tokens for c in failures[:-1]]
        last += [c.output_tokens for c in failures[-1:]]
    return more, last


def test_a_failure_prints_more_while_more_bugs_are_left():
    more, last = _failure_outputs(1.5)
    assert statistics.median(more) > 2 * statistics.median(last)
    more, last = _failure_outputs(0.0)  # off: the size says nothing about the work left
    assert statistics.median(more) < 1.2 * statistics.median(last)
