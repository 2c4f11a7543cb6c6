"""Qwen's tool-call chat format: tool schemas in the system turn, ``<tool_call>`` in the
model's text, ``<tool_response>`` turns back.

The text is exactly what Qwen2.5/Qwen3's chat template renders (``tokenizer.apply_chat_template``
with ``tools=``), so a real Qwen checkpoint works unchanged and the tiny model learns the
same format. A call the model writes::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "3 * (4 + 5)"}}
    </tool_call>

:func:`parse_tool_calls` never raises on model text: a malformed call (bad JSON, unknown
tool, missing or unexpected argument, unclosed tag) becomes a :class:`CallError` whose
``message`` is shown to the model as that call's tool response, so it can recover.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>", "</tool_response>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


@dataclass(frozen=True)
class ToolDef:
    """One tool the model may call: its JSON-schema signature (what the system turn shows)
    and the resource kind of the orchestrator that runs it (``cpu``: a sandbox slot)."""

    name: str
    description: str
    parameters: Mapping[str, str]
    """Argument name → description; every argument is a required string or number."""
    resource: str = "cpu"
    types: Mapping[str, str] = field(default_factory=dict)
    """Argument name → JSON type (default ``string``)."""

    def schema(self) -> dict[str, Any]:
        """The OpenAI/Qwen function schema."""
        props = {k: {"type": self.types.get(k, "string"), "description": v} for k, v in self.parameters.items()}
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": {"type": "object", "properties": props,
                                                                "required": list(self.parameters)}}}


@dataclass(frozen=True)
class ParsedCall:
    """A well-formed call of a known tool with exactly its arguments."""

    name: str
    arguments: dict[str, Any]


@dataclass(frozen=True)
class CallError:
    """A malformed call: ``message`` is the tool response the model sees."""

    raw: str
    message: str
    tool: str = "invalid"
    """The tool it named when that much was readable, else ``invalid`` (C-MLFQ's tool type)."""


def parse_tool_calls(text: str, tools: Sequence[ToolDef]) -> list[ParsedCall | CallError]:
    """Every ``<tool_call>`` block of ``text`` in order, each parsed or explained."""
    known = {t.name: t for t in tools}
    found: list[ParsedCall | CallError] = []
    pos = 0
    while (start := text.find(CALL_OPEN, pos)) >= 0:
        body_start = start + len(CALL_OPEN)
        end = text.find(CALL_CLOSE, body_start)
        if end < 0:
            found.append(CallError(text[start:], f"Error: {CALL_OPEN} is never closed with {CALL_CLOSE}; write "
                                                  f'{CALL_OPEN}{{"name": ..., "arguments": {{...}}}}{CALL_CLOSE}'))
            break
        found.append(_parse_one(text[body_start:end].strip(), known))
        pos = end + len(CALL_CLOSE)
    return found


def _parse_one(body: str, known: Mapping[str, ToolDef]) -> ParsedCall | CallError:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as err:
        return CallError(body, f"Error: the tool call is not valid JSON ({err.msg} at line {err.lineno} column "
                               f'{err.colno}); write {{"name": ..., "arguments": {{...}}}}')
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return CallError(body, 'Error: a tool call is a JSON object with a string "name" and an "arguments" object')
    name = obj["name"]
    if name not in known:
        return CallError(body, f"Error: unknown tool {name!r}; available tools: {', '.join(sorted(known))}")
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models double-encode the arguments
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            pass
    if not isinstance(args, dict):
        return CallError(body, f'Error: "arguments" of {name} must be a JSON object', tool=name)
    expected = known[name].parameters
    missing = [k for k in expected if k not in args]
    extra = [k for k in args if k not in expected]
    if missing or extra:
        parts = ([f"missing argument(s) {', '.join(missing)}"] if missing else []) + (
            [f"unexpected argument(s) {', '.join(extra)}"] if extra else [])
        return CallError(body, f"Error: {name}: {'; '.join(parts)}; it takes {', '.join(expected)}", tool=name)
    return ParsedCall(name, args)


def final_answer(text: str) -> str | None:
    """The content of the last ``<answer>...</answer>`` of ``text`` (stripped), or None."""
    found = ANSWER.findall(text)
    return found[-1].strip() if found else None


def format_call(name: str, arguments: Mapping[str, Any]) -> str:
    """The text of one call, as Qwen writes it."""
    return f"{CALL_OPEN}\n{json.dumps({'name': name, 'arguments': dict(arguments)})}\n{CALL_CLOSE}"


def tools_system_prompt(system: str, tools: Sequence[ToolDef]) -> str:
    """The system turn's content with the tool signatures (Qwen2.5's template, verbatim)."""
    schemas = "\n".join(json.dumps(t.schema(), ensure_ascii=False) for t in tools)  # the template's tojson
    return (f"{system}\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{schemas}\n"
            "</tools>\n\nFor each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
            "<args-json-object>}\n</tool_call>")


def tool_responses(outputs: Sequence[str]) -> str:
    """The content of the user turn that carries one response per call, in call order."""
    return "\n".join(f"{RESPONSE_OPEN}\n{out}\n{RESPONSE_CLOSE}" for out in outputs)


def render_prompt(system: str, user: str) -> str:
    """ChatML text of the system and user turns, ending where the assistant starts writing."""
    return f"{IM_START}system\n{system}{IM_END}\n{IM_START}user\n{user}{IM_END}\n{IM_START}assistant\n"


def render_observation(outputs: Sequence[str]) -> str:
    """What follows a model turn that called tools: the end of that turn, the tool-response
    turn, and the start of the next assistant turn (these tokens come from tools, not the
    policy: the loss masks them). It starts with ``<|im_end|>``, the model's stop token: a
    caller whose engine keeps the stop token in the policy's output drops it here
    (``observation[len(IM_END):]``), so that it is trained on as the policy's own token."""
    return f"{IM_END}\n{IM_START}user\n{tool_responses(outputs)}{IM_END}\n{IM_START}assistant\n"
