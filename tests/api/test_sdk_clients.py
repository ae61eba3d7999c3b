"""The real `openai` and `anthropic` SDKs against a live Hypercorn server on 127.0.0.1 (fake engine)."""

from __future__ import annotations

import asyncio
import http.client
import json
import time
import urllib.error
import urllib.request

import anthropic
import openai
import pytest

from infernix_jax.api import ServerConfig, create_app
from tests.api.conftest import API_KEY, MODEL, FakeEngine, live_server
from tests.api.scripts import WEATHER_ANSWER, WEATHER_TOOL, weather_agent
from tests.api.test_anthropic_messages import ANTHROPIC_TOOL

LONG_STORY = " ".join(f"word{i}" for i in range(400))


def script(prompt: str) -> str:
    if "long story" in prompt:
        return LONG_STORY
    if "Weather" in prompt:
        return weather_agent(prompt)
    return "<think>\nThey greet me.\n</think>\n\nHello! Nice to meet you."


@pytest.fixture(scope="module")
def server(tokenizer):
    engine = FakeEngine(tokenizer, script, max_context=512)
    app = create_app(engine, tokenizer, ServerConfig(served_model_name=MODEL, api_key=API_KEY))
    with live_server(app) as url:
        yield url, engine


@pytest.fixture
def oai(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key=API_KEY, max_retries=0, timeout=20)


@pytest.fixture
def claude(server):
    return anthropic.Anthropic(base_url=server[0], api_key=API_KEY, max_retries=0, timeout=20)


HELLO = [{"role": "user", "content": "Hi"}]


def test_openai_chat_stream_equals_non_stream(oai):
    whole = oai.chat.completions.create(model=MODEL, messages=HELLO, temperature=0)
    stream = oai.chat.completions.create(
        model=MODEL, messages=HELLO, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    text, usage, finish = "", None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert whole.choices[0].message.content == "Hello! Nice to meet you." == text
    assert finish == whole.choices[0].finish_reason == "stop"
    assert (
        usage.completion_tokens == whole.usage.completion_tokens
        and usage.prompt_tokens == whole.usage.prompt_tokens
    )


def test_openai_chat_tool_round_trip(oai):
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    first = oai.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL])
    call = first.choices[0].message.tool_calls[0]
    assert first.choices[0].finish_reason == "tool_calls"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] == "Paris"
    messages += [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    second = oai.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL])
    assert second.choices[0].message.content == WEATHER_ANSWER


def test_openai_completions_and_responses(oai):
    completion = oai.completions.create(model=MODEL, prompt="Hi", max_tokens=4)
    assert completion.choices[0].finish_reason == "length" and completion.usage.completion_tokens == 4
    response = oai.responses.create(model=MODEL, input="Hi", instructions="Be kind.")
    assert response.output_text == "Hello! Nice to meet you."
    with oai.responses.stream(model=MODEL, input="Hi") as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == response.output_text
    assert final.usage.output_tokens == response.usage.output_tokens


def test_anthropic_messages_with_system_tools_and_results(claude):
    first = claude.messages.create(
        model=MODEL,
        max_tokens=200,
        system="You check the weather.",
        tools=[ANTHROPIC_TOOL],
        messages=[{"role": "user", "content": "Weather in Paris?"}],
    )
    assert first.stop_reason == "tool_use"
    tool_use = next(b for b in first.content if b.type == "tool_use")
    assert tool_use.input == {"city": "Paris", "days": 2}
    second = claude.messages.create(
        model=MODEL,
        max_tokens=200,
        system="You check the weather.",
        tools=[ANTHROPIC_TOOL],
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": tool_use.id, "content": "sunny"}],
            },
        ],
    )
    assert second.stop_reason == "end_turn" and second.content[0].text == WEATHER_ANSWER


def test_anthropic_stream_equals_non_stream(claude):
    whole = claude.messages.create(model=MODEL, max_tokens=100, messages=HELLO)
    with claude.messages.stream(model=MODEL, max_tokens=100, messages=HELLO) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert [b.type for b in whole.content] == [b.type for b in final.content] == ["thinking", "text"]
    assert text == whole.content[1].text == final.content[1].text == "Hello! Nice to meet you."
    assert final.usage.output_tokens == whole.usage.output_tokens and final.stop_reason == "end_turn"
    counted = claude.messages.count_tokens(model=MODEL, messages=HELLO)
    assert counted.input_tokens == whole.usage.input_tokens + (whole.usage.cache_read_input_tokens or 0)


def test_sdk_errors_and_server_stays_healthy(server, oai, claude):
    url, _ = server
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="gpt-unknown", messages=HELLO)
    with pytest.raises(openai.BadRequestError) as negative:
        oai.chat.completions.create(model=MODEL, messages=HELLO, max_tokens=-1)
    assert "max_tokens" in str(negative.value)
    with pytest.raises(openai.BadRequestError) as too_long:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 600}])
    assert "context" in str(too_long.value)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=url, api_key="wrong", max_retries=0).messages.create(
            model=MODEL, max_tokens=10, messages=HELLO
        )
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-unknown", max_tokens=10, messages=HELLO)
    request = urllib.request.Request(
        url + "/v1/chat/completions",
        data=b"{broken",
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as malformed:
        urllib.request.urlopen(request, timeout=10)
    assert malformed.value.code == 400 and "JSON" in json.loads(malformed.value.read())["error"]["message"]
    assert oai.chat.completions.create(model=MODEL, messages=HELLO).choices[0].message.content
    assert [m.id for m in oai.models.list()] == [MODEL]


def test_eight_concurrent_streams(server):
    url, _ = server

    async def one(client: openai.AsyncOpenAI, i: int) -> str:
        stream = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Hi {i}"}], stream=True
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=20)
        try:
            return await asyncio.gather(*(one(client, i) for i in range(8)))
        finally:
            await client.close()

    assert asyncio.run(run()) == ["Hello! Nice to meet you."] * 8


@pytest.mark.parametrize("n", [1, 2])
def test_client_disconnect_aborts_and_frees_blocks(server, n):
    url, engine = server
    engine.token_delay_s = 0.01
    try:
        host, port = url.removeprefix("http://").split(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=10)
        connection.request(
            "POST",
            "/v1/chat/completions",
            headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
            body=json.dumps(
                {
                    "model": MODEL,
                    "stream": True,
                    "n": n,
                    "messages": [{"role": "user", "content": "Tell me a long story"}],
                }
            ),
        )
        response = connection.getresponse()
        assert response.status == 200
        assert response.readline().startswith(b"data: ")  # the stream is flowing
        request_ids = {r.request_id for r in engine.submitted[-n:]}
        assert len(request_ids) == n
        connection.sock.close()  # the client goes away mid-stream
        connection.close()
        deadline = time.monotonic() + 10
        while not request_ids <= set(engine.aborted) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert request_ids <= set(engine.aborted)
        assert not request_ids & set(engine.active) and engine.stats().kv_blocks_used == 0
    finally:
        engine.token_delay_s = 0.0


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
def test_client_gone_before_a_non_streaming_answer_aborts(server, path):
    url, engine = server
    engine.token_delay_s = 0.01
    try:
        host, port = url.removeprefix("http://").split(":")
        connection = http.client.HTTPConnection(host, int(port), timeout=10)
        # long enough (100 s at 10 ms a token) that only the abort ends it, on a loaded machine too
        body = {
            "model": MODEL,
            "max_tokens": 10000,
            "messages": [{"role": "user", "content": "Tell me a long story"}],
        }
        before = len(engine.submitted)
        connection.request(
            "POST",
            path,
            body=json.dumps(body),
            headers={"x-api-key": API_KEY, "Content-Type": "application/json"},
        )
        deadline = time.monotonic() + 30
        while len(engine.submitted) == before and time.monotonic() < deadline:
            time.sleep(0.01)
        request_id = engine.submitted[-1].request_id
        connection.sock.close()  # gone while the answer is being generated
        connection.close()
        while request_id not in engine.aborted and time.monotonic() < deadline:
            time.sleep(0.02)
        assert request_id in engine.aborted and request_id not in engine.active
    finally:
        engine.token_delay_s = 0.0
