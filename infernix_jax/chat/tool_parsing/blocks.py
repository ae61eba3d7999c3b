"""Parsing the body of one tool-call block into calls.

A block is the text between `<tool_call>` and `</tool_call>` (or, in tolerant mode, a bare
`<function=...>...</function>` the model wrote without the wrapper). Two body formats exist:

- Qwen3-Coder XML: `<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>`,
  values raw text typed by the tool schema (one newline after the opening tag and one before
  the closing tag belong to the markup, as in vLLM).
- Hermes JSON: `{"name": NAME, "arguments": {...}}`.

Strict parsing accepts only the configured format, well formed, naming a declared tool.
Tolerant parsing accepts either format whatever the configured one, missing closing tags,
repairable JSON, several functions or JSON objects in one block, and tool names that differ
only in case. A block that fails to parse is None: the caller keeps it as text.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from infernix_jax.chat.tool_parsing.lenient_json import loads_lenient, loads_lenient_sequence
from infernix_jax.chat.tool_parsing.schema import (
    ToolSpec,
    coerce_json_arguments,
    convert_raw_value,
    resolve_tool_name,
)

QWEN3_CODER = "qwen3_coder"
HERMES = "hermes"
PARSER_NAMES = (QWEN3_CODER, HERMES)

_STRICT_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.DOTALL)
_STRICT_PARAMETER = re.compile(r"\s*<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)
_FUNCTION_OPEN = "<function="
_PARAMETER_OPEN = "<parameter="


@dataclass(frozen=True)
class ParsedCall:
    """A call read from a block: the declared tool's name and its typed arguments."""

    name: str
    arguments: dict[str, Any]

    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)


def parse_block(
    body: str, parser: str, specs: dict[str, ToolSpec] | None, tolerant: bool
) -> list[ParsedCall] | None:
    """The calls in one block body, or None when the block must stay text."""
    if not tolerant:
        call = _parse_xml_strict(body, specs) if parser == QWEN3_CODER else _parse_json_strict(body, specs)
        return [call] if call is not None else None
    stripped = body.lstrip()
    if _FUNCTION_OPEN in body and not stripped.startswith(("{", "[")):
        calls = _parse_xml_tolerant(body, specs)
    elif stripped.startswith(("{", "[")):
        calls = _parse_json_tolerant(stripped, specs)
    else:
        calls = None
    return calls or None


def _strip_markup_newlines(value: str) -> str:
    value = value.removeprefix("\n")
    value = value.removesuffix("\n")
    return value


def _typed_parameters(pairs: list[tuple[str, str]], spec: ToolSpec | None, tolerant: bool) -> dict[str, Any]:
    return {
        key: convert_raw_value(value, spec.property_schema(key) if spec else None, tolerant)
        for key, value in pairs
    }


def _parse_xml_strict(body: str, specs: dict[str, ToolSpec] | None) -> ParsedCall | None:
    match = _STRICT_FUNCTION.fullmatch(body)
    if match is None:
        return None
    name = resolve_tool_name(match.group(1), specs, tolerant=False)
    if name is None:
        return None
    inner, pos, pairs = match.group(2), 0, []
    while True:
        parameter = _STRICT_PARAMETER.match(inner, pos)
        if parameter is None:
            break
        pairs.append((parameter.group(1).strip(), _strip_markup_newlines(parameter.group(2))))
        pos = parameter.end()
    if inner[pos:].strip():
        return None
    spec = specs.get(name) if specs else None
    return ParsedCall(name, _typed_parameters(pairs, spec, tolerant=False))


def _split_tag_name(text: str) -> tuple[str, str] | None:
    """`NAME>rest` (or `NAME\\nrest` when the `>` is missing) -> (NAME, rest)."""
    match = re.match(r"([^>\n]*)(>|\n)", text)
    if match is None:
        return None
    return match.group(1).strip(), text[match.end() :]


def _parse_xml_tolerant(body: str, specs: dict[str, ToolSpec] | None) -> list[ParsedCall] | None:
    segments = body.split(_FUNCTION_OPEN)[1:]
    calls = []
    for segment in segments:
        head = _split_tag_name(segment)
        if head is None:
            return None
        raw_name, rest = head
        name = resolve_tool_name(raw_name, specs, tolerant=True)
        if name is None:
            return None
        rest = rest.split("</function>")[0]
        spec = specs.get(name) if specs else None
        if _PARAMETER_OPEN not in rest and rest.strip().startswith("{"):
            arguments = _arguments_from_json_text(rest.strip())
            if arguments is None:
                return None
            calls.append(ParsedCall(name, coerce_json_arguments(arguments, spec)))
            continue
        pairs = []
        for chunk in rest.split(_PARAMETER_OPEN)[1:]:
            parameter = _split_tag_name(chunk)
            if parameter is None:
                continue  # a parameter cut off inside its own name
            key, value = parameter
            value = value.split("</parameter>")[0]
            pairs.append((key, _strip_markup_newlines(value)))
        calls.append(ParsedCall(name, _typed_parameters(pairs, spec, tolerant=True)))
    return calls


def _parse_json_strict(body: str, specs: dict[str, ToolSpec] | None) -> ParsedCall | None:
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments")
    if isinstance(arguments, str):
        arguments = _arguments_from_json_text(arguments, tolerant=False)
    if not isinstance(arguments, dict):
        return None
    name = resolve_tool_name(obj["name"], specs, tolerant=False)
    return ParsedCall(name, arguments) if name is not None else None


def _arguments_from_json_text(text: str, tolerant: bool = True) -> dict[str, Any] | None:
    try:
        value = json.loads(text)
    except (ValueError, RecursionError):
        if not tolerant:
            return None
        try:
            value = loads_lenient(text)
        except (ValueError, RecursionError):
            return None
    return value if isinstance(value, dict) else None


def _call_from_object(obj: Any, specs: dict[str, ToolSpec] | None) -> ParsedCall | None:
    if not isinstance(obj, Mapping):
        return None
    if isinstance(obj.get("function"), Mapping) and "name" not in obj:
        obj = obj["function"]  # an OpenAI-shaped {"type": "function", "function": {...}}
    raw_name = obj.get("name")
    if not isinstance(raw_name, str):
        return None
    name = resolve_tool_name(raw_name, specs, tolerant=True)
    if name is None:
        return None
    arguments: Any = {}
    for key in ("arguments", "parameters", "args", "input"):
        if key in obj:
            arguments = obj[key]
            break
    if isinstance(arguments, str):
        arguments = _arguments_from_json_text(arguments) if arguments.strip() else {}
    if not isinstance(arguments, dict):
        return None
    return ParsedCall(name, coerce_json_arguments(arguments, specs.get(name) if specs else None))


def _parse_json_tolerant(body: str, specs: dict[str, ToolSpec] | None) -> list[ParsedCall] | None:
    try:
        values = loads_lenient_sequence(body)
    except (ValueError, RecursionError):
        return None
    objects: list[Any] = []
    for value in values:
        objects.extend(value if isinstance(value, list) else [value])
    calls = [_call_from_object(obj, specs) for obj in objects]
    if not calls or any(call is None for call in calls):
        return None
    return calls  # type: ignore[return-value]
