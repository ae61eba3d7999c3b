"""The prefix cache inside the engine: hits give the logits of a cold prefill, on every tier.

Hybrid (qwen3_next: Gated DeltaNet + attention, MoE) and dense (qwen3_dense) tiny checkpoints in
float32. The reference for each prompt is the same engine with an empty cache (`clear()`), so the
only difference between the two runs is where the prefix's KV and state came from. The engine is
warmed up, and nothing may compile after that: moving entries to the host tier and back included.
"""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest

import infernix_jax
from infernix_jax.cache.prefix_file import MAGIC
from infernix_jax.cache.prefix_host import PINNED_HOST
from infernix_jax.engine.config import EngineConfig
from infernix_jax.engine.core import EngineCore
from infernix_jax.engine.protocol import GenerationRequest, SamplingParams
from tests.conftest import HF_FIXTURES

CONFIG = EngineConfig(
    max_concurrency=2,
    max_context=512,
    kv_capacity=16,
    prefill_chunk=64,
    prefill_shape_override=((1, 16), (1, 64)),
    decode_batch_sizes=(1, 2),
    decode_steps_per_dispatch=4,
    max_top_logprobs=5,
    compilation_cache_dir=None,
    progress=False,
    warmup=False,
    prefix_cache_snapshot_blocks=2,
)


def prompt(n: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 500, size=n).tolist()


def run(
    core: EngineCore, tokens: list[int], max_tokens: int = 6, stop_ids: tuple[int, ...] = (), rid: str = "r"
):
    """Tokens, first-token logprobs (top 5) and cached tokens of one request run to completion.
    (A frequency penalty keeps the tiny random models from repeating one token.)"""
    params = SamplingParams(
        max_tokens=max_tokens, logprobs=5, stop_token_ids=stop_ids, ignore_eos=True, frequency_penalty=5.0
    )
    events = core.add_request(GenerationRequest(rid, tokens, params))
    while core.has_work():
        events += core.step()
    out, logprobs, cached = [], [], 0
    for e in events:
        out += e.token_ids
        logprobs += e.logprobs or []
        cached = max(cached, e.cached_tokens)
        assert e.error is None, e.error
    return out, logprobs, cached


def assert_same(hit, cold) -> None:
    tokens, logprobs, _ = hit
    assert tokens == cold[0]
    for a, b in zip(logprobs, cold[1]):
        want = np.array([lp for _, lp in b.top])
        got = np.array([lp for _, lp in a.top])
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
        assert np.abs(got - want).max() <= 1e-4 * max(1.0, np.abs(want).max())


@pytest.fixture(scope="module")
def compilations():
    """XLA compilations counted since the last engine of the `core` fixture finished its warm-up."""
    counter = {"n": 0}

    def listen(event: str, duration: float, **kwargs) -> None:
        counter["n"] += event == "/jax/core/compile/backend_compile_duration"

    jax.monitoring.register_event_duration_secs_listener(listen)
    yield counter
    jax.monitoring.unregister_event_duration_listener(listen)


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_dense"])
def core(request, compilations):
    """A warmed-up engine: none of the tests below may compile (moving entries between tiers included)."""
    model = infernix_jax.load(HF_FIXTURES / request.param, max_context=512)
    core = EngineCore(model.config, model.params, CONFIG.replace(warmup=True, structured_output=False))
    compilations["n"] = 0
    return core


def test_a_hit_mid_prompt_equals_a_cold_prefill(core):
    cache = core.prefix_cache
    first, extended = prompt(150, 1), None
    extended = first + prompt(70, 2)
    cache.clear()
    cold = run(core, extended)
    assert cold[2] == 0
    cache.clear()
    run(core, first)
    hit = run(core, extended)
    # the first prompt left a snapshot just before its last token: 149 tokens, mid-way through a block
    assert hit[2] == 149
    assert_same(hit, cold)


def test_a_repeated_prompt_feeds_only_its_last_token(core):
    core.prefix_cache.clear()
    tokens = prompt(100, 3)
    cold = run(core, tokens)
    again = run(core, tokens)
    assert again[2] == 99
    assert_same(again, cold)


def test_a_two_turn_chat_reuses_all_of_turn_one(core):
    cache = core.prefix_cache
    turn1 = prompt(90, 4)
    cache.clear()
    reply, _, _ = run(core, turn1, max_tokens=16)
    stop = next(t for i, t in enumerate(reply) if i >= 3 and t not in reply[:i])  # ends turn one like an EOS
    cut = reply.index(stop)
    turn2 = turn1 + reply[:cut] + [stop] + prompt(30, 5)
    cache.clear()
    cold = run(core, turn2)
    cache.clear()
    answer, _, _ = run(core, turn1, max_tokens=16, stop_ids=(stop,))
    assert answer == reply[:cut]
    hit = run(core, turn2)
    assert hit[2] == len(turn1) + cut, "every token of turn one (prompt and reply) is served from the cache"
    assert_same(hit, cold)


def test_evicted_to_host_and_back_gives_the_same_output_without_compiling(core, compilations):
    cache = core.prefix_cache
    cache.clear()
    target = prompt(130, 6)
    cold = run(core, target + [7, 8, 9])
    cache.clear()
    run(core, target)
    before = dict(cache.stats.hit_tokens_by_tier)
    for seed in range(10, 16):  # other prompts push the target's blocks out of the 16-block pool
        run(core, prompt(200, seed))
    assert cache.stats.evicted_to_host > 0
    host = [e.host for e in cache.index.blocks.values() if e.host is not None]
    assert host, "blocks were evicted to the host tier"
    pinned = core.runner.host_memory.pinned  # wherever the backend offers pinned_host (the CPU does)
    for data in host:
        assert all(a.sharding.memory_kind == PINNED_HOST if pinned else isinstance(a, np.ndarray) for a in data)
    hit = run(core, target + [7, 8, 9])
    assert hit[2] == 129
    assert cache.stats.hit_tokens_by_tier["host"] > before["host"], "the hit came back from host memory"
    assert_same(hit, cold)
    assert compilations["n"] == 0, f"{compilations['n']} compilations after warm-up (here or in an earlier test)"


def test_cached_blocks_are_never_freed_while_a_request_uses_them(core):
    cache = core.prefix_cache
    cache.clear()
    shared = prompt(140, 20)
    run(core, shared)
    a, b = shared + prompt(60, 21), shared + prompt(90, 22)
    cold_a, cold_b = (cache.clear(), run(core, a))[1], (cache.clear(), run(core, b))[1]
    cache.clear()
    run(core, shared)
    params = SamplingParams(max_tokens=40, ignore_eos=True, frequency_penalty=5.0)
    events = core.add_request(GenerationRequest("a", a, params)) + core.add_request(
        GenerationRequest("b", b, params)
    )
    blocks = core.scheduler.blocks
    while core.has_work():
        events += core.step()
        for state in core.scheduler.running:
            assert all(blocks.refcount(x) >= 1 for x in state.blocks), "a block in use was freed"
            assert len(set(state.blocks)) == len(state.blocks)
    tokens = {"a": [], "b": []}
    for e in events:
        tokens[e.request_id] += e.token_ids
    assert tokens["a"][:6] == cold_a[0] and tokens["b"][:6] == cold_b[0]
    running = [x for s in core.scheduler.running for x in s.blocks]
    assert not running and blocks.num_free + cache.evictable_blocks() == blocks.num_total


def test_the_cache_file_survives_a_restart_and_bad_files_are_ignored(core, tmp_path, caplog):
    path = tmp_path / "prefix.cache"
    cfg = CONFIG.replace(prefix_cache_file=str(path))
    first = EngineCore(core.cfg, core.runner.params, cfg)
    tokens = prompt(120, 30)
    cold = run(first, tokens)
    assert first.save_prefix_cache() > 0
    restarted = EngineCore(core.cfg, core.runner.params, cfg)
    again = run(restarted, tokens)
    assert again[2] == 119
    assert restarted.prefix_cache.stats.hit_tokens_by_tier["file"] > 0
    assert_same(again, cold)

    data = path.read_bytes()
    for bad in (data[: len(data) // 2], data[:-10] + bytes(10 * [0x5A]), b"not a cache" + data[len(MAGIC) :]):
        path.write_bytes(bad)
        with caplog.at_level(logging.WARNING):
            fresh = EngineCore(core.cfg, core.runner.params, cfg)
        assert "ignoring prefix cache file" in caplog.text
        caplog.clear()
        assert not fresh.prefix_cache.index.blocks
        assert run(fresh, tokens)[2] == 0


def test_a_third_prompt_on_a_shared_system_prompt_hits_at_its_end(core):
    """The second prompt on a system prompt misses it (no state was saved where the two diverge) but
    snapshots there, so the third hits all of it."""
    cache = core.prefix_cache
    system = prompt(100, 20)  # ends inside the second block: no block boundary or interval snapshot there
    third = system + prompt(50, 23)
    cache.clear()
    cold = run(core, third)
    cache.clear()
    run(core, system + prompt(60, 21), rid="a")
    second = run(core, system + prompt(70, 22), rid="b")
    assert second[2] < len(system)
    hit = run(core, third, rid="c")
    assert hit[2] == len(system)
    assert_same(hit, cold)


def test_prompts_admitted_together_snapshot_where_they_diverge(core):
    cache = core.prefix_cache
    system = prompt(100, 30)
    third = system + prompt(40, 33)
    cache.clear()
    cold = run(core, third)
    cache.clear()
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    for rid, seed in (("a", 31), ("b", 32)):  # neither is indexed when the other is admitted
        core.add_request(GenerationRequest(rid, system + prompt(60, seed), params))
    while core.has_work():
        core.step()
    hit = run(core, third, rid="c")
    assert hit[2] == len(system)
    assert_same(hit, cold)


def test_the_second_prompt_on_a_system_message_hits_at_its_end(core):
    """A snapshot is taken just after a prompt's first end-of-message token: the end of the system
    message, which the next session on it shares."""
    cache = core.prefix_cache
    end = 501  # the end-of-message (stop) token; prompt() never draws it
    system = prompt(90, 40) + [end]
    second = system + prompt(50, 42)
    cache.clear()
    cold = run(core, second, stop_ids=(end,))
    cache.clear()
    run(core, system + prompt(60, 41), stop_ids=(end,), rid="a")
    hit = run(core, second, stop_ids=(end,), rid="b")
    assert hit[2] == len(system)
    assert_same(hit, cold)
