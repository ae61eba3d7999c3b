"""OpenAI Completions and Responses through Quart's test client."""

from __future__ import annotations

import json

import pytest

from tests.api.conftest import MODEL
from tests.api.scripts import WEATHER_TOOL, weather_agent
from tests.api.test_anthropic_messages import named_events
from tests.api.test_openai_chat import sse_payloads

pytestmark = pytest.mark.anyio

RESPONSES_TOOL = {"type": "function", **WEATHER_TOOL["function"]}


async def test_completion_uses_raw_prompt_and_echo(make_app, tokenizer):
    app, engine = make_app(" world, and more")
    client = app.test_client()
    data = await (
        await client.post(
            "/v1/completions", json={"model": MODEL, "prompt": "Hello", "echo": True, "max_tokens": 50}
        )
    ).get_json()
    assert engine.submitted[0].prompt_token_ids == tokenizer.encode("Hello")
    assert data["object"] == "text_completion" and data["choices"][0]["text"] == "Hello world, and more"
    assert data["choices"][0]["finish_reason"] == "stop"
    assert data["usage"]["prompt_tokens"] == len(tokenizer.encode("Hello"))


async def test_completion_defaults_to_16_tokens_and_streams_the_same_text(make_app, tokenizer):
    app, engine = make_app("a b c d e f g h i j k l m n o p q r s t u v w x y z")
    client = app.test_client()
    whole = await (
        await client.post("/v1/completions", json={"model": MODEL, "prompt": [1, 2, 3]})
    ).get_json()
    assert engine.submitted[0].prompt_token_ids == [1, 2, 3] and engine.submitted[0].sampling.max_tokens == 16
    assert whole["choices"][0]["finish_reason"] == "length"
    chunks = sse_payloads(
        await (
            await client.post(
                "/v1/completions",
                json={
                    "model": MODEL,
                    "prompt": [1, 2, 3],
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            )
        ).get_data()
    )
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == whole["choices"][0]["text"]
    assert chunks[-1]["usage"] == whole["usage"]


async def test_completion_logprobs_and_bad_prompt(make_app):
    app, _ = make_app("yes")
    client = app.test_client()
    data = await (
        await client.post("/v1/completions", json={"model": MODEL, "prompt": "Q?", "logprobs": 2})
    ).get_json()
    logprobs = data["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) >= 1
    assert all(len(top) <= 2 for top in logprobs["top_logprobs"])
    bad = await client.post("/v1/completions", json={"model": MODEL, "prompt": {"x": 1}})
    assert bad.status_code == 400 and (await bad.get_json())["error"]["param"] == "prompt"


async def test_response_with_reasoning_message_and_usage(make_app, tokenizer):
    app, engine = make_app("<think>\nShort.\n</think>\n\nBonjour!", cached_tokens=2)
    data = await (
        await app.test_client().post(
            "/v1/responses", json={"model": MODEL, "instructions": "Answer in French.", "input": "Hello"}
        )
    ).get_json()
    assert data["object"] == "response" and data["status"] == "completed"
    assert [item["type"] for item in data["output"]] == ["reasoning", "message"]
    assert data["output"][1]["content"][0] == {
        "type": "output_text",
        "text": "Bonjour!",
        "annotations": [],
        "logprobs": [],
    }
    prompt = tokenizer.decode(engine.submitted[0].prompt_token_ids)
    assert prompt.startswith("<|im_start|>system\nAnswer in French.<|im_end|>")
    assert data["usage"]["input_tokens"] == len(engine.submitted[0].prompt_token_ids)
    assert data["usage"]["input_tokens_details"] == {"cached_tokens": 2}


async def test_response_function_call_round_trip_and_stream(make_app):
    app, _ = make_app(weather_agent)
    client = app.test_client()
    request = {"model": MODEL, "input": "Weather in Paris?", "tools": [RESPONSES_TOOL]}
    first = await (await client.post("/v1/responses", json=request)).get_json()
    [call] = [item for item in first["output"] if item["type"] == "function_call"]
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == {"city": "Paris", "days": 2}
    events = named_events(
        await (await client.post("/v1/responses", json={**request, "stream": True})).get_data()
    )
    assert events[0][0] == "response.created" and events[-1][0] == "response.completed"
    assert [p["sequence_number"] for _, p in events] == list(range(len(events)))
    done = [p["arguments"] for n, p in events if n == "response.function_call_arguments.done"]
    assert [json.loads(a) for a in done] == [json.loads(call["arguments"])]
    streamed_output = events[-1][1]["response"]["output"]
    assert [i["type"] for i in streamed_output] == [i["type"] for i in first["output"]]
    follow = {
        **request,
        "input": [
            {"role": "user", "content": "Weather in Paris?"},
            call,
            {"type": "function_call_output", "call_id": call["call_id"], "output": "sunny"},
        ],
    }
    second = await (await client.post("/v1/responses", json=follow)).get_json()
    assert second["output"][-1]["content"][0]["text"] == "It is sunny in Paris."


async def test_response_incomplete_and_unsupported_options(make_app):
    app, _ = make_app("many words here to cut off early")
    client = app.test_client()
    cut = await (
        await client.post("/v1/responses", json={"model": MODEL, "input": "x", "max_output_tokens": 2})
    ).get_json()
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}
    for request in ({"model": MODEL, "input": "x", "previous_response_id": "resp_1"},):
        response = await client.post("/v1/responses", json=request)
        assert (
            response.status_code == 400
            and "not supported yet" in (await response.get_json())["error"]["message"]
        )


PATCH = "*** Begin Patch\n*** Add File: hello.txt\n+hello\n*** End Patch"
APPLY_PATCH = {
    "type": "custom",
    "name": "apply_patch",
    "description": "Edit files with a patch.",
    "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/s"},
}


async def test_custom_tool_is_a_string_input_call_both_ways(make_app, tokenizer):
    call = json.dumps({"name": "apply_patch", "arguments": {"input": PATCH}})
    app, engine = make_app(f"<tool_call>\n{call}\n</tool_call>")
    client = app.test_client()
    request = {"model": MODEL, "input": "Add hello.txt", "tools": [APPLY_PATCH, {"type": "web_search"}]}
    data = await (await client.post("/v1/responses", json=request)).get_json()
    [item] = data["output"]
    assert item["type"] == "custom_tool_call" and item["name"] == "apply_patch" and item["input"] == PATCH
    events = named_events(
        await (await client.post("/v1/responses", json={**request, "stream": True})).get_data()
    )
    done = [p["input"] for n, p in events if n == "response.custom_tool_call_input.done"]
    assert done == [PATCH]
    follow = {
        **request,
        "input": [
            {"role": "user", "content": "Add hello.txt"},
            item,
            {"type": "custom_tool_call_output", "call_id": item["call_id"], "output": "Done!"},
        ],
    }
    await client.post("/v1/responses", json=follow)
    prompt = tokenizer.decode(engine.submitted[-1].prompt_token_ids)
    assert '"name": "apply_patch", "arguments": {"input": "*** Begin Patch' in prompt
    assert "<tool_response>\nDone!\n</tool_response>" in prompt


async def test_completion_n_choices_stream(make_app):
    app, _ = make_app("abc")
    raw = await (
        await app.test_client().post(
            "/v1/completions", json={"model": MODEL, "prompt": "x", "n": 2, "stream": True}
        )
    ).get_data()
    finishes = [c["choices"][0]["index"] for c in sse_payloads(raw) if c["choices"][0]["finish_reason"]]
    assert sorted(finishes) == [0, 1]
