"""The causal prefix tree: remaining output tokens after each sequence of tool returns.

A path from the root spells a trajectory's tool returns in order (children keyed by
:meth:`ToolState.key`); the node at depth ``d`` holds the tokens that finished
trajectories still generated after their ``d``-th tool return (depth 0, the root: their
whole output). C-MLFQ looks a running trajectory up by its tool returns so far and routes
its next turn on the node's mean and p90.

Statistics are over a bounded window of each node's most recent samples (drift: the
policy under training changes its lengths) and are updated in streaming fashion.
:class:`CausalIndex` keeps one tree per prompt plus a global tree, and the last
``retain`` finished trajectories so that :meth:`CausalIndex.rebuild` can drop what has
aged out of every window (rarely visited nodes, prompts no longer sampled).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import tempfile
import time
from bisect import bisect_left, bisect_right, insort
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Final, NamedTuple, TypeVar

from libra_hpc.scheduler.types import CausalTreeFormatError, FinishedTrajectory, ToolState

logger = logging.getLogger(__name__)
_T = TypeVar("_T")

FORMAT = "libra_hpc.causal_index"
VERSION = 1
MAX_SAMPLE = 1 << 48
"""Largest remaining-token count a node takes (the samples are 64-bit integers)."""
MAX_DEPTH = 64
"""Tool returns a tree follows. Deeper nodes would hold too few samples to be trusted, so a
longer trajectory is routed on its node at this depth (conditioned on what it generated
since) and teaches the trees its first ``MAX_DEPTH`` tool returns only. This also bounds
the cost of a lookup or an update, and the nesting of the saved JSON (a recursive
format: Python's JSON and this module recurse once per level)."""
STATUSES = ("success", "failure", "timeout")
NATIVE: Final = not __file__.endswith(".py")
"""Whether this module runs compiled (libra_hpc/_compiled.py). Compiled, the window's
binary searches are plain loops over native ints (:func:`_left`, :func:`_right`), a
third of the cost of the C ``bisect`` functions there (each of their comparisons is a
generic call); interpreted, the C functions are the faster ones."""


class NodeStats:
    """Remaining-token statistics of one tree node over its last ``window`` samples.

    Invariants: ``n == min(count, window)``; ``_ring`` holds the window in arrival order
    rotated by ``_head`` (the oldest sample, once the window is full); ``_sorted`` is the
    window sorted; ``_sum`` is its sum. :meth:`add` costs O(log W) comparisons plus an
    O(W) memmove in the sorted list; :attr:`mean` and :attr:`p90` are O(1).

    Both windows are lists of the same int objects, and a tree node is its own statistics
    (:class:`_Node`): one object fewer for the collector. (An ``array('q')`` ring, which the
    collector does not track, costs a generic call per access once compiled; full
    collections in the queue service are scheduled by its transport anyway,
    scheduler/mpi_service.py.)"""

    __slots__ = ("_head", "_ring", "_sorted", "_sum", "count", "window")

    def __init__(self, window: int):
        if window < 1:
            raise ValueError(f"node window must be >= 1 sample, got {window}")
        self.window = window
        self.count = 0  # samples ever added, including those that left the window
        self._ring: list[int] = []
        self._head = 0
        self._sorted: list[int] = []
        self._sum = 0

    def add(self, tokens: int) -> None:
        """Add one sample (remaining output tokens); the oldest leaves a full window."""
        self.count += 1
        ring, ordered = self._ring, self._sorted
        if len(ring) < self.window:
            ring.append(tokens)
            self._sum += tokens
        else:
            head = self._head
            oldest = ring[head]
            ring[head] = tokens
            self._head = head + 1 if head + 1 < self.window else 0
            del ordered[_left(ordered, oldest) if NATIVE else bisect_left(ordered, oldest)]
            self._sum += tokens - oldest
        if NATIVE:
            ordered.insert(_right(ordered, tokens), tokens)
        else:
            insort(ordered, tokens)

    @property
    def n(self) -> int:
        """Samples in the window (what :attr:`mean` and :attr:`p90` are computed over)."""
        return len(self._ring)

    @property
    def samples(self) -> tuple[int, ...]:
        """The window, oldest first."""
        ring, head = self._ring, self._head
        return tuple(ring[head:]) + tuple(ring[:head])

    @property
    def mean(self) -> float:
        """Mean remaining output tokens over the window (0.0 when empty)."""
        return self._sum / len(self._ring) if self._ring else 0.0

    @property
    def p90(self) -> int:
        """90th percentile by nearest rank: the smallest sample that at least 90 % of the
        window is <= to, ``sorted[ceil(0.9 n) - 1]`` (0 when empty)."""
        n = len(self._sorted)
        return self._sorted[(9 * n + 9) // 10 - 1] if n else 0

    def beyond(self, already: int) -> tuple[float, int] | None:
        """(mean, p90) of ``sample - already`` over the window's samples above
        ``already``: what remains for a trajectory that has generated ``already`` more
        tokens since this node, given that it has not finished yet. None when no sample
        of the window lasted that long. O(log W) plus a C-level sum over the tail."""
        if already <= 0:
            return (self.mean, self.p90) if self._sorted else None
        ordered = self._sorted
        first = _right(ordered, already) if NATIVE else bisect_right(ordered, already)
        n = len(ordered) - first
        if not n:
            return None
        # The sum of the tail from the shorter side of the cut (both copy a slice).
        total = sum(ordered[first:]) if n <= first else self._sum - sum(ordered[:first])
        return total / n - already, ordered[first + (9 * n + 9) // 10 - 1] - already

    def __repr__(self) -> str:
        return f"NodeStats(n={self.n}, count={self.count}, mean={self.mean:.1f}, p90={self.p90})"


class _Node(NodeStats):
    """A tree node: its statistics and its children by tool-return key (None for a leaf,
    which most nodes are: one object fewer for the collector)."""

    __slots__ = ("children",)

    def __init__(self, window: int):
        super().__init__(window)
        self.children: dict[str, _Node] | None = None

    @property
    def stats(self) -> NodeStats:
        return self


def _left(ordered: list[int], x: int) -> int:
    """``bisect_left`` for a list of ints, as a loop the compiled module runs on native ints."""
    lo, hi = 0, len(ordered)
    while lo < hi:
        mid = (lo + hi) >> 1
        if ordered[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo


def _right(ordered: list[int], x: int) -> int:
    """``bisect_right`` for a list of ints (see :func:`_left`)."""
    lo, hi = 0, len(ordered)
    while lo < hi:
        mid = (lo + hi) >> 1
        if x < ordered[mid]:
            hi = mid
        else:
            lo = mid + 1
    return lo


def _keys(states: Sequence[ToolState], keys: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Tree keys of the first :data:`MAX_DEPTH` states: from ``keys`` when it holds one per
    state (the queue service keeps them, so a lookup reads no ToolState), else computed."""
    if len(keys) == len(states):
        return keys[:MAX_DEPTH] if len(keys) > MAX_DEPTH else keys
    return tuple([state._key for state in states[:MAX_DEPTH]])  # as state.key(), without a method call


class CausalTree:
    """One prefix tree of tool-return sequences; every node keeps a :class:`NodeStats`."""

    def __init__(self, window: int):
        self.window = window
        self.root = _Node(window)

    def observe(self, states: Sequence[ToolState], remaining_after: Sequence[int]) -> None:
        """Add one finished trajectory: the node of prefix ``states[:d]`` gets the sample
        ``remaining_after[d]``. Cost proportional to ``len(states)``."""
        if len(remaining_after) != len(states) + 1:
            raise ValueError(f"remaining_after has {len(remaining_after)} entries for "
                             f"{len(states)} tool returns; expected {len(states) + 1}")
        self.observe_keys(_keys(tuple(states)), tuple(remaining_after))

    def observe_keys(self, keys: tuple[str, ...], remaining_after: tuple[int, ...]) -> None:
        node = self.root
        node.add(remaining_after[0])
        depth = 0
        for key in keys:
            depth += 1
            children = node.children
            if children is None:
                children = node.children = {}
            child = children.get(key)
            if child is None:
                child = children[key] = _Node(self.window)
            node = child
            node.add(remaining_after[depth])

    def lookup(self, states: Sequence[ToolState], min_samples: int) -> NodeStats | None:
        """The deepest node on the path of ``states`` (exact match as far as the tree
        goes) whose window holds at least ``min_samples`` samples, or None."""
        return self.deepest(_keys(tuple(states)), min_samples)[0]

    def deepest(self, keys: tuple[str, ...], min_samples: int) -> tuple[NodeStats | None, int]:
        """Like :meth:`lookup` on pre-computed keys, also returning the node's depth (0
        when there is none). A plain tuple: compiled, it is returned without allocating."""
        node = self.root
        best: _Node | None = node if len(node._ring) >= min_samples else None
        depth = best_depth = 0
        for key in keys:
            children = node.children
            if children is None:
                break
            child = children.get(key)
            if child is None:
                break
            node = child
            depth += 1
            if len(node._ring) >= min_samples:
                best, best_depth = node, depth
        return best, best_depth

    def node_count(self) -> int:
        """Nodes in the tree, the root included (walks the whole tree: not for hot paths)."""
        count, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            count += 1
            stack.extend(node.children.values() if node.children else ())
        return count

    def to_json(self) -> dict:
        return _node_to_json(self.root)

    @classmethod
    def from_json(cls, data: object, window: int, where: str = "tree") -> CausalTree:
        tree = cls(window)
        tree.root = _node_from_json(data, window, where)
        return tree


class Match(NamedTuple):
    """A lookup's answer: the trusted node, which tree it came from and how deep it is."""

    stats: NodeStats
    source: str  # "prompt" or "global"
    depth: int


class CausalIndex:
    """Per-prompt causal trees, a global fallback tree, and the recent finished trajectories.

    ``window``: samples per node. ``min_samples``: samples a node needs to be trusted.
    ``retain``: finished trajectories kept for :meth:`rebuild` (at least ``window``, so a
    rebuild keeps the root's window intact)."""

    def __init__(self, window: int, min_samples: int, retain: int):
        if not 1 <= min_samples <= window:
            raise ValueError(f"min_samples={min_samples} must be between 1 and the tree window "
                             f"({window}): a node never holds more than window samples")
        if retain < window:
            raise ValueError(f"retain={retain} finished trajectories must be >= the tree window ({window}): "
                             "a rebuild from fewer would leave even the root's window short")
        self.window = window
        self.min_samples = min_samples
        self.retain = retain
        self.prompt_trees: dict[str, CausalTree] = {}
        self.global_tree = CausalTree(window)
        self.recent: deque[FinishedTrajectory] = deque(maxlen=retain)
        self._deferred: dict[str, list[FinishedTrajectory]] = {}  # see rebuild()

    def observe(self, finished: FinishedTrajectory) -> None:
        """Learn one finished trajectory in its prompt's tree and the global tree; O(depth)."""
        _check_finished(finished)
        self.recent.append(finished)
        self._add(finished)

    def _add(self, finished: FinishedTrajectory) -> None:
        keys = _keys(finished.states, finished.keys)
        tree = self.prompt_trees.get(finished.prompt_id)
        if tree is None:
            tree = self._prompt_tree(finished.prompt_id)
        tree.observe_keys(keys, finished.remaining_after)
        self.global_tree.observe_keys(keys, finished.remaining_after)

    def match(self, prompt_id: str, states: Sequence[ToolState]) -> Match | None:
        """The node to route on. Rule: the prompt's own tree answers with its deepest
        trusted node (samples of the same prompt are the closest evidence), unless the
        global tree has a trusted node strictly deeper on the path (a longer causal
        context beats prompt identity); None when neither tree has a trusted node."""
        stats, source, depth = self.find(prompt_id, states)
        return None if stats is None else Match(stats, source, depth)

    def find(self, prompt_id: str, states: Sequence[ToolState],
             keys: tuple[str, ...] = ()) -> tuple[NodeStats | None, str, int]:
        """:meth:`match` as a plain tuple, ``(None, "", 0)`` when no node is trusted (the
        router's call on every decision: compiled, nothing is allocated). ``keys``: the
        states' tree keys if the caller has them (:attr:`TrajectoryView.keys`)."""
        keys = _keys(tuple(states), keys)
        tree = self.prompt_trees.get(prompt_id)
        own, own_depth = tree.deepest(keys, self.min_samples) if tree is not None else (None, 0)
        shared, shared_depth = self.global_tree.deepest(keys, self.min_samples)
        if own is not None and (shared is None or own_depth >= shared_depth):
            return own, "prompt", own_depth
        if shared is not None:
            return shared, "global", shared_depth
        return None, "", 0

    def lookup(self, prompt_id: str, states: Sequence[ToolState]) -> tuple[NodeStats, str] | None:
        """(statistics, ``"prompt"`` or ``"global"``) by the rule of :meth:`match`."""
        found = self.match(prompt_id, states)
        return (found.stats, found.source) if found else None

    def _prompt_tree(self, prompt_id: str) -> CausalTree:
        """A new tree for ``prompt_id``, holding what the last rebuild deferred for it."""
        tree = self.prompt_trees[prompt_id] = CausalTree(self.window)
        for finished in self._deferred.pop(prompt_id, ()):
            tree.observe_keys(_keys(finished.states, finished.keys), finished.remaining_after)
        return tree

    def rebuild(self) -> None:
        """Re-create every tree from the retained window of finished trajectories only.

        A prompt with fewer retained trajectories than ``min_samples`` gets no tree now:
        none of its nodes could be trusted, so :meth:`match` would ignore it. Its
        trajectories are kept aside and replayed into its tree when the prompt finishes
        another trajectory (or when the index is saved), so every tree ends up exactly
        as a full rebuild makes it, and the rebuild pays only for prompts that matter.
        Most prompts of an RL run are sampled in one step and never again."""
        started = time.perf_counter()
        with _gc_paused():
            self.prompt_trees, self._deferred = {}, {}
            self.global_tree = CausalTree(self.window)
            counts: dict[str, int] = {}
            for finished in self.recent:
                counts[finished.prompt_id] = counts.get(finished.prompt_id, 0) + 1
            for finished in self.recent:
                self.global_tree.observe_keys(_keys(finished.states, finished.keys), finished.remaining_after)
                if counts[finished.prompt_id] >= self.min_samples:
                    tree = self.prompt_trees.get(finished.prompt_id) or self._prompt_tree(finished.prompt_id)
                    tree.observe_keys(_keys(finished.states, finished.keys), finished.remaining_after)
                else:
                    self._deferred.setdefault(finished.prompt_id, []).append(finished)
        logger.info("rebuilt causal trees of %d prompts from %d finished trajectories in %.3f s",
                    len(self.prompt_trees), len(self.recent), time.perf_counter() - started)

    def to_json(self) -> dict:
        """Everything needed to resume: parameters, trees and the retained trajectories."""
        for prompt_id in list(self._deferred):
            self._prompt_tree(prompt_id)
        return {
            "format": FORMAT, "version": VERSION, "window": self.window,
            "min_samples": self.min_samples, "retain": self.retain,
            "global": self.global_tree.to_json(),
            "prompts": {pid: tree.to_json() for pid, tree in self.prompt_trees.items()},
            "recent": [_finished_to_json(f) for f in self.recent],
        }

    @classmethod
    def from_json(cls, data: object) -> CausalIndex:
        """Inverse of :meth:`to_json`; CausalTreeFormatError names the bad field."""
        with _gc_paused():
            return cls._from_json(data)

    @classmethod
    def _from_json(cls, raw: object) -> CausalIndex:
        data = _expect(raw, dict, "index")
        if data.get("format") != FORMAT or data.get("version") != VERSION:
            raise CausalTreeFormatError(
                f"not a causal index: format={data.get('format')!r} version={data.get('version')!r}, "
                f"expected format={FORMAT!r} version={VERSION}")
        try:
            index = cls(_int(data.get("window"), "window", 1), _int(data.get("min_samples"), "min_samples", 1),
                        _int(data.get("retain"), "retain", 1))
        except CausalTreeFormatError:
            raise
        except ValueError as error:
            raise CausalTreeFormatError(str(error)) from error
        index.global_tree = CausalTree.from_json(data.get("global"), index.window, "global")
        prompts = _expect(data.get("prompts"), dict, "prompts")
        index.prompt_trees = {str(pid): CausalTree.from_json(tree, index.window, f"prompts[{pid!r}]")
                              for pid, tree in prompts.items()}
        recent = _expect(data.get("recent"), list, "recent")
        if len(recent) > index.retain:
            raise CausalTreeFormatError(f"recent: {len(recent)} trajectories, more than retain={index.retain}")
        index.recent.extend(_finished_from_json(item, f"recent[{i}]") for i, item in enumerate(recent))
        return index

    def save(self, path: str | os.PathLike) -> None:
        """Write :meth:`to_json` atomically: a temporary file in the same folder, then
        ``os.replace``, so a reader never sees a half-written file."""
        path = Path(path)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w") as handle:
                json.dump(self.to_json(), handle, separators=(",", ":"))
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        logger.debug("saved causal index to %s", path)

    @classmethod
    def load(cls, path: str | os.PathLike) -> CausalIndex:
        """Read a file written by :meth:`save`; CausalTreeFormatError names the file."""
        text = Path(path).read_text()
        try:
            return cls.from_json(json.loads(text))
        except json.JSONDecodeError as error:
            raise CausalTreeFormatError(f"{path}: not valid JSON: {error}") from error
        except RecursionError:
            raise CausalTreeFormatError(f"{path}: nested too deep to be a causal index "
                                        f"(trees stop at MAX_DEPTH={MAX_DEPTH})") from None
        except CausalTreeFormatError as error:
            raise CausalTreeFormatError(f"{path}: {error}") from error


@contextmanager
def _gc_paused() -> Iterator[None]:
    """Pause the cyclic garbage collector while building trees: a rebuild allocates
    several container objects per node and no reference cycles, and the collections its
    allocations would trigger cost more than the rebuild itself (measured 3x)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


# --- JSON helpers -------------------------------------------------------------------


def _expect(value: object, kind: type[_T], where: str) -> _T:
    if not isinstance(value, kind):
        raise CausalTreeFormatError(f"{where}: expected a JSON {kind.__name__}, found {type(value).__name__}")
    return value


def _int(value: object, where: str, minimum: int = 0) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not minimum <= value <= MAX_SAMPLE:
        raise CausalTreeFormatError(f"{where}: expected an integer between {minimum} and {MAX_SAMPLE}, "
                                    f"found {value!r}")
    return value


def _check_key(key: str, where: str) -> None:
    parts = key.split("|")
    if len(parts) != 3 or not parts[0] or not parts[1] or parts[2] not in STATUSES:
        raise CausalTreeFormatError(f"{where}: child key {key!r} is not 'tool|size|status' "
                                    f"with status one of {STATUSES}")


def _node_to_json(node: _Node) -> dict:
    return {"count": node.count, "samples": list(node.samples),
            "children": {key: _node_to_json(child) for key, child in (node.children or {}).items()}}


def _node_from_json(raw: object, window: int, where: str, depth: int = 0) -> _Node:
    data = _expect(raw, dict, where)
    if depth > MAX_DEPTH:
        raise CausalTreeFormatError(f"{where}: deeper than MAX_DEPTH={MAX_DEPTH} tool returns")
    node = _Node(window)
    samples = [_int(s, f"{where}.samples[{i}]") for i, s in enumerate(_expect(data.get("samples"), list, f"{where}.samples"))]
    count = _int(data.get("count"), f"{where}.count")
    if len(samples) > window or count < len(samples):
        raise CausalTreeFormatError(f"{where}: {len(samples)} samples with count={count} and window={window}; "
                                    "expected len(samples) <= min(count, window)")
    for sample in samples:
        node.add(sample)
    node.count = count
    for key, child in _expect(data.get("children"), dict, f"{where}.children").items():
        _check_key(key, f"{where}.children")
        if node.children is None:
            node.children = {}
        node.children[key] = _node_from_json(child, window, f"{where}.children[{key!r}]", depth + 1)
    return node


def _check_finished(finished: FinishedTrajectory) -> None:
    if finished.keys and len(finished.keys) != len(finished.states):
        raise ValueError(f"finished trajectory of prompt {finished.prompt_id!r}: {len(finished.keys)} tree keys for "
                         f"{len(finished.states)} tool returns; give one per state, or none")
    if len(finished.remaining_after) != len(finished.states) + 1:
        raise ValueError(f"finished trajectory of prompt {finished.prompt_id!r}: remaining_after has "
                         f"{len(finished.remaining_after)} entries for {len(finished.states)} tool returns; "
                         f"expected {len(finished.states) + 1}")
    for remaining in finished.remaining_after:  # a loop: it compiles to native comparisons
        if not 0 <= remaining <= MAX_SAMPLE:
            raise ValueError(f"finished trajectory of prompt {finished.prompt_id!r}: remaining tokens "
                             f"{finished.remaining_after} must lie between 0 and {MAX_SAMPLE}")


def _finished_to_json(finished: FinishedTrajectory) -> dict:
    return {"prompt_id": finished.prompt_id, "states": [[s.tool, s.size, s.status] for s in finished.states],
            "remaining_after": list(finished.remaining_after)}


def _finished_from_json(raw: object, where: str) -> FinishedTrajectory:
    data = _expect(raw, dict, where)
    prompt_id = _expect(data.get("prompt_id"), str, f"{where}.prompt_id")
    states = []
    for i, raw_item in enumerate(_expect(data.get("states"), list, f"{where}.states")):
        item = _expect(raw_item, list, f"{where}.states[{i}]")
        if len(item) != 3 or not all(isinstance(x, str) for x in item) or item[2] not in STATUSES:
            raise CausalTreeFormatError(f"{where}.states[{i}]: expected [tool, size, status] strings "
                                        f"with status one of {STATUSES}, found {item!r}")
        state = ToolState(*item)
        _check_key(state.key(), f"{where}.states[{i}]")  # a rebuild turns these into tree keys
        states.append(state)
    remaining = tuple(_int(x, f"{where}.remaining_after[{i}]")
                      for i, x in enumerate(_expect(data.get("remaining_after"), list, f"{where}.remaining_after")))
    finished = FinishedTrajectory(prompt_id, tuple(states), remaining)
    try:
        _check_finished(finished)
    except ValueError as error:
        raise CausalTreeFormatError(f"{where}: {error}") from error
    return finished
