"""Qwen's tool-call format: every malformed call is an explained error, never a crash."""

from __future__ import annotations

import json

from libra_hpc.envs.toolcall import (
    CallError,
    ParsedCall,
    ToolDef,
    final_answer,
    format_call,
    parse_tool_calls,
    render_observation,
    tools_system_prompt,
)

TOOLS = [ToolDef("calculator", "Evaluate.", {"expression": "the expression"}),
         ToolDef("search", "Search.", {"query": "words"}, resource="search")]


def test_well_formed_calls_are_parsed_in_order():
    text = ('I will compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "2*3"}}\n</tool_call>\n'
            + format_call("search", {"query": "Alvo born"}))
    assert parse_tool_calls(text, TOOLS) == [ParsedCall("calculator", {"expression": "2*3"}),
                                             ParsedCall("search", {"query": "Alvo born"})]


def test_double_encoded_arguments_are_accepted():
    body = json.dumps({"name": "search", "arguments": json.dumps({"query": "x"})})
    assert parse_tool_calls(f"<tool_call>{body}</tool_call>", TOOLS) == [ParsedCall("search", {"query": "x"})]


def _error(text):
    [found] = parse_tool_calls(text, TOOLS)
    assert isinstance(found, CallError)
    return found


def test_bad_json_says_where():
    err = _error('<tool_call>\n{"name": "calculator", "arguments": {"expression": 2*3}\n</tool_call>')
    assert err.message.startswith("Error: the tool call is not valid JSON") and "column" in err.message
    assert err.tool == "invalid"


def test_unknown_tool_lists_the_available_ones():
    err = _error(format_call("calc", {"expression": "1"}))
    assert "unknown tool 'calc'" in err.message and "calculator, search" in err.message


def test_missing_and_unexpected_arguments_are_named():
    err = _error(format_call("calculator", {"expr": "1"}))
    assert "missing argument(s) expression" in err.message and "unexpected argument(s) expr" in err.message
    assert err.tool == "calculator"


def test_other_shapes_are_errors():
    assert "string \"name\"" in _error('<tool_call>["calculator"]</tool_call>').message
    assert "must be a JSON object" in _error('<tool_call>{"name": "search", "arguments": 3}</tool_call>').message
    assert "never closed" in _error('<tool_call>{"name": "search", "arguments": {"query": "x"}}').message


def test_answer_and_qwen_rendering():
    assert final_answer("so <answer> 12 </answer> or <answer>13</answer>") == "13"
    assert final_answer("no answer") is None
    system = tools_system_prompt("Be brief.", TOOLS)
    assert system.startswith("Be brief.\n\n# Tools\n") and '"name": "calculator"' in system
    assert render_observation(["5", "No results"]) == (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n5\n</tool_response>\n<tool_response>\nNo results\n"
        "</tool_response><|im_end|>\n<|im_start|>assistant\n")
