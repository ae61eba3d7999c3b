"""Structured-output request fields of every protocol -> one `RequestConstraint` (or None).

Accepted, at most one per request (two are a 400 naming both):

* OpenAI `response_format`: {"type": "json_object"} or {"type": "json_schema", "json_schema":
  {"name", "schema", "strict"}}; llama.cpp's {"type": "json_object", "schema": {...}} too.
* vLLM `structured_outputs`: {"json": schema, "regex": str, "choice": [str], "grammar": str,
  "json_object": true}, and the older `guided_json`, `guided_regex`, `guided_choice`,
  `guided_grammar`.
* llama.cpp (/v1/completions): `grammar` (GBNF) and `json_schema`.
* Tool choice (`plan_chat`): "required" or a named tool forces a valid call (structured/tool_calls.py).

A spec the library cannot compile is a 400 whose message is the library's reason. The grammar
backend is built once per server, on the first constrained request (~1 s for a 151k vocabulary).
"""

from __future__ import annotations

import weakref
from typing import Any

from infernix_jax.api.errors import bad_request
from infernix_jax.api.state import ServerState
from infernix_jax.chat.tool_parsing.blocks import HERMES
from infernix_jax.structured import ConstraintError, ConstraintSpec, RequestConstraint, default_backend
from infernix_jax.structured.tool_calls import tool_call_grammar

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
_GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def _from_kind(kind: str, value: Any, param: str) -> ConstraintSpec:
    if kind == "json":
        return ConstraintSpec.json_schema(value)
    if kind == "json_object":
        return ConstraintSpec.json_object()
    if kind == "regex":
        return ConstraintSpec.regex(value)
    if kind == "choice":
        return ConstraintSpec.choice(value)
    if kind == "grammar":
        return ConstraintSpec.grammar(value)
    raise bad_request(f"{param} has an unknown kind {kind!r}", param=param)


def _response_format(value: Any) -> ConstraintSpec | None:
    if not isinstance(value, dict):
        raise bad_request("response_format must be an object", param="response_format")
    kind = value.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        schema = value.get("schema")  # llama.cpp's form
        return ConstraintSpec.json_object() if schema is None else ConstraintSpec.json_schema(schema)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request(
                'response_format "json_schema" needs a json_schema object', param="response_format"
            )
        schema = spec.get("schema", spec.get("schema_"))
        if schema is None:
            raise bad_request("response_format.json_schema has no schema", param="response_format")
        return ConstraintSpec.json_schema(schema, strict=bool(spec.get("strict", True)))
    raise bad_request(
        f"response_format type {kind!r} is not one of text, json_object, json_schema", param="response_format"
    )


def _structured_outputs(value: Any) -> ConstraintSpec | None:
    if not isinstance(value, dict):
        raise bad_request("structured_outputs must be an object", param="structured_outputs")
    given = [k for k in ("json", "regex", "choice", "grammar") if value.get(k) is not None]
    if value.get("json_object"):
        given.append("json_object")
    if len(given) > 1:
        raise bad_request(
            f"structured_outputs sets {' and '.join(given)}; give one", param="structured_outputs"
        )
    return _from_kind(given[0], value.get(given[0]), "structured_outputs") if given else None


def spec_from_body(body: dict, completions: bool = False) -> tuple[ConstraintSpec | None, str | None]:
    """(the requested spec or None, the field that asked for it). Malformed fields are 400s."""
    found: list[tuple[str, ConstraintSpec]] = []
    try:
        if body.get("response_format") is not None:
            spec = _response_format(body["response_format"])
            if spec is not None:
                found.append(("response_format", spec))
        if body.get("structured_outputs") is not None:
            spec = _structured_outputs(body["structured_outputs"])
            if spec is not None:
                found.append(("structured_outputs", spec))
        for name, kind in _GUIDED.items():
            if body.get(name) is not None:
                found.append((name, _from_kind(kind, body[name], name)))
        if completions and body.get("grammar") is not None:
            found.append(("grammar", ConstraintSpec.grammar(body["grammar"])))
        if completions and body.get("json_schema") is not None:
            found.append(("json_schema", ConstraintSpec.json_schema(body["json_schema"])))
    except ConstraintError as exc:
        raise bad_request(str(exc)) from None
    if len(found) > 1:
        names = " and ".join(name for name, _ in found)
        raise bad_request(f"{names} both constrain the output; give one", param=found[1][0])
    return (found[0][1], found[0][0]) if found else (None, None)


_BACKENDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> its backend


def grammar_backend(state: ServerState):
    """The server's grammar backend, built on first use (one per tokenizer object)."""
    backend = state.structured_backend
    if backend is None:
        backend = _BACKENDS.get(state.tokenizer)
        if backend is None:
            backend = _BACKENDS[state.tokenizer] = default_backend(state.tokenizer)
        state.structured_backend = backend
    return backend


def _single_token(tokenizer: Any, text: str) -> int | None:
    ids = tokenizer.encode(text)
    return ids[0] if len(ids) == 1 else None


def build_constraint(
    state: ServerState,
    spec: ConstraintSpec | None,
    param: str | None,
    prompt_text: str = "",
    thinking: bool = False,
) -> RequestConstraint | None:
    """Compile spec (cached by content) into the request's constraint; a bad spec is a 400.

    thinking: a chat prompt whose template lets the model think first. If the prompt already
    opens the thinking block the output is free until </think>; if it leaves the choice to the
    model (no closed, empty thinking block at its end) the first token may open one instead.
    """
    if spec is None:
        return None
    try:
        grammar = grammar_backend(state).compile(spec)
    except ConstraintError as exc:
        raise bad_request(f"invalid {param or spec.kind}: {exc}", param=param) from None
    if not thinking:
        return RequestConstraint(grammar)
    close = _single_token(state.tokenizer, THINK_CLOSE)
    if close is None:
        return RequestConstraint(grammar)
    tail = prompt_text.rstrip()
    if tail.endswith(THINK_OPEN):
        return RequestConstraint(grammar, starts_after_token=close)
    if tail.endswith(THINK_CLOSE):
        return RequestConstraint(grammar)  # thinking switched off by the template
    opening = _single_token(state.tokenizer, THINK_OPEN)
    if opening is None:
        return RequestConstraint(grammar)
    return RequestConstraint(grammar, starts_after_token=close, may_open_token=opening)


def tool_call_constraint(
    state: ServerState, parser: str, tools: list[dict] | None, forced_name: str | None, parallel: bool
) -> RequestConstraint | None:
    """The grammar of a forced call (tool_choice "required" or a named tool) after its forced prefix.

    Only the Hermes JSON format (Qwen3's `<tool_call>{"name": ..., "arguments": ...}</tool_call>`)
    is constrained; other formats keep the forced prefix alone.
    """
    if parser != HERMES or not tools:
        return None
    tags_are_tokens = all(
        _single_token(state.tokenizer, t) is not None for t in ("<tool_call>", "</tool_call>")
    )
    try:
        spec = tool_call_grammar(tools, forced_name, parallel, tags_are_tokens)
    except ConstraintError as exc:
        raise bad_request(f"invalid tools: {exc}", param="tools") from None
    return build_constraint(state, spec, "tools")
