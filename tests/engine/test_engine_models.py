"""The engine on a dense model, and with quantized KV storage (int8, fp8) against bf16."""

from __future__ import annotations

import pytest

import infernix_jax
from infernix_jax.engine.core import EngineCore
from infernix_jax.engine.protocol import GenerationRequest, SamplingParams
from tests.conftest import HF_FIXTURES
from tests.engine.test_engine_core import MAX_CONTEXT, SMALL, assert_pool_empty, prompts, run

# Largest |logprob difference| of the top-5 alternatives, quantized KV vs model-dtype KV, on the
# tiny fixture with per-token, per-head scales (measured: int8 0.03 over 4 positions, fp8 0.004 at
# the first; the fixture has near-tied top logits, so fp8 may pick another token after that).
KV_LOGPROB_TOLERANCE = {"int8": 0.05, "fp8": 0.15}


def test_dense_model_batched_greedy_equals_each_prompt_alone():
    reference = infernix_jax.load(HF_FIXTURES / "qwen3_dense", max_context=MAX_CONTEXT)
    core = EngineCore(
        reference.config,
        reference.params,
        SMALL.replace(warmup=False),
        reference.tokenizer,
        reference.eos_token_ids(),
    )
    ids = prompts((2, 5, 7, 9, 11, 13, 15, 16), seed=7)
    results = run(
        core,
        [
            GenerationRequest(f"d{i}", p, SamplingParams(max_tokens=10, ignore_eos=True))
            for i, p in enumerate(ids)
        ],
    )
    for i, p in enumerate(ids):
        assert (
            results[f"d{i}"]["tokens"] == reference.generate(p, max_new_tokens=10, ignore_eos=True).token_ids
        )
    assert_pool_empty(core)


@pytest.fixture(scope="module")
def hybrid():
    return infernix_jax.load(HF_FIXTURES / "qwen3_next", max_context=MAX_CONTEXT)


def logprob_rows(model, kv_dtype: str, prompt: list[int]):
    core = EngineCore(model.config, model.params, SMALL.replace(kv_dtype=kv_dtype, warmup=False))
    events = []
    core.add_request(
        GenerationRequest("q", prompt, SamplingParams(max_tokens=4, ignore_eos=True, logprobs=5))
    )
    while core.has_work():
        events += core.step()
    return [lp for e in events for lp in e.logprobs]


KV_PROMPT = prompts((40,), seed=8)[0]


@pytest.fixture(scope="module")
def bf16_rows(hybrid):
    """The model-dtype KV's logprob rows, computed once for both quantized formats."""
    return logprob_rows(hybrid, "bf16", KV_PROMPT)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
def test_quantized_kv_stays_within_logprob_tolerance_of_bf16(hybrid, bf16_rows, kv_dtype):
    exact = bf16_rows
    quantized = logprob_rows(hybrid, kv_dtype, KV_PROMPT)
    # After the prompt the context is identical; later positions are compared while the tokens agree.
    worst = 0.0
    for a, b in zip(exact, quantized):
        ref, got = dict(a.top), dict(b.top)
        shared = set(ref) & set(got)
        assert len(shared) >= 3, f"top-5 alternatives differ: {a.top} vs {b.top}"
        worst = max(worst, max(abs(ref[t] - got[t]) for t in shared))
        if a.token_id != b.token_id:
            break
    print(f"{kv_dtype}: worst top-5 logprob difference {worst:.4f}")
    assert 0 < worst <= KV_LOGPROB_TOLERANCE[kv_dtype]
