"""Perplexity: windows score every token once, and the figure equals the reference model's."""

from __future__ import annotations

import math

import numpy as np
import pytest

import infernix_jax
from infernix_jax.perplexity import perplexity, token_nll, window_plan
from tests.conftest import HF_FIXTURES


@pytest.mark.parametrize("n,context,stride", [(10, 4, 2), (100, 32, 32), (100, 32, 7), (5, 64, 32), (65, 64, 1)])
def test_windows_score_each_token_once(n, context, stride):
    scored = []
    for start, end, first in window_plan(n, context, stride):
        assert end - start <= context and start < first <= end
        scored.extend(range(first, end))
    assert scored == list(range(1, n))


def test_full_context_perplexity_equals_transformers_logits():
    path = HF_FIXTURES / "qwen3_next"
    ref = np.load(path / "reference.npz")
    ids = ref["input_ids"].tolist()
    expected = math.exp(token_nll(ref["logits"][:-1], np.asarray(ids[1:])).mean())
    model = infernix_jax.load(path, max_context=256)
    result = perplexity(model, ids, context=256, stride=128, progress=False)
    assert result.tokens_evaluated == len(ids) - 1
    assert result.perplexity == pytest.approx(expected, rel=1e-4)
    # shorter windows see less history, but score the same tokens
    windowed = perplexity(model, ids, context=64, stride=32, progress=False)
    assert windowed.tokens_evaluated == len(ids) - 1
    assert windowed.perplexity != result.perplexity
    again = perplexity(model, ids, context=64, stride=32, progress=False)
    assert again.perplexity == windowed.perplexity  # reproducible run to run
