"""Tail-decoupled (partial) rollout: which finished trajectories train the next step, and
when the step may start without waiting for the batch's slowest trajectories.

Whole-trajectory asynchronous RL trains step ``j`` on batch ``j`` once its *last*
trajectory is done, so the step waits for the longest chain of turns and tool calls of the
batch. With ``rl.partial_rollout`` the step trains on the first ``batch_size`` finished
trajectories that the staleness bound allows (oldest policy version first, so nothing
expires that could have trained), and the unfinished ones keep generating into later
steps. Three guards keep this honest:

- **Staleness.** A trajectory's lag is counted from the policy version of its oldest token
  (here: the version :meth:`TailDecoupler.started` is given); it trains step ``j`` only if
  ``j - version <= max_staleness``. A trajectory still running when the last step it could train starts
  is *expiring*: it is regenerated from its prompt (never dropped silently, never trained
  stale) and its tokens so far are counted as wasted.
- **A waste budget.** The step starts ahead of an expiring trajectory only if the tokens
  wasted so far plus its tokens stay within ``waste_budget`` of all generated tokens;
  otherwise the step waits for it as whole-trajectory rollout would.
- **Each trajectory is regenerated at most once.** A regenerated trajectory that would
  expire again is waited for: the long ones are trained, not traded for short ones, so
  the trained length distribution follows the generated one (the p90 ratio is reported).

Pure logic, the same in the simulator (libra_hpc/sim/controller.py) and the live job's
controller (libra_hpc/runtime/partial.py); the caller says when trajectories start, finish
and were aborted. Its unit is whatever key the caller tracks: a trajectory in the
simulator (started under the version it began with); in the job a GRPO group, which
trains whole (started under its version floor, finished when its last sample is, with the
tokens of all its samples), and ``batch_size`` is then groups per step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Decision:
    """What step ``step`` does now: train ``train`` (keys, oldest version first); abort
    ``regenerate`` (running, expiring) at their next turn boundary and restart them from
    their prompts; restart ``resubmit`` (finished, but too old for this step or any later
    one) now."""

    step: int
    train: tuple[Hashable, ...]
    regenerate: tuple[Hashable, ...]
    resubmit: tuple[Hashable, ...]
    max_lag: int


@dataclass
class PartialStats:
    """Counters for the step log and the report (per key: a trajectory, or a group's sum)."""

    generated_tokens: int = 0
    """Every decoded token, wasted ones included."""
    wasted_tokens: int = 0
    """Tokens of regenerated trajectories generated before they were aborted."""
    regenerated: int = 0
    trained_lengths: list[int] = field(default_factory=list)
    """Generated tokens of each trained key."""
    finished_lengths: list[int] = field(default_factory=list)
    """Generated tokens of each key that finished (trained or not)."""
    waits: int = 0
    """Times a step that had enough finished trajectories waited for an expiring one."""

    @property
    def wasted_share(self) -> float:
        return self.wasted_tokens / self.generated_tokens if self.generated_tokens else 0.0


def p90(values: list[int]) -> float:
    """The 90th percentile (nearest rank); 0 for no values."""
    if not values:
        return 0.0
    s = sorted(values)
    return float(s[max(0, math.ceil(0.9 * len(s)) - 1)])


class TailDecoupler:
    """Bookkeeping of the trajectories in flight and finished, and the start rule of each
    training step (module docstring)."""

    def __init__(self, batch_size: int, max_staleness: int, waste_budget: float = 0.05):
        if batch_size < 1 or max_staleness < 0 or not 0 <= waste_budget < 1:
            raise ValueError(f"need batch_size >= 1, max_staleness >= 0, 0 <= waste_budget < 1; got "
                             f"{batch_size}, {max_staleness}, {waste_budget}")
        self.batch_size, self.k, self.budget = batch_size, max_staleness, waste_budget
        self.running: dict[Hashable, int] = {}  # key -> version it started under
        self.finished: dict[Hashable, tuple[int, int, float]] = {}  # key -> (version, tokens, finished at)
        self.regenerated: set[Hashable] = set()
        self.stats = PartialStats()

    def started(self, key: Hashable, version: int) -> None:
        """``key`` starts generating under policy ``version`` (again, when regenerated)."""
        if key in self.running or key in self.finished:
            raise ValueError(f"trajectory {key!r} started twice")
        self.running[key] = version

    def generated(self, tokens: int) -> None:
        """``tokens`` more tokens were decoded (by any trajectory)."""
        self.stats.generated_tokens += tokens

    def finish(self, key: Hashable, tokens: int, now: float) -> None:
        """``key`` finished with ``tokens`` generated tokens."""
        version = self.running.pop(key)
        self.finished[key] = (version, tokens, now)
        self.stats.finished_lengths.append(tokens)

    def aborted(self, key: Hashable, tokens_so_far: int) -> None:
        """``key`` (asked for in a :class:`Decision`) stopped after ``tokens_so_far``
        tokens; it is not running any more until :meth:`started` again."""
        self.running.pop(key, None)
        self.stats.wasted_tokens += tokens_so_far
        self.stats.regenerated += 1

    def decide(self, step: int, tokens_so_far: Callable[[Hashable], int]) -> Decision | None:
        """May training step ``step`` start now, and on what? None: wait (fewer than
        ``batch_size`` trajectories may train it, or an expiring one must be waited for).
        ``tokens_so_far(key)``: tokens a running trajectory will have generated when it can
        be stopped (the end of its current turn)."""
        eligible = sorted((v, t, key) for key, (v, _, t) in self.finished.items() if step - v <= self.k)
        if len(eligible) < self.batch_size:
            return None
        expiring = [key for key, v in self.running.items() if step - v >= self.k]
        if expiring:
            if any(key in self.regenerated for key in expiring):
                self.stats.waits += 1
                return None
            cost = sum(tokens_so_far(key) for key in expiring)
            if self.stats.wasted_tokens + cost > self.budget * max(1, self.stats.generated_tokens):
                self.stats.waits += 1
                return None
        chosen = eligible[: self.batch_size]
        for _, _, key in chosen:
            self.stats.trained_lengths.append(self.finished.pop(key)[1])
        # Finished but too old for this step or any later one (more of one version finished
        # than the steps it could train took): regenerated, their tokens wasted.
        old = [key for key, (v, _, _) in self.finished.items() if step - v > self.k]
        for key in old:
            self.stats.wasted_tokens += self.finished.pop(key)[1]
            self.stats.regenerated += 1
        self.regenerated.update(expiring)
        self.regenerated.update(old)
        return Decision(step, tuple(key for _, _, key in chosen), tuple(expiring), tuple(old),
                        max(step - v for v, _, _ in chosen))
