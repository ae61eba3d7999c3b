"""/v1/decide on a live server over the real engine (tiny random Qwen3, the real Qwen3 tokenizer).

Every kind answers; an option decision is one scoring dispatch after the prompt's prefill; and
nothing compiles after warm-up. Compiling the engine's programs for a 151k vocabulary takes about
a minute on 2 CPU cores, hence `slow`.
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.request

import jax
import pytest

from infernix_jax.api import ServerConfig, create_app
from tests.api.conftest import MODEL, live_server
from tests.api.test_real_engine import tiny_qwen3_with_real_tokenizer

pytestmark = pytest.mark.slow

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
ASK = [{"role": "user", "content": "Is the sky blue?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    from infernix_jax.chat.tokenizer import Tokenizer
    from infernix_jax.engine import create_engine

    folder = tiny_qwen3_with_real_tokenizer(tmp_path_factory.mktemp("tiny_qwen3"))
    engine = create_engine(
        folder,
        max_context=256,
        max_concurrency=2,
        progress=False,
        prefill_chunk=64,
        prefill_buckets=(64,),
        prefill_batch_sizes=(1,),
        decode_batch_sizes=(2,),
        decode_steps_per_dispatch=4,
        compilation_cache_dir=None,
    )
    app = create_app(engine, Tokenizer.from_dir(folder), ServerConfig(served_model_name=MODEL))
    try:
        with live_server(app) as url:
            yield url, engine
    finally:
        engine.close()


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        url + "/v1/decide",
        data=json.dumps({"model": MODEL, **body}).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def count_calls(monkeypatch, owner, name: str, counts: dict) -> None:
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        counts[name] = counts.get(name, 0) + 1
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)


def test_every_kind_decides_in_few_dispatches_without_compiling(server, monkeypatch):
    url, engine = server
    core = engine.core
    counts: dict = {}
    count_calls(monkeypatch, core.runner, "prefill", counts)
    count_calls(monkeypatch, core.runner, "decode", counts)
    count_calls(monkeypatch, core.scorer, "_call", counts)
    compiles = {"n": 0}

    def listen(event: str, duration: float, **kwargs) -> None:
        compiles["n"] += event == COMPILE_EVENT

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        status, yes_no = post(url, {"type": "yes_no", "messages": ASK})
        one_decision = dict(counts)
        answers = {
            "choice": post(url, {"type": "choice", "options": ["red", "Ulaanbaatar"], "messages": ASK}),
            "score": post(url, {"type": "score", "scale": [1, 10], "messages": ASK}),
            "number": post(url, {"type": "number", "messages": ASK}),
            "point": post(url, {"type": "point", "messages": ASK}),
            "box": post(url, {"type": "box", "grid": [640, 480], "messages": ASK}),
        }
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert status == 200, yes_no
    # a chat prompt under 64 tokens: one prefill, then one scoring dispatch for all six variants
    assert one_decision == {"prefill": 1, "_call": 1}
    assert yes_no["usage"]["score_dispatches"] == 1
    assert sum(yes_no["probabilities"].values()) == pytest.approx(1.0)
    assert yes_no["decision"] == max(yes_no["probabilities"], key=yes_no["probabilities"].get)
    for kind, (status, data) in answers.items():
        assert status == 200, (kind, data)
    choice = answers["choice"][1]
    assert choice["usage"]["score_dispatches"] == 1 and all(lp < 0 for lp in choice["logprobs"].values())
    score = answers["score"][1]
    assert score["decision"] in range(1, 11) and 1 <= score["expected"] <= 10
    assert isinstance(answers["number"][1]["decision"], int | float)
    point = answers["point"][1]
    assert len(point["decision"]) == 2 and all(0 <= v <= 1000 for v in point["decision"])
    for coordinate in point["coordinates"]:
        assert 0 < coordinate["probability"] <= 1
        assert all(sum(d.values()) == pytest.approx(1.0) for d in coordinate["digits"])
    x1, y1, x2, y2 = answers["box"][1]["decision"]
    assert 0 <= x1 <= 640 and 0 <= x2 <= 640 and 0 <= y1 <= 480 and 0 <= y2 <= 480
    assert compiles["n"] == 0, f"{compiles['n']} compilations after warm-up"


def test_option_logprobs_equal_forced_completion_logprobs(server):
    """The scored logprob of a one-token option equals the raw logprob /v1/completions reports for
    that token when a logit bias forces it (the engine reports logprobs before the bias)."""
    from infernix_jax.chat.tokenizer import Tokenizer
    from tests.api.conftest import qwen_tokenizer_dir

    url, _ = server
    prompt = "The answer is"
    status, data = post(url, {"type": "choice", "options": [" yes", " no"], "prompt": prompt})
    assert status == 200
    tokenizer = Tokenizer.from_dir(qwen_tokenizer_dir())
    for option in (" yes", " no"):
        (token,) = tokenizer.encode(option)
        request = urllib.request.Request(
            url + "/v1/completions",
            data=json.dumps(
                {
                    "model": MODEL,
                    "prompt": prompt,
                    "max_tokens": 1,
                    "logprobs": 1,
                    "logit_bias": {str(token): 100},
                }
            ).encode(),
            headers={"Content-Type": "application/json"},
        )
        completion = json.loads(urllib.request.urlopen(request, timeout=120).read())
        forced = completion["choices"][0]["logprobs"]["token_logprobs"][0]
        assert data["variants"][option][option] == pytest.approx(forced, abs=1e-3)
    assert math.isfinite(sum(data["logprobs"].values()))


def test_bad_requests_answer_400_and_the_server_stays_healthy(server):
    url, _ = server
    for body in (
        {"type": "guess", "messages": ASK},
        {"type": "choice", "messages": ASK},
        {"type": "score", "scale": [3, 3], "messages": ASK},
    ):
        status, data = post(url, body)
        assert status == 400 and data["error"]["type"] == "invalid_request_error"
    assert post(url, {"type": "yes_no", "messages": ASK})[0] == 200
