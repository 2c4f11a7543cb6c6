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
from collections.abc import Callable, Iterable, Mapping, Sequence
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
    """A task's prompts: ``train`` and ``heldout`` never share a text hash."""

    train: tuple[Prompt, ...]
    heldout: tuple[Prompt, ...]

    def __post_init__(self):
        self.check_disjoint((p.text for p in self.train), "the training split")

    def heldout_hashes(self) -> frozenset[str]:
        return frozenset(p.hash for p in self.heldout)

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
    held-out hash are dropped, so the splits are disjoint by construction."""
    seen: set[str] = set()
    out: list[list[Prompt]] = [[], []]
    index = 0
    for part, want in ((1, heldout), (0, train)):
        while len(out[part]) < want:
            if index > max_tries * (train + heldout):
                raise ValueError(f"could not draw {train} + {heldout} distinct prompts: the generator repeats itself")
            prompt = generate(index)
            index += 1
            if prompt.hash not in seen:
                seen.add(prompt.hash)
                out[part].append(prompt)
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


class Episode:
    """One trajectory of ``task`` on ``prompt``; ``trajectory``: its id at the orchestrator."""

    def __init__(self, task: Task, prompt: Prompt, trajectory: str):
        self.task, self.prompt, self.trajectory = task, prompt, trajectory
        self.messages: list[dict[str, str]] = [{"role": "system", "content": task.system_prompt()},
                                               {"role": "user", "content": prompt.text}]
        self.prompt_text = render_prompt(self.messages[0]["content"], prompt.text)
        self.turns: list[tuple[str, list[ToolReturn]]] = []
        """(model text, the returns its calls got) per turn."""
        self.done = False
        self.reward: float | None = None
        self.answer: str | None = None

    def step(self, text: str, executor: Executor) -> StepResult:
        """Feed the model's text of one turn; run its calls; the observation or the reward."""
        if self.done:
            raise RuntimeError(f"episode {self.trajectory} is over (reward {self.reward}); start a new one")
        self.messages.append({"role": "assistant", "content": text})
        calls = parse_tool_calls(text, self.task.tools)
        if not calls or len(self.turns) + 1 >= self.task.max_turns:
            self.turns.append((text, []))
            return self._finish(final_answer(text) if not calls else None)
        returns = self.run_calls(calls, executor)
        self.turns.append((text, returns))
        self.messages.extend({"role": "tool", "content": r.output} for r in returns)
        return StepResult(render_observation([r.output for r in returns]), False, None, returns)

    def run_calls(self, calls: Sequence[ParsedCall | CallError], executor: Executor) -> list[ToolReturn]:
        """Submit every well-formed call at once (they run concurrently), then collect in order."""
        futures: list[Future | ToolReturn] = []
        for call in calls:
            if isinstance(call, CallError):
                futures.append(ToolReturn(call.tool, call.message, "failure"))
                continue
            tool = next(t for t in self.task.tools if t.name == call.name)
            try:
                futures.append(executor.submit(self.trajectory, call.name, tool.resource, self.task.payload(call)))
            except (TypeError, ValueError) as err:  # the task could not build a payload from these arguments
                futures.append(ToolReturn(call.name, f"Error: {call.name}: {err}", "failure"))
        return [self._collect(call, f) for call, f in zip(calls, futures)]

    def _collect(self, call: ParsedCall | CallError, future: Future | ToolReturn) -> ToolReturn:
        if isinstance(future, ToolReturn):
            return future
        assert isinstance(call, ParsedCall)
        try:
            return self.task.tool_return(call, future.result(timeout=self.task.call_timeout_s))
        except FutureTimeout:
            future.cancel()
            return ToolReturn(call.name, f"Error: {call.name} did not return within {self.task.call_timeout_s:g} s",
                              "timeout")
        except Exception as err:  # noqa: BLE001 - a runner's failure is an observation for the model, and logged
            log.warning("episode %s: tool %s failed: %r", self.trajectory, call.name, err)
            return ToolReturn(call.name, f"Error: {call.name} failed: {err}", "failure")

    def _finish(self, answer: str | None) -> StepResult:
        self.done, self.answer = True, answer
        self.reward = self.task.verify(self.prompt, answer)
        return StepResult("", True, self.reward)

    @property
    def generated(self) -> list[str]:
        """The model's text of each turn."""
        return [text for text, _ in self.turns]
