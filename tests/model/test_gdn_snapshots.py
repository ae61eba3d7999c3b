"""Recurrent-state snapshots taken inside a forward equal the state of a forward that stopped there."""

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


@pytest.fixture(scope="module")
def model():
    path = HF_FIXTURES / "qwen3_next"
    cfg = ModelConfig.from_hf_config(path)
    return cfg, load_params(path, cfg, jnp.float32, progress=False), np.load(path / "reference.npz")["input_ids"]


def _run(params, cfg, ids, start, cache, pad=0, snapshot_at=None):
    n = len(ids)
    tokens = np.zeros((1, n + pad), np.int32)
    tokens[0, :n] = ids
    positions = np.full((1, n + pad), -1, np.int32)
    positions[0, :n] = np.arange(start, start + n)
    args = (params, jnp.asarray(tokens), jnp.asarray(positions), cache, cfg)
    if snapshot_at is None:
        return jit_forward(*args)[2]
    return jit_forward(*args, None, jnp.asarray(snapshot_at, jnp.int32)[None])[2]


@pytest.mark.parametrize(
    "window, start, pad, offsets",
    [
        (150, 0, 0, [0, 1, 63, 64, 100, 150]),  # chunked form, offsets on and off the 64-token grid
        (90, 20, 38, [5, 44, 89, -1, -1, 90]),  # chunked, not starting at 0, padded, unused entries
        (12, 30, 4, [0, 3, 11, 12, -1, -1]),  # per-token recurrence
    ],
)
def test_snapshot_equals_state_of_a_walk_that_ended_there(model, window, start, pad, offsets):
    cfg, params, ids = model
    prefix = _run(params, cfg, ids[:start], 0, init_cache(cfg, 1, 256)) if start else init_cache(cfg, 1, 256)
    walked = _run(params, cfg, ids[start : start + window], start, prefix, pad, offsets)
    assert len(walked.snapshots) == len(cfg.linear_attention_layers)
    for s, offset in enumerate(offsets):
        if offset < 0:
            continue
        # the same window with everything from the offset on as padding (one compiled shape)
        stopped = prefix if offset == 0 else _run(params, cfg, ids[start : start + offset], start, prefix, window + pad - offset)
        expected = [e for e, kind in zip(stopped.layers, cfg.layer_types) if kind != "full_attention"]
        for layer, (snap, want) in enumerate(zip(walked.snapshots, expected)):
            np.testing.assert_allclose(
                np.asarray(snap.conv[0, s]), np.asarray(want.conv[0]), rtol=1e-4, atol=1e-5, err_msg=f"conv l{layer} @{offset}"
            )
            scale = float(np.abs(np.asarray(want.recurrent)).max()) or 1.0
            err = float(np.abs(np.asarray(snap.recurrent[0, s]) - np.asarray(want.recurrent[0])).max()) / scale
            assert err < 1e-5, f"recurrent layer {layer} at offset {offset}: rel error {err:.2e}"


def test_snapshots_leave_the_walk_unchanged(model):
    cfg, params, ids = model
    plain = _run(params, cfg, ids[:100], 0, init_cache(cfg, 1, 128))
    snapped = _run(params, cfg, ids[:100], 0, init_cache(cfg, 1, 128), snapshot_at=[64, 99])
    for a, b in zip(jax.tree.leaves(plain.layers), jax.tree.leaves(snapped.layers)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
