"""Running one request on the engine, shared by every protocol.

`start_generation` checks the queue and the context, submits, and waits for the first event so that
a request the engine rejects (empty or over-long prompt) is answered with a 4xx status instead of a
stream that breaks. The returned `Generation` yields the engine's events, records metrics, and, if
it is abandoned before the end (the client went away), aborts the engine request so its KV blocks
and state slot are freed at once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from infernix_jax.api import chat_support
from infernix_jax.api.errors import ApiError, bad_request
from infernix_jax.api.state import ServerState
from infernix_jax.api.thinking import ThinkingWatch
from infernix_jax.engine.protocol import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_LENGTH,
    GenerationRequest,
    SamplingParams,
    TokenEvent,
    TokenLogprob,
)
from infernix_jax.structured import RequestConstraint

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
    """The event stream of one submitted request; iterate it exactly once.

    With a `ThinkingWatch`, thinking that runs past its budget (or loops) is wrapped up: the engine
    request is aborted and continued from prompt + generated tokens + the wrap-up text, and the
    events carry on as one stream (completion_tokens counts the inserted tokens too).
    """

    def __init__(
        self,
        state: ServerState,
        request: GenerationRequest,
        stream: AsyncIterator[TokenEvent],
        first: TokenEvent,
        thinking: ThinkingWatch | None = None,
    ) -> None:
        self.state = state
        self.request = request
        self._stream = stream
        self._first: TokenEvent | None = first
        self.finished = False
        self._last_token_time: float | None = None
        self._abort_task: asyncio.Task | None = None
        self._thinking = thinking if thinking is not None and thinking.policy.active else None
        self._engine_id = request.request_id  # the engine request now running (changes on a wrap-up)
        self._generated: list[int] = []  # every completion token so far, inserted ones included
        self._offset = 0  # completion tokens before the running engine request started
        self._cached_tokens = first.cached_tokens
        self._wrap_ups = 0

    @property
    def request_id(self) -> str:
        return self.request.request_id

    async def events(self) -> AsyncIterator[TokenEvent]:
        """The engine's events, ending with the finished one; aborts the request if abandoned."""
        try:
            while not self.finished:
                if self._first is not None:
                    event, self._first = self._first, None
                else:
                    event = await self._stream.__anext__()
                event = self._as_one_stream(event)
                self.finished = event.finished
                self._generated.extend(event.token_ids)
                self._record(event)
                yield event
                watch = self._thinking
                if not event.finished and watch is not None and watch.observe(event.token_ids, event.text):
                    closing = await self._wrap_up_thinking(watch)
                    self.finished = closing.finished
                    self._generated.extend(closing.token_ids)
                    self._record(closing)
                    yield closing
        except StopAsyncIteration:
            self.finished = True
            raise ApiError(500, "the engine ended the stream without a final event") from None
        finally:
            if not self.finished:
                await self.abort()

    def _as_one_stream(self, event: TokenEvent) -> TokenEvent:
        """After a wrap-up, the continuation's counts as if it were the original request."""
        if self._offset == 0:
            return event
        return dataclasses.replace(
            event,
            request_id=self.request_id,
            prompt_tokens=len(self.request.prompt_token_ids),
            cached_tokens=self._cached_tokens,
            completion_tokens=event.completion_tokens + self._offset,
        )

    async def _wrap_up_thinking(self, watch: ThinkingWatch) -> TokenEvent:
        """Stop the running request and continue it after a wrap-up message that closes the thinking."""
        log.info(
            "%s: wrapping up thinking (%s after %d tokens)",
            self.request_id,
            watch.reason,
            watch.reasoning_tokens,
        )
        await self.state.engine.abort(self._engine_id)
        await _drain(self._stream)
        text = watch.policy.closing_text()
        closing_ids = chat_support.encode(self.state.tokenizer, text)
        generated = len(self._generated) + len(closing_ids)
        remaining = self.request.sampling.max_tokens - generated
        event = TokenEvent(
            request_id=self.request_id,
            token_ids=closing_ids,
            text=text,
            prompt_tokens=len(self.request.prompt_token_ids),
            cached_tokens=self._cached_tokens,
            completion_tokens=generated,
        )
        if remaining <= 0:
            event.finish_reason = FINISH_LENGTH
            return event
        self._wrap_ups += 1
        self._engine_id = f"{self.request_id}-wrapup{self._wrap_ups}"
        self._offset = generated
        continuation = GenerationRequest(
            request_id=self._engine_id,
            prompt_token_ids=[*self.request.prompt_token_ids, *self._generated, *closing_ids],
            sampling=self.request.sampling.replace(max_tokens=remaining),
            # the continuation's prompt holds the closed thinking: its constraint applies at once
            constraint=self.request.constraint.begun() if self.request.constraint is not None else None,
            arrival_time=self.request.arrival_time,
        )
        self._stream = aiter(self.state.engine.submit(continuation))
        return event

    async def abort(self) -> None:
        """Tell the engine to drop this request (idempotent; survives the caller being cancelled)."""
        if self._abort_task is None:
            log.info("aborting %s (client gone)", self.request_id)
            self._abort_task = asyncio.ensure_future(self.state.engine.abort(self._engine_id))
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


async def _drain(stream: AsyncIterator[TokenEvent], timeout_s: float = 10.0) -> None:
    """Read an aborted request's stream to its final event, so the engine can let it go."""

    async def read_to_end() -> None:
        async for event in stream:
            if event.finished:
                return

    try:
        await asyncio.wait_for(read_to_end(), timeout_s)
    except TimeoutError:
        log.warning("an aborted request did not end within %.0f s", timeout_s)


async def start_generation(
    state: ServerState,
    request_id: str,
    prompt_ids: list[int],
    sampling: SamplingParams,
    arrival_time: float,
    thinking: ThinkingWatch | None = None,
    constraint: RequestConstraint | None = None,
) -> Generation:
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
    request = GenerationRequest(
        request_id=request_id,
        prompt_token_ids=list(prompt_ids),
        sampling=sampling,
        constraint=constraint,
        arrival_time=arrival_time,
    )
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
    return Generation(state, request, stream, first, thinking)


async def start_generations(
    state: ServerState,
    request_id: str,
    prompt_ids: list[int],
    sampling: SamplingParams,
    arrival_time: float,
    n: int = 1,
    new_watch: Callable[[], ThinkingWatch | None] = lambda: None,
    constraint: RequestConstraint | None = None,
) -> list[Generation]:
    """`n` generations of one prompt (OpenAI's `n`); a seed, if given, becomes seed, seed + 1, ..."""
    if n == 1:
        return [
            await start_generation(
                state, request_id, prompt_ids, sampling, arrival_time, new_watch(), constraint
            )
        ]
    started = await asyncio.gather(
        *(
            start_generation(
                state,
                f"{request_id}-{i}",
                prompt_ids,
                sampling if sampling.seed is None else sampling.replace(seed=sampling.seed + i),
                arrival_time,
                new_watch(),
                constraint,
            )
            for i in range(n)
        ),
        return_exceptions=True,
    )
    failures = [g for g in started if isinstance(g, BaseException)]
    if failures:
        for generation in started:
            if isinstance(generation, Generation):
                await generation.abort()
        raise failures[0]
    return list(started)


async def collect_all(generations: list[Generation]) -> list[GenerationOutcome]:
    return list(await asyncio.gather(*(g.collect() for g in generations)))


def combined_usage(finals: list) -> tuple[int, int, int]:
    """(prompt, completion, cached) tokens of n choices: the prompt counted once, completions summed."""
    first = finals[0]
    return first.prompt_tokens, sum(f.completion_tokens for f in finals), first.cached_tokens


async def merge_events(generations: list[Generation]) -> AsyncIterator[tuple[int, TokenEvent]]:
    """The events of several generations as they come, tagged with the generation's index.

    If the consumer goes away, every generation still running is cancelled (and so aborted).
    """
    if len(generations) == 1:
        async for event in generations[0].events():
            yield 0, event
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, generation: Generation) -> None:
        try:
            async for event in generation.events():
                await queue.put((index, event, None))
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((index, None, exc))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(generations)]
    try:
        remaining = len(generations)
        while remaining:
            index, event, error = await queue.get()
            if error is not None:
                raise error
            if event.finished:
                remaining -= 1
            yield index, event
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
