"""Context-length-aware parallelism (EARL): the TP size of a stage, chosen from the context
lengths it now runs and the time each TP size would take. Pure: no torch, no MPI, and no
import of the planner (the planner consults this module; the arrow points one way). A
table's rules are the config's (libra_hpc/config_checks.py), so a bad one fails at load.

What a TP size costs comes from one of two sources:

- **a cost model** (:func:`choose_by_cost`): the caller prices each candidate (predicted
  seconds, ``inf`` when it does not fit in memory) — the planner does it with its training
  cost model at the sequence length the batch can reach;
- **a measured table** (:class:`TpTable`): from a benchmark, the TP size to use from a
  context length on (EARL's TP4-against-TP8 speed-up crosses 1 as contexts grow). On CPU
  every measurement picks TP 1, so the job's CPU runs check the mechanism with a table
  given in the config (``parallel.training_tp_by_context``); GPU tables come from the
  hardware profiles.

Both go through :class:`TpSelector`, which keeps the stage from flapping: it moves to a
larger TP at once when the current one does not fit, otherwise only when the other size is
better by ``hysteresis`` (a share of the time, or of the context threshold on the way down)
for ``confirm`` checks in a row.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from libra_hpc.config_checks import tp_table_problem


@dataclass(frozen=True)
class TpChoice:
    """What one check found: the TP size it would use and why."""

    tp: int
    reason: str
    fits: bool = True
    """False when no candidate fits (``tp`` is then the largest)."""


def choose_by_cost(seconds: Mapping[int, float], current: int | None, hysteresis: float) -> TpChoice:
    """The TP size with the least predicted ``seconds`` (``inf``: does not fit); the current
    one is kept unless it does not fit or another beats it by more than ``hysteresis``."""
    if not seconds:
        raise ValueError("choose_by_cost: no candidate TP size")
    fitting = {tp: s for tp, s in seconds.items() if math.isfinite(s)}
    if not fitting:
        return TpChoice(max(seconds), f"no TP size of {sorted(seconds)} fits", fits=False)
    best = min(fitting, key=lambda tp: (fitting[tp], tp))
    if current is None:
        return TpChoice(best, f"TP{best}: {fitting[best]:.3g} s, the fastest that fits")
    if current not in fitting:
        return TpChoice(best, f"TP{current} does not fit; TP{best} does ({fitting[best]:.3g} s)")
    if best != current and fitting[best] < fitting[current] * (1.0 - hysteresis):
        return TpChoice(best, f"TP{best}: {fitting[best]:.3g} s against TP{current}'s {fitting[current]:.3g} s")
    return TpChoice(current, f"TP{current} stays ({fitting[current]:.3g} s)")


@dataclass(frozen=True)
class TpTable:
    """A measured table: from ``context_tokens`` on, use ``tp`` (rows sorted by context,
    TP sizes not decreasing). Written in YAML as ``{0: 1, 8192: 2, 32768: 4}``."""

    rows: tuple[tuple[int, int], ...]

    def __post_init__(self) -> None:
        problem = tp_table_problem(list(self.rows))
        if problem is not None:
            raise ValueError(f"TpTable: {problem}")

    @classmethod
    def from_mapping(cls, table: Mapping[int, int]) -> TpTable:
        return cls(tuple(sorted((int(c), int(tp)) for c, tp in table.items())))

    def tp_for(self, context_tokens: float) -> tuple[int, int]:
        """(TP size, the context its row starts at) for ``context_tokens``."""
        row = max((r for r in self.rows if r[0] <= context_tokens), key=lambda r: r[0])
        return row[1], row[0]

    def choose(self, context_tokens: float, current: int | None, hysteresis: float) -> TpChoice:
        """The table's TP for ``context_tokens``; a move down waits until the context is
        ``hysteresis`` below the threshold that took the stage up."""
        tp, start = self.tp_for(context_tokens)
        if current is not None and tp < current:
            up = min((c for c, t in self.rows if t > tp), default=None)
            if up is not None and context_tokens > up * (1.0 - hysteresis):
                return TpChoice(current, f"TP{current} stays: context {context_tokens:.0f} is within "
                                         f"{hysteresis:.0%} of {up}")
        if tp == current:
            return TpChoice(tp, f"TP{tp} stays: context {context_tokens:.0f} (table row from {start})")
        return TpChoice(tp, f"context {context_tokens:.0f} tokens: the table says TP{tp} from {start} on")


@dataclass
class TpSelector:
    """One stage's TP size over time: a change is proposed after ``confirm`` checks in a
    row agree on it (at once when the current size does not fit)."""

    current: int
    confirm: int = 2
    streak: list[int] = field(default_factory=list)

    def consider(self, choice: TpChoice, must: bool = False) -> TpChoice | None:
        """The change to make now, or None. ``must``: the current size cannot run the
        next batch (no confirmation waits for an out-of-memory crash)."""
        if choice.tp == self.current:
            self.streak.clear()
            return None
        self.streak = [*self.streak, choice.tp][-self.confirm:]
        if must or (len(self.streak) == self.confirm and len(set(self.streak)) == 1):
            self.streak.clear()
            return choice
        return None

    def applied(self, tp: int) -> None:
        self.current = tp
        self.streak.clear()


def context_percentile(lengths: Sequence[float], q: float = 0.9) -> float:
    """The ``q`` quantile of ``lengths`` (nearest rank); 0 for none. The selector reads
    p90: the long contexts set a stage's memory and its per-token cost."""
    if not lengths:
        return 0.0
    ordered = sorted(lengths)
    return float(ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))])
