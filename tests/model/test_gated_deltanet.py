"""The chunked and per-token forms of the gated delta rule agree, from any state, with padding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infernix_jax.model.gated_deltanet import chunk_gated_delta_rule, l2_normalize, recurrent_gated_delta_rule


def _inputs(key, b, t, h, dk, dv):
    ks = jax.random.split(key, 6)
    q = l2_normalize(jax.random.normal(ks[0], (b, t, h, dk))) * dk**-0.5
    k = l2_normalize(jax.random.normal(ks[1], (b, t, h, dk)))
    v = jax.random.normal(ks[2], (b, t, h, dv))
    g = -jax.nn.softplus(jax.random.normal(ks[3], (b, t, h)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[4], (b, t, h)))
    state = 0.3 * jax.random.normal(ks[5], (b, h, dk, dv))
    return q, k, v, g, beta, state


@pytest.mark.parametrize("t", [1, 5, 64, 100, 130])
def test_chunked_equals_recurrent(t):
    q, k, v, g, beta, state = _inputs(jax.random.PRNGKey(t), 2, t, 3, 8, 16)
    out_r, s_r = jax.jit(recurrent_gated_delta_rule)(q, k, v, g, beta, state)
    out_c, s_c = jax.jit(chunk_gated_delta_rule)(q, k, v, g, beta, state)
    np.testing.assert_allclose(np.asarray(out_c), np.asarray(out_r), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(s_c), np.asarray(s_r), rtol=1e-4, atol=1e-4)


def test_the_chunked_rule_solves_its_triangular_system_once():
    """Two independent triangular solves in one program deadlock jaxlib 0.10.2's CPU runtime when
    they run at once (docs/model_config.md): the values and the decayed keys share one solve,
    with the other outputs unchanged (test_chunked_equals_recurrent)."""
    q, k, v, g, beta, state = _inputs(jax.random.PRNGKey(1), 1, 130, 2, 8, 16)
    text = str(jax.make_jaxpr(chunk_gated_delta_rule)(q, k, v, g, beta, state))
    assert text.count("triangular_solve[") == 1


def test_padding_leaves_state_untouched():
    q, k, v, g, beta, state = _inputs(jax.random.PRNGKey(0), 1, 20, 2, 8, 8)
    valid = jnp.arange(20) < 12
    g_pad = jnp.where(valid[None, :, None], g, 0.0)
    beta_pad = jnp.where(valid[None, :, None], beta, 0.0)
    _, s_padded = chunk_gated_delta_rule(q, k, v, g_pad, beta_pad, state, chunk=8)
    _, s_short = recurrent_gated_delta_rule(q[:, :12], k[:, :12], v[:, :12], g[:, :12], beta[:, :12], state)
    np.testing.assert_allclose(np.asarray(s_padded), np.asarray(s_short), rtol=1e-5, atol=1e-5)
