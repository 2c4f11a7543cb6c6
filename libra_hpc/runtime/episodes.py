"""One trajectory in flight on a rollout leader, and its state when it moves to another.

A trajectory's turns may run on different rollout instances (C-MLFQ moves the next turn
to another bucket after a tool return); the token record and the environment's episode
travel with it, leader to leader (:mod:`libra_hpc.runtime.rollout`), and the new instance
recomputes the KV cache from the tokens. :meth:`LiveEpisode.state` is that record as
plain data; :meth:`LiveEpisode.from_state` rebuilds it with the receiving rank's own task
object (the task is never sent: every rank builds the same one from the config).

The token bookkeeping is :func:`libra_hpc.rl.rollout.rollout`'s, turn by turn: prompt and
tool outputs are not generated (never trained on), each model turn carries its log-probs
and the policy version that sampled it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from libra_hpc.envs.task import Episode, Prompt, Task
from libra_hpc.envs.toolcall import IM_END, render_prompt
from libra_hpc.rl.rollout import MIN_TURN
from libra_hpc.rl.trajectory import NOT_GENERATED, Trajectory


def trajectory_id(batch: int, pid: str, sample: int) -> str:
    return f"b{batch}/{pid}/{sample}"


def batch_of(tid: str) -> int:
    """The batch (RL step) a trajectory id belongs to."""
    return int(tid.split("/", 1)[0][1:])


def group_of(tid: str) -> str:
    """The GRPO group of a trajectory id: the samples of one prompt in one batch."""
    return tid.rsplit("/", 1)[0]


@dataclass
class LiveEpisode:
    """Tokens, log-probs and versions so far, and the environment episode."""

    tid: str
    episode: Episode
    tokens: list[int]
    generated: list[bool]
    logprobs: list[float]
    versions: list[int]
    turns: int = 0
    tool_calls: int = 0
    tool_s: float = 0.0
    migrations: int = 0
    tool_failures: int = 0
    tool_timeouts: int = 0
    pending: Any = None
    """The running turn's :class:`~libra_hpc.envs.task.PendingTurn` (tool calls out)."""
    turn_tokens: int = 0
    """Tokens the running turn generated (reported to the queue with its tool return)."""
    tool_started: float = 0.0
    extra: dict = field(default_factory=dict)
    started: float = field(default_factory=time.time)
    """Wall-clock time (``time.time``, comparable between hosts) the first turn began; it
    moves with the trajectory, so the finishing leader reports how long it ran
    (``active_s``) without the time it waited in the queue for its first turn."""

    @classmethod
    def start(cls, task: Task, prompt: Prompt, tid: str, codec: Any) -> LiveEpisode:
        ids = codec.encode(render_prompt(task.system_prompt(), prompt.text))
        return cls(tid, task.episode(prompt, tid), list(ids), [False] * len(ids), [0.0] * len(ids),
                   [NOT_GENERATED] * len(ids))

    @property
    def batch(self) -> int:
        return batch_of(self.tid)

    def add_turn(self, tokens: list[int], logprobs: list[float], version: int) -> None:
        self.tokens += tokens
        self.generated += [True] * len(tokens)
        self.logprobs += logprobs
        self.versions += [version] * len(tokens)
        self.turns += 1
        self.turn_tokens = len(tokens)

    def add_observation(self, observation: str, codec: Any, limit: int) -> bool:
        """Append the tool responses as tokens the policy did not produce; False (and the
        episode ends, reason ``context``) when they would leave no room for a turn."""
        if self.tokens and self.tokens[-1] == codec.im_end and observation.startswith(IM_END):
            observation = observation[len(IM_END):]
        ids = codec.encode(observation)
        if len(self.tokens) + len(ids) + MIN_TURN > limit:
            self.episode.abandon("context")
            return False
        self.tokens += ids
        self.generated += [False] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [NOT_GENERATED] * len(ids)
        return True

    def trajectory(self) -> Trajectory:
        e = self.episode
        return Trajectory(e.prompt.pid, group_of(self.tid), self.tokens, self.generated, self.logprobs, self.versions,
                          float(e.reward or 0.0), e.finish_reason or "context")

    # ------------------------------------------------------------------ migration

    def state(self) -> dict:
        """Plain data for another leader (no pending turn: a turn moves between turns)."""
        if self.pending is not None:
            raise RuntimeError(f"trajectory {self.tid}: cannot move while its tool calls run")
        episode = {k: v for k, v in vars(self.episode).items() if k not in ("task", "_pending")}
        return {"tid": self.tid, "episode": episode, "tokens": self.tokens, "generated": self.generated,
                "logprobs": self.logprobs, "versions": self.versions, "turns": self.turns,
                "tool_calls": self.tool_calls, "tool_s": self.tool_s, "migrations": self.migrations,
                "tool_failures": self.tool_failures, "tool_timeouts": self.tool_timeouts, "started": self.started}

    @classmethod
    def from_state(cls, task: Task, state: dict) -> LiveEpisode:
        saved = dict(state["episode"])
        episode = task.episode(saved["prompt"], state["tid"])
        vars(episode).update(saved)
        live = cls(state["tid"], episode, state["tokens"], state["generated"], state["logprobs"], state["versions"],
                   state["turns"], state["tool_calls"], state["tool_s"], state["migrations"],
                   state.get("tool_failures", 0), state.get("tool_timeouts", 0))
        live.started = state.get("started", live.started)
        return live
