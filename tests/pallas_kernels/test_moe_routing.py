"""The MoE routing kernel (one launch from the router's logits to the pairs' sorted rows) equals
its plain-JAX reference bit for bit in interpret mode, ties, padding tokens and odd sizes
included; it refuses what it cannot take; it lowers to one Triton call for CUDA."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import compat
from pallas_kernels.moe_routing import MAX_TOKENS, moe_routing, reference_moe_routing

NAMES = ("weights", "ids", "order", "rank", "sizes", "xs")


def _inputs(seed: int, n: int, e: int, d: int, dtype=jnp.bfloat16):
    k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
    logits = jax.random.normal(k1, (n, e), jnp.float32) * 3
    logits = logits.at[0, 1].set(logits[0, e - 1])  # a tie between two experts of one token
    return logits, jax.random.normal(k2, (n, d), dtype)


@pytest.mark.parametrize(
    "n,e,k,d,renormalize,valid",
    [
        (1, 512, 10, 2048, True, None),  # the 80B-A3B decode step at one token
        (8, 512, 10, 520, True, [1, 1, 0, 1, 1, 1, 0, 1]),
        (3, 32, 4, 40, False, [1, 0, 1]),
        (5, 60, 6, 70, True, [0, 0, 0, 0, 0]),  # no valid token: every row takes the first's experts
        (16, 128, 8, 64, False, None),
        (2, 7, 7, 33, True, [0, 1]),  # every expert routed
    ],
)
def test_kernel_equals_the_reference(n, e, k, d, renormalize, valid):
    logits, x = _inputs(n * 100 + e, n, e, d)
    valid = None if valid is None else jnp.asarray(valid, bool)
    want = reference_moe_routing(logits, x, valid, top_k=k, renormalize=renormalize)
    got = moe_routing(logits, x, valid, top_k=k, renormalize=renormalize, block_d=32, interpret=True)
    for name, a, b in zip(NAMES, want, got, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=name)


def test_reference_routes_like_lax_top_k_and_a_stable_sort():
    """The reference's ids are lax.top_k's over the softmax; its order is the stable argsort of the
    pairs' experts; rank inverts order; sizes count the pairs; xs are the tokens' rows in that order."""
    n, e, k = 6, 64, 5
    logits, x = _inputs(3, n, e, 24, jnp.float32)
    weights, ids, order, rank, sizes, xs = reference_moe_routing(logits, x, None, top_k=k, renormalize=False)
    values, want_ids = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), k)
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(weights, values)
    flat = np.asarray(ids).reshape(-1)
    np.testing.assert_array_equal(order, np.argsort(flat, kind="stable"))
    np.testing.assert_array_equal(np.asarray(order)[np.asarray(rank)], np.arange(n * k))
    np.testing.assert_array_equal(sizes, np.bincount(flat, minlength=e))
    np.testing.assert_array_equal(xs, np.asarray(x)[np.asarray(order) // k])


def test_renormalized_weights_sum_to_one_and_padding_tokens_copy_the_first_valid_experts():
    logits, x = _inputs(5, 4, 32, 16, jnp.float32)
    valid = jnp.asarray([False, True, False, True])
    weights, ids, *_ = moe_routing(logits, x, valid, top_k=3, renormalize=True, interpret=True)
    np.testing.assert_allclose(np.asarray(weights).sum(axis=1), 1.0, rtol=1e-6)
    ids = np.asarray(ids)
    assert (ids[0] == ids[1]).all() and (ids[2] == ids[1]).all()
    _, own, *_ = moe_routing(logits, x, None, top_k=3, renormalize=True, interpret=True)
    np.testing.assert_array_equal(ids[[1, 3]], np.asarray(own)[[1, 3]])


@pytest.mark.parametrize(
    "logits,x,valid,k,match",
    [
        ((MAX_TOKENS + 1, 64), (MAX_TOKENS + 1, 8), None, 4, "1-16 tokens"),
        ((2, 8), (2, 8), None, 9, "top_k <= E"),
        ((2, 8), (3, 8), None, 2, "share N"),
        ((2, 8), (2, 8), (3,), 2, "valid must be"),
    ],
)
def test_refuses_what_it_cannot_take(logits, x, valid, k, match):
    args = (jnp.zeros(logits, jnp.float32), jnp.zeros(x, jnp.bfloat16), None if valid is None else jnp.ones(valid, bool))
    with pytest.raises(ValueError, match=match):
        moe_routing(*args, top_k=k, renormalize=True, interpret=True)


def test_refuses_logits_not_in_float32():
    with pytest.raises(ValueError, match="float32"):
        moe_routing(jnp.zeros((1, 8), jnp.bfloat16), jnp.zeros((1, 8)), top_k=2, renormalize=True, interpret=True)


@pytest.mark.parametrize("n", [1, 8, MAX_TOKENS])
def test_lowers_to_one_triton_call_for_cuda(n):
    fn = jax.jit(functools.partial(moe_routing, top_k=10, renormalize=True))
    shapes = (
        jax.ShapeDtypeStruct((n, 512), jnp.float32),
        jax.ShapeDtypeStruct((n, 2048), jnp.bfloat16),
        jax.ShapeDtypeStruct((n,), jnp.bool_),
    )
    text = compat.lower_for_cuda(fn, *shapes)
    assert text.count("xla.gpu.triton") == 1 and "moe_routing" in text


@pytest.mark.parametrize("n,d,valid", [(1, 2048, None), (3, 40, [1, 0, 1]), (8, 96, [0, 1, 1, 1, 1, 1, 1, 0])])
def test_word_rows_are_f16_rows_of_the_sorted_rows_in_word_order(n, d, valid):
    """With word_rows the kernel also gives the sorted rows as the grouped word kernels take them:
    `f16_rows` + `word_columns` of xs, bit for bit (rows of very different sizes)."""
    logits, x = _inputs(n, n, 64, d)
    x = (x.astype(jnp.float32) * (10.0 ** jnp.arange(n))[:, None]).astype(jnp.bfloat16)
    valid = None if valid is None else jnp.asarray(valid, bool)
    want = reference_moe_routing(logits, x, valid, top_k=6, renormalize=True, word_rows=True)
    got = moe_routing(logits, x, valid, top_k=6, renormalize=True, word_rows=True, interpret=True)
    assert len(got) == 8 and got[6].dtype == jnp.float16 and got[6].shape == (n * 6, d)
    for name, a, b in zip((*NAMES, "words", "inverse"), want, got, strict=True):
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=name)


def test_word_rows_need_whole_words():
    with pytest.raises(ValueError, match="divisible by 8"):
        moe_routing(jnp.zeros((1, 8)), jnp.zeros((1, 12)), top_k=2, renormalize=True, word_rows=True, interpret=True)


def test_word_rows_lower_to_one_triton_call_for_cuda():
    fn = jax.jit(functools.partial(moe_routing, top_k=10, renormalize=True, word_rows=True))
    shapes = (jax.ShapeDtypeStruct((8, 512), jnp.float32), jax.ShapeDtypeStruct((8, 2048), jnp.bfloat16), None)
    assert compat.lower_for_cuda(fn, *shapes).count("xla.gpu.triton") == 1
