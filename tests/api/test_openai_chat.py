"""OpenAI Chat Completions through Quart's test client."""

from __future__ import annotations

import json

import pytest

from infernix_jax.api import ServerConfig
from infernix_jax.engine.protocol import EngineStats
from tests.api.conftest import MODEL

pytestmark = pytest.mark.anyio


def sse_payloads(raw: bytes) -> list:
    """The JSON payloads of an OpenAI-style `data:` stream, up to [DONE] (asserted present)."""
    out, done = [], False
    for line in raw.decode().splitlines():
        if line.startswith("data: "):
            data = line[len("data: ") :]
            if data == "[DONE]":
                done = True
            else:
                out.append(json.loads(data))
    assert done, "the stream did not end with [DONE]"
    return out


def chat_body(**extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Say hello"}], **extra}


async def test_chat_returns_scripted_text_with_exact_usage(make_app, tokenizer):
    app, engine = make_app("Hello there!", cached_tokens=3)
    response = await app.test_client().post("/v1/chat/completions", json=chat_body())
    assert response.status_code == 200
    data = await response.get_json()
    choice = data["choices"][0]
    assert choice["message"] == {"role": "assistant", "content": "Hello there!"}
    assert choice["finish_reason"] == "stop"
    prompt_ids = engine.submitted[0].prompt_token_ids
    assert tokenizer.decode(prompt_ids) == "<|im_start|>user\nSay hello<|im_end|>\n<|im_start|>assistant\n"
    completion = len(tokenizer.encode("Hello there!")) + 1  # the end-of-sequence token counts
    assert data["usage"] == {
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": completion,
        "total_tokens": len(prompt_ids) + completion,
        "prompt_tokens_details": {"cached_tokens": 3},
    }


async def test_request_options_reach_sampling_params(make_app):
    app, engine = make_app()
    body = chat_body(
        max_completion_tokens=7,
        temperature=0.7,
        top_p=0.9,
        top_k=20,
        min_p=0.05,
        seed=11,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        stop=["END"],
        logit_bias={"42": -100},
        logprobs=True,
        top_logprobs=2,
        user="someone",
        store=False,
    )
    response = await app.test_client().post("/v1/chat/completions", json=body)
    assert response.status_code == 200
    sampling = engine.submitted[0].sampling
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p, sampling.top_k, sampling.min_p) == (
        7,
        0.7,
        0.9,
        20,
        0.05,
    )
    assert (sampling.seed, sampling.presence_penalty, sampling.frequency_penalty) == (11, 0.5, 0.25)
    assert sampling.stop == ("END",) and sampling.logit_bias == ((42, -100.0),) and sampling.logprobs == 2
    logprobs = (await response.get_json())["choices"][0]["logprobs"]["content"]
    assert len(logprobs[0]["top_logprobs"]) == 2 and isinstance(logprobs[0]["token"], str)


async def test_max_tokens_cut_gives_length(make_app):
    app, _ = make_app("one two three four five six seven eight")
    response = await app.test_client().post("/v1/chat/completions", json=chat_body(max_tokens=3))
    data = await response.get_json()
    assert data["choices"][0]["finish_reason"] == "length"
    assert data["usage"]["completion_tokens"] == 3


async def test_stop_string_ends_text_before_it(make_app):
    app, _ = make_app("alpha beta END gamma")
    response = await app.test_client().post("/v1/chat/completions", json=chat_body(stop="END"))
    choice = (await response.get_json())["choices"][0]
    assert choice["message"]["content"] == "alpha beta " and choice["finish_reason"] == "stop"


async def test_reasoning_is_split_from_content(make_app):
    app, _ = make_app("<think>\nLet me think.\n</think>\n\nThe answer is 4.")
    data = await (await app.test_client().post("/v1/chat/completions", json=chat_body())).get_json()
    message = data["choices"][0]["message"]
    assert message["reasoning_content"].strip() == "Let me think."
    assert message["content"] == "The answer is 4."


async def test_stream_equals_non_stream_and_reports_usage(make_app):
    script = "<think>\nHmm, greet.\n</think>\n\nHi! Café ☕ is open."
    app, _ = make_app(script)
    client = app.test_client()
    whole = await (await client.post("/v1/chat/completions", json=chat_body())).get_json()
    response = await client.post(
        "/v1/chat/completions", json=chat_body(stream=True, stream_options={"include_usage": True})
    )
    assert response.status_code == 200 and response.content_type.startswith("text/event-stream")
    chunks = sse_payloads(await response.get_data())
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    reasoning = "".join(
        c["choices"][0]["delta"].get("reasoning_content") or "" for c in chunks if c["choices"]
    )
    assert content == whole["choices"][0]["message"]["content"]
    assert reasoning == whole["choices"][0]["message"]["reasoning_content"]
    finals = [c for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert [c["choices"][0]["finish_reason"] for c in finals] == ["stop"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]


async def test_image_content_is_a_clear_400(make_app):
    app, engine = make_app()
    body = {
        "model": MODEL,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "what is this"},
                    {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                ],
            }
        ],
    }
    response = await app.test_client().post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    error = (await response.get_json())["error"]
    assert "image" in error["message"] and error["type"] == "invalid_request_error"
    assert engine.submitted == []


async def test_unknown_response_format_type_is_400(make_app):
    # json_object and json_schema constrain the output (tests/api/test_structured_fields.py)
    app, _ = make_app()
    body = chat_body(response_format={"type": "yaml"})
    response = await app.test_client().post("/v1/chat/completions", json=body)
    assert response.status_code == 400
    assert "'yaml'" in (await response.get_json())["error"]["message"]


async def test_bad_requests_get_openai_error_shapes(make_app):
    app, _ = make_app(max_context=64)
    client = app.test_client()
    cases = [
        (
            await client.post(
                "/v1/chat/completions", data=b"{not json", headers={"Content-Type": "application/json"}
            ),
            400,
        ),
        (await client.post("/v1/chat/completions", json=chat_body(max_tokens=-1)), 400),
        (await client.post("/v1/chat/completions", json=chat_body(temperature=-2)), 400),
        (await client.post("/v1/chat/completions", json={**chat_body(), "model": "nope"}), 404),
        (await client.post("/v1/chat/completions", json={"model": MODEL, "messages": []}), 400),
        (
            await client.post(
                "/v1/chat/completions",
                json={"model": MODEL, "messages": [{"role": "user", "content": "word " * 200}]},
            ),
            400,
        ),
        (await client.post("/v1/no/such/route", json={}), 404),
    ]
    for response, status in cases:
        assert response.status_code == status
        error = (await response.get_json())["error"]
        assert isinstance(error["message"], str) and error["message"]
    # the server still answers after all of them
    assert (await client.post("/v1/chat/completions", json=chat_body())).status_code == 200


async def test_over_long_prompt_names_context_length(make_app):
    app, _ = make_app(max_context=32)
    body = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 100}]}
    error = (await (await app.test_client().post("/v1/chat/completions", json=body)).get_json())["error"]
    assert error["code"] == "context_length_exceeded" and "32" in error["message"]


async def test_queue_full_is_503_with_retry_after(make_app):
    app, engine = make_app(config=ServerConfig(served_model_name=MODEL, max_waiting=1, retry_after_s=2))
    engine.stats = lambda: EngineStats(waiting=1)
    response = await app.test_client().post("/v1/chat/completions", json=chat_body())
    assert response.status_code == 503 and response.headers["Retry-After"] == "2"


async def test_n_choices_with_seeds_and_usage(make_app, tokenizer):
    app, engine = make_app("Hello there!")
    client = app.test_client()
    data = await (await client.post("/v1/chat/completions", json=chat_body(n=3, seed=7))).get_json()
    assert [c["index"] for c in data["choices"]] == [0, 1, 2]
    assert all(c["message"]["content"] == "Hello there!" for c in data["choices"])
    assert sorted(r.sampling.seed for r in engine.submitted) == [7, 8, 9]
    completion = len(tokenizer.encode("Hello there!")) + 1
    assert data["usage"]["completion_tokens"] == 3 * completion
    assert data["usage"]["prompt_tokens"] == len(engine.submitted[0].prompt_token_ids)
    raw = await (
        await client.post(
            "/v1/chat/completions", json=chat_body(n=2, stream=True, stream_options={"include_usage": True})
        )
    ).get_data()
    chunks = sse_payloads(raw)
    texts = {0: "", 1: ""}
    for c in chunks:
        for choice in c["choices"]:
            texts[choice["index"]] += choice["delta"].get("content") or ""
    assert texts == {0: "Hello there!", 1: "Hello there!"}
    assert chunks[-1]["usage"]["completion_tokens"] == 2 * completion


async def test_engine_rejection_is_400_and_later_failure_is_reported(make_app):
    app, engine = make_app("Hello there, friend!", fail_after=0)
    client = app.test_client()
    rejected = await client.post("/v1/chat/completions", json=chat_body())
    assert rejected.status_code == 400 and "device fault" in (await rejected.get_json())["error"]["message"]
    engine.fail_after = 2
    failed = await client.post("/v1/chat/completions", json=chat_body())
    assert failed.status_code == 500 and (await failed.get_json())["error"]["type"] == "server_error"
    chunks = sse_payloads(
        await (await client.post("/v1/chat/completions", json=chat_body(stream=True))).get_data()
    )
    assert chunks[-1]["error"]["message"] == "device fault"
    engine.fail_after = None
    assert (await client.post("/v1/chat/completions", json=chat_body())).status_code == 200
