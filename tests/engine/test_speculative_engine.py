"""Speculative decoding in the engine: greedy output equals greedy output without speculation.

Over many prompts, batched and alone, with each drafter (n-gram, MTP, both) on the hybrid MoE
fixture (random MTP weights: their drafts are mostly rejected, which exercises rollback) and with
the n-gram drafter on the dense fixture. The tiny random models rarely repeat themselves, so an
oracle drafter (the known greedy continuation, corrupted at chosen places) also drives the engine
through full, partial and zero acceptance in one batch. The reference is the single-sequence path
without speculation (`Model.generate`).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import numpy as np
import pytest

import infernix_jax
from infernix_jax.engine.core import EngineCore
from infernix_jax.engine.protocol import GenerationRequest, SamplingParams
from tests.conftest import HF_FIXTURES
from tests.engine.test_engine_core import MAX_CONTEXT, SMALL, assert_pool_empty, run

NEW_TOKENS = 16
# one prefill and one verify program per model and drafter kind keep compile time down
SPEC = SMALL.replace(
    prefill_chunk=64, prefill_shape_override=((2, 64),), decode_batch_sizes=(8,), draft_tokens=4,
    ngram_draft_tokens=4, warmup=False,
)  # fmt: skip


def repetitive_prompts(count: int, seed: int) -> list[list[int]]:
    """Prompts made of a random phrase repeated (code editing / quoting in miniature), and plain ones."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(count):
        phrase = rng.integers(0, 512, size=int(rng.integers(3, 9))).tolist()
        if i % 3 == 2:
            out.append(rng.integers(0, 512, size=int(rng.integers(2, 100))).tolist())
        else:
            out.append((phrase * 8)[: int(rng.integers(10, 60))])
    return out


MODELS = {"hybrid": "qwen3_next", "dense": "qwen3_dense"}


@cache
def model(name: str):
    return infernix_jax.load(HF_FIXTURES / MODELS[name], max_context=MAX_CONTEXT)


@cache
def expected(name: str, prompt: tuple[int, ...]) -> list[int]:
    return model(name).generate(list(prompt), max_new_tokens=NEW_TOKENS, ignore_eos=True).token_ids


def speculative_core(name: str, spec: str, **options) -> EngineCore:
    m = model(name)
    return EngineCore(m.config, m.params, SPEC.replace(spec=spec, **options), m.tokenizer, m.eos_token_ids())


def check_greedy_equal(name: str, core: EngineCore, ids: list[list[int]], batched: bool) -> None:
    requests = [
        GenerationRequest(f"r{i}", p, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
        for i, p in enumerate(ids)
    ]
    if batched:
        results = run(core, requests)
    else:
        results = {}
        for r in requests:
            results.update(run(core, [r]))
    for i, p in enumerate(ids):
        assert results[f"r{i}"]["tokens"] == expected(name, tuple(p)), f"prompt {i} differs"
    assert_pool_empty(core)


@pytest.mark.slow  # compiles the hybrid model's prefill and verify programs (~30 s each drafter kind)
@pytest.mark.parametrize("spec", ["ngram", "mtp", "mtp+ngram"])
def test_hybrid_moe_greedy_with_speculation_equals_without(spec):
    # single-token matches, so that the n-gram drafter fires on a random model's output
    core = speculative_core("hybrid", spec, ngram_min_match=1)
    check_greedy_equal("hybrid", core, repetitive_prompts(8, seed=11), batched=True)
    check_greedy_equal("hybrid", core, repetitive_prompts(2, seed=12), batched=False)
    assert core.metrics.drafted_tokens > core.metrics.accepted_tokens
    assert core.metrics.drafted_tokens >= 20  # rejections ran (the oracle test below covers acceptance)


@pytest.mark.slow  # ~25 s, mostly compiling
def test_dense_greedy_with_ngram_speculation_equals_without():
    core = speculative_core("dense", "ngram", ngram_min_match=1)
    check_greedy_equal("dense", core, repetitive_prompts(8, seed=13), batched=True)
    check_greedy_equal("dense", core, repetitive_prompts(2, seed=14), batched=False)
    assert core.metrics.drafted_tokens > 0


@dataclass
class OracleDrafter:
    """Proposes the known greedy continuation; for request i it corrupts draft i % 4 (i % 4 == 3:
    never), so one batch sees zero, partial and full acceptance."""

    name: str
    prompts: list[list[int]]
    uses_mtp: bool = False

    def propose(self, tokens, device_drafts, limit):
        for i, p in enumerate(self.prompts):
            if list(tokens[: len(p)]) == p:
                done = len(tokens) - len(p)
                drafts = expected(self.name, tuple(p))[done : done + limit]
                if i % 4 < len(drafts) and i % 4 != 3:
                    drafts[i % 4] = (drafts[i % 4] + 1) % 512
                return drafts
        raise AssertionError("unknown request")


@pytest.mark.slow  # compiles each model's verify program unless an earlier test did (~30 s)
@pytest.mark.parametrize("name", ["hybrid", "dense"])
def test_rows_accepting_different_lengths_in_one_batch_stay_exact(name):
    core = speculative_core(name, "ngram")
    ids = repetitive_prompts(8, seed=17)
    core.speculation.drafter = OracleDrafter(name, ids)
    check_greedy_equal(name, core, ids, batched=True)
    m = core.metrics
    assert m.drafted_tokens > m.accepted_tokens > 0
    assert m.mean_accepted_length > 1.5, m  # about (1 + 2 + 3 + 5) / 4, less where budgets run out


@pytest.mark.slow  # compiles the MTP programs unless an earlier test did (~30 s)
def test_seeded_sampling_with_speculation_is_reproducible_and_batch_independent():
    core = speculative_core("hybrid", "mtp+ngram")
    prompt = repetitive_prompts(1, seed=15)[0]
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
    alone = run(core, [GenerationRequest("s", prompt, params)])["s"]["tokens"]
    others = [
        GenerationRequest(f"o{i}", p, SamplingParams(max_tokens=8, temperature=0.7, seed=i))
        for i, p in enumerate(repetitive_prompts(3, seed=16))
    ]
    together = run(core, others + [GenerationRequest("s", prompt, params)])["s"]["tokens"]
    assert len(alone) == 12 and together == alone
    assert_pool_empty(core)


@pytest.mark.slow  # ~15 s
def test_preemption_under_speculation_gives_identical_output():
    """A pool too small for every window: requests are preempted (their drafts go stale, the MTP KV
    is rebuilt by the recompute prefill) and still produce the non-speculative greedy output."""
    core = speculative_core("hybrid", "mtp+ngram", ngram_min_match=1)
    rng = np.random.default_rng(1)
    ids = [rng.integers(0, 512, size=n).tolist() for n in (50, 60, 45, 55, 40, 52)]
    requests = [
        GenerationRequest(f"p{i}", p, SamplingParams(max_tokens=90, ignore_eos=True))
        for i, p in enumerate(ids)
    ]
    results = run(core, requests)
    assert core.metrics.preemptions > 0, "the pool was meant to run out"
    m = model("hybrid")
    for i, p in enumerate(ids):
        assert results[f"p{i}"]["tokens"] == m.generate(p, max_new_tokens=90, ignore_eos=True).token_ids
    assert_pool_empty(core)


@pytest.mark.slow  # ~40 s: warms up every bucket
def test_no_compilation_after_warmup_with_speculation():
    import jax

    from tests.engine.test_engine_core import COMPILE_EVENT

    m = model("hybrid")
    # sampling plans chosen on the host, as on a GPU: warm-up compiles every verify bucket under both
    config = SMALL.replace(spec="mtp+ngram", warmup=True, sampling_plans="static")
    core = EngineCore(m.config, m.params, config, m.tokenizer, m.eos_token_ids())
    counter = {"n": 0}

    def listen(event: str, duration: float, **kwargs) -> None:
        counter["n"] += event == COMPILE_EVENT

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        sampling = [
            SamplingParams(max_tokens=9, ignore_eos=True),
            SamplingParams(max_tokens=5, temperature=0.8, top_p=0.9, logprobs=3),
        ]
        for ids in (repetitive_prompts(6, seed=3), repetitive_prompts(1, seed=4)):
            run(core, [GenerationRequest(f"c{i}", p, sampling[i % 2]) for i, p in enumerate(ids)])
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert counter["n"] == 0, f"{counter['n']} compilations after warm-up"
    assert_pool_empty(core)
