"""Group rollouts with tool turns, on any engine with ``generate``: the sampling half of a
GRPO step, and the greedy evaluation on held-out prompts.

:func:`rollout` starts ``group_size`` episodes of each prompt
(:class:`~libra_hpc.envs.task.Episode`) and advances all unfinished ones together, one
model turn at a time: one batched ``engine.generate`` call (token ids in, token ids and
log-probs out: :class:`~libra_hpc.engines.rollout.VllmRolloutEngine`), then every
episode's tool calls submitted to the executor at once (the
:class:`~libra_hpc.tools.ToolOrchestrator`; they run concurrently), then each episode's
observation appended as tokens the policy did not produce. What comes out is one
:class:`~libra_hpc.rl.trajectory.Trajectory` per episode, ready for
:func:`~libra_hpc.rl.step.prepare_batch`, plus the episodes and what the step log shows.

Token bookkeeping (the record is exactly what the model saw): the prompt is the chat
template's text, tokenised once; a turn is the engine's own token ids, with the
end-of-turn token it stopped on (trained on: stopping is the policy's choice); an
observation is tokenised as text without its leading ``<|im_end|>`` when the turn already
ends with it (:func:`~libra_hpc.envs.toolcall.render_observation`). An episode whose next
turn would not fit the engine's context (``max_model_len``) ends with reward
``verify(None)`` and finish reason ``context``; its record stops before the observation
that did not fit, so no trajectory is longer than the context.

Pure at import time: the tokenizer (:class:`TextCodec`, the ``tokenizers`` library) is
loaded when one is made.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from libra_hpc.envs.task import Episode, Executor, Prompt, Splits, Task
from libra_hpc.envs.toolcall import IM_END, CallError, parse_tool_calls, render_prompt
from libra_hpc.rl.trajectory import NOT_GENERATED, Trajectory

log = logging.getLogger(__name__)

MIN_TURN = 16
"""Tokens a model turn needs at least; an episode with less room left ends (``context``)."""


class TextCodec:
    """A checkpoint's tokenizer as the rollout uses it: text ↔ token ids with the chat's
    special tokens (``<|im_end|>``, ``<tool_call>``) kept as themselves.

    ``model_path``: a Hugging Face checkpoint directory with ``tokenizer.json`` (the tiny
    model's, or a real Qwen checkpoint's)."""

    def __init__(self, model_path: str | Path):
        from tokenizers import Tokenizer

        file = Path(model_path) / "tokenizer.json"
        if not file.is_file():
            raise FileNotFoundError(f"{file}: no tokenizer.json; the rollout needs the checkpoint's fast tokenizer")
        self._tok = Tokenizer.from_file(str(file))
        self.im_end = self._special(IM_END, file)
        pad = self._tok.token_to_id("<|endoftext|>")
        self.pad_id = self.im_end if pad is None else pad

    def _special(self, token: str, file: Path) -> int:
        found = self._tok.token_to_id(token)
        if found is None:
            raise ValueError(f"{file}: the tokenizer has no {token} token; the tasks use the ChatML format")
        return found

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)


@dataclass
class _Sample:
    episode: Episode
    group_id: str
    tokens: list[int]
    generated: list[bool]
    logprobs: list[float]
    versions: list[int]
    finish: str = ""


@dataclass
class Rollout:
    """What :func:`rollout` produced: one trajectory per episode (same order), the
    episodes, and the numbers of the step log."""

    trajectories: list[Trajectory]
    episodes: list[Episode]
    generated_tokens: int = 0
    generate_s: float = 0.0
    tools_s: float = 0.0
    wall_s: float = 0.0
    turns: int = 0

    @property
    def success(self) -> float:
        """Mean reward."""
        return sum(t.reward for t in self.trajectories) / max(len(self.trajectories), 1)

    @property
    def format_valid(self) -> float:
        """Share of episodes whose tool calls all parsed and that ended with an answer."""
        return sum(map(format_valid, self.episodes)) / max(len(self.episodes), 1)

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.generate_s if self.generate_s > 0 else 0.0

    def summary(self) -> dict[str, float]:
        return {"episodes": len(self.episodes), "success": self.success, "format_valid": self.format_valid,
                "generated_tokens": self.generated_tokens, "tokens_per_s": self.tokens_per_s,
                "turns_per_episode": self.turns / max(len(self.episodes), 1), "generate_s": self.generate_s,
                "tools_s": self.tools_s, "wall_s": self.wall_s}


def format_valid(episode: Episode) -> bool:
    """The episode's tool calls all parsed and it ended with an ``<answer>``."""
    if episode.answer is None:
        return False
    return not any(isinstance(c, CallError) for text in episode.generated for c in parse_tool_calls(text, episode.task.tools))


def rollout(engine: Any, task: Task, prompts: Sequence[Prompt], executor: Executor, codec: TextCodec, *,
            group_size: int, version: int, tag: str, temperature: float = 1.0, top_p: float = 1.0,
            max_turn_tokens: int = 256, seed: int | None = None) -> Rollout:
    """Sample ``group_size`` episodes of each prompt with the engine's current weights
    (policy ``version``) and score them. ``tag`` names this batch (e.g. ``step3``): group
    ids are ``{tag}/{prompt id}``, episode ids ``{tag}/{prompt id}/{sample}``.
    ``temperature`` 0 is greedy; ``seed`` makes sampling reproducible (each turn of each
    episode draws its own seed from it; None: the engine's own generator, see
    ``VllmRolloutEngine.generate`` for why large batches on CPU need that); ``max_turn_tokens``
    caps one model turn."""
    if group_size < 1 or max_turn_tokens < 1:
        raise ValueError(f"rollout: group_size ({group_size}) and max_turn_tokens ({max_turn_tokens}) must be >= 1")
    started = time.perf_counter()
    samples = []
    for p in prompts:
        ids = codec.encode(render_prompt(task.system_prompt(), p.text))
        for k in range(group_size):
            samples.append(_Sample(task.episode(p, f"{tag}/{p.pid}/{k}"), f"{tag}/{p.pid}", list(ids),
                                   [False] * len(ids), [0.0] * len(ids), [NOT_GENERATED] * len(ids)))
    out = Rollout([], [s.episode for s in samples])
    limit = int(getattr(engine, "max_model_len", 1 << 30))
    active = [s for s in samples if not _ends_for_context(s, limit)]
    turn = 0
    while active:
        budget = min(max_turn_tokens, min(limit - len(s.tokens) for s in active))
        tick = time.perf_counter()
        generations = engine.generate([s.tokens for s in active], max_tokens=budget, temperature=temperature,
                                      top_p=top_p,
                                      seed=None if seed is None else random.Random(f"{seed}/{tag}/{turn}").randrange(1 << 30),
                                      stop_token_ids=[codec.im_end])
        out.generate_s += time.perf_counter() - tick
        tick = time.perf_counter()
        pending = []
        for s, gen in zip(active, generations, strict=True):
            s.tokens += gen.tokens
            s.generated += [True] * len(gen.tokens)
            s.logprobs += gen.logprobs
            s.versions += [version] * len(gen.tokens)
            out.generated_tokens += len(gen.tokens)
            text = codec.decode(gen.tokens[:-1] if gen.tokens and gen.tokens[-1] == codec.im_end else gen.tokens)
            pending.append(s.episode.begin(text, executor))
        still = []
        for s, turn_calls in zip(active, pending):
            result = s.episode.finish(turn_calls)
            out.turns += 1
            if result.done:
                continue
            observation = result.observation
            if s.tokens[-1] == codec.im_end and observation.startswith(IM_END):
                observation = observation[len(IM_END):]
            ids = codec.encode(observation)
            if len(s.tokens) + len(ids) + MIN_TURN > limit:  # the tool output would not leave room for a turn
                s.episode.abandon("context")
                continue
            s.tokens += ids
            s.generated += [False] * len(ids)
            s.logprobs += [0.0] * len(ids)
            s.versions += [NOT_GENERATED] * len(ids)
            still.append(s)
        out.tools_s += time.perf_counter() - tick
        active = still
        turn += 1
    end = getattr(executor, "end_trajectory", None)
    for s in samples:
        if end is not None:
            end(s.episode.trajectory)
        out.trajectories.append(Trajectory(s.episode.prompt.pid, s.group_id, s.tokens, s.generated, s.logprobs,
                                           s.versions, float(s.episode.reward or 0.0),
                                           s.episode.finish_reason or "context"))
    out.wall_s = time.perf_counter() - started
    return out


def _ends_for_context(sample: _Sample, limit: int) -> bool:
    """Whether the episode had to end (no answer; it is abandoned here) because not even a
    short turn fits the context any more."""
    if len(sample.tokens) + MIN_TURN <= limit:
        return False
    sample.episode.abandon("context")
    return True


def evaluate(engine: Any, task: Task, prompts: Sequence[Prompt], executor: Executor, codec: TextCodec, *,
             tag: str = "eval", max_turn_tokens: int = 256) -> Rollout:
    """Greedy episodes (one per prompt) with the engine's current weights: ``success`` is
    the held-out success rate when ``prompts`` are the held-out split."""
    return rollout(engine, task, prompts, executor, codec, group_size=1, version=0, tag=tag, temperature=0.0,
                   max_turn_tokens=max_turn_tokens)


@dataclass
class PromptSampler:
    """Training prompts per step: shuffled passes over the training split (seeded), every
    batch checked against the held-out split by text hash before it is used."""

    splits: Splits
    seed: int = 0
    _order: list[Prompt] = field(default_factory=list)
    _epoch: int = 0

    def next(self, count: int, what: Callable[[], str] = lambda: "a training batch") -> list[Prompt]:
        if count > len(self.splits.train):
            raise ValueError(f"{count} prompts per step but the training split has {len(self.splits.train)}")
        batch = []
        while len(batch) < count:
            if not self._order:
                self._order = list(self.splits.train)
                random.Random(f"{self.seed}/{self._epoch}").shuffle(self._order)
                self._epoch += 1
            batch.append(self._order.pop())
        self.splits.check_disjoint((p.text for p in batch), what())
        return batch

    def state(self) -> dict:
        """The position in the stream (JSON): the pass number and the prompts left in it."""
        return {"epoch": self._epoch, "left": [p.pid for p in self._order]}

    def restore(self, state: dict) -> None:
        """Continue from :meth:`state`: the same prompts, in the same order, as the run
        that saved it would have drawn next."""
        by_pid = {p.pid: p for p in self.splits.train}
        if unknown := [pid for pid in state["left"] if pid not in by_pid]:
            raise ValueError(f"sampler state names {len(unknown)} prompt(s) not in the training split, e.g. "
                             f"{unknown[0]!r}: the task or its seed changed since the checkpoint")
        self._epoch, self._order = int(state["epoch"]), [by_pid[pid] for pid in state["left"]]
