"""POST /v1/decide: a decision read from token probabilities instead of generated text.

Kinds:
* `yes_no`  -> "yes" or "no";
* `choice`  -> one of `options` (strings);
* `score`   -> an integer in `scale` [low, high], with the expected value;
* `number`  -> a number the model writes (greedy), with the probability of its tokens.

For options, the probability of each option is the probability of its whole token sequence after
the prompt, read exactly: every token of every option is forced in turn (a +100 logit bias on it
alone, one token generated) and the engine reports its logprob under the model's raw
distribution. Those one-token requests share the prompt, so the prefix cache makes them cheap.
The probabilities returned are renormalised over the options, and the raw logprobs are returned
too. Case variants ("Yes"/"yes") of an option count towards it.
"""

from __future__ import annotations

import asyncio
import math
import re
import time

from quart import Response, jsonify

from infernix_jax.api import chat_support, fields
from infernix_jax.api.errors import bad_request
from infernix_jax.api.generation import clamp_max_tokens, make_sampling, new_request_id, start_generation
from infernix_jax.api.openai_chat import chat_messages
from infernix_jax.api.state import ServerState

KINDS = ("yes_no", "choice", "score", "number")
FORCE_BIAS = 100.0
MAX_SCALE_OPTIONS = 101
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
            or len(options) < 2
            or not all(isinstance(o, str) and o for o in options)
        ):
            raise bad_request("options must be a list of at least two non-empty strings", param="options")
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


def _variants(option: str) -> list[str]:
    return list(dict.fromkeys([option, option.lower(), option.capitalize(), option.upper()]))


class _ForcedLogprobs:
    """logprob(token | prompt + prefix) for many (prefix, token) pairs, each one forced request."""

    def __init__(self, state: ServerState, prompt_ids: list[int], arrival: float, request_id: str) -> None:
        self.state, self.prompt_ids, self.arrival, self.request_id = state, prompt_ids, arrival, request_id
        self._cache: dict[tuple[tuple[int, ...], int], asyncio.Future] = {}
        self.forwards = 0

    def logprob(self, prefix: tuple[int, ...], token: int) -> asyncio.Future:
        key = (prefix, token)
        if key not in self._cache:
            self._cache[key] = asyncio.ensure_future(self._run(prefix, token))
        return self._cache[key]

    async def _run(self, prefix: tuple[int, ...], token: int) -> float:
        ids = [*self.prompt_ids, *prefix]
        clamp_max_tokens(self.state, len(ids), 1)
        sampling = make_sampling(max_tokens=1, logprobs=0, logit_bias=((token, FORCE_BIAS),), ignore_eos=True)
        self.forwards += 1
        generation = await start_generation(
            self.state, f"{self.request_id}-{len(self._cache)}-{self.forwards}", ids, sampling, self.arrival
        )
        outcome = await generation.collect()
        if not outcome.logprobs or outcome.logprobs[0].token_id != token:
            raise bad_request("the engine did not report the forced token's logprob")
        return outcome.logprobs[0].logprob


async def _option_logprobs(forced: _ForcedLogprobs, tokenizer, options: list[str]) -> dict[str, float]:
    """log P(option) (its case variants summed) under the model, before renormalising."""

    async def sequence(ids: list[int]) -> float:
        parts = [forced.logprob(tuple(ids[:i]), ids[i]) for i in range(len(ids))]
        return sum(await asyncio.gather(*parts))

    async def option(text: str) -> float:
        token_seqs = {tuple(chat_support.encode(tokenizer, v)) for v in _variants(text)}
        values = await asyncio.gather(*(sequence(list(ids)) for ids in token_seqs if ids))
        return _logsumexp(values)

    values = await asyncio.gather(*(option(o) for o in options))
    return dict(zip(options, values))


def _logsumexp(values) -> float:
    values = list(values)
    top = max(values)
    return top + math.log(sum(math.exp(v - top) for v in values))


async def handle(state: ServerState, body: dict, arrival: float) -> Response:
    model = fields.check_model(state, body)
    kind = body.get("type")
    if kind not in KINDS:
        raise bad_request(f"type must be one of {list(KINDS)}", param="type")
    prompt_ids = chat_support.encode(state.tokenizer, _prompt(state, body))
    request_id = new_request_id("decide")
    result: dict = {
        "id": request_id,
        "object": "decision",
        "created": int(time.time()),
        "model": model,
        "type": kind,
    }
    if kind == "number":
        result.update(await _number(state, prompt_ids, arrival, request_id, body))
        return jsonify(result)
    options = _options(body, kind)
    forced = _ForcedLogprobs(state, prompt_ids, arrival, request_id)
    logprobs = await _option_logprobs(forced, state.tokenizer, options)
    total = _logsumexp(logprobs.values())
    probabilities = {o: math.exp(lp - total) for o, lp in logprobs.items()}
    best = max(options, key=lambda o: probabilities[o])
    result.update(
        decision=int(best) if kind == "score" else best,
        probabilities=probabilities,
        logprobs=logprobs,
        usage={"prompt_tokens": len(prompt_ids), "forward_passes": forced.forwards},
    )
    if kind == "score":
        result["expected"] = sum(int(o) * p for o, p in probabilities.items())
    return jsonify(result)


async def _number(
    state: ServerState, prompt_ids: list[int], arrival: float, request_id: str, body: dict
) -> dict:
    max_tokens = fields.get_int(body, "max_tokens", minimum=1) or 16
    sampling = make_sampling(
        max_tokens=clamp_max_tokens(state, len(prompt_ids), max_tokens), logprobs=0, stop=("\n",)
    )
    outcome = await (await start_generation(state, request_id, prompt_ids, sampling, arrival)).collect()
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
