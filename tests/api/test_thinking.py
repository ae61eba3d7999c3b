"""Thinking control: budgets and loop detection wrap the thinking up and the model goes on to answer."""

from __future__ import annotations

import pytest

from infernix_jax.api import ServerConfig
from infernix_jax.api.thinking import DEFAULT_WRAP_UP
from tests.api.conftest import MODEL
from tests.api.test_anthropic_messages import named_events
from tests.api.test_openai_chat import sse_payloads

pytestmark = pytest.mark.anyio

LONG_THOUGHT = "<think>\n" + " ".join(f"step{i}" for i in range(300)) + "\n</think>\n\nUnreachable."
LOOPING_THOUGHT = "<think>\n" + "Maybe I should check again. " * 60 + "\n</think>\n\nUnreachable."


def thinker(thought: str):
    """Thinks `thought`; once the prompt already holds closed thinking (a continuation), answers."""

    def script(prompt: str) -> str:
        return "The answer is 42." if "</think>" in prompt.split("<|im_start|>assistant")[-1] else thought

    return script


async def test_anthropic_budget_tokens_wraps_up_thinking(make_app, tokenizer):
    app, engine = make_app(thinker(LONG_THOUGHT))
    body = {
        "model": MODEL,
        "max_tokens": 500,
        "thinking": {"type": "enabled", "budget_tokens": 20},
        "messages": [{"role": "user", "content": "Think hard."}],
    }
    data = await (await app.test_client().post("/v1/messages", json=body)).get_json()
    thinking, text = data["content"]
    assert thinking["type"] == "thinking" and thinking["thinking"].rstrip().endswith(DEFAULT_WRAP_UP.strip())
    assert text == {"type": "text", "text": "The answer is 42."}
    first, second = engine.submitted
    assert engine.aborted == [first.request_id]
    generated = len(second.prompt_token_ids) - len(first.prompt_token_ids)
    assert second.prompt_token_ids[: len(first.prompt_token_ids)] == first.prompt_token_ids
    assert tokenizer.decode(second.prompt_token_ids).endswith(DEFAULT_WRAP_UP + "</think>\n\n")
    assert second.sampling.max_tokens == 500 - generated
    answer_tokens = len(tokenizer.encode("The answer is 42.")) + 1
    assert data["usage"]["output_tokens"] == generated + answer_tokens


async def test_reasoning_effort_low_and_server_budget_apply_to_openai_chat(make_app):
    app, engine = make_app(
        thinker(LONG_THOUGHT), config=ServerConfig(served_model_name=MODEL, reasoning_budget=10)
    )
    client = app.test_client()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Think."}]}
    stream = await client.post("/v1/chat/completions", json={**body, "stream": True})
    deltas = [c["choices"][0]["delta"] for c in sse_payloads(await stream.get_data())]
    assert "".join(d.get("content") or "" for d in deltas) == "The answer is 42."
    whole = await (await client.post("/v1/chat/completions", json=body)).get_json()
    message = whole["choices"][0]["message"]
    assert (
        message["content"] == "The answer is 42." and DEFAULT_WRAP_UP.strip() in message["reasoning_content"]
    )
    assert len(engine.submitted) == 4  # two requests, each continued once


async def test_unlimited_thinking_runs_to_its_end(make_app):
    app, engine = make_app(thinker("<think>\nshort\n</think>\n\nDone."))
    data = await (
        await app.test_client().post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "x"}], "reasoning_effort": "high"},
        )
    ).get_json()
    assert data["choices"][0]["message"]["content"] == "Done." and len(engine.submitted) == 1


async def test_reasoning_loop_is_wrapped_up(make_app):
    app, engine = make_app(
        thinker(LOOPING_THOUGHT), config=ServerConfig(served_model_name=MODEL, reasoning_loop=True)
    )
    body = {"model": MODEL, "max_tokens": 800, "stream": True, "messages": [{"role": "user", "content": "x"}]}
    events = named_events(await (await app.test_client().post("/v1/messages", json=body)).get_data())
    thinking = "".join(p["delta"].get("thinking", "") for n, p in events if n == "content_block_delta")
    text = "".join(p["delta"].get("text", "") for n, p in events if n == "content_block_delta")
    assert text == "The answer is 42." and thinking.count("Maybe I should check again.") < 30
    assert len(engine.submitted) == 2 and engine.aborted == [engine.submitted[0].request_id]
