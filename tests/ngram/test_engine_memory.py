"""The engine with an n-gram memory: batching, chunked prefill and the prefix cache are exact.

The reference is a plain greedy loop over the one forward (full recompute at every token, rows
looked up straight from the table), so a wrong token history at a chunk boundary or in decode
shows up as a different token.
"""

from __future__ import annotations

from functools import partial

import jax
import numpy as np
import pytest

from infernix_jax.cache.sequence import init_cache
from infernix_jax.engine.config import EngineConfig
from infernix_jax.engine.core import EngineCore
from infernix_jax.engine.protocol import FINISH_LENGTH, GenerationRequest, SamplingParams
from infernix_jax.model.forward import forward
from infernix_jax.ngram.memory import table_in_memory
from tests.ngram.conftest import VOCAB

REF_LEN = 96  # the reference forward's padded length (one compile)
NEW_TOKENS = 6


def engine_config(**changes) -> EngineConfig:
    """Chunks of at most 16 tokens (a 40-token prompt is fed in three), the prefix cache on."""
    base = dict(  # noqa: C408 - EngineConfig's keyword names
        max_concurrency=4,
        max_context=128,
        kv_capacity=24,
        prefill_chunk=16,
        prefill_shape_override=((2, 16),),  # one prefill and one decode program: quick to compile
        decode_batch_sizes=(4,),
        max_top_logprobs=2,
        compilation_cache_dir=None,
        progress=False,
        prefix_cache=True,
    )
    base.update(changes)
    return EngineConfig(**base)


@partial(jax.jit, static_argnums=(4,))
def _reference_logits(params, tokens, positions, rows, cfg):
    cache = init_cache(cfg, 1, REF_LEN)
    logits, _, _ = forward(params, tokens, positions, cache, cfg, ngram_rows=rows)
    return logits[0]


def reference_greedy(cfg, params, table, prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        t = len(tokens)
        padded = np.zeros((1, REF_LEN), np.int32)
        padded[0, :t] = tokens
        positions = np.full((1, REF_LEN), -1, np.int32)
        positions[0, :t] = np.arange(t)
        rows = table.empty(1, REF_LEN)
        rows[:, 0, :t] = table.rows(tokens, 0, t)
        logits = _reference_logits(params, padded, positions, rows, cfg)
        tokens.append(int(np.argmax(np.asarray(logits[t - 1]))))
    return tokens[len(prompt) :]


def run(core: EngineCore, prompts: list[list[int]], prefix: str) -> dict[str, list[int]]:
    out = {f"{prefix}{i}": [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        assert (
            core.add_request(
                GenerationRequest(f"{prefix}{i}", p, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
            )
            == []
        )
    while core.has_work():
        for e in core.step():
            assert e.error is None, e.error
            out[e.request_id] += e.token_ids
            if e.finished:
                assert e.finish_reason == FINISH_LENGTH
    return [out[f"{prefix}{i}"] for i in range(len(prompts))]


PROMPT_LENGTHS = (5, 21, 40, 2)  # 40 spans two chunks of 32 and three of 16


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(3)
    return [rng.integers(0, VOCAB, size=n).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def memory(tiny_cfg, tiny_table):
    return table_in_memory(tiny_cfg, tiny_table, cache_bytes=64 << 10)


@pytest.fixture(scope="module")
def expected(tiny_cfg, tiny_params, memory, prompts):
    return [reference_greedy(tiny_cfg, tiny_params, memory, p, NEW_TOKENS) for p in prompts]


@pytest.fixture(scope="module")
def core(tiny_cfg, tiny_params, memory):
    return EngineCore(tiny_cfg, tiny_params, engine_config(), ngram_table=memory)


def test_batched_chunked_prefill_equals_the_reference(core, prompts, expected):
    """Four prompts in one batch, the longest fed in chunks of 16: n-grams that straddle a chunk
    boundary read the previous chunk's tokens, decode reads the sampled ones."""
    assert core.config.decode_steps_per_dispatch == 1  # a memory's next rows need the sampled token
    assert run(core, prompts, "batch") == expected


def test_each_prompt_alone_equals_the_reference(core, prompts, expected):
    for i, p in enumerate(prompts):
        assert run(core, [p], f"alone{i}-") == [expected[i]], f"prompt {i} alone differs"


def test_prefix_cache_hit_gives_the_reference_tokens(core, tiny_cfg, tiny_params, memory, prompts):
    long_prompt = prompts[2] + prompts[1] + prompts[1]  # 82 tokens: one full 64-token block
    want = [reference_greedy(tiny_cfg, tiny_params, memory, long_prompt, NEW_TOKENS)]
    hits = core.prefix_cache.stats.hit_tokens
    assert run(core, [long_prompt], "first") == want
    assert run(core, [long_prompt], "again") == want
    assert core.prefix_cache.stats.hit_tokens >= hits + 64, "the second prompt was meant to hit the cache"


def test_the_table_changes_the_output(tiny_cfg, tiny_params, tiny_table, prompts, expected):
    """The memory is really read: another table gives other tokens."""
    other = table_in_memory(tiny_cfg, tiny_table[::-1].copy())
    core = EngineCore(tiny_cfg, tiny_params, engine_config(), ngram_table=other)
    assert run(core, prompts, "other") != expected


def test_random_lookup_delays_do_not_change_tokens(tiny_cfg, tiny_params, tiny_table, prompts, expected):
    from infernix_jax.ngram.memory import NgramTable
    from tests.ngram.test_prefetch import DelayedRows

    slow = NgramTable(tiny_cfg, DelayedRows(tiny_table, seed=9), cache_bytes=4 << 10)
    core = EngineCore(tiny_cfg, tiny_params, engine_config(), ngram_table=slow)
    assert run(core, prompts, "slow") == expected


def test_a_memory_model_without_a_table_says_which_flag_to_give(tiny_cfg, tiny_params):
    with pytest.raises(ValueError, match="--ngram-volume"):
        EngineCore(tiny_cfg, tiny_params, engine_config())


def test_speculation_with_a_memory_gives_the_reference_tokens(tiny_cfg, tiny_params, memory, prompts, expected):
    """Prompt-lookup drafts are known on the host, so each verify window's rows (n-grams running
    through the drafts) are looked up with it: greedy output is the reference's, token for token."""
    core = EngineCore(
        tiny_cfg, tiny_params, engine_config(spec="ngram", ngram_draft_tokens=3, ngram_min_match=1),
        ngram_table=memory,
    )
    repetitive = [p + p for p in prompts]  # the continuation often repeats: drafts get proposed
    want = [reference_greedy(tiny_cfg, tiny_params, memory, p, NEW_TOKENS) for p in repetitive]
    assert run(core, repetitive, "spec") == want
    # drafts were verified, and some accepted: tokens read from window positions whose rows depend on them
    assert core.metrics.drafted_tokens > 0 and core.metrics.accepted_tokens > 0, core.metrics


def test_unsupported_speculation_with_a_memory_is_refused_clearly(tiny_cfg, tiny_params, memory):
    with pytest.raises(ValueError, match="--spec ngram with linear windows only"):
        EngineCore(tiny_cfg, tiny_params, engine_config(spec="mtp"), ngram_table=memory)
    with pytest.raises(ValueError, match="--spec ngram with linear windows only"):
        EngineCore(tiny_cfg, tiny_params, engine_config(spec="ngram", spec_tree_width=2), ngram_table=memory)


def test_score_requests_are_refused_with_a_reason(core):
    """Scoring (the /v1/decide path) does not feed memory rows yet: a clear error, not a crash."""
    from infernix_jax.engine.protocol import FINISH_ERROR, ScoreRequest

    events = core.add_score_request(ScoreRequest("s", [1, 2, 3], [[4], [5]]))
    assert events and events[0].finish_reason == FINISH_ERROR and "n-gram memory" in events[0].error
