"""OpenAI (legacy) Completions: POST /v1/completions, raw prompt in, text out, no chat template."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from quart import Response, jsonify

from infernix_jax.api import chat_support, fields
from infernix_jax.api.errors import bad_request, not_supported
from infernix_jax.api.generation import (
    Generation,
    clamp_max_tokens,
    make_sampling,
    new_request_id,
    start_generation,
)
from infernix_jax.api.openai_chat import usage
from infernix_jax.api.sse import SSE_DONE, SSE_HEADERS, sse_data
from infernix_jax.api.state import ServerState
from infernix_jax.engine.protocol import FINISH_ERROR, FINISH_LENGTH, TokenLogprob

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
    if (fields.get_int(body, "n", minimum=1) or 1) != 1 or (
        fields.get_int(body, "best_of", minimum=1) or 1
    ) != 1:
        raise not_supported("n > 1 / best_of > 1", param="n")
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
    prefix = (text if text is not None else chat_support.decode(state.tokenizer, ids)) if echo else ""
    request_id = new_request_id("cmpl")
    generation = await start_generation(state, request_id, ids, sampling, arrival)
    if fields.get_bool(body, "stream"):
        stream_options = body.get("stream_options") or {}
        include_usage = bool(isinstance(stream_options, dict) and stream_options.get("include_usage"))
        return Response(
            _stream(state, model, generation, prefix, include_usage),
            content_type="text/event-stream",
            headers=SSE_HEADERS,
        )
    outcome = await generation.collect()
    choice = {
        "index": 0,
        "text": prefix + outcome.text,
        "logprobs": (
            completion_logprobs(state.tokenizer, outcome.logprobs, len(prefix))
            if want_logprobs is not None
            else None
        ),
        "finish_reason": finish_reason(outcome.finish_reason),
    }
    return jsonify(
        {
            "id": request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": model,
            "choices": [choice],
            "usage": usage(outcome.prompt_tokens, outcome.completion_tokens, outcome.cached_tokens),
        }
    )


async def _stream(
    state: ServerState, model: str, generation: Generation, prefix: str, include_usage: bool
) -> AsyncIterator[bytes]:
    base = {
        "id": generation.request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
    }
    offset = len(prefix)

    def chunk(text: str, finish: str | None = None, logprobs: dict | None = None) -> bytes:
        payload = {
            **base,
            "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish}],
        }
        if include_usage:
            payload["usage"] = None
        return sse_data(payload)

    if prefix:
        yield chunk(prefix)
    async for event in generation.events():
        if event.text or event.logprobs:
            logprobs = (
                completion_logprobs(state.tokenizer, event.logprobs, offset) if event.logprobs else None
            )
            offset += len(event.text)
            yield chunk(event.text, logprobs=logprobs)
        if event.finished:
            if event.finish_reason == FINISH_ERROR:
                yield sse_data(
                    {
                        "error": {
                            "message": event.error or "generation failed",
                            "type": "server_error",
                            "param": None,
                            "code": None,
                        }
                    }
                )
                break
            yield chunk("", finish=finish_reason(event.finish_reason))
            if include_usage:
                yield sse_data(
                    {
                        **base,
                        "choices": [],
                        "usage": usage(event.prompt_tokens, event.completion_tokens, event.cached_tokens),
                    }
                )
    yield SSE_DONE
