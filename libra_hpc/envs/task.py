"""What every agentic task is made of, and the episode step that drives one trajectory.

A :class:`Task` owns its prompts (a train and a held-out split, disjoint by text hash), its
tools (:class:`~libra_hpc.envs.toolcall.ToolDef`), how a parsed call becomes a payload for
the orchestrator's runner of the tool's resource kind and how the runner's result becomes
the text the model sees, and a verifier.

An :class:`Episode` is one trajectory: :meth:`Episode.step` takes the model's text of one
turn, parses its tool calls, runs them through an *executor* (anything with
``submit(trajectory, tool, resource, payload) -> Future``: the
:class:`~libra_hpc.tools.ToolOrchestrator`, which runs them in sandboxes), and returns
the next observation, or, when the turn answers or stops, the reward. Model text never
crashes an episode: malformed calls, tool errors, tool timeouts and runner exceptions all
become tool responses the model reads (status ``failure`` or ``timeout``, the causal
signal C-MLFQ routes on). This module imports neither the tools package nor MPI nor torch:
the executor is injected.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from libra_hpc.envs.toolcall import (
    CallError,
    ParsedCall,
    ToolDef,
    final_answer,
    parse_tool_calls,
    render_observation,
    render_prompt,
    tools_system_prompt,
)

log = logging.getLogger(__name__)

Status = Literal["success", "failure", "timeout"]
"""How a tool return ended (the values of C-MLFQ's ``ToolState.status``)."""


def text_hash(text: str) -> str:
    """Identity of a prompt text for split checks: SHA-256 of its whitespace-normalised,
    case-folded form (two prompts that differ only in spacing or case are the same)."""
    return hashlib.sha256(" ".join(text.split()).casefold().encode()).hexdigest()[:24]


@dataclass(frozen=True)
class Prompt:
    """One problem: the user's text, the reference answer, and task-specific facts
    (``meta``: what the scripted solver and the verifier may use, never shown to the model)."""

    pid: str
    text: str
    answer: str
    meta: Mapping[str, Any] = field(default_factory=dict)

    @property
    def hash(self) -> str:
        return text_hash(self.text)


class SplitLeak(ValueError):
    """Held-out prompt texts found where they must never be (training, demonstrations)."""


@dataclass(frozen=True)
class Splits:
    """A task's prompts: ``train`` and ``heldout`` never share a text hash, nor, where the
    prompts name the entity they ask about (``meta["entity"]``: the search task's person),
    an entity: a held-out person's facts are asked in no training prompt."""

    train: tuple[Prompt, ...]
    heldout: tuple[Prompt, ...]

    def __post_init__(self):
        self.check_disjoint((p.text for p in self.train), "the training split")
        shared = self.shared_entities()
        if shared:
            raise SplitLeak(f"{len(shared)} held-out entities also asked about in the training split, "
                            f"e.g. {sorted(shared)[0]!r}")

    def heldout_hashes(self) -> frozenset[str]:
        return frozenset(p.hash for p in self.heldout)

    def heldout_entities(self) -> frozenset[str]:
        """The entities the held-out prompts ask about (empty for tasks that name none)."""
        return frozenset(p.meta["entity"] for p in self.heldout if p.meta.get("entity"))

    def shared_entities(self) -> frozenset[str]:
        """Held-out entities a training prompt also asks about."""
        return self.heldout_entities() & {p.meta.get("entity") for p in self.train}

    def entity_overlap(self) -> int:
        """How many :meth:`shared_entities` there are (``heldout_entity_overlap`` in
        ``summary.json`` and ``bench_learning.py``; 0 by construction, recounted here)."""
        return len(self.shared_entities())

    def leaking(self, text: str) -> str | None:
        """The first held-out entity named in ``text`` (a demonstration's transcript: its
        tool outputs may show another person's passage), or None."""
        return next((e for e in self.heldout_entities() if e in text), None)

    def check_disjoint(self, texts: Iterable[str], what: str) -> None:
        """Raise :class:`SplitLeak` when any of ``texts`` is a held-out prompt. The hook for
        warm-start demonstrations, and for training batches: pass their prompt texts."""
        held = self.heldout_hashes()
        leaked = [t for t in texts if text_hash(t) in held]
        if leaked:
            raise SplitLeak(f"{len(leaked)} held-out prompt(s) found in {what}, e.g. {leaked[0][:80]!r}")


def make_splits(generate: Callable[[int], Prompt], train: int, heldout: int, *, max_tries: int = 20) -> Splits:
    """Draw ``heldout`` then ``train`` prompts from ``generate(i)`` (a seeded, deterministic
    generator of prompt ``i``), dropping duplicate texts; training drafts that hit a
    held-out hash, or ask about an entity a held-out prompt asks about (``meta["entity"]``),
    are dropped, so the splits are disjoint by text and by entity by construction."""
    seen: set[str] = set()
    held_entities: set[str] = set()
    out: list[list[Prompt]] = [[], []]
    index = 0
    for part, want in ((1, heldout), (0, train)):
        while len(out[part]) < want:
            if index > max_tries * (train + heldout):
                raise ValueError(f"could not draw {train} + {heldout} distinct prompts (disjoint by entity from the "
                                 f"{len(held_entities)} held-out entities): the generator repeats itself")
            prompt = generate(index)
            index += 1
            entity = prompt.meta.get("entity")
            if prompt.hash in seen or (part == 0 and entity in held_entities):
                continue
            seen.add(prompt.hash)
            out[part].append(prompt)
            if part == 1 and entity:
                held_entities.add(entity)
    return Splits(tuple(out[0]), tuple(out[1]))


class Executor(Protocol):
    """Runs tool calls (:class:`~libra_hpc.tools.ToolOrchestrator` is one)."""

    def submit(self, trajectory: str, tool: str, resource: str, payload: Any) -> Future: ...


@dataclass(frozen=True)
class ToolReturn:
    """One call's response as the model and the scheduler see it."""

    tool: str
    output: str
    status: Status


class Task:
    """Base of the agentic tasks. Subclasses set ``name``, ``system``, ``tools``,
    ``splits``, ``max_turns`` and implement :meth:`payload` and :meth:`verify`; they may
    override :meth:`tool_return` and :meth:`runners`."""

    name: str = "task"
    system: str = "You are a helpful assistant."
    tools: tuple[ToolDef, ...] = ()
    splits: Splits
    max_turns: int = 10
    call_timeout_s: float = 60.0
    """Seconds :meth:`Episode.step` waits for one call's result before it reports a timeout."""
    max_output_chars: int = 2000
    """A tool response longer than this is cut (head and tail kept) before the model sees it:
    a runaway print must not fill the context."""

    def payload(self, call: ParsedCall) -> Any:
        """What the runner of the call's resource kind gets (for ``cpu``: Python source or
        ``{"code": ..., "tool": ...}``, see :class:`~libra_hpc.tools.SandboxRunner`)."""
        raise NotImplementedError

    def verify(self, prompt: Prompt, answer: str | None) -> float:
        """Reward of a final answer (None: the episode ended without one)."""
        raise NotImplementedError

    def tool_return(self, call: ParsedCall, result: Any) -> ToolReturn:
        """The runner's result as the model sees it. Default: a sandbox
        :class:`~libra_hpc.tools.ToolResult` (duck-typed: ``output``, ``timed_out``,
        ``state.status``), or a mapping ``{"output", "status"}`` from an in-process runner."""
        if isinstance(result, Mapping):
            return ToolReturn(call.name, str(result["output"]), result.get("status", "success"))
        output = result.output.strip()
        if result.timed_out:
            return ToolReturn(call.name, f"{output}\nError: {call.name} timed out (killed at the wall-time limit)".strip(),
                              "timeout")
        return ToolReturn(call.name, output or "(no output)", result.state.status)

    def runners(self) -> dict[str, Any]:
        """In-process runners for resource kinds other than ``cpu`` that this task's tools
        use (``{"search": SearchRunner}``): give them to the orchestrator with its pools."""
        return {}

    def resources(self) -> list[str]:
        """Resource kinds this task's tools run on."""
        return sorted({t.resource for t in self.tools})

    def system_prompt(self) -> str:
        return tools_system_prompt(self.system, self.tools)

    def episode(self, prompt: Prompt, trajectory: str) -> Episode:
        return Episode(self, prompt, trajectory)


@dataclass
class StepResult:
    """The outcome of one model turn."""

    observation: str
    """Text to append after the model's turn (tool responses and the next assistant header;
    tokens the policy did not produce); empty when ``done``."""
    done: bool
    reward: float | None = None
    returns: list[ToolReturn] = field(default_factory=list)


@dataclass
class PendingTurn:
    """A model turn whose calls are running: :meth:`Episode.finish` it once :meth:`ready`
    (or at once: it waits, up to ``Task.call_timeout_s`` from submission)."""

    text: str
    calls: list[ParsedCall | CallError]
    futures: list[Future | ToolReturn]
    deadline: float
    """``time.monotonic()`` after which a call still running is reported as timed out."""

    def ready(self) -> bool:
        return all(isinstance(f, ToolReturn) or f.done() for f in self.futures)


class Episode:
    """One trajectory of ``task`` on ``prompt``; ``trajectory``: its id at the orchestrator.

    Synchronous use: ``step(text, executor)`` per model turn. A rollout loop that keeps
    many episodes going calls ``begin`` (parses, submits the calls, returns at once) and
    ``finish`` when the turn's calls are done (``PendingTurn.ready`` or their futures)."""

    def __init__(self, task: Task, prompt: Prompt, trajectory: str):
        self.task, self.prompt, self.trajectory = task, prompt, trajectory
        self.messages: list[dict[str, str]] = [{"role": "system", "content": task.system_prompt()},
                                               {"role": "user", "content": prompt.text}]
        self.prompt_text = render_prompt(self.messages[0]["content"], prompt.text)
        self.turns: list[tuple[str, list[ToolReturn]]] = []
        """(model text, the returns its calls got) per turn."""
        self.observations: list[str] = []
        """The text after each turn that called tools (:attr:`StepResult.observation`)."""
        self.done = False
        self.reward: float | None = None
        self.answer: str | None = None
        self.finish_reason = ""
        """Why the episode ended: ``answer`` (the turn had no call), ``max_turns``."""
        self._pending: PendingTurn | None = None

    def step(self, text: str, executor: Executor) -> StepResult:
        """Feed the model's text of one turn; run its calls; the observation or the reward."""
        return self.finish(self.begin(text, executor))

    def begin(self, text: str, executor: Executor) -> PendingTurn:
        """Parse the turn and submit its well-formed calls (they run concurrently); a
        malformed call or a payload the task cannot build is already its tool response."""
        if self.done or self._pending is not None:
            raise RuntimeError(f"episode {self.trajectory}: a turn is pending or the episode is over "
                               f"(reward {self.reward}); finish the turn, or start a new episode")
        calls = parse_tool_calls(text, self.task.tools)
        if len(self.turns) + 1 >= self.task.max_turns and calls:
            calls = []  # out of turns: the calls are not run
            self.finish_reason = "max_turns"
        futures: list[Future | ToolReturn] = []
        for call in calls:
            if isinstance(call, CallError):
                futures.append(ToolReturn(call.tool, call.message, "failure"))
                continue
            tool = next(t for t in self.task.tools if t.name == call.name)
            try:
                payload = self.task.payload(call)
            except (TypeError, ValueError) as err:  # the arguments do not make a payload
                futures.append(ToolReturn(call.name, f"Error: {call.name}: {err}", "failure"))
                continue
            futures.append(executor.submit(self.trajectory, call.name, tool.resource, payload))
        self._pending = PendingTurn(text, calls, futures, time.monotonic() + self.task.call_timeout_s)
        return self._pending

    def finish(self, turn: PendingTurn) -> StepResult:
        """Collect the turn's returns (waiting for running calls up to their deadline)."""
        if turn is not self._pending:
            raise RuntimeError(f"episode {self.trajectory}: finish() takes the turn begin() returned")
        self._pending = None
        self.messages.append({"role": "assistant", "content": turn.text})
        if not turn.calls:
            self.turns.append((turn.text, []))
            return self._end(None if self.finish_reason == "max_turns" else final_answer(turn.text))
        returns = [_cut(self._collect(call, f, turn.deadline), self.task.max_output_chars)
                   for call, f in zip(turn.calls, turn.futures)]
        self.turns.append((turn.text, returns))
        self.messages.extend({"role": "tool", "content": r.output} for r in returns)
        observation = render_observation([r.output for r in returns])
        self.observations.append(observation)
        return StepResult(observation, False, None, returns)

    def _collect(self, call: ParsedCall | CallError, future: Future | ToolReturn, deadline: float) -> ToolReturn:
        if isinstance(future, ToolReturn):
            return future
        assert isinstance(call, ParsedCall)
        try:
            return self.task.tool_return(call, future.result(timeout=max(0.0, deadline - time.monotonic())))
        except FutureTimeout:
            future.cancel()
            return ToolReturn(call.name, f"Error: {call.name} did not return within {self.task.call_timeout_s:g} s",
                              "timeout")
        except Exception as err:  # noqa: BLE001 - a runner's failure is an observation for the model, and logged
            log.warning("episode %s: tool %s failed: %r", self.trajectory, call.name, err)
            return ToolReturn(call.name, f"Error: {call.name} failed: {err}", "failure")

    def abandon(self, reason: str) -> None:
        """End the episode without an answer (reward ``verify(None)``) for a reason outside
        the model's turns, e.g. ``context``: the next turn would not fit the engine."""
        if self.done or self._pending is not None:
            raise RuntimeError(f"episode {self.trajectory}: abandon() needs a running episode with no pending turn")
        self.finish_reason = reason
        self._end(None)

    def _end(self, answer: str | None) -> StepResult:
        self.done, self.answer = True, answer
        self.finish_reason = self.finish_reason or "answer"
        self.reward = self.task.verify(self.prompt, answer)
        return StepResult("", True, self.reward)

    @property
    def generated(self) -> list[str]:
        """The model's text of each turn."""
        return [text for text, _ in self.turns]

    def segments(self) -> list[tuple[str, bool]]:
        """The whole trajectory as (text, produced by the policy) pieces, in order: the
        prompt, then each turn and the observation after it. Tokenised piece by piece,
        this gives the RL record's tokens and its ``generated`` mask."""
        pieces = [(self.prompt_text, False)]
        for k, text in enumerate(self.generated):
            pieces.append((text, True))
            if k < len(self.observations):
                pieces.append((self.observations[k], False))
        return pieces


def _cut(ret: ToolReturn, limit: int) -> ToolReturn:
    """``ret`` with its output cut to about ``limit`` characters: the head and the tail
    (where a traceback's last line is) around a note of how much was left out."""
    if len(ret.output) <= limit:
        return ret
    half = limit // 2
    left_out = len(ret.output) - 2 * half
    return ToolReturn(ret.tool, f"{ret.output[:half]}\n[... {left_out} characters cut ...]\n{ret.output[-half:]}",
                      ret.status)
