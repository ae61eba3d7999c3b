"""bench.engine_setup.chain_params: a random model that keeps to a fixed token chain, whatever came
before, by a margin no rounding of the constrained programs can flip."""

from __future__ import annotations

import dataclasses
import json

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


def test_a_path_is_written_token_after_token_and_the_rest_stays_a_permutation():
    cfg, params = build_model("tiny", jnp.float32)
    path = [17, 3, 250, 8, 99]
    chained, successor = chain_params(cfg, params, path=path)
    assert sorted(successor.tolist()) == list(range(cfg.vocab_size))
    assert [int(successor[t]) for t in path[:-1]] == path[1:]
    tokens = np.asarray(path[:-1])
    logits, _, _ = jit_forward(
        chained, jnp.asarray(tokens)[None], jnp.arange(tokens.size)[None], init_cache(cfg, 1, 64), cfg
    )
    np.testing.assert_array_equal(np.asarray(logits[0]).argmax(axis=-1), path[1:])


@pytest.mark.parametrize("path", [[5, 6, 5], [1, 10**9]])
def test_a_path_that_no_permutation_follows_is_refused(path):
    cfg, params = build_model("tiny", jnp.float32)
    with pytest.raises(ValueError, match="distinct token ids"):
        chain_params(cfg, params, path=path)


def test_the_chain_document_is_valid_json_under_its_schema_token_by_token():
    from bench.structured import CHAIN_SCHEMA, chain_document, qwen3_tokenizer
    from infernix_jax.structured import ConstraintSpec, default_backend

    tokenizer = qwen3_tokenizer(None)
    path = chain_document(tokenizer, words=50)
    assert len(set(path)) == len(path)
    matcher = default_backend(tokenizer).compile(ConstraintSpec.json_schema(CHAIN_SCHEMA)).new_matcher()
    assert all(matcher.consume(token) for token in path[1:]), matcher.error  # path[0]: the prompt's
    document = json.loads(tokenizer.decode(path[1:]))
    assert len(document["text"].split()) == 50


def test_a_leaving_chain_parts_from_the_models_choice_once_every_k_tokens():
    from bench.structured import leaving_chain

    successor = np.random.default_rng(0).permutation(1000)
    candidates = np.arange(10, 900)
    tokens = leaving_chain(successor, start=5, length=64, every=8, candidates=candidates)
    previous = [5, *tokens[:-1]]
    parted = [i for i, (last, token) in enumerate(zip(previous, tokens)) if successor[last] != token]
    assert parted == list(range(7, 64, 8))  # the model's free choice is refused there only
    assert all(tokens[i] in candidates for i in parted)
