"""Decode's (token, expert) pairs are ordered and counted by comparisons exactly as by a sort."""

from __future__ import annotations

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
