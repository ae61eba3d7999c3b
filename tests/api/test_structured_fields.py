"""Structured-output request fields of every protocol reach the engine as one compiled constraint;
bad specs are 400s in the protocol's own error shape with the library's reason."""

from __future__ import annotations

import pytest

from infernix_jax.structured import ConstraintSpec
from tests.api.conftest import MODEL
from tests.api.scripts import WEATHER_TOOL

pytestmark = pytest.mark.anyio

USER = {"role": "user", "content": "Give me data."}
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


async def submitted_spec(make_app, path: str, body: dict) -> ConstraintSpec | None:
    app, engine = make_app('{"n": 1}')
    response = await app.test_client().post(path, json={"model": MODEL, **body})
    assert response.status_code == 200, await response.get_json()
    constraint = engine.submitted[-1].constraint
    return None if constraint is None else constraint.grammar.spec


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"response_format": {"type": "json_object"}}, ConstraintSpec.json_object()),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "n", "schema": SCHEMA, "strict": True},
                }
            },
            ConstraintSpec.json_schema(SCHEMA),
        ),
        ({"structured_outputs": {"json": SCHEMA}}, ConstraintSpec.json_schema(SCHEMA)),
        ({"structured_outputs": {"regex": "[0-9]+"}}, ConstraintSpec.regex("[0-9]+")),
        ({"structured_outputs": {"choice": ["a", "b"]}}, ConstraintSpec.choice(["a", "b"])),
        ({"guided_json": SCHEMA}, ConstraintSpec.json_schema(SCHEMA)),
        ({"guided_regex": "x+"}, ConstraintSpec.regex("x+")),
        ({"guided_choice": ["yes", "no"]}, ConstraintSpec.choice(["yes", "no"])),
        ({"guided_grammar": 'root ::= "hi"'}, ConstraintSpec.grammar('root ::= "hi"')),
        ({"response_format": {"type": "text"}}, None),
    ],
)
async def test_chat_fields_become_the_engine_constraint(make_app, fields, expected):
    body = {"messages": [USER], **NO_THINKING, **fields}
    assert await submitted_spec(make_app, "/v1/chat/completions", body) == expected


async def test_completions_take_llama_cpp_grammar_and_json_schema(make_app):
    gbnf = "root ::= [0-9]+"
    assert await submitted_spec(make_app, "/v1/completions", {"prompt": "x", "grammar": gbnf}) == (
        ConstraintSpec.grammar(gbnf)
    )
    assert await submitted_spec(make_app, "/v1/completions", {"prompt": "x", "json_schema": SCHEMA}) == (
        ConstraintSpec.json_schema(SCHEMA)
    )


async def test_responses_text_format_json_schema(make_app):
    body = {"input": "hi", "text": {"format": {"type": "json_schema", "name": "n", "schema": SCHEMA}}}
    assert await submitted_spec(make_app, "/v1/responses", body) == ConstraintSpec.json_schema(SCHEMA)


async def test_thinking_prompts_start_the_constraint_after_the_thinking(make_app, tokenizer):
    app, engine = make_app('{"n": 1}')
    client = app.test_client()
    body = {"model": MODEL, "messages": [USER], "response_format": {"type": "json_object"}}
    await client.post("/v1/chat/completions", json=body)
    thinking = engine.submitted[-1].constraint
    assert thinking.starts_after_token == tokenizer.encode("</think>")[0]
    assert thinking.may_open_token == tokenizer.encode("<think>")[0]  # Qwen3 lets the model choose
    await client.post("/v1/chat/completions", json={**body, **NO_THINKING})
    plain = engine.submitted[-1].constraint
    assert plain.starts_after_token is None and plain.may_open_token is None


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"tools": [WEATHER_TOOL], "tool_choice": "required"}),
        (
            "/v1/chat/completions",
            {
                "tools": [WEATHER_TOOL],
                "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
            },
        ),
        (
            "/v1/messages",
            {
                "tools": [
                    WEATHER_TOOL["function"] | {"input_schema": WEATHER_TOOL["function"]["parameters"]}
                ],
                "tool_choice": {"type": "any"},
                "max_tokens": 16,
            },
        ),
    ],
)
async def test_forced_tool_calls_are_constrained_and_auto_is_free(make_app, path, body):
    app, engine = make_app('{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>')
    client = app.test_client()
    response = await client.post(path, json={"model": MODEL, "messages": [USER], **body})
    assert response.status_code == 200, await response.get_json()
    spec = engine.submitted[-1].constraint.grammar.spec
    assert spec.kind == "grammar" and "%json" in spec.source and '"city"' in spec.source
    await client.post(path, json={"model": MODEL, "messages": [USER], **body, "tool_choice": None})
    assert engine.submitted[-1].constraint is None


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}}, "nope"),
        ({"structured_outputs": {"regex": "a(b"}}, "unclosed group"),
        ({"guided_grammar": "root ::= ("}, "GBNF"),
        ({"guided_choice": []}, "non-empty list"),
        ({"response_format": {"type": "xml"}}, "xml"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "give one"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "give one"),
    ],
)
async def test_bad_constraints_are_400_in_openai_shape(make_app, fields, reason):
    app, engine = make_app()
    body = {"model": MODEL, "messages": [USER], **fields}
    response = await app.test_client().post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    error = (await response.get_json())["error"]
    assert error["type"] == "invalid_request_error" and reason in error["message"]
    assert not engine.submitted


async def test_bad_tool_schema_under_anthropic_forced_tool_is_400_in_anthropic_shape(make_app):
    app, engine = make_app()
    tool = {"name": "f", "input_schema": {"type": "object", "properties": {"x": {"type": "nope"}}}}
    body = {
        "model": MODEL,
        "messages": [USER],
        "max_tokens": 8,
        "tools": [tool],
        "tool_choice": {"type": "tool", "name": "f"},
    }
    response = await app.test_client().post("/v1/messages", json=body)
    assert response.status_code == 400
    data = await response.get_json()
    assert data["type"] == "error" and "nope" in data["error"]["message"]
    assert not engine.submitted
