"""What the planner knows of trajectory lengths (pure): one finished trajectory
(:class:`LengthSample`), and a window of them scaled to an RL batch and cut into buckets
(:class:`LengthProfile`), the input of every rollout makespan. Units: tokens, seconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple, Protocol


class SerialCost(Protocol):
    """What a trajectory's serial time is priced with (:class:`~libra_hpc.planner.costs.RolloutCost`)."""

    def serial_s(self, prompt_len: float, gen_len: float, tool_time_s: float, context: float | None = None,
                 turns: float = 0.0) -> float: ...


class LengthSample(NamedTuple):
    """One observed trajectory: prompt and generated tokens (all turns), turns, tool seconds,
    ``tool_tokens``, the part of ``prompt_len`` that tools returned between turns, and
    ``trained``: whether the training step trains it (False: its GRPO group was left out,
    every reward equal, ``rl.filter_zero_variance``)."""

    prompt_len: float
    gen_len: float
    turns: int
    tool_time_s: float
    tool_tokens: float = 0.0
    trained: bool = True

    @property
    def decode_context(self) -> float:
        """Mean KV context a generated token of this trajectory sees: the first prompt, half
        of what it generates and half of what its tools return (both arrive turn by turn,
        so the average token sees half of each). Counting every tool output from the start
        overpredicts decode steps where tools return much (measured: 2× on context-growth)."""
        return self.prompt_len - self.tool_tokens / 2 + self.gen_len / 2

    def serial_s(self, cost: SerialCost) -> float:
        """This trajectory alone on ``cost``'s instance (:meth:`RolloutCost.serial_s`)."""
        return cost.serial_s(self.prompt_len, self.gen_len, self.tool_time_s, self.decode_context, self.turns)


@dataclass(frozen=True)
class LengthProfile:
    """A window of observed trajectories scaled to an RL batch and cut into buckets, so a
    makespan costs O(buckets × pools), not O(trajectories). Buckets are quantiles of the
    generated length, longest first; the longest trajectory is a bucket of its own, so the
    tail is never averaged away. ``extremes`` (the samples no other sample beats in both
    generated length and tool time) give the exact serial bound."""

    prompt: tuple[float, ...]
    gen: tuple[float, ...]
    tool_s: tuple[float, ...]
    count: tuple[int, ...]
    extremes: tuple[LengthSample, ...]
    mean_seq_tokens: float
    mean_context: float
    max_seq_tokens: float
    context: tuple[float, ...] = ()
    """Per bucket: the mean KV context a generated token sees (:attr:`LengthSample.decode_context`)."""
    turns: tuple[float, ...] = ()
    """Per bucket: the mean turns of a trajectory (each turn costs ``Calibration.turn_latency_s``)."""
    trained_share: float = 1.0
    """The share of the samples training trains (:attr:`LengthSample.trained`): rollout
    generates the whole batch, training works on this share of it."""
    trained_seq_tokens: float = 0.0
    """The mean sequence of the trained samples (:attr:`mean_seq_tokens` when all are, or
    none is): what training packs to."""

    @classmethod
    def from_samples(cls, samples: Sequence[LengthSample], batch_size: int, buckets: int = 32) -> LengthProfile:
        if not samples or batch_size < 1 or buckets < 2:
            raise ValueError(f"need samples, batch_size >= 1, buckets >= 2 (got {len(samples)}, {batch_size}, {buckets})")
        s = sorted(samples, key=lambda x: (x.gen_len, x.tool_time_s), reverse=True)
        n_rest = max(0, batch_size - 1)
        groups = [[s[0]]] + [g for g in _split(s[1:] or s[:1], buckets - 1) if g]
        counts = [1] + apportion([len(g) for g in groups[1:]], n_rest)
        keep = [(g, c) for g, c in zip(groups, counts) if c > 0]
        mean = lambda g, f: sum(getattr(x, f) for x in g) / len(g)
        trained = [x for x in s if x.trained]
        extremes, best_tool = [], -1.0
        for x in s:  # descending gen: keep those with more tool time than every longer one
            if x.tool_time_s > best_tool:
                extremes.append(x)
                best_tool = x.tool_time_s
        return cls(prompt=tuple(mean(g, "prompt_len") for g, _ in keep), gen=tuple(mean(g, "gen_len") for g, _ in keep),
                   tool_s=tuple(mean(g, "tool_time_s") for g, _ in keep), count=tuple(c for _, c in keep),
                   extremes=tuple(extremes),
                   mean_seq_tokens=sum(x.prompt_len + x.gen_len for x in s) / len(s),
                   mean_context=sum(x.decode_context for x in s) / len(s),
                   max_seq_tokens=max(x.prompt_len + x.gen_len for x in s),
                   context=tuple(mean(g, "decode_context") for g, _ in keep),
                   turns=tuple(mean(g, "turns") for g, _ in keep),
                   trained_share=len(trained) / len(s),
                   trained_seq_tokens=sum(x.prompt_len + x.gen_len for x in trained or s) / len(trained or s))

    @property
    def batch_size(self) -> int:
        return sum(self.count)

    @property
    def train_seq_tokens(self) -> float:
        """The mean length training packs to (:attr:`trained_seq_tokens`; profiles built
        without it: :attr:`mean_seq_tokens`)."""
        return self.trained_seq_tokens or self.mean_seq_tokens

    def bucket_turns(self) -> tuple[float, ...]:
        """:attr:`turns`, or no turns per bucket for a profile built without them."""
        return self.turns if len(self.turns) == len(self.count) else (0.0,) * len(self.count)


def _split(items: list, parts: int) -> list[list]:
    """``items`` cut into ``parts`` runs in order, their sizes differing by at most one."""
    k, r = divmod(len(items), parts)
    out, i = [], 0
    for p in range(parts):
        j = i + k + (1 if p < r else 0)
        out.append(items[i:j])
        i = j
    return out


def apportion(weights: list[int], total: int) -> list[int]:
    """Integers proportional to ``weights`` summing to ``total`` (largest remainders)."""
    w = sum(weights)
    if not w:
        return [0] * len(weights)
    raw = [total * x / w for x in weights]
    out = [int(x) for x in raw]
    for i in sorted(range(len(raw)), key=lambda i: out[i] - raw[i])[: total - sum(out)]:
        out[i] += 1
    return out
