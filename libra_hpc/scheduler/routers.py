"""Routing policies behind the :class:`~libra_hpc.scheduler.types.Router` protocol.

Buckets are the MLFQ levels, sorted by ``token_limit`` ascending: level 0 (top) takes the
shortest remaining work. Every policy is registered by name (``SchedulerConfig.policy``):

- ``cmlfq``: :class:`CmlfqRouter`, the paper's causal multi-level feedback queue.
- ``fifo``: :class:`FifoRouter`, round-robin, never changes a trajectory's bucket.
- ``least_load``: :class:`LeastLoadRouter`, least outstanding work over one pool.
- ``length_aware``: :class:`LengthAwareRouter`, a noisy length predictor.
- ``oracle``: :class:`OracleRouter`, the true remaining length (a bound).

All share the load accounting (:meth:`RouterBase.turn_started` / ``turn_ended``: the
expected tokens of the turns queued on or running on each instance), the silent
instances they skip (:meth:`RouterBase.set_down`) and the counters ``decisions``,
``migrations`` (the bucket changed: the KV cache is recomputed at the destination) and
``fallbacks`` (the chosen bucket had no unsaturated instance, a neighbour took the turn).

Instance choice inside a bucket: the instance the trajectory's previous turn ran on (its
KV prefix is cached there, so the turn prefills only the tool output) while it is live,
unsaturated and has at most ``affinity_tokens`` more outstanding work than the least loaded
one; otherwise the least outstanding work among unsaturated instances, ties to the instance
listed first. FIFO keeps its round-robin. Fallback order from level ``l``: ``l+1, l-1, l+2,
l-2, ...`` (a longer level first: it can finish the work, a shorter one may cut it). When
every instance everywhere is saturated, the turn still has to run: it goes to the least
loaded instance of the first non-empty bucket in that order, saturation ignored.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
import math
import random
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from libra_hpc.scheduler.tree import MAX_DEPTH, CausalIndex
from libra_hpc.scheduler.types import (
    BucketSpec,
    FinishedTrajectory,
    Placement,
    Router,
    ToolState,
    TrajectoryView,
    new_tuple,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouterOptions:
    """Every policy's knobs, so one factory builds any of them (each uses what it needs).

    ``window``: samples per causal-tree node. ``min_samples``: samples before a node is
    trusted. ``rebuild_every``: finished trajectories between tree rebuilds.
    ``predictor_noise``: sigma of the length_aware predictor's log-normal error.
    ``seed``: the only source of randomness."""

    window: int = 256
    min_samples: int = 8
    rebuild_every: int = 1000
    predictor_noise: float = 0.5
    seed: int = 0
    affinity_tokens: int = 0
    """Extra outstanding tokens a turn accepts to stay on the instance holding its KV
    prefix (0: always the least loaded)."""
    self_check: int = 0
    """cmlfq: decisions it scores itself on against the top level (0: off; see
    :class:`CmlfqRouter`)."""


ROUTERS: dict[str, type[RouterBase]] = {}


def register(cls: type[RouterBase]) -> type[RouterBase]:
    """Make a policy available to :func:`make_router` under its class attribute ``name``.
    (Called after the class, not as a decorator: a decorated class cannot be compiled to
    a native class, see libra_hpc/_compiled.py.)"""
    if cls.name in ROUTERS:
        raise ValueError(f"router name {cls.name!r} is already registered by {ROUTERS[cls.name].__name__}")
    ROUTERS[cls.name] = cls
    return cls


def validate_buckets(buckets: Sequence[BucketSpec]) -> tuple[BucketSpec, ...]:
    """The buckets sorted by ``token_limit`` (the MLFQ levels), after checking unique
    names, distinct positive limits, instance ids unique across buckets and at least one
    instance overall; ValueError names the offending bucket or instance."""
    names: set[str] = set()
    owner: dict[int, str] = {}
    for bucket in buckets:
        if bucket.name in names:
            raise ValueError(f"bucket name {bucket.name!r} appears twice; bucket names must be unique")
        names.add(bucket.name)
        if bucket.token_limit <= 0 or bucket.max_outstanding_tokens <= 0:
            raise ValueError(f"bucket {bucket.name!r}: token_limit={bucket.token_limit} and max_outstanding_tokens="
                             f"{bucket.max_outstanding_tokens} must be positive token counts")
        for instance in bucket.instances:
            if instance in owner:
                raise ValueError(f"instance {instance} is in both bucket {owner[instance]!r} and {bucket.name!r}; "
                                 "an instance belongs to exactly one bucket")
            owner[instance] = bucket.name
    if not owner:
        raise ValueError(f"no rollout instance in any bucket ({[b.name for b in buckets]}); a router needs at least one")
    ordered = tuple(sorted(buckets, key=lambda b: b.token_limit))
    for lower, upper in itertools.pairwise(ordered):
        if lower.token_limit == upper.token_limit:
            raise ValueError(f"buckets {lower.name!r} and {upper.name!r} share token_limit={lower.token_limit}; "
                             "MLFQ levels need distinct limits")
    return ordered


def outward_order(level: int, levels: int) -> tuple[int, ...]:
    """``level`` then its neighbours outward, the longer (higher index) one first."""
    order = [level]
    for step in range(1, levels):
        order.extend(x for x in (level + step, level - step) if 0 <= x < levels)
    return tuple(order)


class RouterBase:
    """Buckets, levels, per-instance outstanding work and the counters every policy shares."""

    name: ClassVar[str] = "base"

    def __init__(self, buckets: Sequence[BucketSpec], *, affinity_tokens: int = 0):
        if affinity_tokens < 0:
            raise ValueError(f"affinity_tokens={affinity_tokens} must be >= 0 outstanding tokens")
        self.buckets = validate_buckets(buckets)
        self.affinity_tokens = affinity_tokens
        self.level_of = {bucket.name: level for level, bucket in enumerate(self.buckets)}
        self._level_of_instance = {i: level for level, bucket in enumerate(self.buckets) for i in bucket.instances}
        self.limits = [float(bucket.token_limit) for bucket in self.buckets]  # by level; compared with token estimates
        self.outstanding = {instance: 0 for bucket in self.buckets for instance in bucket.instances}
        self._order = [outward_order(level, len(self.buckets)) for level in range(len(self.buckets))]
        self.down: set[int] = set()  # silent instances (see set_down)
        self.decisions = self.migrations = self.fallbacks = 0

    @classmethod
    def build(cls, buckets: Sequence[BucketSpec], options: RouterOptions) -> RouterBase:
        """Construct from the shared options (what :func:`make_router` calls)."""
        return cls(buckets, affinity_tokens=options.affinity_tokens)

    def place(self, view: TrajectoryView) -> Placement:
        """Where the trajectory's next turn runs (each policy's own rule)."""
        raise NotImplementedError

    # --- load accounting ---
    def turn_started(self, instance: int, expected_tokens: int) -> None:
        """A turn of ``expected_tokens`` now waits on or runs on ``instance``."""
        load = self.outstanding.get(instance)
        if load is None or expected_tokens < 0:
            raise self._invalid(instance, expected_tokens)
        self.outstanding[instance] = load + expected_tokens

    def turn_ended(self, instance: int, expected_tokens: int) -> None:
        """That turn left ``instance`` (done, expired, taken by a sibling, instance
        silent); pass the same tokens."""
        load = self.outstanding.get(instance)
        if load is None or expected_tokens < 0:
            raise self._invalid(instance, expected_tokens)
        if load < expected_tokens:
            raise ValueError(f"instance {instance}: turn_ended({expected_tokens}) with only "
                             f"{load} outstanding tokens; was the turn ended twice?")
        self.outstanding[instance] = load - expected_tokens

    def _invalid(self, instance: int, expected_tokens: int) -> Exception:
        """The error for an unknown ``instance`` or negative ``expected_tokens``."""
        if instance not in self.outstanding:
            return KeyError(f"unknown rollout instance {instance}; this router's instances are {sorted(self.outstanding)}")
        return ValueError(f"instance {instance}: expected_tokens={expected_tokens} must be >= 0")

    def set_down(self, instance: int, down: bool) -> None:
        """Mark ``instance`` silent (``down``: its lease expired without a renewal, the
        engine may be dead) or back (it asked or sent a heartbeat). Placements skip silent
        instances while any other instance can take the turn."""
        if instance not in self.outstanding:
            raise self._invalid(instance, 0)
        if down:
            self.down.add(instance)
        else:
            self.down.discard(instance)

    def observe(self, finished: FinishedTrajectory) -> None:
        """Baselines learn nothing from finished trajectories."""

    def counters(self) -> dict[str, int]:
        return {"decisions": self.decisions, "migrations": self.migrations, "fallbacks": self.fallbacks}

    # --- shared placement rules ---
    def level_for(self, tokens: float) -> int:
        """The level whose token_limit is the smallest >= ``tokens`` (beyond all: the last).
        A scan: there are a handful of levels, and it compiles to native comparisons."""
        last = len(self.limits) - 1
        for level in range(last):
            if self.limits[level] >= tokens:
                return level
        return last

    def least_loaded(self, level: int, respect_saturation: bool = True, skip_down: bool = True) -> int | None:
        """The instance of ``level`` with the least outstanding work (first listed on ties);
        None when the bucket is empty, or every instance is saturated or silent."""
        bucket = self.buckets[level]
        best, best_load = None, bucket.max_outstanding_tokens if respect_saturation else math.inf
        outstanding, down = self.outstanding, self.down if skip_down else ()
        for instance in bucket.instances:
            load = outstanding[instance]
            if load < best_load and instance not in down:
                best, best_load = instance, load
        return best

    def in_bucket(self, view: TrajectoryView, level: int, respect_saturation: bool = True) -> int | None:
        """The instance of ``level`` for the trajectory's turn: where its KV prefix is, by
        the affinity rule (module docstring), else :meth:`least_loaded`."""
        best = self.least_loaded(level, respect_saturation)
        prev = view.instance
        if best is None or prev is None or prev == best or not self.affinity_tokens \
                or self._level_of_instance.get(prev) != level or prev in self.down:
            return best
        load = self.outstanding[prev]
        if load - self.outstanding[best] <= self.affinity_tokens and \
                (not respect_saturation or load < self.buckets[level].max_outstanding_tokens):
            return prev
        return best

    def place_near(self, view: TrajectoryView, level: int) -> tuple[int, int]:
        """(level, instance) for a turn meant for ``level``, by the fallback rule (the
        affinity rule inside each bucket tried)."""
        for candidate in self._order[level]:
            instance = self.in_bucket(view, candidate)
            if instance is not None:
                return candidate, instance
        for candidate in self._order[level]:  # every instance saturated
            instance = self.in_bucket(view, candidate, respect_saturation=False)
            if instance is not None:
                return candidate, instance
        for candidate in self._order[level]:  # every instance silent too
            instance = self.least_loaded(candidate, respect_saturation=False, skip_down=False)
            if instance is not None:
                return candidate, instance
        raise AssertionError("validate_buckets guarantees an instance")  # pragma: no cover

    def placement(self, view: TrajectoryView, target: int, reason: str) -> Placement:
        """Place near ``target`` and count the decision, fallback and migration."""
        instance = self.in_bucket(view, target)
        level = target
        if instance is None:
            level, instance = self.place_near(view, target)
        if level != target:
            self.fallbacks += 1
            reason = f"{reason}; fell back from {self.buckets[target].name}"
        return self.record(view, level, instance, reason)

    def record(self, view: TrajectoryView, level: int, instance: int, reason: str) -> Placement:
        """The Placement of a decision, counted (a migration when the bucket changed)."""
        self.decisions += 1
        bucket = self.buckets[level].name
        migrated = view.bucket is not None and view.bucket != bucket
        if migrated:
            self.migrations += 1
        return new_tuple(Placement, (bucket, instance, migrated, reason))


class CmlfqRouter(RouterBase):
    """Causal MLFQ: start at the top level; after each tool return, look the trajectory's
    tool-return sequence up in the causal index (per-prompt tree, global fallback) and map
    the node's remaining-token mean and p90 to levels; move the next turn only when both
    map to the same level and it differs from the current one (up or down). No length
    predictor. The trees are rebuilt from the recent window every ``rebuild_every``
    finished trajectories.

    Self-check (``self_check`` > 0 decisions): before a finished trajectory is learnt, its
    turns are replayed through the verdicts the current index gives (prequential: never
    scored on what it learnt from it), and each decision after a tool return is scored
    against the level its true remaining length maps to, beside the level the trivial
    policy keeps (the top). Over the last ``self_check`` decisions, once a quarter of them
    are in, the router sends every turn to the top level (:attr:`falling_back`) unless the
    causal verdicts are right more often by a clear margin: more than two standard
    deviations of an even split of the decisions where exactly one of the two is right. A
    move costs a re-prefill; a tie is not worth it."""

    name: ClassVar[str] = "cmlfq"

    def __init__(self, buckets: Sequence[BucketSpec], *, window: int = 256, min_samples: int = 8,
                 rebuild_every: int = 1000, retain: int | None = None, affinity_tokens: int = 0,
                 self_check: int = 0):
        super().__init__(buckets, affinity_tokens=affinity_tokens)
        if rebuild_every < 1:
            raise ValueError(f"rebuild_every={rebuild_every} finished trajectories must be >= 1")
        if self_check < 0:
            raise ValueError(f"self_check={self_check} decisions must be >= 0 (0: off)")
        self.rebuild_every = rebuild_every
        self.index = CausalIndex(window, min_samples, retain or max(rebuild_every, window))
        self.observed = 0
        self.rebuilt_at = 0  # value of `observed` at the last rebuild
        self._reasons: dict[str, dict[str, list[str]]] = {}  # see _why()
        self.self_check = self_check
        self._scores: deque[int] = deque()  # per scored decision: bit 0 causal right, bit 1 top level right
        self.causal_right = self.top_right = 0
        self.disagree = 0  # scored decisions where exactly one of the two was right
        self.falling_back = False

    @classmethod
    def build(cls, buckets: Sequence[BucketSpec], options: RouterOptions) -> CmlfqRouter:
        return cls(buckets, window=options.window, min_samples=options.min_samples,
                   rebuild_every=options.rebuild_every, affinity_tokens=options.affinity_tokens,
                   self_check=options.self_check)

    def place(self, view: TrajectoryView) -> Placement:
        current = self.level_of.get(view.bucket) if view.bucket is not None else None
        if current is None:  # new, or its bucket left the layout: start at the top
            return self.placement(view, 0, "new" if view.bucket is None else f"bucket {view.bucket!r} gone")
        states = view.states
        if not states:
            return self.placement(view, current, "no tool return")
        if self.falling_back:
            return self.placement(view, 0, "self-check: the top level scores better")
        level, reason = self.verdict(view.prompt_id, states, view.keys, view.turn_tokens, current)
        return self.placement(view, level, reason)

    def verdict(self, prompt_id: str, states: Sequence[ToolState], keys: tuple[str, ...],
                turn_tokens: Sequence[int], current: int) -> tuple[int, str]:
        """The causal verdict for the next turn of a trajectory on level ``current`` after
        ``states`` (``turn_tokens``: its turns' output tokens so far): (level, reason)."""
        stats, source, depth = self.index.find(prompt_id, states, keys)
        if stats is None:
            return current, "no trusted node"
        # A shallower node describes what remained back at its tool return; condition it
        # on the tokens generated since (samples that lasted longer, minus those tokens).
        estimate = stats.beyond(sum(turn_tokens[depth:]) if depth < len(states) else 0)
        if estimate is None:
            return current, self._why("outlived every sample", source, depth)
        by_mean, by_p90 = self.level_for(estimate[0]), self.level_for(estimate[1])
        if by_mean != by_p90:
            return current, self._why("mean/p90 disagree", source, depth)
        if by_mean == current:
            return current, self._why("stay", source, depth)
        return by_mean, self._why("move", source, depth)

    def _why(self, verdict: str, source: str, depth: int) -> str:
        """The reason ``f"{verdict} ({source} depth {depth})"``, one shared string per value
        (built once; the service sends it back with every placement, and a string that
        recurs in a message is pickled once)."""
        by_source = self._reasons.get(verdict)
        if by_source is None:
            by_source = self._reasons[verdict] = {}
        by_depth = by_source.get(source)
        if by_depth is None:
            by_depth = by_source[source] = [f"{verdict} ({source} depth {d})" for d in range(MAX_DEPTH + 1)]
        return by_depth[depth]

    def observe(self, finished: FinishedTrajectory) -> None:
        """Score the verdicts it would have got (the self-check), then learn it
        incrementally (O(depth)). A rebuild falls due every ``rebuild_every``
        observations; it runs in :meth:`maintain`, off the request path."""
        if self.self_check:
            self._score(finished)
        self.index.observe(finished)
        self.observed += 1

    def _score(self, finished: FinishedTrajectory) -> None:
        remaining = finished.remaining_after
        states = finished.states
        turns = [remaining[i] - remaining[i + 1] for i in range(len(remaining) - 1)]
        level = 0
        for d in range(1, min(len(remaining), len(states) + 1)):
            level = self.verdict(finished.prompt_id, states[:d], finished.keys[:d], turns[:d], level)[0]
            truth = self.level_for(remaining[d])
            score = (1 if level == truth else 0) | (2 if truth == 0 else 0)
            self._scores.append(score)
            self.causal_right += score & 1
            self.top_right += score >> 1
            self.disagree += 1 if score == 1 or score == 2 else 0
            if len(self._scores) > self.self_check:
                old = self._scores.popleft()
                self.causal_right -= old & 1
                self.top_right -= old >> 1
                self.disagree -= 1 if old == 1 or old == 2 else 0
        if 4 * len(self._scores) >= self.self_check:
            # Where exactly one of the two is right, equal skill would split those
            # decisions evenly: keep the causal verdicts only when they win by more than
            # two standard deviations of that split (a tie or noise goes to the top level,
            # which migrates nothing).
            self.falling_back = self.causal_right - self.top_right <= 2.0 * math.sqrt(self.disagree)

    def counters(self) -> dict[str, int]:
        out = super().counters()
        out["self_check_scored"] = len(self._scores)
        out["self_check_causal_right"] = self.causal_right
        out["self_check_top_right"] = self.top_right
        out["falling_back"] = int(self.falling_back)
        return out

    def maintain(self, *, busy: bool = False) -> bool:
        """Periodic work the service runs between requests: rebuild the trees from the
        recent window when due. ``busy`` (no idle moment came): rebuild only once a
        second period is overdue, so drift is still followed under constant load.
        Returns whether it rebuilt."""
        overdue = self.observed - self.rebuilt_at >= (2 if busy else 1) * self.rebuild_every
        if not overdue:
            return False
        self.index.rebuild()
        self.rebuilt_at = self.observed
        return True

    def state_dict(self) -> dict:
        """The causal index as JSON (for the service's periodic save)."""
        return self.index.to_json()

    def load_state_dict(self, state: dict) -> None:
        """Resume from :meth:`state_dict`. A saved index with another window or retention
        than configured is rebuilt, with the configured ones, from its retained
        trajectories (the configuration wins)."""
        loaded = CausalIndex.from_json(state)
        loaded.min_samples = self.index.min_samples
        if (loaded.window, loaded.retain) != (self.index.window, self.index.retain):
            logger.info("saved causal index has window %d and retain %d, configured %d and %d: rebuilding",
                        loaded.window, loaded.retain, self.index.window, self.index.retain)
            fresh = CausalIndex(self.index.window, self.index.min_samples, self.index.retain)
            fresh.recent.extend(loaded.recent)
            fresh.rebuild()
            loaded = fresh
        self.index = loaded


class FifoRouter(RouterBase):
    """Round-robin: a new trajectory takes the next instance over all buckets in level
    order; later turns take the next instance of the trajectory's bucket. Load-blind and
    never changes a trajectory's bucket (unless that bucket left the layout or all its
    instances are silent: then the next live instance over all). Silent instances are
    skipped while any instance is live."""

    name: ClassVar[str] = "fifo"

    def __init__(self, buckets: Sequence[BucketSpec], *, affinity_tokens: int = 0):
        super().__init__(buckets)  # round-robin: no affinity
        self._all = [(level, i) for level, b in enumerate(self.buckets) for i in b.instances]
        self._next_all = 0
        self._next_in: dict[int, int] = defaultdict(int)

    def place(self, view: TrajectoryView) -> Placement:
        current = self.level_of.get(view.bucket) if view.bucket is not None else None
        if current is not None:
            instances = self.buckets[current].instances
            for _ in range(len(instances)):
                instance = instances[self._next_in[current] % len(instances)]
                self._next_in[current] += 1
                if instance not in self.down:
                    return self.record(view, current, instance, "round-robin in bucket")
        level, instance = self._all[0]
        for _ in range(len(self._all)):
            level, instance = self._all[self._next_all % len(self._all)]
            self._next_all += 1
            if instance not in self.down:
                break  # else every instance is silent: the turn waits on the next one
        return self.record(view, level, instance, "round-robin over all")


class LeastLoadRouter(RouterBase):
    """One homogeneous pool: a new trajectory takes the instance with the least outstanding
    work over all buckets; later turns the least loaded instance of its own bucket (never
    migrates unless that bucket left the layout or all its instances are silent).
    Saturation only breaks ties in favour of unsaturated instances: the pool has nowhere
    else to send work; silent instances come last."""

    name: ClassVar[str] = "least_load"

    def place(self, view: TrajectoryView) -> Placement:
        current = self.level_of.get(view.bucket) if view.bucket is not None else None
        if current is None:
            candidates = [(i in self.down, self._saturated(i, b), self.outstanding[i], lv, i)
                          for lv, b in enumerate(self.buckets) for i in b.instances]
            _, _, _, level, instance = min(candidates, key=lambda c: c[:3])
            return self.record(view, level, instance, "least load")
        found = self.in_bucket(view, current)
        if found is None:  # all saturated: stay anyway
            found = self.in_bucket(view, current, respect_saturation=False)
        if found is None:  # its bucket has no instance left
            level, instance = self.place_near(view, current)
            return self.record(view, level, instance, "least load")
        return self.record(view, current, found, "least load")

    def _saturated(self, instance: int, bucket: BucketSpec) -> bool:
        return self.outstanding[instance] >= bucket.max_outstanding_tokens


class _TrueLengthRouter(RouterBase):
    """Maps an estimate of ``view.true_remaining`` to a level at every turn, first included."""

    def estimate(self, true_remaining: int) -> float:
        raise NotImplementedError

    def place(self, view: TrajectoryView) -> Placement:
        if view.true_remaining is None:
            raise ValueError(f"{self.name} router needs view.true_remaining (trajectory {view.tid!r}); "
                             "it exists only in simulations and benchmarks")
        estimate = self.estimate(view.true_remaining)
        return self.placement(view, self.level_for(estimate), f"{self.name} estimate {estimate:.0f}")


class LengthAwareRouter(_TrueLengthRouter):
    """A length predictor: the true remaining length times ``exp(N(0, noise))``, drawn
    afresh at every decision from a seeded generator; the estimate's level, least load
    inside, neighbour fallback."""

    name: ClassVar[str] = "length_aware"

    def __init__(self, buckets: Sequence[BucketSpec], *, noise: float = 0.5, seed: int = 0, affinity_tokens: int = 0):
        super().__init__(buckets, affinity_tokens=affinity_tokens)
        if noise < 0:
            raise ValueError(f"predictor_noise={noise} must be >= 0 (sigma of a log-normal error)")
        self.noise = noise
        self.rng = random.Random(seed)

    @classmethod
    def build(cls, buckets: Sequence[BucketSpec], options: RouterOptions) -> LengthAwareRouter:
        return cls(buckets, noise=options.predictor_noise, seed=options.seed, affinity_tokens=options.affinity_tokens)

    def estimate(self, true_remaining: int) -> float:
        return true_remaining * math.exp(self.rng.gauss(0.0, self.noise)) if self.noise else float(true_remaining)


class OracleRouter(_TrueLengthRouter):
    """The level of the true remaining length, exactly (an upper bound for benchmarks)."""

    name: ClassVar[str] = "oracle"

    def estimate(self, true_remaining: int) -> float:
        return float(true_remaining)


for _policy in (CmlfqRouter, FifoRouter, LeastLoadRouter, LengthAwareRouter, OracleRouter):
    register(_policy)


def make_router(policy: str, buckets: Sequence[BucketSpec], *, window: int, min_samples: int,
                rebuild_every: int, predictor_noise: float = 0.5, seed: int = 0, affinity_tokens: int = 0,
                self_check: int = 0) -> Router:
    """The registered policy ``policy`` over ``buckets``; ValueError lists the names."""
    if policy not in ROUTERS:
        raise ValueError(f"unknown routing policy {policy!r}; registered policies: {sorted(ROUTERS)}")
    options = RouterOptions(window, min_samples, rebuild_every, predictor_noise, seed, affinity_tokens, self_check)
    return ROUTERS[policy].build(buckets, options)


def router_from_config(cfg, buckets: Sequence[BucketSpec], seed: int = 0) -> Router:
    """:func:`make_router` from a :class:`~libra_hpc.config.SchedulerConfig`."""
    return make_router(cfg.policy, buckets, window=cfg.tree_window, min_samples=cfg.min_samples,
                       rebuild_every=cfg.rebuild_every, predictor_noise=cfg.predictor_noise, seed=seed,
                       affinity_tokens=cfg.affinity_tokens, self_check=cfg.self_check)


def buckets_from_instances(instances: Sequence[tuple[int, int]], token_limits: dict[int, int]) -> list[BucketSpec]:
    """Group ``(instance_id, tp)`` pairs by TP into buckets ``tp{tp}`` with the configured
    token limit (``SchedulerConfig.bucket_token_limits``), sorted by limit; instances
    keep their given order inside a bucket."""
    by_tp: dict[int, list[int]] = defaultdict(list)
    seen: set[int] = set()
    for instance, tp in instances:
        if instance in seen:
            raise ValueError(f"rollout instance {instance} is listed twice")
        if tp not in token_limits:
            raise ValueError(f"rollout instance {instance} has TP={tp}, which has no token limit in "
                             f"scheduler.bucket_token_limits (configured TPs: {sorted(token_limits)})")
        seen.add(instance)
        by_tp[tp].append(instance)
    buckets = [BucketSpec(f"tp{tp}", tp, token_limits[tp], tuple(ids)) for tp, ids in by_tp.items()]
    return sorted(buckets, key=lambda b: b.token_limit)
