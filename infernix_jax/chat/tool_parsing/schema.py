"""Tool declarations and typing of argument values by each tool's JSON schema.

The Qwen3-Coder XML format writes every parameter value as raw text (`<parameter=n>\\n5\\n`);
the tool's JSON schema says whether that text means the integer 5 or the string "5". Tools
arrive in OpenAI form (`{"type": "function", "function": {"name", "parameters"}}`), flat form
(`{"name", "parameters"}`) or Anthropic form (`{"name", "input_schema"}`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from infernix_jax.chat.tool_parsing.lenient_json import loads_lenient


@dataclass(frozen=True)
class ToolSpec:
    """The name of one declared tool and the JSON schema of its arguments object."""

    name: str
    parameters: Mapping[str, Any]

    def property_schema(self, key: str) -> Mapping[str, Any] | None:
        """The schema of argument `key`, or None when the tool does not declare it."""
        properties = self.parameters.get("properties")
        if isinstance(properties, Mapping):
            schema = properties.get(key)
            if isinstance(schema, Mapping):
                return schema
        return None


def tool_specs(tools: Sequence[Mapping[str, Any]] | None) -> dict[str, ToolSpec] | None:
    """Indexes request tools by name; None when the request declared no tool list at all."""
    if tools is None:
        return None
    specs: dict[str, ToolSpec] = {}
    for tool in tools:
        function = tool.get("function") if isinstance(tool.get("function"), Mapping) else tool
        name = function.get("name")
        if not isinstance(name, str):
            continue
        parameters = function.get("parameters", function.get("input_schema")) or {}
        specs[name] = ToolSpec(name=name, parameters=parameters if isinstance(parameters, Mapping) else {})
    return specs


def resolve_tool_name(name: str, specs: dict[str, ToolSpec] | None, tolerant: bool) -> str | None:
    """The declared tool that `name` refers to, or None when it names no declared tool.

    With no tool list every name is accepted. Tolerant mode also accepts a name that differs
    from exactly one declared tool only in case or surrounding quotes.
    """
    name = name.strip()
    if specs is None:
        return name or None
    if name in specs:
        return name
    if tolerant:
        bare = name.strip("\"'`").lower()
        matches = [declared for declared in specs if declared.lower() == bare]
        if len(matches) == 1:
            return matches[0]
    return None


def _schema_types(schema: Mapping[str, Any]) -> set[str]:
    """The JSON types a schema allows (from `type`, `anyOf`/`oneOf` branches and `enum`)."""
    types: set[str] = set()
    declared = schema.get("type")
    if isinstance(declared, str):
        types.add(declared)
    elif isinstance(declared, list):
        types.update(t for t in declared if isinstance(t, str))
    for key in ("anyOf", "oneOf"):
        for branch in schema.get(key) or ():
            if isinstance(branch, Mapping):
                types |= _schema_types(branch)
    for value in schema.get("enum") or ():
        types.add(_json_type(value))
    if "const" in schema:
        types.add(_json_type(schema["const"]))
    return types


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, list):
        return "array"
    if isinstance(value, dict):
        return "object"
    return "string"


def _as_integer(raw: str) -> int | None:
    try:
        return int(raw.strip())
    except ValueError:
        pass
    try:
        number = float(raw.strip())
    except ValueError:
        return None
    return int(number) if number.is_integer() else None


def _as_number(raw: str) -> int | float | None:
    integer = _as_integer(raw) if "." not in raw and "e" not in raw.lower() else None
    if integer is not None:
        return integer
    try:
        number = float(raw.strip())
    except ValueError:
        return None
    return number if math.isfinite(number) else None


def _as_container(raw: str, kind: type, tolerant: bool) -> Any:
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        if not tolerant:
            return None
        try:
            value = loads_lenient(raw)
        except (ValueError, RecursionError):
            return None
    return value if isinstance(value, kind) else None


def convert_raw_value(raw: str, schema: Mapping[str, Any] | None, tolerant: bool) -> Any:
    """Turns the raw text of an XML parameter into the JSON value its schema asks for.

    Strings stay strings even when they look like numbers; "5" becomes 5 only for an
    integer/number parameter, "true" becomes True only for a boolean one, object and array
    parameters are read as JSON. An undeclared parameter, a schema without a type, or text that
    does not fit the declared type stays the raw string (as vLLM does).
    """
    if schema is None:
        return raw
    types = _schema_types(schema)
    if not types or types <= {"string", "null"}:
        return None if "null" in types and "string" not in types else raw
    text = raw.strip()
    if "null" in types and text == "null":
        return None
    if "boolean" in types and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if "integer" in types:
        integer = _as_integer(text)
        if integer is not None:
            return integer
    if "number" in types:
        number = _as_number(text)
        if number is not None:
            return number
    if "object" in types:
        value = _as_container(text, dict, tolerant)
        if value is not None:
            return value
    if "array" in types:
        value = _as_container(text, list, tolerant)
        if value is not None:
            return value
    return raw


def coerce_json_arguments(arguments: dict[str, Any], spec: ToolSpec | None) -> dict[str, Any]:
    """Tolerant mode: fixes JSON arguments whose scalars were sent as strings ("5" for 5).

    Only a string value whose declared type does not allow strings is converted; everything
    else is left as the model wrote it.
    """
    if spec is None:
        return arguments
    fixed: dict[str, Any] = {}
    for key, value in arguments.items():
        schema = spec.property_schema(key)
        if isinstance(value, str) and schema is not None and "string" not in _schema_types(schema):
            value = convert_raw_value(value, schema, tolerant=True)
        fixed[key] = value
    return fixed
