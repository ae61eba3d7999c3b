"""The forward computes what transformers computes, for every Qwen3-family architecture.

The reference logits and greedy continuations were produced by transformers (torch, float32) on
tiny random checkpoints by tests/fixtures/make_hf_fixtures.py; these tests need no torch.
"""

from __future__ import annotations

import numpy as np
import pytest

import infernix_jax
from tests.conftest import HF_FIXTURES, HF_VARIANTS


@pytest.fixture(scope="module", params=HF_VARIANTS)
def variant(request):
    path = HF_FIXTURES / request.param
    model = infernix_jax.load(path, max_context=256)
    return request.param, model, np.load(path / "reference.npz")


def test_logits_match_transformers(variant):
    name, model, ref = variant
    logits = model.logits(ref["input_ids"])
    expected = ref["logits"]
    rel = np.abs(logits - expected).max() / np.abs(expected).max()
    assert rel <= 1e-3, f"{name}: max |dlogit| / max |logit| = {rel:.2e}"
    # not degenerate: the argmax varies along the sequence
    assert len(set(np.argmax(expected, -1).tolist())) > 10


def test_greedy_matches_transformers_generate(variant):
    name, model, ref = variant
    result = model.generate(ref["greedy_prompt"].tolist(), max_new_tokens=len(ref["greedy_tokens"]), ignore_eos=True)
    assert result.token_ids == ref["greedy_tokens"].tolist(), name
    assert result.finish_reason == "length"
