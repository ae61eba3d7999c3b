"""Routes that are not generation: health, models, tokenize, metrics, auth."""

from __future__ import annotations

import pytest

from infernix_jax.api import ServerConfig
from tests.api.conftest import API_KEY, MODEL

pytestmark = pytest.mark.anyio


async def test_health_and_models(make_app):
    app, _ = make_app(
        config=ServerConfig(served_model_name=MODEL, model_aliases=("alias",)), max_context=1234
    )
    client = app.test_client()
    health = await (await client.get("/health")).get_json()
    assert health["status"] == "ok" and health["running"] == 0
    models = await (await client.get("/v1/models")).get_json()
    assert [m["id"] for m in models["data"]] == [MODEL, "alias"] and models["data"][0][
        "max_model_len"
    ] == 1234
    assert (await client.get("/v1/models/alias")).status_code == 200
    assert (await client.get("/v1/models/other")).status_code == 404


async def test_tokenize_round_trip_and_chat_form(make_app, tokenizer):
    app, engine = make_app()
    client = app.test_client()
    tokens = (await (await client.post("/tokenize", json={"prompt": "Hello world"})).get_json())["tokens"]
    assert tokens == tokenizer.encode("Hello world")
    text = (await (await client.post("/detokenize", json={"tokens": tokens})).get_json())["prompt"]
    assert text == "Hello world"
    messages = [{"role": "user", "content": "Hi"}]
    counted = await (await client.post("/tokenize", json={"messages": messages})).get_json()
    await client.post("/v1/chat/completions", json={"model": MODEL, "messages": messages})
    assert counted["tokens"] == engine.submitted[0].prompt_token_ids
    assert (await client.post("/detokenize", json={"tokens": ["a"]})).status_code == 400


async def test_metrics_count_requests_tokens_and_kv(make_app, tokenizer):
    app, _ = make_app("Hello there!")
    client = app.test_client()
    await client.post(
        "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    )
    text = (await (await client.get("/metrics")).get_data()).decode()
    completion = len(tokenizer.encode("Hello there!")) + 1
    assert f"infernix_generation_tokens_total {float(completion)}" in text
    assert 'infernix_requests_total{endpoint="/v1/chat/completions",status="200"} 1.0' in text
    assert "infernix_time_to_first_token_seconds_count 1.0" in text
    assert "infernix_inter_token_latency_seconds_count" in text
    assert "infernix_kv_blocks_total 256.0" in text and "infernix_requests_waiting 0.0" in text


async def test_api_key_via_bearer_or_x_api_key(make_app):
    app, _ = make_app(config=ServerConfig(served_model_name=MODEL, api_key=API_KEY))
    client = app.test_client()
    body = {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
    missing = await client.post("/v1/chat/completions", json=body)
    assert missing.status_code == 401 and (await missing.get_json())["error"]["code"] == "invalid_api_key"
    wrong = await client.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer nope"})
    assert wrong.status_code == 401
    assert (
        await client.post("/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    ).status_code == 200
    assert (
        await client.post("/v1/chat/completions", json=body, headers={"x-api-key": API_KEY})
    ).status_code == 200
    assert (await client.get("/v1/models")).status_code == 401
    assert (await client.get("/health")).status_code == 200  # probes need no key
