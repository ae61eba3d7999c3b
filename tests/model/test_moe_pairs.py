"""Decode's routing (top-k, then the (token, expert) pairs' order and counts) by comparisons, exactly as by a sort."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infernix_jax.model import mlp


@pytest.mark.parametrize("tokens, k, experts", [(1, 10, 512), (8, 10, 32), (5, 3, 4), (64, 4, 64)])
def test_small_pair_counts_order_like_a_stable_sort(tokens, k, experts):
    """Below COUNT_BY_COMPARING_MAX the order, the group sizes and the way back equal the stable
    argsort, bincount and scatter (repeated experts included: several tokens on one expert)."""
    rng = np.random.default_rng(tokens * 100 + k)
    ids = np.stack([rng.choice(experts, k, replace=False) for _ in range(tokens)]).astype(np.int32)
    assert ids.size <= mlp.COUNT_BY_COMPARING_MAX
    order, sizes, rank = mlp._sort_pairs(jnp.asarray(ids), experts)
    np.testing.assert_array_equal(np.asarray(order), np.argsort(ids.reshape(-1), kind="stable"))
    np.testing.assert_array_equal(np.asarray(sizes), np.bincount(ids.reshape(-1), minlength=experts))
    ys = jnp.asarray(rng.standard_normal((ids.size, 3)), jnp.float32)
    back = mlp._unsort_pairs(ys, order, jnp.asarray(ids), rank)
    want = mlp._unsort_pairs(ys, order, jnp.asarray(ids))  # the scatter
    np.testing.assert_array_equal(np.asarray(back), np.asarray(want))


def test_many_pairs_keep_the_sort():
    ids = jnp.asarray(
        np.random.default_rng(0).integers(0, 16, (mlp.COUNT_BY_COMPARING_MAX + 1, 1)), jnp.int32
    )
    order, sizes, rank = mlp._sort_pairs(ids, 16)
    assert rank is None
    np.testing.assert_array_equal(np.asarray(order), np.argsort(np.asarray(ids).reshape(-1), kind="stable"))
    assert int(sizes.sum()) == ids.size


def test_counts_with_weights_match_bincount():
    ids = jnp.asarray([3, 1, 3, 0, 7], jnp.int32)
    weights = jnp.asarray([1, 0, 1, 1, 1], jnp.int32)
    np.testing.assert_array_equal(
        np.asarray(mlp._count_ids(ids, 8, weights)), np.bincount([3, 1, 3, 0, 7], [1, 0, 1, 1, 1], 8)
    )


@pytest.mark.parametrize("tokens, k, experts", [(1, 10, 512), (8, 10, 512), (64, 4, 64), (3, 2, 4)])
def test_router_top_k_by_comparing_equals_lax_top_k(tokens, k, experts):
    """Up to TOP_K_BY_COMPARING_MAX tokens the router's top-k gives lax.top_k's values and ids, in
    its order, ties (equal probabilities, underflowed zeros) at the lower expert first."""
    rng = np.random.default_rng(tokens + experts)
    logits = rng.standard_normal((tokens, experts)).astype(np.float32) * 4
    logits[:, ::3] = np.round(logits[:, ::3])  # repeated values: ties
    logits[0, : experts // 2] = -1e4  # half the experts' probabilities underflow to 0
    probs = jax.nn.softmax(jnp.asarray(logits), axis=-1)
    assert tokens <= mlp.TOP_K_BY_COMPARING_MAX
    values, ids = mlp._top_k(probs, k)
    want_values, want_ids = jax.lax.top_k(probs, k)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values))
    ties = jnp.asarray([[0.5, 0.1, 0.5, 0.1, 0.0, 0.0]], jnp.float32)
    np.testing.assert_array_equal(np.asarray(mlp._top_k(ties, 5)[1]), np.asarray(jax.lax.top_k(ties, 5)[1]))


def test_router_top_k_of_many_tokens_keeps_lax_top_k():
    probs = jax.nn.softmax(
        jnp.asarray(np.random.default_rng(1).standard_normal((mlp.TOP_K_BY_COMPARING_MAX + 1, 16)))
    )
    values, ids = mlp._top_k(probs, 4)
    want_values, want_ids = jax.lax.top_k(probs, 4)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values))


def test_the_sort_switch_takes_lax_top_k_at_decode_sizes_inside_its_block_only(monkeypatch):
    """`router_top_k("sort")` (for measuring against the comparisons) routes a decode-size batch
    through lax.top_k while the block lasts; the values and ids are the same either way."""
    probs = jax.nn.softmax(jax.random.normal(jax.random.key(0), (2, 16)), axis=-1)
    sorts = []
    real = jax.lax.top_k
    monkeypatch.setattr(jax.lax, "top_k", lambda *a: sorts.append(1) or real(*a))
    with mlp.router_top_k("sort"):
        sorted_way = mlp._top_k(probs, 4)
    compared = mlp._top_k(probs, 4)
    assert sorts == [1]
    for got, want in zip(compared, sorted_way):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match="router top-k"), mlp.router_top_k("heap"):
        pass


@pytest.mark.parametrize("tokens", [1, 5])
def test_renormalized_routing_is_the_chosen_logits_softmax(tokens):
    """With renormalisation the router takes the top-k of the logits and the softmax of the chosen
    ones: the experts of the top-k of the full softmax, and its renormalised weights within
    float32 rounding (one launch a layer fewer)."""
    rng = np.random.default_rng(tokens)
    router = jnp.asarray(rng.standard_normal((64, 32)), jnp.float32)
    x = jnp.asarray(rng.standard_normal((tokens, 32)), jnp.float32)
    weights, ids = mlp.route(router, x, 6, True)
    probs = jax.nn.softmax(mlp._router_logits(router, x), axis=-1)
    values, want_ids = jax.lax.top_k(probs, 6)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    want = values / values.sum(axis=-1, keepdims=True)
    np.testing.assert_allclose(np.asarray(weights), np.asarray(want), rtol=1e-6, atol=0)
    plain, plain_ids = mlp.route(router, x, 6, False)  # without: the softmax's own values
    np.testing.assert_array_equal(np.asarray(plain_ids), np.asarray(want_ids))
    np.testing.assert_allclose(np.asarray(plain), np.asarray(values), rtol=1e-6, atol=0)
