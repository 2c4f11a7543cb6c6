"""Tool-return state: turn one tool call's outcome into the causal signal C-MLFQ routes on.

A :class:`~libra_hpc.scheduler.types.ToolState` is (tool, payload size class, status).
Plain arguments, no config object, so the tool sandbox can call :func:`classify` directly.

Size classes. ``k`` strictly increasing thresholds (characters of tool output) cut sizes
into ``k + 1`` classes; class ``i`` holds sizes ``s`` with ``thresholds[i-1] <= s <
thresholds[i]``. The classes are named from a fixed ladder so that names read the same in
logs and saved trees whatever the count: 1 class ``M``; 2 ``S L``; 3 ``S M L`` (the
default thresholds ``[256, 4096]``); 4 ``XS S M L``; 5 ``XS S M L XL``. More than four
thresholds is refused: a finer split spreads finished trajectories over more tree
branches, so each node needs proportionally more samples before it is trusted.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from functools import lru_cache
from typing import cast

from libra_hpc.scheduler.types import Status, ToolState

STATUSES: tuple[Status, ...] = ("success", "failure", "timeout")

SIZE_CLASS_NAMES: dict[int, tuple[str, ...]] = {
    1: ("M",),
    2: ("S", "L"),
    3: ("S", "M", "L"),
    4: ("XS", "S", "M", "L"),
    5: ("XS", "S", "M", "L", "XL"),
}
"""Number of size classes → their names, smallest first."""

MAX_THRESHOLDS = max(SIZE_CLASS_NAMES) - 1


def size_class_names(size_thresholds: Sequence[int]) -> tuple[str, ...]:
    """Names of the ``len(size_thresholds) + 1`` size classes, smallest first (checked
    once per distinct threshold list: classify() calls this for every tool return)."""
    return _size_class_names(tuple(size_thresholds))


@lru_cache(maxsize=64)
def _size_class_names(size_thresholds: tuple[object, ...]) -> tuple[str, ...]:
    """Names of the ``len(size_thresholds) + 1`` size classes, smallest first.

    Raises ValueError when the thresholds are not strictly increasing positive integers
    or there are more than :data:`MAX_THRESHOLDS` of them."""
    if len(size_thresholds) > MAX_THRESHOLDS:
        raise ValueError(
            f"scheduler.size_thresholds: {len(size_thresholds)} thresholds given "
            f"({list(size_thresholds)}); at most {MAX_THRESHOLDS} are supported "
            f"(size classes {SIZE_CLASS_NAMES[MAX_THRESHOLDS + 1]})")
    previous = 0
    for threshold in size_thresholds:
        if not isinstance(threshold, int) or isinstance(threshold, bool) or threshold <= previous:
            raise ValueError(
                f"scheduler.size_thresholds: {list(size_thresholds)} must be strictly increasing "
                f"positive integers (characters of tool output); {threshold!r} is not")
        previous = threshold
    return SIZE_CLASS_NAMES[len(size_thresholds) + 1]


def size_class(size: int, size_thresholds: Sequence[int]) -> str:
    """The class name of an output of ``size`` characters (see the module docstring)."""
    if size < 0:
        raise ValueError(f"tool output size must be >= 0 characters, got {size}")
    return size_class_names(size_thresholds)[bisect_right(size_thresholds, size)]


def tool_status(output: str, exit_code: int | None, timed_out: bool, error_markers: Sequence[str]) -> Status:
    """How a tool call ended.

    ``timeout`` when the sandbox killed it at its wall-time limit (whatever it printed);
    ``failure`` when it exited non-zero, or when any of ``error_markers`` occurs in its
    output (a Python tool that printed a traceback but exited 0; a tool without a process,
    ``exit_code=None``, that reported an exception); ``success`` otherwise."""
    if timed_out:
        return "timeout"
    if exit_code is not None and exit_code != 0:
        return "failure"
    if any(marker and marker in output for marker in error_markers):
        return "failure"
    return "success"


def classify(tool: str, output: str, exit_code: int | None, timed_out: bool,
             size_thresholds: Sequence[int], error_markers: Sequence[str]) -> ToolState:
    """The :class:`ToolState` of one tool return.

    ``tool``: the tool's type name (``"python"``, ``"search"``), not one call's arguments;
    it must be non-empty and free of ``|``, which separates the fields of
    :meth:`ToolState.key`. ``output``: what the tool returned to the model; its length in
    characters gives the size class. ``exit_code``: the process exit status, ``None`` for
    tools without a process. ``timed_out``: the sandbox hit the wall-time limit."""
    _check_tool(tool)
    return ToolState(tool=tool, size=size_class(len(output), size_thresholds),
                     status=tool_status(output, exit_code, timed_out, error_markers))


def _check_tool(tool: str) -> None:
    if not tool or "|" in tool:
        raise ValueError(f"tool name {tool!r} must be non-empty and must not contain '|' "
                         "(the separator of ToolState.key())")


class Classifier:
    """:func:`classify` with the thresholds and markers fixed, for the queue service's hot
    path: the thresholds are checked once, here, and every distinct (tool, size class,
    status) is one shared ToolState (its tree key computed once). The cache is cleared
    when it holds :attr:`MAX_STATES` states (tool names come from the workers)."""

    MAX_STATES = 4096
    __slots__ = ("_index", "_markers", "_names", "_states", "_thresholds")

    def __init__(self, size_thresholds: Sequence[int], error_markers: Sequence[str]):
        self._names = size_class_names(size_thresholds)
        self._index = {name: i for i, name in enumerate(self._names)}
        self._thresholds = tuple(size_thresholds)
        self._markers = tuple(marker for marker in error_markers if marker)
        self._states: dict[tuple[str, int, str], ToolState] = {}

    def __call__(self, tool: str, output: str, exit_code: int | None, timed_out: bool) -> ToolState:
        """The ToolState of one tool return (arguments as :func:`classify`'s)."""
        if timed_out:
            status = "timeout"
        elif exit_code is not None and exit_code != 0:
            status = "failure"
        else:
            status = "success"
            for marker in self._markers:
                if marker in output:
                    status = "failure"
                    break
        size = bisect_right(self._thresholds, len(output))
        state = self._states.get((tool, size, status))
        if state is None:
            _check_tool(tool)
            if len(self._states) >= self.MAX_STATES:
                self._states.clear()
            state = self._states[(tool, size, status)] = ToolState(tool, self._names[size], cast(Status, status))
        return state

    def state(self, tool: str, size: str, status: str) -> ToolState:
        """The ToolState a worker classified itself (with the same thresholds and
        markers): ``size`` must be one of this classifier's size class names, ``status``
        one of success/failure/timeout. ValueError names what is wrong."""
        index = self._index.get(size)
        if index is None:
            raise ValueError(f"size {size!r} must be one of {list(self._names)} (the configured size classes)")
        if status not in STATUSES:
            raise ValueError(f"status {status!r} must be one of {list(STATUSES)}")
        state = self._states.get((tool, index, status))
        if state is None:
            _check_tool(tool)
            if len(self._states) >= self.MAX_STATES:
                self._states.clear()
            state = self._states[(tool, index, status)] = ToolState(tool, size, cast(Status, status))
        return state
