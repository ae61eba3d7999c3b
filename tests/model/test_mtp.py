"""The MTP head matches a torch reference of vLLM's qwen3_next_mtp semantics.

The reference (tests/fixtures/make_hf_fixtures.py) builds transformers' own decoder layer with the
checkpoint's mtp.* weights: at index i it reads token x_{i+1} and the target's final hidden h_i at
position i, computes fc(concat[norm(embed(x)), norm(h)]), one full-attention MoE layer, mtp.norm and
the shared lm_head.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from infernix_jax.cache.sequence import init_cache
from infernix_jax.config import ModelConfig
from infernix_jax.model.forward import forward, mtp_forward
from infernix_jax.weights.hf import load_params
from tests.conftest import HF_FIXTURES


def test_mtp_forward_matches_reference():
    path = HF_FIXTURES / "qwen3_next"
    cfg = ModelConfig.from_hf_config(path)
    assert cfg.mtp_num_layers == 1
    params = load_params(path, cfg, jnp.float32, progress=False)
    assert params.mtp is not None
    ref = np.load(path / "reference.npz")
    ids = jnp.asarray(ref["input_ids"])[None]
    t = ids.shape[1]
    cache = init_cache(cfg, 1, t, with_mtp=True)
    _, hidden, cache = jax.jit(forward, static_argnums=(4,))(params, ids, jnp.arange(t)[None], cache, cfg)
    np.testing.assert_allclose(np.asarray(hidden[0]), ref["hidden"], rtol=1e-3, atol=1e-3)
    logits, mtp_hidden, _ = jax.jit(mtp_forward, static_argnums=(5,))(
        params, ids[:, 1:], hidden[:, :-1], jnp.arange(t - 1)[None], cache, cfg
    )
    expected = ref["mtp_logits"]
    rel = np.abs(np.asarray(logits[0]) - expected).max() / np.abs(expected).max()
    assert rel <= 1e-3, f"MTP logits rel error {rel:.2e}"
    np.testing.assert_allclose(np.asarray(mtp_hidden[0]), ref["mtp_hidden"], rtol=1e-3, atol=1e-3)
