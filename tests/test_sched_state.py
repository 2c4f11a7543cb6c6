"""Tool-return classification: size classes and status, from plain arguments."""

from __future__ import annotations

import pytest

from libra_hpc.scheduler.state import (
    classify,
    size_class,
    size_class_names,
    tool_status,
)
from libra_hpc.scheduler.types import ToolState

MARKERS = ["Traceback (most recent call last)", "Error:", "error:", "Exception"]


@pytest.mark.parametrize(("size", "name"), [(0, "S"), (255, "S"), (256, "M"), (4095, "M"), (4096, "L"), (10**6, "L")])
def test_default_thresholds_cut_s_m_l_with_lower_bound_inclusive(size, name):
    assert size_class(size, [256, 4096]) == name


@pytest.mark.parametrize(("thresholds", "names"), [
    ([], ("M",)), ([10], ("S", "L")), ([10, 20], ("S", "M", "L")),
    ([10, 20, 30], ("XS", "S", "M", "L")), ([10, 20, 30, 40], ("XS", "S", "M", "L", "XL")),
])
def test_class_names_follow_the_ladder(thresholds, names):
    assert size_class_names(thresholds) == names
    assert [size_class(t - 1, thresholds) for t in thresholds] + [size_class(10**9, thresholds)] == list(names)


@pytest.mark.parametrize("thresholds", [[10, 20, 30, 40, 50], [20, 10], [10, 10], [0, 5], [1.5]])
def test_bad_thresholds_are_refused_naming_the_field(thresholds):
    with pytest.raises(ValueError, match="size_thresholds"):
        size_class_names(thresholds)


def test_negative_size_is_refused():
    with pytest.raises(ValueError, match="-1"):
        size_class(-1, [256])


@pytest.mark.parametrize(("output", "exit_code", "timed_out", "status"), [
    ("ok", 0, False, "success"),
    ("", None, False, "success"),
    ("ok", 1, False, "failure"),
    ("ok", -9, False, "failure"),
    ("Traceback (most recent call last):\n  ...", 0, False, "failure"),  # printed a traceback, exited 0
    ("ValueError: Exception raised", None, False, "failure"),  # no process, reported an exception
    ("partial output", 0, True, "timeout"),
    ("Traceback (most recent call last)", 1, True, "timeout"),  # a timeout wins over everything
    ("all fine, no errors", 0, False, "success"),  # 'errors' without a colon is no marker
])
def test_status(output, exit_code, timed_out, status):
    assert tool_status(output, exit_code, timed_out, MARKERS) == status


def test_empty_marker_matches_nothing():
    assert tool_status("anything", 0, False, [""]) == "success"


def test_classify_combines_size_and_status():
    state = classify("python", "x" * 300 + "\nError: boom", 0, False, [256, 4096], MARKERS)
    assert state == ToolState("python", "M", "failure")
    assert state.key() == "python|M|failure"


@pytest.mark.parametrize("tool", ["", "py|thon"])
def test_tool_names_that_would_break_the_tree_key_are_refused(tool):
    with pytest.raises(ValueError, match="tool name"):
        classify(tool, "", 0, False, [256], MARKERS)
