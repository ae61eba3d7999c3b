"""Running one request on the engine, shared by every protocol.

`start_generation` checks the queue and the context, submits, and waits for the first event so that
a request the engine rejects (empty or over-long prompt) is answered with a 4xx status instead of a
stream that breaks. The returned `Generation` yields the engine's events, records metrics, and, if
it is abandoned before the end (the client went away), aborts the engine request so its KV blocks
and state slot are freed at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from infernix_jax.api.errors import ApiError, bad_request
from infernix_jax.api.state import ServerState
from infernix_jax.engine.protocol import (
    FINISH_ABORT,
    FINISH_ERROR,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
    TokenLogprob,
)

log = logging.getLogger(__name__)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


@dataclass
class GenerationOutcome:
    """Everything a non-streaming response needs, gathered from the events of one request."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str = ""
    stop_reason: str | int | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


class Generation:
    """The event stream of one submitted request; iterate it exactly once."""

    def __init__(self, state: ServerState, request: GenerationRequest,
                 stream: AsyncIterator[TokenEvent], first: TokenEvent) -> None:
        self.state = state
        self.request = request
        self._stream = stream
        self._first: TokenEvent | None = first
        self.finished = first.finished
        self._last_token_time: float | None = None
        self._abort_task: asyncio.Task | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    async def events(self) -> AsyncIterator[TokenEvent]:
        """The engine's events, ending with the finished one; aborts the request if abandoned."""
        try:
            if self._first is not None:
                first, self._first = self._first, None
                self._record(first)
                yield first
            while not self.finished:
                event = await self._stream.__anext__()
                self.finished = event.finished
                self._record(event)
                yield event
        except StopAsyncIteration:
            self.finished = True
            raise ApiError(500, "the engine ended the stream without a final event") from None
        finally:
            if not self.finished:
                await self.abort()

    async def abort(self) -> None:
        """Tell the engine to drop this request (idempotent; survives the caller being cancelled)."""
        if self._abort_task is None:
            log.info("aborting %s (client gone)", self.request_id)
            self._abort_task = asyncio.ensure_future(self.state.engine.abort(self.request_id))
            self.state.metrics.finished.labels(FINISH_ABORT).inc()
        try:
            await asyncio.shield(self._abort_task)
        except asyncio.CancelledError:
            pass  # the abort goes on in its task

    async def collect(self) -> GenerationOutcome:
        """Run to the end and gather text, tokens, logprobs and usage."""
        out = GenerationOutcome()
        pieces: list[str] = []
        async for event in self.events():
            pieces.append(event.text)
            out.token_ids.extend(event.token_ids)
            if event.logprobs:
                out.logprobs.extend(event.logprobs)
            if event.finished:
                if event.finish_reason == FINISH_ERROR:
                    raise ApiError(500, event.error or "generation failed")
                out.finish_reason = event.finish_reason or ""
                out.stop_reason = event.stop_reason
                out.prompt_tokens = event.prompt_tokens
                out.cached_tokens = event.cached_tokens
                out.completion_tokens = event.completion_tokens
        out.text = "".join(pieces)
        return out

    def _record(self, event: TokenEvent) -> None:
        metrics = self.state.metrics
        now = time.monotonic()
        if event.token_ids:
            if self._last_token_time is None:
                metrics.time_to_first_token.observe(now - self.request.arrival_time)
            else:
                metrics.inter_token_latency.observe((now - self._last_token_time) / len(event.token_ids))
            self._last_token_time = now
        if event.finished:
            metrics.prompt_tokens.inc(event.prompt_tokens)
            metrics.cached_prompt_tokens.inc(event.cached_tokens)
            metrics.generation_tokens.inc(event.completion_tokens)
            metrics.finished.labels(event.finish_reason).inc()
            metrics.request_latency.observe(now - self.request.arrival_time)


def clamp_max_tokens(state: ServerState, prompt_len: int, requested: int | None) -> int:
    """The generation limit: what was asked (or the default), never past the context window."""
    room = state.engine.max_context - prompt_len
    if room <= 0:
        raise ApiError(
            400,
            f"the prompt has {prompt_len} tokens; this model's context is {state.engine.max_context} tokens",
            code="context_length_exceeded",
        )
    wanted = state.config.default_max_tokens if requested is None else requested
    return max(0, min(wanted, room))


def make_sampling(**options) -> SamplingParams:
    """SamplingParams from request options; invalid values become a 400 naming them."""
    try:
        return SamplingParams(**{k: v for k, v in options.items() if v is not None})
    except (ValueError, TypeError) as exc:
        raise bad_request(str(exc)) from None


async def start_generation(state: ServerState, request_id: str, prompt_ids: list[int],
                           sampling: SamplingParams, arrival_time: float) -> Generation:
    """Submit a request and wait for its first event; engine rejections become 4xx errors."""
    if not prompt_ids:
        raise bad_request("the prompt is empty")
    if len(prompt_ids) >= state.engine.max_context:
        raise ApiError(
            400,
            f"the prompt has {len(prompt_ids)} tokens; this model's context is {state.engine.max_context} tokens",
            code="context_length_exceeded",
        )
    limit = state.config.max_waiting
    if limit and state.engine.stats().waiting >= limit:
        raise ApiError(503, "the server is busy; retry shortly", retry_after_s=state.config.retry_after_s)
    request = GenerationRequest(request_id=request_id, prompt_token_ids=list(prompt_ids),
                                sampling=sampling, arrival_time=arrival_time)
    stream = aiter(state.engine.submit(request))
    try:
        first = await anext(stream)
    except StopAsyncIteration:
        raise ApiError(500, "the engine ended the stream without a final event") from None
    except asyncio.CancelledError:
        await state.engine.abort(request_id)
        raise
    if first.finish_reason == FINISH_ERROR and not first.token_ids:
        state.metrics.finished.labels(FINISH_ERROR).inc()
        raise bad_request(first.error or "the engine rejected the request")
    return Generation(state, request, stream, first)
