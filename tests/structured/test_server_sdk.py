"""Structured output through the real `openai` SDK against the app over the real engine (tiny
random-weight model, real Qwen3 tokenizer): forced tool calls, response_format, thinking + schema."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from infernix_jax.api import ServerConfig, create_app
from tests.api.conftest import MODEL, live_server

THINK_OPEN = 151667
LEVEL = {
    "type": "object",
    "properties": {"level": {"type": "integer", "minimum": 1, "maximum": 5}, "unit": {"enum": ["cm", "m"]}},
    "required": ["level", "unit"],
    "additionalProperties": False,
}
PING = {
    "type": "object",
    "properties": {"loud": {"type": "boolean"}},
    "required": ["loud"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "set_level", "description": "Set the level.", "parameters": LEVEL},
    },
    {"type": "function", "function": {"name": "ping", "description": "Ping.", "parameters": PING}},
]
SCHEMAS = {"set_level": LEVEL, "ping": PING}
ANSWER = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["s", "m", "l"]}},
    "required": ["ok", "size"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Do it."}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def client(llm):
    from infernix_jax.engine.core import EngineCore
    from infernix_jax.engine.engine import AsyncEngine

    model = llm.model
    engine = AsyncEngine(
        EngineCore(model.config, model.params, llm.config, model.tokenizer, model.eos_token_ids())
    )
    config = ServerConfig(served_model_name=MODEL, reasoning_budget=6)
    app = create_app(engine, model.tokenizer, config)
    try:
        with live_server(app) as url:
            yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    finally:
        engine.close()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tool_choice_required_yields_a_valid_call(client, seed):
    response = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=1.0,
        seed=seed,
        max_tokens=40,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_tool_choice_yields_that_tool_with_valid_arguments(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "set_level"}},
        temperature=1.0,
        seed=3,
        max_tokens=40,
    )
    [call] = response.choices[0].message.tool_calls
    assert call.function.name == "set_level"
    jsonschema.validate(json.loads(call.function.arguments), LEVEL)


def test_response_format_json_schema_yields_valid_content(client):
    response = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": ANSWER, "strict": True},
        },
        temperature=1.0,
        seed=4,
        max_tokens=40,
        extra_body=NO_THINKING,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), ANSWER)


def test_invalid_schema_is_a_400_through_the_sdk(client):
    with pytest.raises(openai.BadRequestError, match="nope"):
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}},
        )


def test_thinking_within_its_budget_then_valid_json(client):
    # A bias makes the random model open its thinking (the first token may be <think> or JSON) and
    # keep thinking; the server's 6-token budget wraps the thinking up, and the answer that follows
    # is constrained (the mask overrides the bias).
    response = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": ANSWER}},
        logit_bias={str(THINK_OPEN): 100},
        temperature=1.0,
        seed=5,
        max_tokens=64,
    )
    choice = response.choices[0]
    assert choice.finish_reason == "stop"
    message = choice.message.model_dump()
    assert message["reasoning_content"]
    jsonschema.validate(json.loads(choice.message.content), ANSWER)
