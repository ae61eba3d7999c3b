"""POST /v1/decide: a decision read from token probabilities instead of generated text.

Kinds (the README defines the JSON):
* `yes_no`  -> "yes" or "no";
* `choice`  -> one of `options` (strings);
* `score`   -> an integer in `scale` [low, high], with the expected value;
* `number`  -> a number the model writes, with the probability of its tokens;
* `point`   -> [x, y] the model writes as "(x, y)", integers on a `grid` (default 1000 x 1000);
* `box`     -> [x1, y1, x2, y2] written as "(x1, y1, x2, y2)" on the same grid.

Options (yes_no, choice, score) are read exactly, in one engine score request: the probability of
each option is that of its whole token sequence after the prompt (its case variants "yes", "Yes",
"YES" summed), computed by the engine's scoring pass (engine/scoring.py: the prompt prefilled
once, then one dispatch that reads every option's tokens). Probabilities are renormalised over
the options; the raw logprobs are returned too. Options are tokenized as written: a raw prompt
that expects a space before the answer needs options with that space.

number, point and box are written by the model, greedily, under a grammar that only admits the
expected form, and read with the distribution behind each digit (api/decide_numbers.py).
"""

from __future__ import annotations

import math
import re
import time

from quart import Response, jsonify

from infernix_jax.api import chat_support, fields
from infernix_jax.api.decide_numbers import NUMBER_PATTERN, coordinates_pattern, read_integers
from infernix_jax.api.errors import ApiError, bad_request, not_supported
from infernix_jax.api.generation import clamp_max_tokens, make_sampling, new_request_id, start_generation
from infernix_jax.api.openai_chat import chat_messages
from infernix_jax.api.state import ServerState
from infernix_jax.api.structured_fields import build_constraint
from infernix_jax.engine.protocol import ScoreError, ScoreRequest
from infernix_jax.structured import ConstraintSpec

OPTION_KINDS = ("yes_no", "choice", "score")
KINDS = (*OPTION_KINDS, "number", "point", "box")
MAX_SCALE_OPTIONS = 101
MAX_OPTIONS = 64
MAX_GRID = 100_000
TOP_LOGPROBS = 20  # alternatives read at each digit step (the engine may compute fewer)
COORDINATE_NAMES = {"point": ("x", "y"), "box": ("x1", "y1", "x2", "y2")}
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def _prompt(state: ServerState, body: dict) -> str:
    """The text after which the answer starts: a chat turn with thinking off, or a raw prompt."""
    if "messages" in body:
        kwargs = dict(body.get("chat_template_kwargs") or {})
        kwargs.setdefault("enable_thinking", False)
        prompt = chat_support.render_prompt(state.tokenizer, chat_messages(body["messages"]), None, kwargs)
        if chat_support.prompt_opens_thinking(prompt):
            prompt += "\n</think>\n\n"
        return prompt
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise bad_request('send "messages" or a non-empty "prompt"', param="messages")
    return prompt


def _options(body: dict, kind: str) -> list[str]:
    if kind == "yes_no":
        return ["yes", "no"]
    if kind == "choice":
        options = body.get("options")
        if (
            not isinstance(options, list)
            or not 2 <= len(options) <= MAX_OPTIONS
            or not all(isinstance(o, str) and o for o in options)
        ):
            raise bad_request(
                f"options must be a list of 2 to {MAX_OPTIONS} non-empty strings", param="options"
            )
        if len(set(options)) != len(options):
            raise bad_request("options must be distinct", param="options")
        return options
    scale = body.get("scale", [1, 10])
    if (
        not isinstance(scale, list)
        or len(scale) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in scale)
        or scale[0] >= scale[1]
        or scale[1] - scale[0] + 1 > MAX_SCALE_OPTIONS
    ):
        raise bad_request(
            f"scale must be [low, high] integers, low < high, at most {MAX_SCALE_OPTIONS} values",
            param="scale",
        )
    return [str(v) for v in range(scale[0], scale[1] + 1)]


def _grid(body: dict) -> list[int]:
    grid = body.get("grid", [1000, 1000])
    if (
        not isinstance(grid, list)
        or len(grid) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) and 1 <= v <= MAX_GRID for v in grid)
    ):
        raise bad_request(f"grid must be [width, height], integers in 1..{MAX_GRID}", param="grid")
    return grid


def _variants(option: str) -> list[str]:
    return list(dict.fromkeys([option, option.lower(), option.capitalize(), option.upper()]))


def _logsumexp(values) -> float:
    values = list(values)
    top = max(values)
    if top == -math.inf:
        return top
    return top + math.log(sum(math.exp(v - top) for v in values))


async def handle(state: ServerState, body: dict, arrival: float) -> Response:
    model = fields.check_model(state, body)
    kind = body.get("type")
    if kind not in KINDS:
        raise bad_request(f"type must be one of {list(KINDS)}", param="type")
    options = _options(body, kind) if kind in OPTION_KINDS else None
    grid = _grid(body) if kind in COORDINATE_NAMES else None
    prompt_ids = chat_support.encode(state.tokenizer, _prompt(state, body))
    request_id = new_request_id("decide")
    result: dict = {
        "id": request_id,
        "object": "decision",
        "created": int(time.time()),
        "model": model,
        "type": kind,
    }
    if options is not None:
        result.update(await _decide_option(state, kind, options, prompt_ids, request_id, arrival))
    elif kind == "number":
        result.update(await _number(state, prompt_ids, arrival, request_id, body))
    else:
        result.update(await _coordinates(state, kind, grid, prompt_ids, arrival, request_id))
    return jsonify(result)


async def _decide_option(
    state: ServerState, kind: str, options: list[str], prompt_ids: list[int], request_id: str, arrival: float
) -> dict:
    score = getattr(state.engine, "score", None)
    if score is None:
        raise not_supported("scoring options with this engine", param="type")
    variants: dict[str, dict[str, tuple[int, ...]]] = {}  # option -> variant text -> its tokens
    for option in options:
        ids = {v: tuple(chat_support.encode(state.tokenizer, v)) for v in _variants(option)}
        variants[option] = {text: seq for text, seq in ids.items() if seq}
    candidates = list(dict.fromkeys(seq for by_text in variants.values() for seq in by_text.values()))
    longest = max(len(c) for c in candidates)
    clamp_max_tokens(state, len(prompt_ids) + longest - 1, 1)  # a 400 when the answer cannot fit
    try:
        scored = await score(ScoreRequest(request_id, list(prompt_ids), tuple(candidates), arrival))
    except ScoreError as exc:
        raise bad_request(f"the options cannot be scored: {exc}") from None
    totals = dict(zip(candidates, scored.totals()))
    detail = {o: {text: totals[seq] for text, seq in by_text.items()} for o, by_text in variants.items()}
    logprobs = {o: _logsumexp(totals[seq] for seq in set(variants[o].values())) for o in options}
    total = _logsumexp(logprobs.values())
    probabilities = {o: math.exp(lp - total) for o, lp in logprobs.items()}
    best = max(options, key=lambda o: probabilities[o])
    out = {
        "decision": int(best) if kind == "score" else best,
        "probabilities": probabilities,
        "logprobs": logprobs,
        "variants": detail,
        "usage": {
            "prompt_tokens": scored.prompt_tokens,
            "cached_tokens": scored.cached_tokens,
            "candidate_tokens": sum(len(c) for c in candidates),
            "score_dispatches": scored.score_dispatches,
        },
    }
    if kind == "score":
        out["expected"] = sum(int(o) * p for o, p in probabilities.items())
    return out


async def _generate(state: ServerState, prompt_ids, arrival, request_id, pattern: str, max_tokens: int):
    """Greedy tokens under a grammar admitting only `pattern`, with the top raw logprobs per step."""
    sampling = make_sampling(
        max_tokens=clamp_max_tokens(state, len(prompt_ids), max_tokens), logprobs=TOP_LOGPROBS
    )
    constraint = build_constraint(state, ConstraintSpec.regex(pattern), "type")
    generation = await start_generation(
        state, request_id, prompt_ids, sampling, arrival, constraint=constraint
    )
    return await generation.collect()


async def _number(
    state: ServerState, prompt_ids: list[int], arrival: float, request_id: str, body: dict
) -> dict:
    max_tokens = fields.get_int(body, "max_tokens", minimum=1) or 24
    outcome = await _generate(state, prompt_ids, arrival, request_id, NUMBER_PATTERN, max_tokens)
    match = _NUMBER.search(outcome.text)
    if match is None:
        raise bad_request(f"the model wrote no number: {outcome.text!r}", code="no_decision")
    value = float(match.group())
    logprob = sum(entry.logprob for entry in outcome.logprobs)
    return {
        "decision": int(value) if value.is_integer() and "." not in match.group() else value,
        "text": outcome.text,
        "probability": math.exp(logprob),
        "logprob": logprob,
        "usage": {"prompt_tokens": outcome.prompt_tokens, "completion_tokens": outcome.completion_tokens},
    }


async def _coordinates(
    state: ServerState, kind: str, grid: list[int], prompt_ids: list[int], arrival: float, request_id: str
) -> dict:
    names = COORDINATE_NAMES[kind]
    pattern = coordinates_pattern(len(names), grid)
    max_tokens = len(names) * (len(str(max(grid))) + 2) + 4
    outcome = await _generate(state, prompt_ids, arrival, request_id, pattern, max_tokens)
    pieces: dict[int, str] = {}

    def decode(token: int) -> str:
        if token not in pieces:
            pieces[token] = state.tokenizer.decode([token])
        return pieces[token]

    readings = read_integers(outcome.token_ids, outcome.logprobs, decode)
    if len(readings) != len(names):
        raise ApiError(
            400, f"the model wrote no {kind} (got {outcome.text!r})", param="type", code="no_decision"
        )
    logprob = sum(entry.logprob for entry in outcome.logprobs)
    return {
        "decision": [r.value for r in readings],
        "text": outcome.text,
        "grid": grid,
        "coordinates": [{"name": name, **r.as_json()} for name, r in zip(names, readings)],
        "probability": math.exp(logprob),
        "logprob": logprob,
        "usage": {"prompt_tokens": outcome.prompt_tokens, "completion_tokens": outcome.completion_tokens},
    }
