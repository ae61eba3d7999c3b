"""/v1/decide: decisions read from the probabilities the engine reports for forced tokens."""

from __future__ import annotations

import math

import pytest

from tests.api.conftest import MODEL

pytestmark = pytest.mark.anyio

QUESTION = [{"role": "user", "content": "Is Paris in France? Answer yes or no."}]


def distribution(tokenizer, table: dict[str, float]):
    """forced_logprob from {token text: probability}; unlisted tokens get probability 0.001."""

    def logprob(prompt: str, token: int) -> float:
        return math.log(table.get(tokenizer.decode([token]), 0.001))

    return logprob


async def test_yes_no_sums_case_variants_and_renormalises(make_app, tokenizer):
    table = {"yes": 0.5, "Yes": 0.3, "no": 0.1, "No": 0.05}
    app, engine = make_app(forced_logprob=distribution(tokenizer, table))
    data = await (
        await app.test_client().post(
            "/v1/decide", json={"model": MODEL, "type": "yes_no", "messages": QUESTION}
        )
    ).get_json()
    assert data["decision"] == "yes"
    assert data["probabilities"]["yes"] == pytest.approx(0.8 / 0.95, rel=1e-3)
    assert data["logprobs"]["no"] == pytest.approx(math.log(0.15 + 0.001), rel=1e-3)  # "NO" too
    prompt = tokenizer.decode(engine.submitted[0].prompt_token_ids)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking is off
    assert all(r.sampling.max_tokens == 1 for r in engine.submitted)


async def test_choice_with_multi_token_option_chains_prefixes(make_app, tokenizer):
    ids = tokenizer.encode("Ulaanbaatar")
    assert len(ids) > 1
    first, rest = tokenizer.decode(ids[:1]), [tokenizer.decode([t]) for t in ids[1:]]
    table = {first: 0.5, **{piece: 0.9 for piece in rest}, "Paris": 0.2}
    app, engine = make_app(forced_logprob=distribution(tokenizer, table))
    data = await (
        await app.test_client().post(
            "/v1/decide",
            json={
                "model": MODEL,
                "type": "choice",
                "prompt": "Capital of Mongolia:",
                "options": ["Paris", "Ulaanbaatar"],
            },
        )
    ).get_json()
    assert data["decision"] == "Ulaanbaatar"
    expected = 0.5 * 0.9 ** len(rest)
    assert data["logprobs"]["Ulaanbaatar"] == pytest.approx(math.log(expected), rel=1e-2)
    prefixes = {len(r.prompt_token_ids) for r in engine.submitted}
    assert len(prefixes) == len(ids)  # one prompt length per position in the longest option


async def test_score_returns_expected_value(make_app, tokenizer):
    app, _ = make_app(forced_logprob=distribution(tokenizer, {"1": 0.1, "2": 0.2, "3": 0.7}))
    data = await (
        await app.test_client().post(
            "/v1/decide", json={"model": MODEL, "type": "score", "scale": [1, 3], "prompt": "Rate: "}
        )
    ).get_json()
    assert data["decision"] == 3
    assert data["expected"] == pytest.approx((0.1 * 1 + 0.2 * 2 + 0.7 * 3) / 1.0, rel=1e-2)


async def test_number_is_read_from_greedy_output(make_app):
    app, _ = make_app("42 apples")
    data = await (
        await app.test_client().post(
            "/v1/decide", json={"model": MODEL, "type": "number", "prompt": "How many?"}
        )
    ).get_json()
    assert data["decision"] == 42 and 0 < data["probability"] <= 1


async def test_bad_decide_requests(make_app):
    app, _ = make_app()
    client = app.test_client()
    for body in (
        {"type": "guess", "prompt": "x"},
        {"type": "choice", "prompt": "x", "options": ["a"]},
        {"type": "score", "prompt": "x", "scale": [5, 1]},
        {"type": "yes_no"},
    ):
        response = await client.post("/v1/decide", json={"model": MODEL, **body})
        assert response.status_code == 400 and (await response.get_json())["error"]["message"]
