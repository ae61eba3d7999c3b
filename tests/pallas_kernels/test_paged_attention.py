"""The paged decode attention kernel equals its float32 reference (interpret mode) and lowers to Triton.

The reference itself is checked against dense attention on the rows' gathered KV, and the kernel
against the engine's XLA path (PagedKV.attend) on pages written by the pool.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infernix_jax.cache.kv_pool import PagedKV
from pallas_kernels import compat
from pallas_kernels.paged_attention import (
    PAGE_SIZE,
    combine_partitions,
    default_partition_size,
    paged_decode_attention,
    reference_paged_attention,
)

PAGE_DTYPES = {"bf16": jnp.bfloat16, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


def _shuffled_block_table(rng, lengths, max_blocks, num_blocks):
    """int32 [B, M]: each row's pages are distinct random blocks (never block 0); unused entries 0."""
    free = list(rng.permutation(np.arange(1, num_blocks)))
    table = np.zeros((len(lengths), max_blocks), np.int32)
    for row, length in enumerate(lengths):
        for j in range(-(-length // PAGE_SIZE)):
            table[row, j] = free.pop()
    return jnp.asarray(table)


def _random_case(rng, fmt, lengths, heads, kv_heads, head_dim, max_blocks=None):
    """(q, k_pages, v_pages, block_table, lengths, k_scales, v_scales) with random pages in `fmt`."""
    lengths = list(lengths)
    max_blocks = max_blocks or max(1, max(-(-n // PAGE_SIZE) for n in lengths))
    num_blocks = 1 + sum(-(-n // PAGE_SIZE) for n in lengths) + 2  # null block, rows, two spare
    shape = (num_blocks, PAGE_SIZE, kv_heads, head_dim)
    q = jnp.asarray(rng.standard_normal((len(lengths), heads, head_dim)), jnp.bfloat16)

    def pages():
        if fmt == "int8":
            return jnp.asarray(rng.integers(-127, 128, shape), jnp.int8)
        return jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(PAGE_DTYPES[fmt])

    def scales():
        if fmt == "bf16":
            return None
        return jnp.asarray(rng.uniform(0.002, 0.05, shape[:3]), jnp.float32)

    table = _shuffled_block_table(rng, lengths, max_blocks, num_blocks)
    return q, pages(), pages(), table, jnp.asarray(lengths, jnp.int32), scales(), scales()


def _assert_close(got, want, rel):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(got, want, rtol=rel, atol=rel * max(float(np.abs(want).max()), 1e-6))


def test_reference_equals_dense_attention_on_the_gathered_rows():
    rng = np.random.default_rng(0)
    heads, kv_heads, head_dim = 4, 2, 16
    args = _random_case(rng, "int8", [70, 1, 128], heads, kv_heads, head_dim, max_blocks=3)
    q, k_pages, v_pages, table, lengths, k_scales, v_scales = args
    got = reference_paged_attention(*args)
    for b, length in enumerate(np.asarray(lengths)):
        rows = np.asarray(table[b])
        pos = np.arange(length)
        blocks, offsets = rows[pos // PAGE_SIZE], pos % PAGE_SIZE
        keys = (
            np.asarray(k_pages, np.float32)[blocks, offsets]
            * np.asarray(k_scales)[blocks, offsets][..., None]
        )
        values = (
            np.asarray(v_pages, np.float32)[blocks, offsets]
            * np.asarray(v_scales)[blocks, offsets][..., None]
        )
        for h in range(heads):
            k = h // (heads // kv_heads)
            s = keys[:, k] @ np.asarray(q[b, h], np.float32) / np.sqrt(head_dim)
            p = np.exp(s - s.max())
            want = (p / p.sum()) @ values[:, k]
            np.testing.assert_allclose(np.asarray(got[b, h]), want, rtol=1e-5, atol=1e-6)


RAGGED = (
    [1, 64, 200],
    6,
    2,
    32,
    {"partition_size": 128, "block_tokens": 32},
)  # 1 token, a full block, ragged
ODD_BATCH = (
    [129, 3, 256, 65, 191],
    8,
    1,
    16,
    {"partition_size": 64, "block_tokens": 16},
)  # 8 q heads per KV head
NO_GQA = (
    [320],
    2,
    2,
    64,
    {"partition_size": 256, "block_tokens": 64},
)  # the partition past 320 tokens is idle


@pytest.mark.parametrize(
    "fmt,lengths,heads,kv_heads,head_dim,tiles",
    [
        ("bf16", *RAGGED),
        ("int8", *RAGGED),
        ("fp8", *RAGGED),
        ("bf16", *ODD_BATCH),
        ("int8", *ODD_BATCH),
        ("fp8", *NO_GQA),
    ],
)
def test_kernel_matches_reference(fmt, lengths, heads, kv_heads, head_dim, tiles):
    rng = np.random.default_rng(len(lengths) * 100 + heads + head_dim)
    args = _random_case(rng, fmt, lengths, heads, kv_heads, head_dim, max_blocks=6)
    got = paged_decode_attention(*args, out_dtype=jnp.float32, interpret=True, **tiles)
    want = reference_paged_attention(*args)
    assert got.shape == (len(lengths), heads, head_dim)
    # q, the page values and the probabilities enter the dots in bf16; accumulation is float32.
    _assert_close(got, want, 2e-2)


def test_default_tiles_and_output_dtype():
    args = _random_case(np.random.default_rng(3), "bf16", [100, 7], 4, 2, 32)
    got = paged_decode_attention(*args, interpret=True)
    assert got.dtype == jnp.bfloat16
    _assert_close(got, reference_paged_attention(*args), 2e-2)


def test_row_with_no_tokens_gives_zeros():
    args = list(_random_case(np.random.default_rng(4), "int8", [0, 90], 4, 1, 16, max_blocks=2))
    got = np.asarray(paged_decode_attention(*args, partition_size=64, interpret=True, out_dtype=jnp.float32))
    np.testing.assert_array_equal(got[0], 0.0)
    assert np.all(np.isfinite(got[1])) and np.abs(got[1]).max() > 0


def test_lengths_past_the_block_table_are_clipped_to_its_capacity():
    args = list(_random_case(np.random.default_rng(5), "bf16", [128], 2, 1, 16, max_blocks=2))
    full = paged_decode_attention(*args, interpret=True, out_dtype=jnp.float32)
    args[4] = jnp.asarray([10_000], jnp.int32)
    np.testing.assert_array_equal(
        np.asarray(paged_decode_attention(*args, interpret=True, out_dtype=jnp.float32)), full
    )


@pytest.mark.parametrize("fmt,model_dtype", [("bf16", jnp.float32), ("fp8", jnp.bfloat16)])
def test_kernel_matches_the_engines_xla_path_on_pool_pages(fmt, model_dtype):
    """Pages written by PagedKV.write (the pool's own quantization) read by the kernel and by PagedKV.attend."""
    rng = np.random.default_rng(6)
    batch, heads, kv_heads, head_dim, max_blocks = 3, 6, 2, 32, 3
    lengths = np.array([1, 100, 192])
    num_blocks = 1 + batch * max_blocks
    page_dtype = model_dtype if fmt == "bf16" else PAGE_DTYPES[fmt]
    shape = (num_blocks, PAGE_SIZE, kv_heads, head_dim)
    scales = None if fmt == "bf16" else jnp.ones(shape[:3], jnp.float32)
    table = jnp.asarray(rng.permutation(np.arange(1, num_blocks)).reshape(batch, max_blocks), jnp.int32)
    kv = PagedKV(jnp.zeros(shape, page_dtype), jnp.zeros(shape, page_dtype), scales, scales, table, fmt)
    capacity = max_blocks * PAGE_SIZE
    k = jnp.asarray(rng.standard_normal((batch, capacity, kv_heads, head_dim)), model_dtype)
    v = jnp.asarray(rng.standard_normal((batch, capacity, kv_heads, head_dim)), model_dtype)
    positions = np.arange(capacity)[None, :]
    kv = kv.write(k, v, jnp.asarray(np.where(positions < lengths[:, None], positions, -1), jnp.int32))
    q = jnp.asarray(rng.standard_normal((batch, heads, head_dim)), model_dtype)
    want = kv.attend(q[:, None], jnp.asarray(lengths - 1, jnp.int32)[:, None], head_dim**-0.5)[:, 0]
    got = paged_decode_attention(
        q,
        kv.k_pages,
        kv.v_pages,
        table,
        jnp.asarray(lengths, jnp.int32),
        kv.k_scales,
        kv.v_scales,
        partition_size=64,
        interpret=True,
    )
    assert got.dtype == model_dtype
    _assert_close(got, want, 1e-5 if (fmt == "bf16" and model_dtype == jnp.float32) else 2e-2)


def test_combine_weighs_partitions_by_their_maxima():
    # Two partitions of one row: scores {0} and {log 3} over values 1 and 2 -> (1 + 3*2) / 4.
    m = jnp.asarray([[0.0], [np.log(3.0)]], jnp.float32)
    l = jnp.ones((2, 1), jnp.float32)
    acc = jnp.asarray([[[1.0]], [[2.0]]], jnp.float32)
    np.testing.assert_allclose(np.asarray(combine_partitions(m, l, acc)), [[7.0 / 4.0]], rtol=1e-6)
    empty = combine_partitions(jnp.full((2, 1), -jnp.inf), jnp.zeros((2, 1)), jnp.zeros((2, 1, 1)))
    np.testing.assert_array_equal(np.asarray(empty), [[0.0]])


def test_combining_chunked_partials_equals_one_softmax():
    """Partials of a softmax split into 5 chunks (one empty) combine to the whole softmax."""
    rng = np.random.default_rng(8)
    scores = rng.standard_normal((3, 40)) * 20  # [G, S]: large spreads, exp would overflow unshifted
    values = rng.standard_normal((40, 8))
    chunks = [slice(0, 7), slice(7, 7), slice(7, 20), slice(20, 33), slice(33, 40)]
    m = np.full((len(chunks), 3), -np.inf, np.float32)
    l = np.zeros((len(chunks), 3), np.float32)
    acc = np.zeros((len(chunks), 3, 8), np.float32)
    for i, c in enumerate(chunks):
        if c.start == c.stop:
            continue
        m[i] = scores[:, c].max(axis=1)
        p = np.exp(scores[:, c] - m[i][:, None])
        l[i], acc[i] = p.sum(axis=1), p @ values[c]
    probs = np.exp(scores - scores.max(axis=1, keepdims=True))
    want = (probs / probs.sum(axis=1, keepdims=True)) @ values
    got = combine_partitions(jnp.asarray(m), jnp.asarray(l), jnp.asarray(acc))
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)


def test_default_partition_size_fills_the_gpu_at_batch_one():
    assert default_partition_size(1, 4, 32768) * 264 <= 4 * 32768 * 2  # >= 264 programs
    assert default_partition_size(8, 4, 32768) > default_partition_size(1, 4, 32768)
    assert default_partition_size(64, 8, 32768) == 4096


@pytest.mark.parametrize("fmt", ["bf16", "int8", "fp8"])
def test_kernel_lowers_to_a_triton_call_for_cuda(fmt):
    # Qwen3.5-27B's attention: 24 q heads over 4 KV heads of 256, batch 8, 32K context.
    dtype = PAGE_DTYPES[fmt]
    pages = jax.ShapeDtypeStruct((4097, PAGE_SIZE, 4, 256), dtype)
    shapes = [
        jax.ShapeDtypeStruct((8, 24, 256), jnp.bfloat16),
        pages,
        pages,
        jax.ShapeDtypeStruct((8, 512), jnp.int32),
        jax.ShapeDtypeStruct((8,), jnp.int32),
    ]
    if fmt != "bf16":
        shapes += [jax.ShapeDtypeStruct((4097, PAGE_SIZE, 4), jnp.float32)] * 2
    text = compat.lower_for_cuda(jax.jit(functools.partial(paged_decode_attention, block_tokens=32)), *shapes)
    assert "xla.gpu.triton" in text and "paged_decode_attention" in text


def _good_inputs():
    return dict(
        zip(
            ("q", "k_pages", "v_pages", "block_table", "lengths", "k_scales", "v_scales"),
            _random_case(np.random.default_rng(7), "int8", [70], 4, 2, 16, max_blocks=2),
        )
    )


@pytest.mark.parametrize(
    "change,match",
    [
        ({"q": jnp.ones((1, 1, 4, 16), jnp.bfloat16)}, r"q must be \[B, H, Dh\]"),
        ({"q": jnp.ones((1, 4, 16), jnp.int32)}, "q must be bf16"),
        ({"q": jnp.ones((1, 3, 16), jnp.bfloat16)}, "multiple of the KV heads 2"),
        ({"q": jnp.ones((1, 4, 32), jnp.bfloat16)}, "head_dim 32 != page head_dim 16"),
        (
            {"k_pages": jnp.ones((4, 32, 2, 16), jnp.int8), "v_pages": jnp.ones((4, 32, 2, 16), jnp.int8)},
            "64 tokens",
        ),
        (
            {"k_pages": jnp.ones((4, 64, 2, 16), jnp.int16), "v_pages": jnp.ones((4, 64, 2, 16), jnp.int16)},
            "int16",
        ),
        ({"v_pages": jnp.ones((4, 64, 2, 16), jnp.float8_e4m3fn)}, "must match k_pages"),
        ({"k_scales": None}, "need k_scales"),
        ({"v_scales": jnp.ones((4, 64, 2), jnp.bfloat16)}, "v_scales must be float32"),
        ({"block_table": jnp.zeros((2, 2), jnp.int32)}, r"block_table must be int32 \[B=1, M\]"),
        (
            {"lengths": jnp.ones((1,), jnp.int64 if jax.config.jax_enable_x64 else jnp.uint32)},
            "lengths must be int32",
        ),
        ({"tiles": {"block_tokens": 128}}, "block_tokens=128"),
        ({"tiles": {"partition_size": 48, "block_tokens": 32}}, "partition_size=48"),
    ],
)
def test_rejects_bad_inputs_naming_the_value(change, match):
    kwargs = _good_inputs()
    change = dict(change)
    tiles = change.pop("tiles", {})
    kwargs.update(change)
    with pytest.raises(ValueError, match=match):
        paged_decode_attention(**kwargs, interpret=True, **tiles)


def test_rejects_scales_on_unscaled_pages_and_non_power_of_two_head_dim():
    kwargs = _good_inputs()
    bf16 = {
        "k_pages": kwargs["k_pages"].astype(jnp.bfloat16),
        "v_pages": kwargs["v_pages"].astype(jnp.bfloat16),
    }
    with pytest.raises(ValueError, match="unscaled"):
        paged_decode_attention(**{**kwargs, **bf16}, interpret=True)
    odd = jnp.ones((3, PAGE_SIZE, 2, 24), jnp.bfloat16)
    with pytest.raises(ValueError, match="head_dim=24 must be a power of two"):
        paged_decode_attention(
            jnp.ones((1, 4, 24), jnp.bfloat16),
            odd,
            odd,
            kwargs["block_table"],
            kwargs["lengths"],
            interpret=True,
        )
