"""The chunked and per-token forms of the gated delta rule agree, from any state, with padding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infernix_jax.model.gated_deltanet import (
    _rule_with_snapshots,
    chunk_gated_delta_rule,
    l2_normalize,
    recurrent_gated_delta_rule,
    solve_unit_lower,
    unit_lower_inverse,
)


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


def test_the_chunked_rule_makes_no_lapack_call_on_the_cpu():
    """jaxlib's CPU triangular solve (LAPACK) deadlocks a 2-thread pool when two run at once
    (docs/model_config.md): on the CPU the chunked rule, snapshots included, solves by matmuls."""
    q, k, v, g, beta, state = _inputs(jax.random.PRNGKey(1), 1, 130, 2, 8, 16)
    text = str(jax.make_jaxpr(chunk_gated_delta_rule)(q, k, v, g, beta, state))
    assert "triangular_solve" not in text
    offsets = jnp.array([[70, 130]], jnp.int32)
    text = str(jax.make_jaxpr(_rule_with_snapshots)(q, k, v, g, beta, state, offsets))
    assert "triangular_solve" not in text


@pytest.mark.parametrize("c", [1, 5, 8, 64])
def test_unit_lower_inverse_solves_delta_rule_systems(c, monkeypatch):
    """The matmul inverse and the triangular solve (the GPU's way) both match float64."""
    _, k, _, g, beta, _ = _inputs(jax.random.PRNGKey(c), 3, c, 2, 16, 4)
    k_beta = k * beta[..., None]
    cum = jnp.moveaxis(jnp.cumsum(g, axis=1), 1, 2)  # [B, H, C]
    decay = jnp.exp(cum[..., :, None] - cum[..., None, :])
    strict = jnp.tril(jnp.einsum("bihk,bjhk->bhij", k_beta, k) * decay, -1)
    rhs = jax.random.normal(jax.random.PRNGKey(9), strict.shape[:-1] + (6,))
    want = np.linalg.solve(np.eye(c) + np.asarray(strict, np.float64), np.asarray(rhs, np.float64))
    got = solve_unit_lower(strict, rhs)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    inverse = np.asarray(unit_lower_inverse(strict), np.float64)
    np.testing.assert_allclose(
        inverse @ (np.eye(c) + np.asarray(strict, np.float64)),
        np.broadcast_to(np.eye(c), inverse.shape),
        atol=1e-5,
    )
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    np.testing.assert_allclose(np.asarray(solve_unit_lower(strict, rhs)), want, rtol=1e-5, atol=1e-5)


def test_padding_leaves_state_untouched():
    q, k, v, g, beta, state = _inputs(jax.random.PRNGKey(0), 1, 20, 2, 8, 8)
    valid = jnp.arange(20) < 12
    g_pad = jnp.where(valid[None, :, None], g, 0.0)
    beta_pad = jnp.where(valid[None, :, None], beta, 0.0)
    _, s_padded = chunk_gated_delta_rule(q, k, v, g_pad, beta_pad, state, chunk=8)
    _, s_short = recurrent_gated_delta_rule(q[:, :12], k[:, :12], v[:, :12], g[:, :12], beta[:, :12], state)
    np.testing.assert_allclose(np.asarray(s_padded), np.asarray(s_short), rtol=1e-5, atol=1e-5)
