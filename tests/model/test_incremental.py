"""Chunked prefill followed by token-by-token decode gives the logits of one full forward."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infernix_jax.cache.sequence import init_cache
from infernix_jax.config import ModelConfig
from infernix_jax.model.forward import forward
from infernix_jax.weights.hf import load_params
from tests.conftest import HF_FIXTURES

jit_forward = jax.jit(forward, static_argnums=(4,))


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5", "qwen3_next_custom"])
def test_chunked_prefill_then_decode_equals_full_forward(name):
    path = HF_FIXTURES / name
    cfg = ModelConfig.from_hf_config(path)
    params = load_params(path, cfg, jnp.float32, progress=False)
    ids = np.load(path / "reference.npz")["input_ids"][:120]
    total = len(ids)
    full, _, _ = jit_forward(params, jnp.asarray(ids)[None], jnp.arange(total)[None], init_cache(cfg, 1, 128), cfg)
    full = np.asarray(full[0])

    # chunks of several sizes (one crossing a 64-token GDN chunk, one padded), then single tokens
    cache = init_cache(cfg, 1, 128)
    pieces, pos = [], 0
    for n, pad in ((5, 0), (70, 0), (17, 7), (1, 0)):
        tokens = np.zeros((1, n + pad), np.int32)
        tokens[0, :n] = ids[pos : pos + n]
        positions = np.full((1, n + pad), -1, np.int32)
        positions[0, :n] = np.arange(pos, pos + n)
        logits, _, cache = jit_forward(params, jnp.asarray(tokens), jnp.asarray(positions), cache, cfg)
        pieces.append(np.asarray(logits[0, :n]))
        pos += n
    while pos < total:
        logits, _, cache = jit_forward(params, jnp.asarray(ids[pos : pos + 1])[None], jnp.full((1, 1), pos), cache, cfg)
        pieces.append(np.asarray(logits[0]))
        pos += 1
    incremental = np.concatenate(pieces)
    rel = np.abs(incremental - full).max() / np.abs(full).max()
    assert rel <= 1e-4, f"{name}: incremental vs full rel error {rel:.2e}"


def test_batched_rows_are_independent():
    """Two sequences of different lengths in one batch give each its own logits."""
    path = HF_FIXTURES / "qwen3_next"
    cfg = ModelConfig.from_hf_config(path)
    params = load_params(path, cfg, jnp.float32, progress=False)
    ids = np.load(path / "reference.npz")["input_ids"]
    a, b = ids[:40], ids[50:70]
    alone_a, _, _ = jit_forward(params, jnp.asarray(a)[None], jnp.arange(40)[None], init_cache(cfg, 1, 64), cfg)
    alone_b, _, _ = jit_forward(params, jnp.asarray(b)[None], jnp.arange(20)[None], init_cache(cfg, 1, 64), cfg)
    tokens = np.zeros((2, 40), np.int32)
    positions = np.full((2, 40), -1, np.int32)
    tokens[0], positions[0] = a, np.arange(40)
    tokens[1, :20], positions[1, :20] = b, np.arange(20)
    both, _, _ = jit_forward(params, jnp.asarray(tokens), jnp.asarray(positions), init_cache(cfg, 2, 64), cfg)
    np.testing.assert_allclose(np.asarray(both[0]), np.asarray(alone_a[0]), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(both[1, :20]), np.asarray(alone_b[0]), rtol=1e-4, atol=1e-4)
