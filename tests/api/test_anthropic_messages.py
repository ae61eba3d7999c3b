"""Anthropic Messages through Quart's test client: shapes, stop reasons, usage, streams, errors."""

from __future__ import annotations

import json

import pytest

from infernix_jax.api import ServerConfig
from tests.api.conftest import API_KEY, MODEL
from tests.api.scripts import WEATHER_ANSWER, WEATHER_TOOL, weather_agent

pytestmark = pytest.mark.anyio

ANTHROPIC_TOOL = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": WEATHER_TOOL["function"]["parameters"],
}


def named_events(raw: bytes) -> list[tuple[str, dict]]:
    out, name = [], None
    for line in raw.decode().splitlines():
        if line.startswith("event: "):
            name = line[len("event: ") :]
        elif line.startswith("data: "):
            payload = json.loads(line[len("data: ") :])
            assert payload["type"] == name
            out.append((name, payload))
    return out


def body(**extra) -> dict:
    return {"model": MODEL, "max_tokens": 100, "messages": [{"role": "user", "content": "Hi"}], **extra}


async def test_message_with_system_blocks_thinking_and_usage(make_app, tokenizer):
    script = "<think>\nA greeting.\n</think>\n\nHello!"
    app, engine = make_app(script, cached_tokens=4)
    request = body(
        system=[{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
        metadata={"user_id": "u1"},
        top_k=5,
        stop_sequences=["###"],
    )
    data = await (await app.test_client().post("/v1/messages", json=request)).get_json()
    assert data["type"] == "message" and data["role"] == "assistant" and data["model"] == MODEL
    assert [b["type"] for b in data["content"]] == ["thinking", "text"]
    assert data["content"][0]["thinking"].strip() == "A greeting." and data["content"][1]["text"] == "Hello!"
    assert data["stop_reason"] == "end_turn" and data["stop_sequence"] is None
    prompt = engine.submitted[0].prompt_token_ids
    assert tokenizer.decode(prompt).startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert engine.submitted[0].sampling.top_k == 5 and engine.submitted[0].sampling.stop == ("###",)
    assert data["usage"] == {
        "input_tokens": len(prompt) - 4,
        "output_tokens": len(tokenizer.encode(script)) + 1,
        "cache_read_input_tokens": 4,
        "cache_creation_input_tokens": 0,
    }


async def test_stop_reasons(make_app):
    app, _ = make_app("one two three ### four five")
    client = app.test_client()
    cut = await (await client.post("/v1/messages", json=body(max_tokens=2))).get_json()
    assert cut["stop_reason"] == "max_tokens"
    stopped = await (await client.post("/v1/messages", json=body(stop_sequences=["###"]))).get_json()
    assert stopped["stop_reason"] == "stop_sequence" and stopped["stop_sequence"] == "###"
    assert stopped["content"] == [{"type": "text", "text": "one two three "}]


async def test_tool_use_and_tool_result_round_trip(make_app):
    app, engine = make_app(weather_agent)
    client = app.test_client()
    first = await (
        await client.post(
            "/v1/messages",
            json=body(messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[ANTHROPIC_TOOL]),
        )
    ).get_json()
    assert first["stop_reason"] == "tool_use"
    tool_use = next(b for b in first["content"] if b["type"] == "tool_use")
    assert tool_use["name"] == "get_weather" and tool_use["input"] == {"city": "Paris", "days": 2}
    assert tool_use["id"].startswith("toolu_")
    follow = body(
        tools=[ANTHROPIC_TOOL],
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": first["content"]},
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": tool_use["id"],
                        "content": [{"type": "text", "text": "sunny"}],
                    }
                ],
            },
        ],
    )
    second = await (await client.post("/v1/messages", json=follow)).get_json()
    assert second["content"] == [{"type": "text", "text": WEATHER_ANSWER}]
    prompt = app.extensions["infernix"].tokenizer.decode(engine.submitted[-1].prompt_token_ids)
    assert "<tool_response>\nsunny\n</tool_response>" in prompt


async def test_stream_events_in_order_and_equal_to_non_stream(make_app):
    app, _ = make_app(weather_agent)
    client = app.test_client()
    request = body(messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[ANTHROPIC_TOOL])
    whole = await (await client.post("/v1/messages", json=request)).get_json()
    events = named_events(
        await (await client.post("/v1/messages", json={**request, "stream": True})).get_data()
    )
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    blocks: dict[int, dict] = {}
    for name, payload in events:
        if name == "content_block_start":
            blocks[payload["index"]] = dict(payload["content_block"], partial="")
        elif name == "content_block_delta":
            delta, block = payload["delta"], blocks[payload["index"]]
            key = {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial"}[
                delta["type"]
            ]
            block[key] = (
                block.get(key, "")
                + delta[
                    {"text_delta": "text", "thinking_delta": "thinking", "input_json_delta": "partial_json"}[
                        delta["type"]
                    ]
                ]
            )
    streamed_calls = [
        (b["name"], json.loads(b["partial"])) for b in blocks.values() if b["type"] == "tool_use"
    ]
    assert streamed_calls == [(b["name"], b["input"]) for b in whole["content"] if b["type"] == "tool_use"]
    streamed_text = "".join(b.get("text", "") for b in blocks.values() if b["type"] == "text")
    assert streamed_text == "".join(b["text"] for b in whole["content"] if b["type"] == "text")
    assert [b["type"] for b in blocks.values()] == [b["type"] for b in whole["content"]]
    delta = events[-2][1]
    assert (
        delta["delta"]["stop_reason"] == "tool_use"
        and delta["usage"]["output_tokens"] == whole["usage"]["output_tokens"]
    )


async def test_count_tokens_matches_the_prompt(make_app):
    app, engine = make_app()
    client = app.test_client()
    request = body(system="Be brief.", tools=[ANTHROPIC_TOOL])
    counted = await (await client.post("/v1/messages/count_tokens", json=request)).get_json()
    await client.post("/v1/messages", json=request)
    assert counted == {"input_tokens": len(engine.submitted[0].prompt_token_ids)}


async def test_errors_in_anthropic_shape(make_app):
    app, _ = make_app(config=ServerConfig(served_model_name=MODEL, api_key=API_KEY))
    client = app.test_client()
    unauthorized = await client.post("/v1/messages", json=body())
    assert unauthorized.status_code == 401
    assert (await unauthorized.get_json())["error"]["type"] == "authentication_error"
    headers = {"x-api-key": API_KEY}
    image = body(
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
                ],
            }
        ]
    )
    for request, status, kind in [
        (image, 400, "invalid_request_error"),
        (body(max_tokens=-5), 400, "invalid_request_error"),
        ({**body(), "model": "claude-x"}, 404, "not_found_error"),
    ]:
        response = await client.post("/v1/messages", json=request, headers=headers)
        assert response.status_code == status
        data = await response.get_json()
        assert data["type"] == "error" and data["error"]["type"] == kind and data["error"]["message"]
    assert (await client.post("/v1/messages", json=body(), headers=headers)).status_code == 200
