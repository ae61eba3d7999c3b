"""After a rejected draft the recurrent state equals the state of a run that never saw it.

States are compared directly, to 1e-5: the window's input projections are matmuls over 5 tokens
instead of 1..4, which round differently in the last bits (measured: 1.4e-6 at most); a state that
kept a rejected draft differs by orders of magnitude more (checked below).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infernix_jax.cache.sequence import GDNState, init_cache
from infernix_jax.config import ModelConfig
from infernix_jax.engine.speculative.rollback import keep_accepted_states, verify_state_bytes
from infernix_jax.model.forward import forward
from infernix_jax.weights.hf import load_params
from tests.conftest import HF_FIXTURES

jit_forward = jax.jit(forward, static_argnums=(4,), static_argnames=("keep_states",))


@pytest.fixture(scope="module")
def model():
    path = HF_FIXTURES / "qwen3_next"
    cfg = ModelConfig.from_hf_config(path)
    return cfg, load_params(path, cfg, jnp.float32, progress=False)


def run(params, cfg, cache, tokens, start, keep_states=False):
    tokens = jnp.asarray(tokens, jnp.int32)[None]
    positions = jnp.arange(start, start + tokens.shape[1])[None]
    return jit_forward(params, tokens, positions, cache, cfg, keep_states=keep_states)


def gdn_states(cache):
    return [e for e in cache.layers if isinstance(e, GDNState)]


@pytest.mark.parametrize("accepted", [0, 3])
def test_rejected_drafts_leave_no_trace_in_the_recurrent_state(model, accepted):
    cfg, params = model
    rng = np.random.default_rng(accepted)
    prompt = rng.integers(0, cfg.vocab_size, 20).tolist()
    window = rng.integers(0, cfg.vocab_size, 5).tolist()  # pending token + 4 drafts
    _, _, prefix = run(params, cfg, init_cache(cfg, 1, 64), prompt, 0)

    _, _, verified = run(params, cfg, prefix, window, len(prompt), keep_states=True)
    for entry in gdn_states(verified):
        assert entry.conv.shape[1] == len(window) and entry.recurrent.shape[1] == len(window)
    kept = keep_accepted_states(verified, jnp.asarray([accepted]))
    saw_everything = keep_accepted_states(verified, jnp.asarray([len(window) - 1]))

    _, _, never_saw = run(params, cfg, prefix, window[: accepted + 1], len(prompt))
    for got, want in zip(gdn_states(kept), gdn_states(never_saw)):
        np.testing.assert_allclose(np.asarray(got.conv), np.asarray(want.conv), rtol=0, atol=1e-5)
        np.testing.assert_allclose(np.asarray(got.recurrent), np.asarray(want.recurrent), rtol=0, atol=1e-5)
    polluted = gdn_states(saw_everything)[-1].recurrent - gdn_states(never_saw)[-1].recurrent
    assert float(jnp.abs(polluted).max()) > 1e-3

    # decoding on from the rolled-back cache (stale KV past the accepted length included) gives the
    # logits of the run that never saw the rejected drafts
    nxt = rng.integers(0, cfg.vocab_size, 3).tolist()
    start = len(prompt) + accepted + 1
    got, _, _ = run(params, cfg, kept, nxt, start)
    want, _, _ = run(params, cfg, never_saw, nxt, start)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_per_position_states_follow_plain_decoding(model):
    """State after window position i == state after feeding the window's first i + 1 tokens one by one."""
    cfg, params = model
    tokens = list(range(7, 32))
    _, _, cache = run(params, cfg, init_cache(cfg, 1, 64), tokens[:20], 0)
    _, _, per_position = run(params, cfg, cache, tokens[20:], 20, keep_states=True)
    step = cache
    for i, token in enumerate(tokens[20:]):
        _, _, step = run(params, cfg, step, [token], 20 + i)
        for got, want in zip(gdn_states(per_position), gdn_states(step)):
            np.testing.assert_allclose(np.asarray(got.recurrent[:, i]), np.asarray(want.recurrent), atol=1e-5)
            np.testing.assert_allclose(np.asarray(got.conv[:, i]), np.asarray(want.conv), atol=1e-5)


def test_state_memory_is_reported_per_row_and_position(model):
    cfg, _ = model
    one = verify_state_bytes(cfg, 1, 1, jnp.float32)
    assert one > 0 and verify_state_bytes(cfg, 4, 5, jnp.float32) == 20 * one
