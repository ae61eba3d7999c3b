"""OpenAI (legacy) Completions: POST /v1/completions, raw prompt in, text out, no chat template."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from quart import Response, jsonify

from infernix_jax.api import chat_support, fields, structured_fields
from infernix_jax.api.errors import bad_request, not_supported
from infernix_jax.api.generation import (
    Generation,
    clamp_max_tokens,
    collect_all,
    combined_usage,
    make_sampling,
    merge_events,
    new_request_id,
    start_generations,
)
from infernix_jax.api.openai_chat import usage
from infernix_jax.api.sse import SSE_DONE, SSE_HEADERS, openai_stream_error, sse_data
from infernix_jax.api.state import ServerState
from infernix_jax.engine.protocol import FINISH_ERROR, FINISH_LENGTH, TokenEvent, TokenLogprob

_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for this endpoint


def prompt_ids(state: ServerState, prompt) -> tuple[str | None, list[int]]:
    """A prompt given as text or token ids (one prompt per request)."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt, chat_support.encode(state.tokenizer, prompt)
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)
    ):
        return None, list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise not_supported("several prompts in one request", param="prompt")
    raise bad_request("prompt must be a non-empty string or a list of token ids", param="prompt")


def completion_logprobs(tokenizer, entries: list[TokenLogprob], offset: int) -> dict:
    """The Completions `logprobs` object: tokens, their logprobs, top alternatives, text offsets."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for entry in entries:
        text = chat_support.decode(tokenizer, [entry.token_id])
        tokens.append(text)
        token_logprobs.append(entry.logprob)
        top.append({chat_support.decode(tokenizer, [tid]): lp for tid, lp in entry.top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def finish_reason(engine_reason: str) -> str:
    return "length" if engine_reason == FINISH_LENGTH else "stop"


async def handle(state: ServerState, body: dict, arrival: float) -> Response:
    model = fields.check_model(state, body)
    n = fields.get_int(body, "n", minimum=1) or 1
    if (fields.get_int(body, "best_of", minimum=1) or n) != n:
        raise not_supported("best_of other than n", param="best_of")
    if body.get("suffix"):
        raise not_supported("suffix (fill-in-the-middle)", param="suffix")
    text, ids = prompt_ids(state, body.get("prompt"))
    echo = fields.get_bool(body, "echo")
    want_logprobs = fields.get_int(body, "logprobs", minimum=0)
    requested = fields.get_int(body, "max_tokens", minimum=0)
    sampling = make_sampling(
        max_tokens=clamp_max_tokens(state, len(ids), _DEFAULT_MAX_TOKENS if requested is None else requested),
        temperature=fields.get_float(body, "temperature"),
        top_p=fields.get_float(body, "top_p"),
        top_k=fields.get_int(body, "top_k", minimum=0),
        min_p=fields.get_float(body, "min_p"),
        seed=fields.get_int(body, "seed"),
        presence_penalty=fields.get_float(body, "presence_penalty"),
        frequency_penalty=fields.get_float(body, "frequency_penalty"),
        repetition_penalty=fields.get_float(body, "repetition_penalty"),
        logit_bias=fields.get_logit_bias(body) or None,
        stop=fields.get_stop(body, "stop") or None,
        min_tokens=fields.get_int(body, "min_tokens", minimum=0),
        logprobs=want_logprobs,
    )
    spec, spec_param = structured_fields.spec_from_body(body, completions=True)
    constraint = structured_fields.build_constraint(state, spec, spec_param)
    prefix = (text if text is not None else chat_support.decode(state.tokenizer, ids)) if echo else ""
    request_id = new_request_id("cmpl")
    generations = await start_generations(state, request_id, ids, sampling, arrival, n, constraint=constraint)
    if fields.get_bool(body, "stream"):
        stream_options = body.get("stream_options") or {}
        include_usage = bool(isinstance(stream_options, dict) and stream_options.get("include_usage"))
        return Response(
            _stream(state, model, request_id, generations, prefix, include_usage),
            content_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    outcomes = await collect_all(generations)
    choices = [
        {
            "index": index,
            "text": prefix + outcome.text,
            "logprobs": (
                completion_logprobs(state.tokenizer, outcome.logprobs, len(prefix))
                if want_logprobs is not None
                else None
            ),
            "finish_reason": finish_reason(outcome.finish_reason),
        }
        for index, outcome in enumerate(outcomes)
    ]
    return jsonify(
        {
            "id": request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": choices,
            "usage": usage(*combined_usage(outcomes)),
        }
    )


async def _stream(
    state: ServerState,
    model: str,
    request_id: str,
    generations: list[Generation],
    prefix: str,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    base = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model}
    offsets = [len(prefix)] * len(generations)
    finals: list[TokenEvent] = []

    def chunk(index: int, text: str, finish: str | None = None, logprobs: dict | None = None) -> bytes:
        payload = {
            **base,
            "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}],
        }
        if include_usage:
            payload["usage"] = None
        return sse_data(payload)

    if prefix:
        for index in range(len(generations)):
            yield chunk(index, prefix)
    async for index, event in merge_events(generations):
        if event.text or event.logprobs:
            logprobs = None
            if event.logprobs:
                logprobs = completion_logprobs(state.tokenizer, event.logprobs, offsets[index])
            offsets[index] += len(event.text)
            yield chunk(index, event.text, logprobs=logprobs)
        if event.finished:
            if event.finish_reason == FINISH_ERROR:
                yield openai_stream_error(event.error or "generation failed")
                yield SSE_DONE  # the others (n > 1) are aborted as the stream ends
                return
            finals.append(event)
            yield chunk(index, "", finish=finish_reason(event.finish_reason))
    if include_usage:
        yield sse_data({**base, "choices": [], "usage": usage(*combined_usage(finals))})
    yield SSE_DONE
