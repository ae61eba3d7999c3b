"""The paged prefill flash attention kernel equals its float32 reference (interpret mode) and lowers to Triton.

The reference itself is checked against the engine's XLA path (PagedKV.attend) on pages written by
the pool, and the INT8 Q.K option against exact scores within its stated tolerance.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infernix_jax.cache.kv_pool import PagedKV
from pallas_kernels import compat
from pallas_kernels.flash_prefill import (
    QK_INT8_TOLERANCE,
    paged_prefill_attention,
    quantize_int8_rows,
    reference_prefill_attention,
)
from pallas_kernels.paged_attention import PAGE_SIZE

PAGE_DTYPES = {"bf16": jnp.bfloat16, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn}


def _chunk_positions(starts, tokens, lengths=None):
    """int32 [B, T]: row b's chunk at starts[b] .. starts[b] + lengths[b] - 1, then -1 padding.

    A start of -1 makes the whole row padding.
    """
    lengths = lengths or [tokens] * len(starts)
    pos = np.full((len(starts), tokens), -1, np.int32)
    for row, (start, n) in enumerate(zip(starts, lengths)):
        if start >= 0:
            pos[row, :n] = start + np.arange(n)
    return jnp.asarray(pos)


def _random_case(rng, fmt, positions, heads, kv_heads, head_dim, max_blocks):
    """(q, k_pages, v_pages, block_table, positions, k_scales, v_scales): random pages in `fmt`,
    each row's blocks distinct, shuffled and never block 0 (the null block)."""
    batch, tokens = positions.shape
    num_blocks = 1 + batch * max_blocks + 2  # null block, rows, two spare
    shape = (num_blocks, PAGE_SIZE, kv_heads, head_dim)
    table = rng.permutation(np.arange(1, num_blocks))[: batch * max_blocks].reshape(batch, max_blocks)
    q = jnp.asarray(rng.standard_normal((batch, tokens, heads, head_dim)), jnp.bfloat16)

    def pages():
        if fmt == "int8":
            return jnp.asarray(rng.integers(-127, 128, shape), jnp.int8)
        return jnp.asarray(rng.standard_normal(shape), jnp.float32).astype(PAGE_DTYPES[fmt])

    def scales():
        return None if fmt == "bf16" else jnp.asarray(rng.uniform(0.002, 0.05, shape[:3]), jnp.float32)

    return q, pages(), pages(), jnp.asarray(table, jnp.int32), positions, scales(), scales()


def _assert_close(got, want, rel):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    np.testing.assert_allclose(got, want, rtol=rel, atol=rel * max(float(np.abs(want).max()), 1e-6))


def _rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.abs(got - want).max() / np.abs(want).max())


def _write_pool(rng, fmt, model_dtype, batch, kv_heads, head_dim, max_blocks):
    """A PagedKV whose rows' every slot was written by PagedKV.write (the pool's own quantization)."""
    num_blocks = 1 + batch * max_blocks
    page_dtype = model_dtype if fmt == "bf16" else PAGE_DTYPES[fmt]
    shape = (num_blocks, PAGE_SIZE, kv_heads, head_dim)
    scales = None if fmt == "bf16" else jnp.ones(shape[:3], jnp.float32)
    table = jnp.asarray(rng.permutation(np.arange(1, num_blocks)).reshape(batch, max_blocks), jnp.int32)
    kv = PagedKV(jnp.zeros(shape, page_dtype), jnp.zeros(shape, page_dtype), scales, scales, table, fmt)
    capacity = max_blocks * PAGE_SIZE
    k = jnp.asarray(rng.standard_normal((batch, capacity, kv_heads, head_dim)), model_dtype)
    v = jnp.asarray(rng.standard_normal((batch, capacity, kv_heads, head_dim)), model_dtype)
    slots = jnp.broadcast_to(jnp.arange(capacity, dtype=jnp.int32), (batch, capacity))
    return kv.write(k, v, slots)


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_reference_equals_the_engines_xla_path_on_pool_pages(fmt):
    """float32 pages (and int8 pages read back in float32): the reference is PagedKV.attend to 1e-5."""
    rng = np.random.default_rng(1)
    kv = _write_pool(rng, fmt, jnp.float32, batch=3, kv_heads=2, head_dim=16, max_blocks=3)
    positions = _chunk_positions([0, 150, -1], 40, [40, 21, 0])
    q = jnp.asarray(rng.standard_normal((3, 40, 6, 16)), jnp.float32)
    want = kv.attend(q, positions, 0.3)
    got = reference_prefill_attention(
        q, kv.k_pages, kv.v_pages, kv.block_table, positions, kv.k_scales, kv.v_scales, scale=0.3
    )
    _assert_close(got, want, 1e-5)


def test_kernel_equals_the_engines_xla_path_in_float32():
    rng = np.random.default_rng(2)
    kv = _write_pool(rng, "bf16", jnp.float32, batch=2, kv_heads=1, head_dim=16, max_blocks=3)
    positions = _chunk_positions([64, 100], 50, [50, 37])
    q = jnp.asarray(rng.standard_normal((2, 50, 3, 16)), jnp.float32)
    want = kv.attend(q, positions, 16**-0.5)
    got = paged_prefill_attention(
        q, kv.k_pages, kv.v_pages, kv.block_table, positions, block_q=16, block_kv=32, interpret=True
    )
    assert got.dtype == jnp.float32
    _assert_close(got, want, 1e-5)


# (chunk starts per row, chunk lengths, T, heads, kv_heads, head_dim, max_blocks, tiles)
FROM_ZERO = ([0, 0], [37, 20], 37, 6, 2, 32, 1, {"block_q": 16, "block_kv": 32})  # GQA 3, padded tail
MID_SEQUENCE = ([100, 5, -1], [30, 30, 0], 30, 6, 1, 16, 3, {"block_q": 16, "block_kv": 128})  # GQA 6
NO_GQA = ([70, 180], [45, 12], 45, 2, 2, 16, 4, {"block_q": 32, "block_kv": 64})  # pages past the chunk


@pytest.mark.parametrize(
    "fmt,case",
    [
        ("bf16", FROM_ZERO),
        ("int8", FROM_ZERO),
        ("fp8", FROM_ZERO),
        ("bf16", MID_SEQUENCE),
        ("int8", MID_SEQUENCE),
        ("fp8", NO_GQA),
        ("bf16", NO_GQA),
    ],
)
def test_kernel_matches_reference(fmt, case):
    starts, lengths, tokens, heads, kv_heads, head_dim, max_blocks, tiles = case
    rng = np.random.default_rng(tokens + heads + max_blocks)
    positions = _chunk_positions(starts, tokens, lengths)
    args = _random_case(rng, fmt, positions, heads, kv_heads, head_dim, max_blocks)
    got = paged_prefill_attention(*args, out_dtype=jnp.float32, interpret=True, **tiles)
    want = reference_prefill_attention(*args)
    assert got.shape == (len(starts), tokens, heads, head_dim)
    # q, the page values and the probabilities enter the dots in bf16; accumulation is float32.
    _assert_close(got, want, 2e-2)
    padding = np.asarray(positions) < 0
    np.testing.assert_array_equal(np.asarray(got)[padding], 0.0)


def test_default_tiles_and_output_dtype():
    positions = _chunk_positions([64], 20)
    args = _random_case(np.random.default_rng(3), "bf16", positions, 4, 2, 32, max_blocks=2)
    got = paged_prefill_attention(*args, interpret=True)
    assert got.dtype == jnp.bfloat16
    _assert_close(got, reference_prefill_attention(*args), 2e-2)


def test_chunked_prefill_equals_one_chunk():
    """Three chunks continuing one another give the same outputs as the whole prompt at once."""
    rng = np.random.default_rng(4)
    whole = _chunk_positions([0], 150)
    q, k_pages, v_pages, table, _, _, _ = _random_case(rng, "bf16", whole, 4, 2, 16, max_blocks=3)
    run = functools.partial(
        paged_prefill_attention, block_q=32, block_kv=64, out_dtype=jnp.float32, interpret=True
    )
    at_once = run(q, k_pages, v_pages, table, whole)
    cuts = [0, 64, 100, 150]
    for start, stop in itertools.pairwise(cuts):
        part = run(q[:, start:stop], k_pages, v_pages, table, whole[:, start:stop])
        np.testing.assert_allclose(np.asarray(part), np.asarray(at_once[:, start:stop]), rtol=1e-6, atol=1e-6)


def test_positions_past_the_block_table_see_all_of_it():
    positions = jnp.asarray([[127, 500, 10_000]], jnp.int32)
    args = list(_random_case(np.random.default_rng(5), "int8", positions, 2, 1, 16, max_blocks=2))
    args[0] = jnp.broadcast_to(args[0][:, :1], args[0].shape)  # one query vector at three positions
    got = np.asarray(paged_prefill_attention(*args, block_q=16, interpret=True, out_dtype=jnp.float32))
    np.testing.assert_allclose(got[0, 1], got[0, 0], rtol=1e-6)
    np.testing.assert_allclose(got[0, 2], got[0, 0], rtol=1e-6)


def test_quantize_int8_rows_round_trips_within_half_a_step():
    x = jnp.asarray(np.random.default_rng(6).standard_normal((5, 64)), jnp.float32).at[2].set(0.0)
    codes, scale = quantize_int8_rows(x)
    assert codes.dtype == jnp.int8 and int(jnp.max(jnp.abs(codes.astype(jnp.int32)))) == 127
    back = codes.astype(jnp.float32) * scale[:, None]
    assert np.all(np.abs(np.asarray(back - x)) <= 0.5 * np.asarray(scale)[:, None] + 1e-7)
    np.testing.assert_array_equal(np.asarray(codes[2]), 0)


@pytest.mark.parametrize("fmt,case", [("bf16", FROM_ZERO), ("int8", MID_SEQUENCE), ("fp8", NO_GQA)])
def test_qk_int8_matches_its_reference_and_exact_scores_within_tolerance(fmt, case):
    starts, lengths, tokens, heads, kv_heads, head_dim, max_blocks, tiles = case
    rng = np.random.default_rng(10 + tokens)
    args = _random_case(
        rng, fmt, _chunk_positions(starts, tokens, lengths), heads, kv_heads, head_dim, max_blocks
    )
    got = paged_prefill_attention(*args, qk_int8=True, out_dtype=jnp.float32, interpret=True, **tiles)
    quantized = reference_prefill_attention(*args, qk_int8=True)
    _assert_close(got, quantized, 2e-2)  # the same int8 scores; P.V in bf16
    exact = reference_prefill_attention(*args)
    assert _rel_err(got, exact) <= QK_INT8_TOLERANCE


@pytest.mark.parametrize(
    "fmt,qk_int8,block_kv",
    [("bf16", False, 64), ("int8", True, 128), ("fp8", False, 128), ("bf16", True, 32)],
)
def test_kernel_lowers_to_a_triton_call_for_cuda(fmt, qk_int8, block_kv):
    # Qwen3.5-27B's attention: 24 q heads over 4 KV heads of 256; a 4096-token chunk, 32K context.
    dtype = PAGE_DTYPES[fmt]
    pages = jax.ShapeDtypeStruct((513, PAGE_SIZE, 4, 256), dtype)
    shapes = [
        jax.ShapeDtypeStruct((1, 4096, 24, 256), jnp.bfloat16),
        pages,
        pages,
        jax.ShapeDtypeStruct((1, 512), jnp.int32),
        jax.ShapeDtypeStruct((1, 4096), jnp.int32),
    ]
    if fmt != "bf16":
        shapes += [jax.ShapeDtypeStruct((513, PAGE_SIZE, 4), jnp.float32)] * 2
    fn = jax.jit(functools.partial(paged_prefill_attention, block_q=128, block_kv=block_kv, qk_int8=qk_int8))
    text = compat.lower_for_cuda(fn, *shapes)
    assert "xla.gpu.triton" in text and "paged_prefill_attention" in text


def _good_inputs():
    names = ("q", "k_pages", "v_pages", "block_table", "positions", "k_scales", "v_scales")
    case = _random_case(np.random.default_rng(7), "int8", _chunk_positions([0], 8), 4, 2, 16, max_blocks=2)
    return dict(zip(names, case))


@pytest.mark.parametrize(
    "change,match",
    [
        ({"q": jnp.ones((1, 4, 16), jnp.bfloat16)}, r"q must be \[B, T, H, Dh\]"),
        ({"q": jnp.ones((1, 8, 4, 16), jnp.int32)}, "q must be bf16"),
        ({"q": jnp.ones((1, 8, 3, 16), jnp.bfloat16)}, "multiple of the KV heads 2"),
        ({"q": jnp.ones((1, 8, 4, 32), jnp.bfloat16)}, "head_dim 32 != page head_dim 16"),
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
        ({"positions": jnp.zeros((1, 7), jnp.int32)}, r"positions must be int32 \[B=1, T=8\]"),
        ({"positions": jnp.zeros((1, 8), jnp.float32)}, "positions must be int32"),
        ({"tiles": {"block_q": 8}}, "block_q=8"),
        ({"tiles": {"block_q": 48}}, "block_q=48"),
        ({"tiles": {"block_kv": 96}}, "block_kv=96"),
    ],
)
def test_rejects_bad_inputs_naming_the_value(change, match):
    kwargs = _good_inputs()
    change = dict(change)
    tiles = change.pop("tiles", {})
    kwargs.update(change)
    with pytest.raises(ValueError, match=match):
        paged_prefill_attention(**kwargs, interpret=True, **tiles)


def test_rejects_scales_on_unscaled_pages_and_non_power_of_two_head_dim():
    kwargs = _good_inputs()
    bf16 = {
        "k_pages": kwargs["k_pages"].astype(jnp.bfloat16),
        "v_pages": kwargs["v_pages"].astype(jnp.bfloat16),
    }
    with pytest.raises(ValueError, match="unscaled"):
        paged_prefill_attention(**{**kwargs, **bf16}, interpret=True)
    odd = jnp.ones((3, PAGE_SIZE, 2, 24), jnp.bfloat16)
    with pytest.raises(ValueError, match="head_dim=24 must be a power of two"):
        paged_prefill_attention(
            jnp.ones((1, 8, 4, 24), jnp.bfloat16),
            odd,
            odd,
            kwargs["block_table"],
            kwargs["positions"],
            interpret=True,
        )
