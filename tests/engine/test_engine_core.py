"""The engine on tiny checkpoints: batching is exact, preemption and aborts are clean, no compiles.

One warmed-up engine over the hybrid MoE fixture (qwen3_next) is shared by most tests; buckets are
small so that compiling them stays cheap on CI's CPUs. The reference for exactness is the
single-sequence path, `infernix_jax.load(path).generate`.
"""

from __future__ import annotations

import asyncio

import jax
import numpy as np
import pytest

import infernix_jax
from infernix_jax.engine.config import EngineConfig
from infernix_jax.engine.core import EngineCore
from infernix_jax.engine.engine import AsyncEngine
from infernix_jax.engine.llm import LLM
from infernix_jax.engine.protocol import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_LENGTH,
    GenerationRequest,
    SamplingParams,
)
from tests.conftest import HF_FIXTURES

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
MAX_CONTEXT = 256

# 14 blocks of 64 tokens: the 8 prompts below fit at once; long generations force preemption.
SMALL = EngineConfig(
    max_concurrency=8,
    max_context=MAX_CONTEXT,
    kv_capacity=14,
    prefill_chunk=64,
    prefill_shape_override=((4, 16), (1, 64)),
    decode_batch_sizes=(4, 8),
    decode_steps_per_dispatch=4,
    max_top_logprobs=5,
    compilation_cache_dir=None,
    progress=False,
    structured_output=False,  # tests/structured/ warm up the masked programs
    scoring=False,  # tests/engine/test_scoring.py has its own engine
)
PROMPT_LENGTHS = (3, 10, 17, 40, 70, 100, 130, 5)


def prompts(lengths, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 512, size=n).tolist() for n in lengths]


def run(core: EngineCore, requests: list[GenerationRequest], on_step=None) -> dict[str, dict]:
    """Drive the core to completion; returns per request its tokens, finish reason and events."""
    results = {r.request_id: {"tokens": [], "finish": None, "events": 0} for r in requests}

    def collect(events):
        for e in events:
            results[e.request_id]["tokens"] += e.token_ids
            results[e.request_id]["events"] += 1
            if e.finished:
                results[e.request_id]["finish"] = e.finish_reason

    for r in requests:
        collect(core.add_request(r))
    steps = 0
    while core.has_work():
        collect(core.step())
        steps += 1
        if on_step is not None:
            collect(on_step(steps))
    return results


@pytest.fixture(scope="module")
def reference():
    return infernix_jax.load(HF_FIXTURES / "qwen3_next", max_context=MAX_CONTEXT)


@pytest.fixture(scope="module")
def core(reference):
    return EngineCore(
        reference.config, reference.params, SMALL, reference.tokenizer, reference.eos_token_ids()
    )


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def assert_pool_empty(core: EngineCore) -> None:
    """No request holds a block or a slot: every used block is held by the prefix cache alone."""
    blocks, slots = core.scheduler.blocks, core.scheduler.slots
    cached = core.prefix_cache.evictable_blocks() if core.prefix_cache is not None else 0
    assert blocks.num_free + cached == blocks.num_total, "KV blocks leaked"
    assert slots.num_free == slots.num_total, "state slots leaked"


def test_batched_greedy_equals_each_prompt_alone(core, reference):
    ids = prompts(PROMPT_LENGTHS)
    requests = [GenerationRequest(f"b{i}", p, greedy(12)) for i, p in enumerate(ids)]
    results = run(core, requests)
    for i, p in enumerate(ids):
        alone = reference.generate(p, max_new_tokens=12, ignore_eos=True).token_ids
        assert results[f"b{i}"]["tokens"] == alone, f"prompt {i} ({len(p)} tokens) differs"
        assert results[f"b{i}"]["finish"] == FINISH_LENGTH
    assert core.metrics.preemptions == 0
    assert_pool_empty(core)


def test_preemption_by_a_small_pool_gives_identical_output(core, reference):
    ids = prompts((50, 60, 45, 55, 40, 52), seed=1)
    before = core.metrics.preemptions
    results = run(core, [GenerationRequest(f"p{i}", p, greedy(90)) for i, p in enumerate(ids)])
    assert core.metrics.preemptions > before, "the pool was meant to run out"
    for i, p in enumerate(ids):
        assert (
            results[f"p{i}"]["tokens"] == reference.generate(p, max_new_tokens=90, ignore_eos=True).token_ids
        )
    assert_pool_empty(core)


def test_aborting_half_the_requests_frees_every_block_and_slot(core):
    ids = prompts((20, 33, 8, 64, 15, 90, 2, 41), seed=2)
    requests = [GenerationRequest(f"a{i}", p, greedy(40)) for i, p in enumerate(ids)]
    aborted = [r.request_id for r in requests[::2]]

    def abort_midway(step):
        return [e for rid in aborted for e in core.abort(rid)] if step == 3 else []

    results = run(core, requests, abort_midway)
    for r in requests:
        expected = FINISH_ABORT if r.request_id in aborted else FINISH_LENGTH
        assert results[r.request_id]["finish"] == expected
    assert all(len(results[r.request_id]["tokens"]) == 40 for r in requests[1::2])
    assert_pool_empty(core)


def test_seeded_sampling_is_independent_of_the_batch(core):
    target = GenerationRequest(
        "s",
        prompts((12,), seed=3)[0],
        SamplingParams(max_tokens=10, temperature=1.0, top_k=40, seed=1234, ignore_eos=True),
    )
    alone = run(core, [target])["s"]["tokens"]
    others = [
        GenerationRequest(f"o{i}", p, SamplingParams(max_tokens=6 + i, temperature=0.7, seed=i))
        for i, p in enumerate(prompts((30, 5, 66), seed=4))
    ]
    together = run(core, others + [GenerationRequest("s", target.prompt_token_ids, target.sampling)])["s"][
        "tokens"
    ]
    assert together == alone
    other_seed = run(
        core, [GenerationRequest("s", target.prompt_token_ids, target.sampling.replace(seed=99))]
    )
    assert other_seed["s"]["tokens"] != alone


def test_no_compilation_after_warmup_across_lengths_and_batch_sizes(core):
    counter = {"n": 0}

    def listen(event: str, duration: float, **kwargs) -> None:
        counter["n"] += event == COMPILE_EVENT

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        for lengths in ((7,), (100, 3, 19), (1, 2, 3, 4, 5, 6, 70, 130)):
            sampling = [greedy(9), SamplingParams(max_tokens=5, temperature=0.8, top_p=0.9, logprobs=3)]
            run(
                core, [GenerationRequest(f"c{i}", p, sampling[i % 2]) for i, p in enumerate(prompts(lengths))]
            )
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert counter["n"] == 0, f"{counter['n']} compilations after warm-up"


def test_invalid_requests_end_with_one_error_event(core):
    for prompt in ([], list(range(MAX_CONTEXT + 1)), [10**6]):
        events = core.add_request(GenerationRequest("bad", prompt))
        assert len(events) == 1 and events[0].finish_reason == FINISH_ERROR and events[0].error
    assert not core.has_work()


def test_stop_token_and_logprobs_reach_the_events(core, reference):
    prompt = prompts((9,), seed=5)[0]
    free = reference.generate(prompt, max_new_tokens=8, ignore_eos=True).token_ids
    stop_at = free[4]
    events = []
    core.add_request(
        GenerationRequest("t", prompt, SamplingParams(max_tokens=8, stop_token_ids=(stop_at,), logprobs=2))
    )
    while core.has_work():
        events += core.step()
    tokens = [t for e in events for t in e.token_ids]
    assert tokens == free[: free.index(stop_at)]
    assert events[-1].finish_reason == "stop" and events[-1].stop_reason == stop_at
    logprobs = [lp for e in events for lp in (e.logprobs or [])]
    assert [lp.token_id for lp in logprobs] == tokens
    assert all(len(lp.top) == 2 and lp.top[0][1] >= lp.top[1][1] and lp.logprob <= 0 for lp in logprobs)


def test_async_engine_streams_and_aborts(core):
    engine = AsyncEngine(core)

    async def main():
        async def consume(request):
            return [e async for e in engine.submit(request)]

        ids = prompts((6, 25), seed=6)
        long_running = engine.submit(GenerationRequest("long", ids[1], greedy(200)))
        first = await long_running.__anext__()
        await engine.abort("long")
        rest = [e async for e in long_running]
        short = await consume(GenerationRequest("short", ids[0], greedy(5)))
        bad = await consume(GenerationRequest("empty", []))
        return [first] + rest, short, bad

    try:
        long_events, short, bad = asyncio.run(main())
    finally:
        engine.close()
    assert long_events[-1].finish_reason == FINISH_ABORT
    assert short[-1].finish_reason == FINISH_LENGTH and sum(len(e.token_ids) for e in short) == 5
    assert len(bad) == 1 and bad[0].finish_reason == FINISH_ERROR
    assert_pool_empty(core)


class ByteTokenizer:
    """UTF-8 bytes as token ids (the fixtures have no tokenizer files)."""

    eos_token_ids: tuple[int, ...] = ()
    chat_template = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=None) -> str:
        return bytes(i for i in ids if i < 256).decode(errors="replace")


def test_llm_generates_from_text_and_ids(reference):
    model = infernix_jax.Model(reference.config, reference.params, ByteTokenizer(), MAX_CONTEXT)
    llm = LLM(model=model, **{**SMALL.__dict__, "warmup": False})
    text_prompt = "hello world"
    results = llm.generate([text_prompt, prompts((11,))[0]], [greedy(6), greedy(4)])
    ids = model.encode(text_prompt)
    assert results[0].token_ids == reference.generate(ids, max_new_tokens=6, ignore_eos=True).token_ids
    assert results[0].prompt_tokens == len(ids) and results[0].finish_reason == FINISH_LENGTH
    assert results[0].text == model.tokenizer.decode(results[0].token_ids)
    assert len(results[1].token_ids) == 4


def test_a_failing_dispatch_fails_its_requests_not_the_engine(core, reference, monkeypatch):
    real_decode = core.runner.decode

    def broken(batch):
        raise RuntimeError("device fell over")

    monkeypatch.setattr(core.runner, "decode", broken)
    failed = run(core, [GenerationRequest("f", prompts((5,), seed=9)[0], greedy(8))])
    assert failed["f"]["finish"] == FINISH_ERROR
    assert_pool_empty(core)
    monkeypatch.setattr(core.runner, "decode", real_decode)
    prompt = prompts((6,), seed=10)[0]
    healthy = run(core, [GenerationRequest("h", prompt, greedy(6))])
    assert healthy["h"]["tokens"] == reference.generate(prompt, max_new_tokens=6, ignore_eos=True).token_ids
