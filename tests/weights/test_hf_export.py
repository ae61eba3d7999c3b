"""Exporting Params back to Hugging Face names reproduces the original checkpoint bit for bit."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from infernix_jax.config import ModelConfig
from infernix_jax.weights.hf import load_params
from infernix_jax.weights.hf_export import params_to_hf
from infernix_jax.weights.safetensors_io import SafetensorsCheckpoint
from tests.conftest import HF_FIXTURES


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5", "qwen3_dense", "qwen3_moe", "qwen3_next_custom"])
def test_export_roundtrip_is_bit_exact(name):
    path = HF_FIXTURES / name
    cfg = ModelConfig.from_hf_config(path)
    params = load_params(path, cfg, jnp.float32, progress=False)
    exported = params_to_hf(params, cfg)
    ckpt = SafetensorsCheckpoint(path)
    original = {n for n in ckpt.names() if not n.startswith("model.visual.")}
    if cfg.tie_word_embeddings:
        original.discard("lm_head.weight")
    assert set(exported) == original
    for n in sorted(original):
        np.testing.assert_array_equal(exported[n], np.asarray(ckpt.get(n), np.float32), err_msg=n)
