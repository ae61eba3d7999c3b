"""bench.engine_setup.chain_params: a random model that keeps to a fixed token chain, whatever came
before, by a margin no rounding of the constrained programs can flip."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.engine_setup import build_model, chain_params
from infernix_jax.cache.sequence import init_cache
from infernix_jax.model.forward import forward

jit_forward = jax.jit(forward, static_argnums=(4,))


@pytest.mark.parametrize(
    ("dtype", "tied"), [(jnp.float32, False), (jnp.bfloat16, False), (jnp.float32, True)]
)
def test_every_position_predicts_its_tokens_successor_by_a_wide_margin(dtype, tied):
    cfg, params = build_model("tiny", dtype)
    if tied:  # the output embedding is the input one: the chain repeats each token
        params = dataclasses.replace(params, lm_head=None)
    chained, successor = chain_params(cfg, params)
    assert sorted(successor.tolist()) == list(range(cfg.vocab_size))  # a permutation of the vocabulary
    assert tied == (successor == np.arange(cfg.vocab_size)).all()
    tokens = np.random.default_rng(1).integers(0, cfg.vocab_size, size=24)  # any context, not a chain
    positions = jnp.arange(tokens.size)[None]
    logits, _, _ = jit_forward(chained, jnp.asarray(tokens)[None], positions, init_cache(cfg, 1, 64), cfg)
    logits = np.asarray(logits[0], np.float32)
    np.testing.assert_array_equal(logits.argmax(axis=-1), successor[tokens])
    top2 = np.sort(logits, axis=-1)[:, -2:]
    assert np.all(top2[:, 1] - top2[:, 0] > 20), "sampling at temperature 1 takes the successor too"
    # the layers are the random model's: the cost of a step does not change
    assert jax.tree.structure(chained.layers) == jax.tree.structure(params.layers)
    assert all(a is b for a, b in zip(jax.tree.leaves(chained.layers), jax.tree.leaves(params.layers)))
