"""Grammars that force a tool call in the Hermes / Qwen3 JSON format.

The chat template teaches the model to call a tool as

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

`tool_call_grammar` is a Lark grammar (llguidance's dialect, with `%json` for the JSON parts)
whose strings are exactly such calls, the name one of the tools and the arguments valid for its
`parameters` schema. The server ends the prompt with the call's opening (`forced_prefix` in
api/chat_support.py), so the grammar starts where that prefix stops: after `<tool_call>\\n` for any
tool, after `"arguments": ` for a named one.
"""

from __future__ import annotations

import json
from typing import Any

from infernix_jax.structured.llguidance_backend import JSON_DEFAULTS
from infernix_jax.structured.spec import ConstraintError, ConstraintSpec


def _tags(tags_are_tokens: bool) -> tuple[str, str]:
    """Lark for the call's opening and closing. llguidance holds added tokens such as <tool_call>
    as special tokens, matched only by the `<tool_call>` token syntax, never by a quoted string."""
    if tags_are_tokens:
        return '<tool_call> "\\n"', '"\\n" </tool_call>'
    return '"<tool_call>\\n"', '"\\n</tool_call>"'


def _parameters(tool: dict) -> Any:
    function = tool.get("function", tool)
    schema = function.get("parameters")
    if schema is None:
        return {"type": "object"}
    if not isinstance(schema, (dict, bool)):
        raise ConstraintError(f"the parameters of tool {function.get('name')!r} are not a JSON schema")
    return schema


def _json_rule(schema: Any) -> str:
    if isinstance(schema, dict):
        schema = {"x-guidance": dict(JSON_DEFAULTS), **schema}
    return "%json " + json.dumps(schema)


def call_schema(tools: list[dict]) -> dict:
    """The JSON schema of one call object {"name": ..., "arguments": ...} over the tools."""
    options = []
    for tool in tools:
        function = tool.get("function", tool)
        options.append(
            {
                "type": "object",
                "properties": {"name": {"const": function["name"]}, "arguments": _parameters(tool)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
        )
    return options[0] if len(options) == 1 else {"anyOf": options}


def tool_call_grammar(
    tools: list[dict], forced_name: str | None, parallel: bool, tags_are_tokens: bool = True
) -> ConstraintSpec:
    """A grammar spec for the text after the forced prefix (see the module docstring).

    tags_are_tokens: the vocabulary has <tool_call> and </tool_call> as tokens of their own (Qwen3).
    """
    call_open, call_close = _tags(tags_are_tokens)
    if not tools:
        raise ConstraintError("a forced tool call needs tools")
    if forced_name is not None:
        [tool] = [t for t in tools if t.get("function", t).get("name") == forced_name] or [None]
        if tool is None:
            raise ConstraintError(f"no tool is named {forced_name!r}")
        lines = [
            f'start: arguments "}}" {call_close}',
            "arguments: " + _json_rule(_parameters(tool)),
        ]
    else:
        more = f' ("\\n" {call_open} call {call_close})*' if parallel else ""
        lines = [
            f"start: call {call_close}{more}",
            "call: " + _json_rule(call_schema(tools)),
        ]
    return ConstraintSpec.grammar("\n".join(lines) + "\n")
