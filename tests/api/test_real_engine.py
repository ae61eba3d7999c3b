"""The server over the real engine: a tiny random Qwen3 model with the real Qwen3 tokenizer.

The model is the tests' qwen3_dense fixture with its embedding widened to Qwen3's vocabulary, so
prompts rendered by the real chat template fit it. Compiling the engine's few programs takes
~30 s on 2 CPU cores, hence `slow`.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import shutil
import time
from pathlib import Path

import anthropic
import numpy as np
import openai
import pytest

from infernix_jax.api import ServerConfig, create_app
from tests.api.conftest import MODEL, live_server, qwen_tokenizer_dir
from tests.api.test_anthropic_messages import ANTHROPIC_TOOL

pytestmark = pytest.mark.slow

FIXTURE = Path(__file__).parents[1] / "fixtures" / "hf" / "qwen3_dense"
QWEN3_VOCAB = 151936


def tiny_qwen3_with_real_tokenizer(folder: Path) -> Path:
    from safetensors.numpy import load_file, save_file

    weights = load_file(FIXTURE / "model.safetensors")
    hidden = weights["model.embed_tokens.weight"].shape[1]
    rng = np.random.default_rng(0)
    weights["model.embed_tokens.weight"] = (rng.standard_normal((QWEN3_VOCAB, hidden)) * 0.5).astype(
        np.float32
    )
    save_file(weights, folder / "model.safetensors")
    config = json.loads((FIXTURE / "config.json").read_text())
    config.update(vocab_size=QWEN3_VOCAB, eos_token_id=151645)
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(qwen_tokenizer_dir() / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def real_server(tmp_path_factory):
    from infernix_jax.chat.tokenizer import Tokenizer
    from infernix_jax.engine import create_engine

    folder = tiny_qwen3_with_real_tokenizer(tmp_path_factory.mktemp("tiny_qwen3"))
    engine = create_engine(
        folder,
        max_context=512,
        max_concurrency=8,
        warmup=False,
        progress=False,
        prefill_chunk=64,
        prefill_buckets=(64,),
        prefill_batch_sizes=(1,),
        decode_batch_sizes=(1, 8),
        compilation_cache_dir=None,
    )
    app = create_app(engine, Tokenizer.from_dir(folder), ServerConfig(served_model_name=MODEL))
    try:
        with live_server(app) as url:
            yield url, engine
    finally:
        engine.close()


def test_real_engine_chat_stream_equals_non_stream(real_server):
    client = openai.OpenAI(base_url=real_server[0] + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages = [{"role": "user", "content": "Hello"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=12, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=12,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == (whole.choices[0].message.content or "")
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 12
    assert whole.choices[0].finish_reason == "length"


def test_real_engine_messages_with_system_and_tools(real_server):
    client = anthropic.Anthropic(base_url=real_server[0], api_key="unused", max_retries=0, timeout=120)
    request = {
        "model": MODEL,
        "max_tokens": 6,
        "system": "You check the weather.",
        "tools": [ANTHROPIC_TOOL],
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
    }
    message = client.messages.create(**request)
    counted = client.messages.count_tokens(**{k: v for k, v in request.items() if k != "max_tokens"})
    assert message.usage.input_tokens == counted.input_tokens and message.usage.output_tokens <= 6


def test_real_engine_eight_streams_and_a_disconnect(real_server):
    url, engine = real_server

    async def one(client, i):
        stream = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Hi {i}"}],
            max_tokens=8,
            stream=True,
            stream_options={"include_usage": True},
        )
        return [c async for c in stream][-1].usage.completion_tokens

    async def eight():
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(client, i) for i in range(8)))
        finally:
            await client.close()

    assert asyncio.run(eight()) == [8] * 8

    host, port = url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=60)
    connection.request(
        "POST",
        "/v1/chat/completions",
        headers={"Content-Type": "application/json"},
        body=json.dumps(
            {
                "model": MODEL,
                "stream": True,
                "max_tokens": 400,
                "messages": [{"role": "user", "content": "A story"}],
            }
        ),
    )
    response = connection.getresponse()
    assert response.readline().startswith(b"data: ")
    assert engine.stats().kv_blocks_used > 0
    connection.sock.close()
    connection.close()
    deadline = time.monotonic() + 30
    while engine.stats().running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine.stats().running == 0 and engine.stats().kv_blocks_used == 0


def test_real_engine_rejects_bad_requests_and_stays_healthy(real_server):
    client = openai.OpenAI(base_url=real_server[0] + "/v1", api_key="unused", max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError, match="context"):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 600}])
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=-1
        )
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    assert (
        client.completions.create(model=MODEL, prompt="def f(x):", max_tokens=3).usage.completion_tokens == 3
    )


def test_real_engine_decide_reads_option_probabilities(real_server):
    import urllib.request

    body = {
        "model": MODEL,
        "type": "choice",
        "options": ["red", "green", "Ulaanbaatar"],
        "messages": [{"role": "user", "content": "Pick a colour."}],
    }
    request = urllib.request.Request(
        real_server[0] + "/v1/decide",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    data = json.loads(urllib.request.urlopen(request, timeout=120).read())
    assert sum(data["probabilities"].values()) == pytest.approx(1.0)
    assert all(lp < 0 for lp in data["logprobs"].values())
    assert data["decision"] == max(data["probabilities"], key=data["probabilities"].get)
