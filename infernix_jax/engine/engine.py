"""The async engine the API server talks to: one thread owns all device state.

`AsyncEngine.submit(request)` returns an async iterator of `TokenEvent`s. The scheduler thread
runs `EngineCore.step()` in a loop and hands each event to the request's asyncio queue with
`loop.call_soon_threadsafe`, so the event loop never waits on the device and the device never
waits on the event loop. Commands (new requests, aborts) reach the thread through a thread-safe
inbox; a stream the client stops reading (a disconnect) aborts its request.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
from collections.abc import AsyncIterator

import jax

from infernix_jax.engine.config import EngineConfig
from infernix_jax.engine.core import EngineCore, EngineMetrics
from infernix_jax.engine.protocol import (
    FINISH_ERROR,
    EngineStats,
    GenerationRequest,
    ScoreError,
    ScoreRequest,
    ScoreResult,
    TokenEvent,
)

log = logging.getLogger(__name__)


class AsyncEngine:
    """Implements the `Engine` protocol (engine/protocol.py) over an `EngineCore` on its own thread."""

    def __init__(self, core: EngineCore):
        self.core = core
        self._inbox: queue.Queue = queue.Queue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._lock = threading.Lock()
        self._stats = core.stats()
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="infernix-engine", daemon=True)
        self._thread.start()

    @property
    def max_context(self) -> int:
        return self.core.config.max_context

    def stats(self) -> EngineStats:
        return self._stats

    def metrics(self) -> EngineMetrics:
        """Cumulative counters, including the host's share of decode time."""
        return self.core.metrics

    # ---- the protocol --------------------------------------------------------------------------
    def submit(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        return self._submit("add", request)

    async def score(self, request: ScoreRequest) -> ScoreResult:
        """Score candidate continuations (engine/scoring.py); a cancelled caller aborts the request."""
        async for event in self._submit("score", request):
            if event.finished:
                if event.score is None:
                    raise ScoreError(event.error or f"the score request ended: {event.finish_reason}")
                return event.score
        raise ScoreError("the score request ended without a result")

    def _submit(self, kind: str, request: GenerationRequest | ScoreRequest) -> AsyncIterator[TokenEvent]:
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if request.request_id in self._streams:
                events.put_nowait(
                    TokenEvent(
                        request.request_id,
                        [],
                        "",
                        finish_reason=FINISH_ERROR,
                        error=f"request id {request.request_id!r} is already running",
                    )
                )
                return self._drain(request.request_id, events, owned=False)
            self._streams[request.request_id] = (loop, events)
        self._inbox.put((kind, request))
        return self._drain(request.request_id, events, owned=True)

    async def abort(self, request_id: str) -> None:
        self._inbox.put(("abort", request_id))

    def close(self) -> None:
        """Stop the scheduler thread (running requests are abandoned) and save the prefix cache
        file when one is configured."""
        self._stopped.set()
        self._inbox.put(("wake", None))
        self._thread.join(timeout=30)
        if not self._thread.is_alive():
            try:
                self.core.save_prefix_cache()
            except Exception:  # a failed save must not turn a clean shutdown into a crash
                log.exception("saving the prefix cache failed")

    async def _drain(self, request_id: str, events: asyncio.Queue, owned: bool) -> AsyncIterator[TokenEvent]:
        finished = False
        try:
            while not finished:
                event = await events.get()
                finished = event.finished
                yield event
        finally:
            if owned and not finished:  # the consumer went away: free the request's memory now
                self._inbox.put(("abort", request_id))

    # ---- the scheduler thread ------------------------------------------------------------------
    def _loop(self) -> None:
        core = self.core
        while not self._stopped.is_set():
            commands = []
            if not core.has_work():  # idle: sleep until a command arrives (or a periodic save is due)
                try:
                    commands.append(self._inbox.get(timeout=30.0))
                except queue.Empty:
                    pass
            while True:
                try:
                    commands.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            events: list[TokenEvent] = []
            for kind, payload in commands:
                if kind == "add":
                    events += core.add_request(payload)
                elif kind == "score":
                    events += core.add_score_request(payload)
                elif kind == "abort":
                    events += core.abort(payload)
            if core.has_work():
                try:
                    events += core.step()
                except Exception as exc:
                    log.exception("engine step failed")
                    for request_id in list(core.requests):
                        for event in core.abort(request_id):
                            event.finish_reason, event.error = FINISH_ERROR, f"{type(exc).__name__}: {exc}"
                            events.append(event)
            self._stats = core.stats()
            self._deliver(events)
            try:
                core.maybe_save_prefix_cache()
            except Exception:
                log.exception("saving the prefix cache failed")

    def _deliver(self, events: list[TokenEvent]) -> None:
        for event in events:
            with self._lock:
                target = self._streams.get(event.request_id)
                if target is not None and event.finished:
                    del self._streams[event.request_id]
            if target is None:
                continue
            loop, events_queue = target
            try:
                loop.call_soon_threadsafe(events_queue.put_nowait, event)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass


CPU_PREFILL_CHUNK = 256  # default prefill chunk on the CPU backend


def create_engine(model_dir: str | os.PathLike | None = None, *, dtype=None, **options) -> AsyncEngine:
    """Load a checkpoint and start an engine. `options` are EngineConfig fields; kv_dtype "auto"
    means the model dtype ("bf16") and max_context None the smaller of the model's and 8192."""
    from infernix_jax.experts.offload import experts_at_load
    from infernix_jax.loaded_model import load

    kv_dtype = options.get("kv_dtype")
    if kv_dtype in (None, "auto"):
        options["kv_dtype"] = "bf16"
    model = load(model_dir, dtype=dtype, experts=experts_at_load(model_dir, options))
    if options.get("max_context") is None:
        options["max_context"] = model.max_context
    if options.get("prefill_chunk") is None and jax.default_backend() == "cpu":
        # fewer and smaller programs to compile at start on a CPU (they once also dodged a jaxlib
        # 0.10.2 deadlock in long prefills, since fixed at its cause: docs/model_config.md)
        options["prefill_chunk"] = CPU_PREFILL_CHUNK
    options = {k: v for k, v in options.items() if v is not None}
    config = EngineConfig(**options)
    core = EngineCore(model.config, model.params, config, model.tokenizer, model.eos_token_ids())
    return AsyncEngine(core)
