"""Tool calls across protocols: parsed from Hermes output, streamed, sent back, forced by tool_choice."""

from __future__ import annotations

import json

import pytest

from infernix_jax.api import ServerConfig
from tests.api.conftest import MODEL
from tests.api.scripts import WEATHER_ANSWER, WEATHER_TOOL, weather_agent
from tests.api.test_openai_chat import sse_payloads

pytestmark = pytest.mark.anyio

USER = {"role": "user", "content": "Weather in Paris?"}


async def test_chat_tool_call_is_parsed_with_typed_arguments(make_app):
    app, engine = make_app(weather_agent)
    body = {"model": MODEL, "messages": [USER], "tools": [WEATHER_TOOL]}
    data = await (await app.test_client().post("/v1/chat/completions", json=body)).get_json()
    choice = data["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"].strip() == "Let me check."
    [call] = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"]["name"] == "get_weather" and call["id"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 2}
    # the tools were rendered into the prompt through the chat template
    assert '"name": "get_weather"' in app.extensions["infernix"].tokenizer.decode(
        engine.submitted[0].prompt_token_ids
    )


async def test_chat_tool_call_stream_matches_non_stream(make_app):
    app, _ = make_app(weather_agent)
    client = app.test_client()
    body = {"model": MODEL, "messages": [USER], "tools": [WEATHER_TOOL]}
    whole = (await (await client.post("/v1/chat/completions", json=body)).get_json())["choices"][0]
    chunks = sse_payloads(
        await (await client.post("/v1/chat/completions", json={**body, "stream": True})).get_data()
    )
    calls: dict[int, dict] = {}
    for chunk in chunks:
        for delta in chunk["choices"][0]["delta"].get("tool_calls") or []:
            entry = calls.setdefault(delta["index"], {"name": "", "arguments": ""})
            entry["name"] += delta["function"].get("name") or ""
            entry["arguments"] += delta["function"].get("arguments") or ""
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in whole["message"]["tool_calls"]
    ]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


async def test_chat_tool_result_round_trip(make_app):
    app, _ = make_app(weather_agent)
    client = app.test_client()
    body = {"model": MODEL, "messages": [USER], "tools": [WEATHER_TOOL]}
    first = (await (await client.post("/v1/chat/completions", json=body)).get_json())["choices"][0]["message"]
    call = first["tool_calls"][0]
    follow = {
        **body,
        "messages": [USER, first, {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}],
    }
    second = await (await client.post("/v1/chat/completions", json=follow)).get_json()
    assert second["choices"][0]["message"]["content"] == WEATHER_ANSWER
    assert second["choices"][0]["finish_reason"] == "stop"


async def test_tool_choice_none_leaves_tools_out(make_app):
    app, engine = make_app(weather_agent)
    body = {"model": MODEL, "messages": [USER], "tools": [WEATHER_TOOL], "tool_choice": "none"}
    data = await (await app.test_client().post("/v1/chat/completions", json=body)).get_json()
    assert data["choices"][0]["message"]["content"] == "I have no tools."
    assert "get_weather" not in app.extensions["infernix"].tokenizer.decode(
        engine.submitted[0].prompt_token_ids
    )


async def test_named_tool_choice_forces_that_call(make_app):
    # The script only writes the arguments: the server put the call's opening into the prompt.
    app, engine = make_app('{"city": "Rome"}}\n</tool_call>')
    body = {
        "model": MODEL,
        "messages": [USER],
        "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }
    data = await (await app.test_client().post("/v1/chat/completions", json=body)).get_json()
    [call] = data["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == {
        "city": "Rome"
    }
    prompt = app.extensions["infernix"].tokenizer.decode(engine.submitted[0].prompt_token_ids)
    assert prompt.endswith('<tool_call>\n{"name": "get_weather", "arguments": ')


async def test_tool_choice_naming_unknown_tool_is_400(make_app):
    app, _ = make_app(weather_agent)
    body = {
        "model": MODEL,
        "messages": [USER],
        "tools": [WEATHER_TOOL],
        "tool_choice": {"type": "function", "function": {"name": "nope"}},
    }
    response = await app.test_client().post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and (await response.get_json())["error"]["param"] == "tool_choice"


async def test_parallel_tool_calls_false_keeps_first_call(make_app):
    two = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "A"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "B"}}\n</tool_call>'
    )
    app, _ = make_app(two)
    body = {"model": MODEL, "messages": [USER], "tools": [WEATHER_TOOL]}
    client = app.test_client()
    both = (await (await client.post("/v1/chat/completions", json=body)).get_json())["choices"][0]
    one = (
        await (
            await client.post("/v1/chat/completions", json={**body, "parallel_tool_calls": False})
        ).get_json()
    )["choices"][0]
    assert [json.loads(c["function"]["arguments"])["city"] for c in both["message"]["tool_calls"]] == [
        "A",
        "B",
    ]
    assert [json.loads(c["function"]["arguments"])["city"] for c in one["message"]["tool_calls"]] == ["A"]


async def test_tolerant_mode_recovers_a_call_without_closing_tag(make_app):
    broken = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    body = {"model": MODEL, "messages": [USER], "tools": [WEATHER_TOOL]}
    app, _ = make_app(broken, config=ServerConfig(served_model_name=MODEL, tolerant_tool_calls=True))
    data = await (await app.test_client().post("/v1/chat/completions", json=body)).get_json()
    [call] = data["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Oslo"}


XML_CALL = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
)


@pytest.fixture
def xml_tokenizer(tokenizer):
    """The Qwen3 tokenizer with an XML tool-call (Qwen3-Coder style) chat template."""
    from pathlib import Path

    from infernix_jax.chat.tokenizer import Tokenizer

    fixture = Path(__file__).parents[1] / "fixtures" / "chat" / "custom_templates.json"
    template = json.loads(fixture.read_text())["templates"]["xml"]
    assert "<function=" in template
    return Tokenizer(tokenizer.backend, tokenizer.config, {"default": template})


async def test_xml_template_selects_the_qwen3_coder_parser(xml_tokenizer):
    from infernix_jax.api import create_app
    from tests.api.conftest import FakeEngine

    engine = FakeEngine(xml_tokenizer, XML_CALL)
    app = create_app(engine, xml_tokenizer, ServerConfig(served_model_name=MODEL))
    client = app.test_client()
    body = {"model": MODEL, "messages": [USER], "tools": [WEATHER_TOOL]}
    data = await (await client.post("/v1/chat/completions", json=body)).get_json()
    [call] = data["choices"][0]["message"]["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 2}  # typed by the schema
    forced = {**body, "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    await client.post("/v1/chat/completions", json=forced)
    prompt = xml_tokenizer.decode(engine.submitted[-1].prompt_token_ids)
    assert prompt.endswith("<tool_call>\n<function=get_weather>\n")
