"""/v1/decide over a scripted engine: option probabilities, numbers, points, boxes and bad requests."""

from __future__ import annotations

import math

import pytest

from infernix_jax.api import ServerConfig, create_app
from infernix_jax.api.decide_numbers import coordinates_pattern, integer_range_pattern, read_integers
from infernix_jax.engine.protocol import ScoreRequest, ScoreResult, TokenLogprob
from tests.api.conftest import MODEL, FakeEngine

pytestmark = pytest.mark.anyio

QUESTION = [{"role": "user", "content": "Is Paris in France? Answer yes or no."}]


class ScoringFakeEngine(FakeEngine):
    """The scripted engine with `score`: each candidate token's logprob is `forced_logprob`."""

    def __init__(self, tokenizer, *args, **kwargs):
        super().__init__(tokenizer, *args, **kwargs)
        self.scored: list[ScoreRequest] = []

    async def score(self, request: ScoreRequest) -> ScoreResult:
        self.scored.append(request)
        prompt = self.tokenizer.decode(request.prompt_token_ids)
        values = tuple(tuple(self.forced_logprob(prompt, t) for t in c) for c in request.candidates)
        return ScoreResult(request.request_id, values, len(request.prompt_token_ids), 0, 1)


def build(tokenizer, script="Hello there!", **engine_kwargs):
    engine = ScoringFakeEngine(tokenizer, script, **engine_kwargs)
    return create_app(engine, tokenizer, ServerConfig(served_model_name=MODEL)), engine


def distribution(tokenizer, table: dict[str, float]):
    """forced_logprob from {token text: probability}; unlisted tokens get probability 0.001."""

    def logprob(prompt: str, token: int) -> float:
        return math.log(table.get(tokenizer.decode([token]), 0.001))

    return logprob


async def decide(app, **body):
    response = await app.test_client().post("/v1/decide", json={"model": MODEL, **body})
    return response.status_code, await response.get_json()


async def test_yes_no_sums_case_variants_in_one_score_request(tokenizer):
    table = {"yes": 0.5, "Yes": 0.3, "no": 0.1, "No": 0.05}
    app, engine = build(tokenizer, forced_logprob=distribution(tokenizer, table))
    status, data = await decide(app, type="yes_no", messages=QUESTION)
    assert status == 200 and data["decision"] == "yes"
    assert data["probabilities"]["yes"] == pytest.approx(0.8 / 0.95, rel=1e-3)
    assert data["logprobs"]["no"] == pytest.approx(math.log(0.15 + 0.001), rel=1e-3)  # "NO" too
    assert data["variants"]["yes"]["Yes"] == pytest.approx(math.log(0.3))
    assert len(engine.scored) == 1 and not engine.submitted  # one scoring request, nothing generated
    prompt = tokenizer.decode(engine.scored[0].prompt_token_ids)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # thinking is off
    assert data["usage"]["score_dispatches"] == 1


async def test_choice_with_multi_token_option_multiplies_its_tokens(tokenizer):
    ids = tokenizer.encode("Ulaanbaatar")
    assert len(ids) > 1
    first, rest = tokenizer.decode(ids[:1]), [tokenizer.decode([t]) for t in ids[1:]]
    table = {first: 0.5, **{piece: 0.9 for piece in rest}, "Paris": 0.2}
    app, engine = build(tokenizer, forced_logprob=distribution(tokenizer, table))
    status, data = await decide(
        app, type="choice", prompt="Capital of Mongolia:", options=["Paris", "Ulaanbaatar"]
    )
    assert status == 200 and data["decision"] == "Ulaanbaatar"
    assert data["logprobs"]["Ulaanbaatar"] == pytest.approx(math.log(0.5 * 0.9 ** len(rest)), rel=1e-2)
    assert tuple(ids) in engine.scored[0].candidates


async def test_score_returns_expected_value(tokenizer):
    app, _ = build(tokenizer, forced_logprob=distribution(tokenizer, {"1": 0.1, "2": 0.2, "3": 0.7}))
    status, data = await decide(app, type="score", scale=[1, 3], prompt="Rate: ")
    assert status == 200 and data["decision"] == 3
    assert data["expected"] == pytest.approx(0.1 * 1 + 0.2 * 2 + 0.7 * 3, rel=1e-2)


async def test_number_is_read_from_greedy_output(tokenizer):
    app, engine = build(tokenizer, "42 apples")
    status, data = await decide(app, type="number", prompt="How many?")
    assert status == 200 and data["decision"] == 42 and 0 < data["probability"] <= 1
    assert engine.submitted[0].constraint is not None  # the grammar admits only a number


async def test_point_and_box_return_coordinates_with_their_digit_distributions(tokenizer):
    app, _ = build(tokenizer, "(512, 30)")
    status, data = await decide(app, type="point", prompt="Where is the cat?")
    assert status == 200 and data["decision"] == [512, 30] and data["grid"] == [1000, 1000]
    x = data["coordinates"][0]
    assert x["name"] == "x" and x["value"] == 512 and len(x["digits"]) == 3
    assert all(sum(d.values()) == pytest.approx(1.0) for d in x["digits"])
    assert 0 <= x["expected"] <= 999 and 0 < x["probability"] <= 1
    app, _ = build(tokenizer, "(1, 2, 300, 400)")
    status, data = await decide(app, type="box", prompt="Box the cat.", grid=[640, 480])
    assert status == 200 and data["decision"] == [1, 2, 300, 400]
    assert [c["name"] for c in data["coordinates"]] == ["x1", "y1", "x2", "y2"]


async def test_an_answer_without_a_point_is_a_400(tokenizer):
    app, _ = build(tokenizer, "no idea")
    status, data = await decide(app, type="point", prompt="Where?")
    assert status == 400 and data["error"]["code"] == "no_decision"


async def test_bad_decide_requests_are_400_in_the_openai_shape(tokenizer):
    app, _ = build(tokenizer)
    for body, param in (
        ({"type": "guess", "prompt": "x"}, "type"),
        ({"prompt": "x"}, "type"),
        ({"type": "choice", "prompt": "x"}, "options"),
        ({"type": "choice", "prompt": "x", "options": ["a"]}, "options"),
        ({"type": "choice", "prompt": "x", "options": ["a", "a"]}, "options"),
        ({"type": "score", "prompt": "x", "scale": [5, 1]}, "scale"),
        ({"type": "score", "prompt": "x", "scale": [0, 1000]}, "scale"),
        ({"type": "point", "prompt": "x", "grid": [0, 10]}, "grid"),
        ({"type": "box", "prompt": "x", "grid": "big"}, "grid"),
        ({"type": "yes_no"}, "messages"),
    ):
        status, data = await decide(app, **body)
        assert status == 400, body
        error = data["error"]
        assert error["type"] == "invalid_request_error" and error["message"] and error["param"] == param


async def test_an_engine_that_cannot_score_answers_400(make_app):
    app, _ = make_app()
    response = await app.test_client().post(
        "/v1/decide", json={"model": MODEL, "type": "yes_no", "prompt": "Is it?"}
    )
    assert response.status_code == 400 and (await response.get_json())["error"]["code"] == "not_supported"


def test_integer_range_pattern_matches_exactly_the_range():
    import re

    for high in (0, 7, 10, 99, 100, 480, 1000, 1920):
        pattern = re.compile(integer_range_pattern(high))
        matched = [n for n in range(3 * high + 20) if pattern.fullmatch(str(n))]
        assert matched == list(range(high + 1))
        assert not pattern.fullmatch("01")
    assert re.fullmatch(coordinates_pattern(2, [640, 480]), "(640, 480)")
    assert not re.fullmatch(coordinates_pattern(2, [640, 480]), "(640, 481)")


def test_digit_distributions_give_the_expected_value():
    digits = {str(d): 100 + d for d in range(10)}  # token ids of "0".."9"
    decode = {**{v: k for k, v in digits.items()}, 1: "(", 2: ")"}.__getitem__
    # "(42)": the first digit is "4" (0.6) or "5" (0.2) or "(" (0.2, not a digit); the second is sure
    first = TokenLogprob(
        digits["4"],
        math.log(0.6),
        ((digits["4"], math.log(0.6)), (digits["5"], math.log(0.2)), (1, math.log(0.2))),
    )
    second = TokenLogprob(digits["2"], 0.0, ((digits["2"], 0.0),))
    plain = TokenLogprob(1, 0.0)
    (reading,) = read_integers([1, digits["4"], digits["2"], 2], [plain, first, second, plain], decode)
    assert reading.value == 42
    assert reading.logprob == pytest.approx(math.log(0.6))
    assert reading.digits[0]["4"] == pytest.approx(0.75) and reading.digits[0]["5"] == pytest.approx(0.25)
    assert reading.expected == pytest.approx(10 * (4 * 0.75 + 5 * 0.25) + 2)
