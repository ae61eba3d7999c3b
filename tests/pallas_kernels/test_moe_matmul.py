"""The grouped MoE matmul equals its float32 reference on ragged groups (interpret mode), the
reference equals a dense per-expert loop, and the kernel lowers to Triton for CUDA."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import compat
from pallas_kernels.fp8_matmul import reference_fp8_matmul
from pallas_kernels.moe_matmul import (
    grouped_fp8_matmul,
    grouped_matmul,
    grouped_matmuls,
    grouped_nvfp4_matmul,
    max_work_items,
    reference_grouped_matmul,
    work_items,
)
from pallas_kernels.nvfp4_matmul import GEMV_W_TOLERANCE, reference_nvfp4_matmul


def _nvfp4_stack(rng, e, n, k):
    packed = jnp.asarray(rng.integers(0, 256, (e, n, k // 2)), jnp.uint8)
    block_scale = jnp.asarray(rng.uniform(2.0**-6, 8.0, (e, n, k // 16)), jnp.float8_e4m3fn)
    tensor_scale = jnp.asarray(rng.uniform(0.01, 1.0, (e,)), jnp.float32)
    return packed, block_scale, tensor_scale


def _nvfp4_shapes(e, n, k):
    """An NVFP4 stack's leaves as shapes (for lowering without data)."""
    return (
        jax.ShapeDtypeStruct((e, n, k // 2), jnp.uint8),
        jax.ShapeDtypeStruct((e, n, k // 16), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((e,), jnp.float32),
    )


def _fp8_stack(rng, e, n, k, block_size):
    data = jnp.asarray(rng.standard_normal((e, n, k)) * 16, jnp.float8_e4m3fn)
    if block_size is None:
        scale = jnp.asarray(rng.uniform(0.001, 0.1, (e,)), jnp.float32)
    else:
        shape = (e, -(-n // block_size), -(-k // block_size))
        scale = jnp.asarray(rng.uniform(0.001, 0.1, shape), jnp.float32)
    return data, scale


def _x(rng, m, k):
    return jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)


def _close(got, want):
    # Weight tiles are exact in bf16 and accumulation is float32: only summation order differs.
    np.testing.assert_allclose(
        np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4 * float(jnp.abs(want).max())
    )


def _dense_loop(x, group_sizes, one_expert):
    """Rows of each group through that expert's dense reference, zeros past the groups."""
    parts, row = [], 0
    for e, size in enumerate(np.asarray(group_sizes)):
        if size:
            parts.append(np.asarray(one_expert(e, x[row : row + size])))
        row += int(size)
    out = np.concatenate(parts)
    return np.concatenate([out, np.zeros((x.shape[0] - row, out.shape[1]), np.float32)])


def test_reference_equals_a_dense_per_expert_loop_nvfp4():
    rng = np.random.default_rng(0)
    packed, block_scale, tensor_scale = _nvfp4_stack(rng, 5, 24, 64)
    x, sizes = _x(rng, 12, 64), jnp.asarray([3, 0, 6, 0, 1], jnp.int32)  # two rows past the groups
    got = reference_grouped_matmul(x, (packed, block_scale, tensor_scale), sizes, fmt="nvfp4")
    want = _dense_loop(
        x, sizes, lambda e, xs: reference_nvfp4_matmul(xs, packed[e], block_scale[e], tensor_scale[e])
    )
    # float32 sums of 64 products in another order (XLA's optimisation level changes it): ~1e-5
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
    assert not np.asarray(got[10:]).any()


@pytest.mark.parametrize("block_size", [None, 16])
def test_reference_equals_a_dense_per_expert_loop_fp8(block_size):
    rng = np.random.default_rng(1)
    data, scale = _fp8_stack(rng, 4, 20, 40, block_size)
    x, sizes = _x(rng, 9, 40), jnp.asarray([0, 9, 0, 0], jnp.int32)
    got = reference_grouped_matmul(x, (data, scale), sizes, fmt="fp8", block_size=block_size)
    want = _dense_loop(
        x, sizes, lambda e, xs: reference_fp8_matmul(xs, data[e], scale[e], block_size=block_size)
    )
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)  # as above


@pytest.mark.parametrize("block_m", [1, 3, 16])
def test_work_items_cover_every_row_once_within_the_static_bound(block_m):
    rng = np.random.default_rng(block_m)
    m, e = 40, 12
    skew = np.arange(1, e + 1) / (e * (e + 1) / 2)
    sizes = np.bincount(rng.choice(e, m - 3, p=skew), minlength=e)  # skewed, 3 rows past the groups
    expert, first, end = (np.asarray(a) for a in work_items(jnp.asarray(sizes, jnp.int32), m, block_m))
    assert len(expert) == max_work_items(m, e, block_m)
    row_expert = np.repeat(np.arange(e), sizes)
    covered = np.zeros(m, np.int64)
    for ex, a, b in zip(expert, first, end):
        assert b - a <= block_m
        covered[a:b] += 1
        assert (row_expert[a:b] == ex).all()
    np.testing.assert_array_equal(covered, (np.arange(m) < sizes.sum()).astype(np.int64))


def _brute_force_items(sizes, m, block_m):
    """(expert, first, end) of every work item: the groups cut at M, then into block_m-row tiles."""
    items, row = [], 0
    for e, size in enumerate(sizes):
        end = min(row + int(size), m)
        items += [(e, a, min(a + block_m, end)) for a in range(row, end, block_m)]
        row = end
    return items


def test_items_located_in_the_kernel_are_the_groups_cut_at_m_then_into_tiles():
    """The kernel's per-program search (one scan pair, packed sums) against a plain loop: sizes
    that sum to M, fall short of it or run past it, groups larger than M, empty groups."""
    rng = np.random.default_rng(7)
    for trial in range(21):  # a few shapes (few compiles); the last a prefill's M, past the packed counts
        (e, m), block_m = ((12, 40), (5, 97))[trial % 2], (3, 16)[trial // 9 % 2]
        if trial >= 18:
            e, m, block_m = 12, 40000, 4096
        if trial % 3 == 0:
            sizes = rng.multinomial(int(rng.integers(0, m + 1)), np.ones(e) / e)
        elif trial % 3 == 1:
            sizes = rng.integers(0, 3 * m // e + 2, e)
        else:
            sizes = np.where(rng.random(e) < 0.7, 0, rng.integers(0, 2 * m + 1, e))
        expert, first, end = (np.asarray(a) for a in work_items(jnp.asarray(sizes, jnp.int32), m, block_m))
        real = end > first
        assert list(zip(expert[real], first[real], end[real], strict=True)) == _brute_force_items(sizes, m, block_m)
        assert not expert[~real].any() and not first[~real].any() and not end[~real].any()
        assert real[: real.sum()].all()  # the items come first, in row order


def test_decode_pairs_read_each_distinct_expert_once():
    """batch 4 x top-3 of 16 experts, shared experts included: with block_m >= the tokens, every
    routed expert is exactly one work item (its weights are streamed once)."""
    ids = np.array([[0, 5, 9], [5, 9, 15], [5, 2, 0], [5, 7, 9]])
    sizes = np.bincount(ids.ravel(), minlength=16)
    expert, first, end = (np.asarray(a) for a in work_items(jnp.asarray(sizes, jnp.int32), ids.size, 4))
    work = expert[end > first]
    np.testing.assert_array_equal(np.sort(work), np.unique(ids))


NVFP4_CASES = [
    # (m, e, n, k, group sizes, options)
    (10, 32, 64, 256, "decode", {"variant": "gemv", "block_m": 1, "block_n": 32, "block_k": 128}),
    (13, 6, 70, 96, [3, 0, 5, 1, 0, 3], {"variant": "gemv", "block_m": 3, "block_n": 32, "block_k": 64}),
    (37, 4, 48, 160, [0, 37, 0, 0], {"variant": "dot", "block_m": 16, "block_n": 16, "block_k": 64}),
    (21, 5, 40, 128, [4, 0, 0, 9, 5], {"variant": "dot_t", "block_m": 16, "block_n": 32, "split_k": 2}),
]


@pytest.mark.parametrize("m,e,n,k,sizes,options", NVFP4_CASES)
def test_nvfp4_kernel_matches_reference(m, e, n, k, sizes, options):
    rng = np.random.default_rng(m * 100 + n + k)
    weight = _nvfp4_stack(rng, e, n, k)
    if sizes == "decode":  # one token's top-10: ten distinct experts, one row each
        sizes = np.zeros(e, np.int64)
        sizes[rng.choice(e, m, replace=False)] = 1
    sizes = jnp.asarray(sizes, jnp.int32)
    x = _x(rng, m, k)
    got = grouped_nvfp4_matmul(x, *weight, sizes, out_dtype=jnp.float32, interpret=True, **options)
    want = reference_grouped_matmul(x, weight, sizes, fmt="nvfp4")
    assert got.shape == (m, n)
    _close(got, want)
    assert not np.asarray(got[int(sizes.sum()) :]).any()  # rows past the groups are zero


WORD_CASES = [
    # (m, e, n, k, group sizes, x dtype, options): word variants take bf16 / f16 x, block_k >= 128
    (10, 32, 32, 256, "decode", jnp.bfloat16, {"variant": "dot_t_w", "block_n": 32, "block_k": 128}),
    # N = 40 and K = 160 (20 words) ragged against 32 x 16-word tiles; 3 rows past the groups
    (21, 5, 40, 160, [4, 0, 0, 9, 5], jnp.float16, {"variant": "dot_w", "block_n": 32, "block_k": 128}),
    # a group of 37 rows cut into three items; 48 words in two splits of one 16-word step each
    (37, 4, 48, 384, [0, 37, 0, 0], jnp.bfloat16, {"variant": "dot_t_w", "block_n": 16, "split_k": 2}),
    (13, 6, 70, 128, [3, 0, 5, 1, 0, 3], jnp.float16, {"variant": "dot_w", "block_n": 64, "split_k": 2}),
    # the joined dot (x in natural order): ragged N and K, rows past the groups; a 37-row group
    # cut into three items with K split in two
    (21, 5, 40, 160, [4, 0, 0, 9, 5], jnp.bfloat16, {"variant": "dot_jw", "block_n": 32, "block_k": 128}),
    (37, 4, 48, 384, [0, 37, 0, 0], jnp.float16, {"variant": "dot_jw", "block_n": 16, "split_k": 2}),
]


def _word_case(rng, m, e, n, k, sizes, dtype):
    """An NVFP4 stack, group sizes ("decode": one row on each of m distinct experts) and m rows of
    very different sizes (within float16's range: |x| < 65504)."""
    weight = _nvfp4_stack(rng, e, n, k)
    if sizes == "decode":
        sizes = np.zeros(e, np.int64)
        sizes[rng.choice(e, m, replace=False)] = 1
    x = jnp.asarray(rng.standard_normal((m, k)) * np.resize([1.0, 3e3, 2e-3, 40.0], m)[:, None], dtype)
    return weight, jnp.asarray(sizes, jnp.int32), x


@pytest.mark.parametrize("m,e,n,k,sizes,dtype,options", WORD_CASES)
def test_nvfp4_word_variants_match_reference(m, e, n, k, sizes, dtype, options):
    """Weights decoded from uint32 words into float16 dots: rows of very different sizes (each row
    is scaled by its own power of two into float16 and back) equal the float32 reference row by
    row; rows past the groups are zero."""
    rng = np.random.default_rng(m * 100 + n + k)
    weight, sizes, x = _word_case(rng, m, e, n, k, sizes, dtype)
    options = {"block_m": 16, "block_k": 128, **options}
    got = grouped_nvfp4_matmul(x, *weight, sizes, out_dtype=jnp.float32, interpret=True, **options)
    want = np.asarray(reference_grouped_matmul(x, weight, sizes, fmt="nvfp4"))
    assert got.shape == (m, n)
    got = np.asarray(got)
    for row in range(int(sizes.sum())):  # each row against its own size
        np.testing.assert_allclose(got[row], want[row], rtol=1e-5, atol=1e-5 * np.abs(want[row]).max())
    assert not got[int(sizes.sum()) :].any()


@pytest.mark.parametrize("variant", ["dot_w", "dot_jw"])
def test_word_variants_take_the_tensor_scales_as_stored(variant):
    """The word variants' E2M1 factor (2**14) multiplies the tensor scale inside the kernel: a
    multiply before it would be one more XLA launch per stack and call (3 a MoE layer a decode
    step). The kernel's operands hold each stack's tensor scale itself."""
    e, n, k, m = 8, 32, 256, 10
    x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((e,), jnp.int32)
    stack = _nvfp4_shapes(e, n, k)
    fn = functools.partial(grouped_matmuls, fmt="nvfp4", variant=variant, block_m=16, block_n=32, block_k=128)
    jaxpr = jax.make_jaxpr(lambda x, g, u, s: fn(x, (g, u), s))(x, stack, stack, sizes).jaxpr
    inner = jaxpr.eqns[0].params["jaxpr"]  # the jitted grouped_matmuls
    call = next(eq for eq in inner.eqns if eq.primitive.name == "pallas_call")
    scales = [inner.invars[1 + 2], inner.invars[1 + 5]]  # x, (gate leaves), (up leaves), sizes
    assert all(any(v is s for v in call.invars) for s in scales)


STREAMED_CASES = [
    # (m, e, n, k, group sizes, options) of "gemv_ws": a few programs so that runs span several
    # units and tiles are shared by programs (their slots), or more programs than units (idle ones)
    (10, 32, 64, 256, "decode", {"block_m": 1, "block_n": 32, "block_k": 128, "programs": 7}),
    # N = 40 and K = 160 (20 words) ragged against 16 x 16-word tiles; 2 rows past the groups
    (12, 5, 40, 160, [3, 0, 6, 0, 1], {"block_m": 2, "block_n": 16, "block_k": 128, "programs": 5}),
    # a group of 9 rows cut into three items of block_m 4; K in three steps
    (9, 4, 48, 384, [0, 9, 0, 0], {"block_m": 4, "block_n": 16, "block_k": 128, "programs": 3}),
    (10, 32, 64, 256, "decode", {"block_m": 1, "block_n": 32, "block_k": 128, "programs": 200}),
    (6, 3, 32, 256, [0, 0, 0], {"block_m": 1, "block_n": 32, "block_k": 128, "programs": 4}),  # no rows
]


@pytest.mark.parametrize("m,e,n,k,sizes,options", STREAMED_CASES)
def test_nvfp4_streamed_gemv_matches_reference(m, e, n, k, sizes, options):
    """The streamed gemv over work items equals the float32 reference row by row (float16 sums of
    eight products: the dense gemv_w's tolerance), rows past the groups zero."""
    rng = np.random.default_rng(m * 10 + n + k + options["programs"])
    weight = _nvfp4_stack(rng, e, n, k)
    if sizes == "decode":
        sizes = np.zeros(e, np.int64)
        sizes[rng.choice(e, m, replace=False)] = 1
    sizes = jnp.asarray(sizes, jnp.int32)
    x = _x(rng, m, k)
    got = np.asarray(
        grouped_nvfp4_matmul(
            x, *weight, sizes, variant="gemv_ws", out_dtype=jnp.float32, interpret=True, **options
        )
    )
    want = np.asarray(reference_grouped_matmul(x, weight, sizes, fmt="nvfp4"))
    covered = int(sizes.sum())
    assert got.shape == (m, n)
    if covered:
        np.testing.assert_allclose(got[:covered], want[:covered], atol=GEMV_W_TOLERANCE * np.abs(want).max())
    assert not got[covered:].any()


FP8_CASES = [
    (7, 5, 33, 100, None, [2, 0, 0, 5, 0], {"variant": "gemv", "block_m": 2, "block_n": 16, "block_k": 32}),
    (19, 3, 33, 100, None, [0, 0, 19], {"variant": "dot_t", "block_m": 16, "block_n": 16, "block_k": 64}),
    # 20 of 40 rows in groups: the zeroed tail spans several 16-row chunks, starting mid-chunk
    (40, 4, 24, 48, None, [12, 0, 8, 0], {"variant": "gemv", "block_m": 4, "block_n": 16, "block_k": 16}),
    (
        11,
        4,
        40,
        72,
        32,
        [5, 0, 3, 0],
        {"variant": "dot", "block_m": 16, "block_n": 16, "block_k": 32, "split_k": 2},
    ),
]


@pytest.mark.parametrize("m,e,n,k,block_size,sizes,options", FP8_CASES)
def test_fp8_kernel_matches_reference(m, e, n, k, block_size, sizes, options):
    rng = np.random.default_rng(m * 100 + n + k)
    data, scale = _fp8_stack(rng, e, n, k, block_size)
    sizes = jnp.asarray(sizes, jnp.int32)
    x = _x(rng, m, k)
    got = grouped_fp8_matmul(
        x, data, scale, sizes, block_size=block_size, out_dtype=jnp.float32, interpret=True, **options
    )
    want = reference_grouped_matmul(x, (data, scale), sizes, fmt="fp8", block_size=block_size)
    assert got.shape == (m, n)
    _close(got, want)
    assert not np.asarray(got[int(sizes.sum()) :]).any()


PLAIN_CASES = [
    (7, 5, 33, 100, [2, 0, 0, 5, 0], {"variant": "gemv", "block_m": 2, "block_n": 16, "block_k": 32}),
    (19, 3, 33, 100, [0, 0, 19], {"variant": "dot_t", "block_m": 16, "block_n": 16, "block_k": 64}),
    # a prefill-like chunk: groups larger than one item, a ragged tail of zero rows
    (150, 4, 40, 72, [70, 0, 33, 40], {"variant": "dot", "block_m": 16, "block_n": 16, "block_k": 32}),
    (
        11,
        4,
        40,
        72,
        [5, 0, 3, 0],
        {"variant": "dot", "block_m": 16, "block_n": 16, "block_k": 16, "split_k": 2},
    ),
]


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("m,e,n,k,sizes,options", PLAIN_CASES)
def test_plain_kernel_matches_reference_and_a_dense_loop(m, e, n, k, sizes, options, dtype):
    """Unquantized experts (what XLA's ragged_dot would otherwise expand densely on a GPU)."""
    rng = np.random.default_rng(m * 10 + n + k)
    w = jnp.asarray(rng.standard_normal((e, n, k)), dtype)
    sizes = jnp.asarray(sizes, jnp.int32)
    x = _x(rng, m, k).astype(dtype)
    got = grouped_matmul(x, (w,), sizes, fmt="plain", out_dtype=jnp.float32, interpret=True, **options)
    want = reference_grouped_matmul(x, (w,), sizes, fmt="plain")
    assert got.shape == (m, n)
    _close(got, want)
    wf = np.asarray(w, np.float32)
    loop = _dense_loop(np.asarray(x, np.float32), sizes, lambda i, rows: rows @ wf[i].T)
    np.testing.assert_allclose(np.asarray(want), loop, rtol=1e-5, atol=1e-4 * np.abs(loop).max())
    assert not np.asarray(got[int(sizes.sum()) :]).any()


def test_plain_rejects_integer_weights_and_a_k_mismatch():
    x, sizes = jnp.ones((2, 32), jnp.bfloat16), jnp.asarray([1, 1])
    with pytest.raises(ValueError, match="plain weights must be bf16, f16 or f32"):
        grouped_matmul(x, (jnp.ones((2, 16, 32), jnp.int8),), sizes, fmt="plain", interpret=True)
    with pytest.raises(ValueError, match="x has K=32"):
        grouped_matmul(x, (jnp.ones((2, 16, 48), jnp.bfloat16),), sizes, fmt="plain", interpret=True)


def test_defaults_run_and_keep_the_activation_dtype():
    rng = np.random.default_rng(7)
    weight = _nvfp4_stack(rng, 8, 32, 64)
    x, sizes = _x(rng, 4, 64), jnp.asarray([1, 0, 0, 2, 0, 0, 1, 0], jnp.int32)
    got = grouped_nvfp4_matmul(x, *weight, sizes, interpret=True)
    assert got.dtype == jnp.bfloat16
    want = reference_grouped_matmul(x, weight, sizes, fmt="nvfp4")
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "plain"])
@pytest.mark.parametrize("variant,block_m", [("gemv", 3), ("dot", 16), ("dot_t", 16)])
def test_kernel_lowers_to_a_triton_call_for_cuda(fmt, variant, block_m):
    """The 80B expert gate_up stack (512 experts, [1024, 2048]) at batch 8 x top-10."""
    e, n, k, m = 512, 1024, 2048, 80
    if fmt == "plain":
        weight = (jax.ShapeDtypeStruct((e, n, k), jnp.bfloat16),)
        block_size = None
    elif fmt == "nvfp4":
        weight = (
            jax.ShapeDtypeStruct((e, n, k // 2), jnp.uint8),
            jax.ShapeDtypeStruct((e, n, k // 16), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((e,), jnp.float32),
        )
        block_size = None
    else:
        weight = (
            jax.ShapeDtypeStruct((e, n, k), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((e, n // 128, k // 128), jnp.float32),
        )
        block_size = 128
    fn = jax.jit(
        functools.partial(
            grouped_matmul,
            fmt=fmt,
            block_size=block_size,
            variant=variant,
            block_m=block_m,
            block_n=64,
            block_k=128,
        )
    )
    shapes = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), weight, jax.ShapeDtypeStruct((e,), jnp.int32))
    text = compat.lower_for_cuda(fn, *shapes)
    assert "xla.gpu.triton" in text and f"grouped_{fmt}_matmul_{variant}" in text


@pytest.mark.parametrize(
    "variant,e,n,k,m,split_k,dtype",
    [
        ("dot_w", 512, 1024, 2048, 80, 1, jnp.bfloat16),  # 80B gate_up, batch 8 x top-10: no masks
        ("dot_t_w", 512, 2048, 512, 80, 1, jnp.bfloat16),  # 80B down
        ("dot_t_w", 60, 1000, 2064, 37, 2, jnp.float16),  # N, K and the group sizes masked; split K
        ("dot_jw", 512, 1024, 2048, 80, 1, jnp.bfloat16),
        ("dot_jw", 60, 1000, 2064, 37, 2, jnp.float16),
    ],
)
def test_word_variants_lower_to_a_triton_call_for_cuda(variant, e, n, k, m, split_k, dtype):
    weight = _nvfp4_shapes(e, n, k)
    fn = jax.jit(
        functools.partial(
            grouped_matmul, fmt="nvfp4", variant=variant, block_m=16, block_n=64, block_k=256, split_k=split_k
        )
    )
    shapes = (jax.ShapeDtypeStruct((m, k), dtype), weight, jax.ShapeDtypeStruct((e,), jnp.int32))
    text = compat.lower_for_cuda(fn, *shapes)
    assert "xla.gpu.triton" in text and f"grouped_nvfp4_matmul_{variant}" in text


@pytest.mark.parametrize(
    "m,e,n,k,sizes,dtype,options",
    [
        (21, 5, 40, 160, [4, 0, 0, 9, 5], jnp.bfloat16, {"block_n": 32, "block_k": 128}),  # ragged N, K
        (37, 4, 48, 384, [0, 37, 0, 0], jnp.float16, {"block_n": 16, "block_k": 128, "split_k": 2}),
        (10, 32, 64, 256, "decode", jnp.bfloat16, {"block_n": 32, "block_k": 128}),
    ],
)
def test_dot_jw_rows_made_in_the_kernel_equal_those_made_before_it(m, e, n, k, sizes, dtype, options):
    """x_rows="kernel": each program scales its own rows to float16 (no XLA op before the launch).
    Rows of very different sizes, an all-zero row, split K and rows past the groups give the same
    bits as the rows made by `f16_rows` before the kernel."""
    rng = np.random.default_rng(m + k)
    weight = _nvfp4_stack(rng, e, n, k)
    if sizes == "decode":
        sizes = np.zeros(e, np.int64)
        sizes[rng.choice(e, m, replace=False)] = 1
    sizes = jnp.asarray(sizes, jnp.int32)
    row_size = np.resize([1.0, 3e3, 2e-3, 40.0, 0.0], m)[:, None]
    x = jnp.asarray(rng.standard_normal((m, k)) * row_size, dtype)
    options = {"variant": "dot_jw", "block_m": 16, **options}
    want = grouped_nvfp4_matmul(x, *weight, sizes, out_dtype=jnp.float32, interpret=True, **options)
    got = grouped_nvfp4_matmul(x, *weight, sizes, out_dtype=jnp.float32, interpret=True, x_rows="kernel", **options)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert np.abs(np.asarray(want)).max() > 0


@pytest.mark.parametrize("e,n,k,m,split_k", [(512, 1024, 2048, 10, 1), (60, 1000, 2064, 37, 2)])
def test_dot_jw_rows_made_in_the_kernel_lower_for_cuda_with_nothing_before_it(e, n, k, m, split_k):
    """The 80B gate_up at one token, and masked N, K, expert count and split K: one Triton call,
    and no XLA op on x before it (the jaxpr hands x to the kernel as given)."""
    fn = jax.jit(
        functools.partial(grouped_matmul, fmt="nvfp4", variant="dot_jw", block_m=16, block_n=64, block_k=256,
                          split_k=split_k, x_rows="kernel")
    )  # fmt: skip
    shapes = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), _nvfp4_shapes(e, n, k), jax.ShapeDtypeStruct((e,), jnp.int32))
    text = compat.lower_for_cuda(fn, *shapes)
    assert text.count("xla.gpu.triton") == 1 and "grouped_nvfp4_matmul_dot_jw" in text
    jaxpr = jax.make_jaxpr(fn)(*shapes).jaxpr
    while not any(eq.primitive.name == "pallas_call" for eq in jaxpr.eqns):  # into the nested jits
        jaxpr = next(eq.params["jaxpr"] for eq in jaxpr.eqns if "jaxpr" in eq.params).jaxpr
    call = next(eq for eq in jaxpr.eqns if eq.primitive.name == "pallas_call")
    assert call.invars[1] is jaxpr.invars[0]  # after the group sizes: x itself


def test_rows_made_in_the_kernel_are_dot_jw_s_only():
    rng = np.random.default_rng(3)
    weight = _nvfp4_stack(rng, 4, 32, 128)
    x, sizes = _x(rng, 8, 128), jnp.asarray([2, 2, 2, 2], jnp.int32)
    with pytest.raises(ValueError, match="x_rows='kernel' is dot_jw's"):
        grouped_nvfp4_matmul(x, *weight, sizes, variant="dot_w", block_m=16, x_rows="kernel", interpret=True)
    with pytest.raises(ValueError, match="x_rows='gpu' must be one of"):
        grouped_nvfp4_matmul(x, *weight, sizes, variant="dot_jw", block_m=16, x_rows="gpu", interpret=True)


@pytest.mark.parametrize(
    "fmt,stacks,e,n,k,m,block_m",
    [("nvfp4", 1, 512, 2048, 512, 10, 1), ("nvfp4", 2, 512, 512, 2048, 80, 2), ("nvfp4", 1, 60, 1000, 2064, 37, 8),
     ("fp8", 2, 512, 512, 2048, 10, 1), ("fp8_block128", 1, 512, 2048, 512, 80, 2)],
)  # fmt: skip
def test_streamed_gemv_lowers_to_one_triton_call_for_cuda(fmt, stacks, e, n, k, m, block_m):
    """The 80B's down and (two stacks) gate / up at batch 1 and 8, a masked N, K and expert count,
    and FP8 stacks with per-expert and 128-block scales."""
    block_size = 128 if fmt == "fp8_block128" else None
    if fmt == "nvfp4":
        weight = _nvfp4_shapes(e, n, k)
    else:
        scale = (e,) if block_size is None else (e, -(-n // block_size), -(-k // block_size))
        weight = (jax.ShapeDtypeStruct((e, n, k), jnp.float8_e4m3fn), jax.ShapeDtypeStruct(scale, jnp.float32))
    fn = jax.jit(
        functools.partial(
            grouped_matmuls, fmt="fp8" if fmt.startswith("fp8") else fmt, block_size=block_size, variant="gemv_ws",
            block_m=block_m, block_n=32, block_k=512 if fmt == "nvfp4" else 128,
        )
    )  # fmt: skip
    shapes = (
        jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
        (weight,) * stacks,
        jax.ShapeDtypeStruct((e,), jnp.int32),
    )
    text = compat.lower_for_cuda(fn, *shapes)
    assert text.count("xla.gpu.triton") == 1 and "_matmul_gemv_ws" in text


@pytest.mark.parametrize(
    "options,match",
    [
        ({"split_k": 2}, "spreads K over its programs"),
        ({"block_m": 16}, "block_m=16 must be in 1..8"),
        ({"programs": -1}, "programs=-1"),
    ],
)
def test_streamed_gemv_rejects_bad_options(options, match):
    args, _ = _nvfp4_args()
    with pytest.raises(ValueError, match=match):
        grouped_nvfp4_matmul(**args, variant="gemv_ws", block_k=128, interpret=True, **options)


def test_streamed_gemv_takes_nvfp4_and_fp8_only():
    weight = (jnp.ones((2, 16, 128), jnp.bfloat16),)
    with pytest.raises(ValueError, match="variant='gemv_ws' streams NVFP4 or FP8 stacks"):
        grouped_matmul(jnp.ones((2, 128), jnp.bfloat16), weight, jnp.asarray([1, 1]), fmt="plain", variant="gemv_ws",
                       block_k=128, interpret=True)  # fmt: skip


FP8_STREAMED_CASES = [
    # (m, e, n, k, block size, group sizes, x dtype, options) of the FP8 "gemv_ws"
    (10, 32, 64, 256, None, "decode", jnp.bfloat16, {"block_m": 1, "block_n": 32, "block_k": 64, "programs": 7}),
    # N = 40, K = 100 ragged against 16 x 32 tiles; float32 rows; 2 rows past the groups
    (12, 5, 40, 100, None, [3, 0, 6, 0, 1], jnp.float32, {"block_m": 2, "block_n": 16, "block_k": 32, "programs": 5}),
    # 32-blocks of scales, a group cut into three items
    (9, 4, 48, 96, 32, [0, 9, 0, 0], jnp.bfloat16, {"block_m": 4, "block_n": 16, "block_k": 32, "programs": 3}),
    (11, 4, 40, 72, 32, [5, 0, 3, 0], jnp.float32, {"block_m": 2, "block_n": 16, "block_k": 32, "programs": 9}),
]


@pytest.mark.parametrize("m,e,n,k,block_size,sizes,dtype,options", FP8_STREAMED_CASES)
def test_fp8_streamed_gemv_matches_reference(m, e, n, k, block_size, sizes, dtype, options):
    """FP8 stacks (per-expert or block scales) through the streamed gemv: float32 products, so the
    reference to float32 rounding; rows past the groups zero."""
    rng = np.random.default_rng(m + n + k)
    data, scale = _fp8_stack(rng, e, n, k, block_size)
    if sizes == "decode":
        sizes = np.zeros(e, np.int64)
        sizes[rng.choice(e, m, replace=False)] = 1
    sizes = jnp.asarray(sizes, jnp.int32)
    x = jnp.asarray(rng.standard_normal((m, k)), dtype)
    got = grouped_fp8_matmul(x, data, scale, sizes, block_size=block_size, variant="gemv_ws", out_dtype=jnp.float32,
                             interpret=True, **options)  # fmt: skip
    want = reference_grouped_matmul(x, (data, scale), sizes, fmt="fp8", block_size=block_size)
    _close(got, want)
    assert not np.asarray(got[int(sizes.sum()) :]).any()


@pytest.mark.parametrize("variant,block_m", [("gemv", 8), ("dot_t", 16)])
def test_lowers_with_experts_not_a_power_of_two_and_split_k(variant, block_m):
    """60 experts (a masked load of the group sizes), per-expert FP8 scales, float32 partial sums."""
    e, n, k, m = 60, 2048, 512, 37
    weight = (jax.ShapeDtypeStruct((e, n, k), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((e,), jnp.float32))
    fn = jax.jit(
        functools.partial(
            grouped_matmul, fmt="fp8", variant=variant, block_m=block_m, block_n=64, block_k=128, split_k=2
        )
    )
    shapes = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), weight, jax.ShapeDtypeStruct((e,), jnp.int32))
    assert "xla.gpu.triton" in compat.lower_for_cuda(fn, *shapes)


def _nvfp4_args(**change):
    rng = np.random.default_rng(3)
    packed, block_scale, tensor_scale = _nvfp4_stack(rng, 4, 32, 64)
    args = {
        "x": _x(rng, 6, 64),
        "packed": packed,
        "block_scale": block_scale,
        "tensor_scale": tensor_scale,
        "group_sizes": jnp.asarray([2, 0, 4, 0], jnp.int32),
    }
    options = change.pop("options", {})
    args.update(change)
    return args, options


@pytest.mark.parametrize(
    "change,match",
    [
        ({"packed": jnp.zeros((4, 32, 30), jnp.uint8)}, "implies K=60"),
        ({"packed": jnp.zeros((32, 32), jnp.uint8)}, r"packed must be uint8 \[E, N, K/2\]"),
        ({"block_scale": jnp.ones((4, 32, 3), jnp.float8_e4m3fn)}, r"block_scale must be \[E, N, K/16\]"),
        ({"block_scale": jnp.ones((4, 32, 4), jnp.float32)}, "float8_e4m3fn"),
        ({"tensor_scale": jnp.float32(1.0)}, r"one float per expert \[E=4\]"),
        ({"group_sizes": jnp.asarray([2, 4], jnp.int32)}, r"group_sizes must be \[E=4\]"),
        ({"group_sizes": jnp.asarray([2.0, 0, 4, 0])}, "group_sizes must be integers"),
        ({"x": jnp.ones((6, 64), jnp.int32)}, "x must be bf16"),
        ({"options": {"variant": "wide"}}, "variant='wide'"),
        ({"options": {"variant": "gemv", "block_m": 9}}, "block_m=9 must be in 1..8"),
        ({"options": {"variant": "dot", "block_m": 8}}, "block_m=8 must be a power of two >= 16"),
        ({"options": {"block_n": 48}}, "block_n=48"),
        ({"options": {"block_k": 16}}, "block_k=16"),
        ({"options": {"split_k": 0}}, "split_k=0"),
        ({"options": {"variant": "dot_w", "block_k": 64}}, "block_k=64 must be >= 128 for variant='dot_w'"),
        ({"options": {"variant": "dot_t_w", "block_m": 8}}, "block_m=8 must be a power of two >= 16"),
        (
            {"x": jnp.ones((6, 64), jnp.float32), "options": {"variant": "dot_t_w"}},
            "variant='dot_t_w' runs float16 dots, which would round float32 x",
        ),
    ],
)
def test_nvfp4_rejects_bad_inputs_naming_the_value(change, match):
    args, options = _nvfp4_args(**change)
    with pytest.raises(ValueError, match=match):
        grouped_nvfp4_matmul(**args, interpret=True, **options)


@pytest.mark.parametrize("fmt", ["fp8", "plain"])
def test_word_variants_take_only_nvfp4(fmt):
    x, sizes = jnp.ones((2, 128), jnp.bfloat16), jnp.asarray([1, 1], jnp.int32)
    if fmt == "fp8":
        weight = (jnp.ones((2, 16, 128), jnp.float8_e4m3fn), jnp.ones((2,), jnp.float32))
    else:
        weight = (jnp.ones((2, 16, 128), jnp.bfloat16),)
    with pytest.raises(
        ValueError, match=f"variant='dot_w' decodes NVFP4 words: it takes fmt='nvfp4', not '{fmt}'"
    ):
        grouped_matmul(x, weight, sizes, fmt=fmt, variant="dot_w", block_k=128, interpret=True)


def test_nvfp4_rejects_k_not_a_multiple_of_16():
    with pytest.raises(ValueError, match="K=40 must be a multiple of 16"):
        grouped_nvfp4_matmul(
            jnp.ones((2, 40), jnp.bfloat16),
            jnp.zeros((2, 16, 20), jnp.uint8),
            jnp.ones((2, 16, 2), jnp.float8_e4m3fn),
            jnp.ones((2,), jnp.float32),
            jnp.asarray([1, 1], jnp.int32),
            interpret=True,
        )


@pytest.mark.parametrize(
    "block_size,scale_shape,options,match",
    [
        (None, (3, 1), {}, r"per-expert scale must be \[E=3\]"),
        (32, (3, 1, 1), {}, r"block scale must be \[E, ceil\(N/32\), ceil\(K/32\)\]"),
        (32, (3, 1, 2), {"block_k": 64}, "block_k=64 must divide the scale block_size=32"),
    ],
)
def test_fp8_rejects_bad_scales(block_size, scale_shape, options, match):
    rng = np.random.default_rng(5)
    data, _ = _fp8_stack(rng, 3, 32, 48, None)
    with pytest.raises(ValueError, match=match):
        grouped_fp8_matmul(
            _x(rng, 4, 48),
            data,
            jnp.ones(scale_shape, jnp.float32),
            jnp.asarray([4, 0, 0], jnp.int32),
            block_size=block_size,
            interpret=True,
            **options,
        )


def test_fp8_rejects_non_fp8_data():
    with pytest.raises(ValueError, match=r"data must be float8_e4m3fn \[E, N, K\]"):
        grouped_fp8_matmul(
            jnp.ones((2, 32), jnp.bfloat16),
            jnp.ones((2, 16, 32), jnp.bfloat16),
            jnp.ones((2,), jnp.float32),
            jnp.asarray([1, 1], jnp.int32),
            interpret=True,
        )


def test_rejects_an_unknown_format():
    with pytest.raises(ValueError, match="fmt='int4'"):
        grouped_matmul(
            jnp.ones((2, 32), jnp.bfloat16), (jnp.ones((2, 16, 32)),), jnp.asarray([1, 1]), fmt="int4"
        )


H2W_CASES = [
    # (m, e, n, k, group sizes, block_m, options): one row an expert (one token's top-10), ragged N
    # and K (40 x 160: 20 words against 16-word steps) with rows past the groups, two-row items, K split
    (10, 32, 64, 512, "decode", 1, {"block_n": 32, "block_k": 256}),
    (21, 5, 40, 160, [4, 0, 0, 9, 5], 2, {"block_n": 32, "block_k": 128}),
    (13, 6, 70, 512, [3, 0, 5, 1, 0, 3], 4, {"block_n": 16, "block_k": 128, "split_k": 2}),
]


@pytest.mark.parametrize("m,e,n,k,sizes,block_m,options", H2W_CASES)
def test_the_half2_word_gemv_matches_the_reference(m, e, n, k, sizes, block_m, options):
    """gemv_h2w: each word's 8 products summed in float16 (as the dense gemv_h2w_ws), so rows of
    very different sizes stay within the float16 gemvs' tolerance of the float32 reference, row by
    row; rows past the groups are zero."""
    weight, sizes, x = _word_case(np.random.default_rng(m * 7 + n + k), m, e, n, k, sizes, jnp.bfloat16)
    options = {"variant": "gemv_h2w", "block_m": block_m, "out_dtype": jnp.float32, **options}
    got = np.asarray(grouped_nvfp4_matmul(x, *weight, sizes, interpret=True, **options))
    want = np.asarray(reference_grouped_matmul(x, weight, sizes, fmt="nvfp4"))
    covered = int(sizes.sum())
    for row in range(covered):
        np.testing.assert_allclose(got[row], want[row], rtol=0, atol=GEMV_W_TOLERANCE * np.abs(want[row]).max())
    assert not got[covered:].any()


def test_the_half2_word_gemv_lowers_for_cuda_as_one_call_with_its_ptx():
    """The 80B-A3B's gate and up at one token: one Triton call holding the packed half2 FMAs."""
    fn = jax.jit(functools.partial(grouped_matmuls, fmt="nvfp4", variant="gemv_h2w", block_m=1, block_n=32,
                                   block_k=512))  # fmt: skip
    stack = _nvfp4_shapes(512, 512, 2048)
    text = compat.lower_for_cuda(
        jax.jit(lambda x, a, b, s: fn(x, (a, b), s)), jax.ShapeDtypeStruct((10, 2048), jnp.bfloat16), stack, stack,
        jax.ShapeDtypeStruct((512,), jnp.int32),
    )  # fmt: skip
    assert text.count("xla.gpu.triton") == 1 and "grouped_nvfp4_matmul_gemv_h2w" in text


@pytest.mark.parametrize(
    "fmt,variant,block_size",
    [("nvfp4", "gemv", None), ("nvfp4", "dot_w", None), ("nvfp4", "dot_t", None), ("nvfp4", "gemv_ws", None),
     ("nvfp4", "gemv_h2w", None), ("fp8", "gemv", 128), ("plain", "dot_t", None)],
)  # fmt: skip
def test_several_stacks_in_one_launch_equal_each_alone(fmt, variant, block_size):
    """An expert's gate and up through one launch: ragged groups, a ragged N edge, rows past the
    groups (zeroed in both results), each result the stack's own grouped matmul."""
    rng = np.random.default_rng(31)
    e, n, k = 5, 40, 256
    if fmt == "nvfp4":
        stacks = (_nvfp4_stack(rng, e, n, k), _nvfp4_stack(rng, e, n, k))
    elif fmt == "fp8":
        stacks = (_fp8_stack(rng, e, n, k, block_size), _fp8_stack(rng, e, n, k, block_size))
    else:
        stacks = tuple((jnp.asarray(rng.standard_normal((e, n, k)), jnp.bfloat16),) for _ in range(2))
    x, sizes = _x(rng, 12, k), jnp.asarray([3, 0, 6, 0, 1], jnp.int32)  # two rows past the groups
    tiles = {
        "variant": variant,
        "block_m": 2 if variant.startswith("gemv") else 16,
        "block_n": 16,
        "block_k": 128,
    }
    got = grouped_matmuls(x, stacks, sizes, fmt=fmt, block_size=block_size, interpret=True,
                          out_dtype=jnp.float32, **tiles)  # fmt: skip
    assert len(got) == 2
    for g, stack in zip(got, stacks, strict=True):
        alone = grouped_matmul(x, stack, sizes, fmt=fmt, block_size=block_size, interpret=True,
                               out_dtype=jnp.float32, **tiles)  # fmt: skip
        assert g.shape == (12, n)
        np.testing.assert_array_equal(np.asarray(g), np.asarray(alone))
        assert not np.asarray(g[10:]).any()


def test_several_stacks_refuse_different_shapes_and_lower_to_one_triton_call():
    rng = np.random.default_rng(32)
    a, b = _nvfp4_stack(rng, 4, 32, 256), _nvfp4_stack(rng, 4, 64, 256)
    with pytest.raises(ValueError, match="stacks of one shape"):
        grouped_matmuls(_x(rng, 4, 256), (a, b), jnp.asarray([1, 1, 1, 1]), fmt="nvfp4", interpret=True)
    shapes = (
        jax.ShapeDtypeStruct((10, 2048), jnp.bfloat16),
        tuple(
            (
                jax.ShapeDtypeStruct((512, 512, 1024), jnp.uint8),
                jax.ShapeDtypeStruct((512, 512, 128), jnp.float8_e4m3fn),
                jax.ShapeDtypeStruct((512,), jnp.float32),
            )
            for _ in range(2)
        ),
        jax.ShapeDtypeStruct((512,), jnp.int32),
    )
    fn = jax.jit(functools.partial(grouped_matmuls, fmt="nvfp4", variant="gemv", block_m=1, block_n=32))
    text = compat.lower_for_cuda(fn, *shapes)
    assert text.count("xla.gpu.triton") == 1


def _joined(a: tuple, b: tuple) -> tuple:
    return tuple(jnp.concatenate([u, v]) for u, v in zip(a, b, strict=True))


@pytest.mark.parametrize(
    "fmt,block_size,options",
    [
        ("nvfp4", None, {"variant": "dot_w", "block_m": 16, "block_n": 32, "block_k": 128}),
        ("nvfp4", None, {"variant": "dot_jw", "block_m": 16, "block_n": 32, "block_k": 128, "x_rows": "kernel"}),
        ("nvfp4", None, {"variant": "dot_t", "block_m": 16, "block_n": 16, "split_k": 2}),
        ("nvfp4", None, {"variant": "gemv", "block_m": 1, "block_n": 32}),
        ("fp8", 16, {"variant": "dot", "block_m": 16, "block_n": 16, "block_k": 16}),  # block scales per stack
        ("fp8", None, {"variant": "dot_t", "block_m": 16, "block_n": 16}),
        ("plain", None, {"variant": "dot", "block_m": 16, "block_n": 16}),
    ],
)
def test_two_stacks_read_in_place_equal_their_concatenation(fmt, block_size, options):
    """`second`: experts past the first stack's are read from the second one, so the two serve as
    their concatenation, bit for bit, for gate and up in one launch (a slotted layer's slots and
    the experts fetched for the step)."""
    rng = np.random.default_rng(7)
    e1, e2, n, k = 5, 3, 40, 256

    def stack(e):
        if fmt == "nvfp4":
            return _nvfp4_stack(rng, e, n, k)
        if fmt == "fp8":
            return _fp8_stack(rng, e, n, k, block_size)
        return (jnp.asarray(rng.standard_normal((e, n, k)), jnp.float32),)

    firsts, seconds = (stack(e1), stack(e1)), (stack(e2), stack(e2))
    gemv = options["variant"] == "gemv"
    sizes = jnp.asarray([1, 0, 1, 0, 1, 1, 0, 1] if gemv else [2, 0, 1, 0, 3, 1, 0, 2], jnp.int32)
    x = _x(rng, int(sizes.sum()) + 1, k)  # and a row past the groups
    common = {"fmt": fmt, "block_size": block_size, "out_dtype": jnp.float32, "interpret": True, **options}
    want = grouped_matmuls(x, tuple(_joined(a, b) for a, b in zip(firsts, seconds, strict=True)), sizes, **common)
    got = grouped_matmuls(x, firsts, sizes, second=seconds, **common)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
        assert np.abs(np.asarray(w)).max() > 0 and not np.asarray(w)[-1].any()


def test_two_stacks_refuse_what_they_cannot_serve():
    rng = np.random.default_rng(8)
    a, b = _nvfp4_stack(rng, 4, 32, 128), _nvfp4_stack(rng, 2, 32, 128)
    x, sizes = _x(rng, 4, 128), jnp.asarray([1, 1, 0, 0, 1, 1], jnp.int32)
    options = {"fmt": "nvfp4", "variant": "dot_w", "block_m": 16, "interpret": True}
    with pytest.raises(ValueError, match=r"group_sizes must be \[E1 \+ E2 = 6\]"):
        grouped_matmuls(x, (a,), sizes[:5], second=(b,), **options)
    with pytest.raises(ValueError, match="but for the expert count"):
        grouped_matmuls(x, (a,), sizes, second=(_nvfp4_stack(rng, 2, 16, 128),), **options)
    with pytest.raises(ValueError, match="second gives 2 stacks for 1 weights"):
        grouped_matmuls(x, (a,), sizes, second=(b, b), **options)
    with pytest.raises(ValueError, match="not for the streamed variant"):
        grouped_matmuls(x, (a,), sizes, second=(b,), **{**options, "variant": "gemv_ws", "block_m": 1})


def test_two_stacks_lower_for_cuda_as_one_call():
    """The 80B-A3B's gate and up at one token from 100 slots and 10 fetched experts: one Triton call."""
    fn = jax.jit(
        functools.partial(grouped_matmuls, fmt="nvfp4", variant="dot_w", block_m=16, block_n=64, block_k=256)
    )
    first, second = _nvfp4_shapes(100, 512, 2048), _nvfp4_shapes(10, 512, 2048)
    text = compat.lower_for_cuda(
        jax.jit(lambda x, a, b, c, d, s: fn(x, (a, b), s, second=(c, d))),
        jax.ShapeDtypeStruct((10, 2048), jnp.bfloat16), first, first, second, second,
        jax.ShapeDtypeStruct((110,), jnp.int32),
    )  # fmt: skip
    assert text.count("xla.gpu.triton") == 1 and "grouped_nvfp4_matmul_dot_w" in text


@pytest.mark.parametrize("variant", ["dot_w", "dot_t_w", "dot_jw", "gemv", "gemv_h2w"])
def test_rows_made_before_the_launch_give_the_same_bits(variant):
    """x_words (the rows as the word kernels take them, made by the MoE routing kernel or from a
    norm's rows) replace the XLA op before the launch for dot_w / dot_t_w (word columns) and
    gemv_h2w (word pairs); dot_jw and the other formulations read x."""
    from pallas_kernels import _e2m1_half2 as h2
    from pallas_kernels import _quant_common as qc

    rng = np.random.default_rng(11)
    gate, up = _nvfp4_stack(rng, 6, 40, 256), _nvfp4_stack(rng, 6, 40, 256)
    sizes = jnp.asarray([1, 0, 3, 0, 2, 1], jnp.int32)
    x = _x(rng, 8, 256) * 50
    x16, inverse = qc.f16_rows(x)
    block_m = {"gemv": 1, "gemv_h2w": 1}.get(variant, 16)
    common = {"fmt": "nvfp4", "variant": variant, "block_m": block_m, "out_dtype": jnp.float32, "interpret": True}
    words = h2.word_x_pairs(x16) if variant == "gemv_h2w" else qc.word_columns(x16)
    want = grouped_matmuls(x, (gate, up), sizes, **common)
    got = grouped_matmuls(x, (gate, up), sizes, x_words=(words, inverse), **common)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    if variant == "dot_w":
        with pytest.raises(ValueError, match="'columns' layout: float16"):
            grouped_matmuls(x, (gate,), sizes, x_words=(x16.astype(jnp.float32), inverse), **common)
    if variant == "gemv_h2w":  # word columns where it reads word pairs
        with pytest.raises(ValueError, match="'pairs' layout: uint32"):
            grouped_matmuls(x, (gate,), sizes, x_words=(qc.word_columns(x16), inverse), **common)


@pytest.mark.parametrize(
    "fmt,variant,block_m", [("nvfp4", "gemv_h2w", 1), ("nvfp4", "gemv", 1), ("nvfp4", "dot_w", 16), ("plain", "dot_t", 16)]
)
def test_rows_naming_their_experts_equal_the_rows_sorted_by_expert(fmt, variant, block_m):
    """row_experts: a token's pairs in slot order, each naming its expert, give the sorted call's
    rows bit for bit, put back in slot order (no count, sort or unsort around the launch)."""
    rng = np.random.default_rng(5)
    e, n, k, pairs = 32, 40, 256, 10
    if fmt == "plain":
        stacks = (jnp.asarray(rng.standard_normal((e, n, k)), jnp.bfloat16),), (jnp.asarray(rng.standard_normal((e, n, k)), jnp.bfloat16),)
    else:
        stacks = _nvfp4_stack(rng, e, n, k), _nvfp4_stack(rng, e, n, k)
    experts = jnp.asarray(rng.permutation(e)[:pairs], jnp.int32)  # one token's top-10, in slot order
    x = _x(rng, pairs, k) * 30
    common = {"fmt": fmt, "variant": variant, "block_m": block_m, "out_dtype": jnp.float32, "interpret": True}
    got = grouped_matmuls(x, stacks, experts, row_experts=True, **common)
    order = jnp.argsort(experts)
    sizes = jnp.bincount(experts, length=e).astype(jnp.int32)
    want = grouped_matmuls(x[order], stacks, sizes, **common)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g)[order], np.asarray(w))


def test_pairs_of_one_token_read_its_word_row_once():
    """gemv_h2w under row_experts takes a token's word row and factor for all of its pairs
    (x_words [T, K/2] for M = T * k rows): the same bits as each pair's row gathered."""
    from pallas_kernels import _e2m1_half2 as h2
    from pallas_kernels import _quant_common as qc

    rng = np.random.default_rng(9)
    e, n, k, top = 16, 40, 256, 4
    stacks = _nvfp4_stack(rng, e, n, k), _nvfp4_stack(rng, e, n, k)
    tokens = _x(rng, 2, k) * 40
    experts = jnp.asarray(np.concatenate([rng.permutation(e)[:top] for _ in range(2)]), jnp.int32)
    x = jnp.repeat(tokens, top, axis=0)  # [T * k, K] in (token, slot) order
    words, inverse = qc.f16_rows(tokens)
    common = {"fmt": "nvfp4", "variant": "gemv_h2w", "block_m": 1, "out_dtype": jnp.float32, "interpret": True,
              "row_experts": True}  # fmt: skip
    got = grouped_matmuls(x, stacks, experts, x_words=(h2.word_x_pairs(words), inverse), **common)
    want = grouped_matmuls(x, stacks, experts, **common)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
    with pytest.raises(ValueError, match="'pairs' layout"):  # three token rows for eight pairs
        grouped_matmuls(x, stacks, experts, x_words=(h2.word_x_pairs(qc.f16_rows(x[:3])[0]), inverse[:1].repeat(3)),
                        **common)  # fmt: skip


@pytest.mark.parametrize("variant,block_m", [("gemv_h2w", 1), ("dot_w", 16)])
def test_rows_naming_experts_of_a_second_stack_equal_the_joined_stacks(variant, block_m):
    """row_experts with `second`: a token's pairs and one more row naming the second stack's one
    expert (a MoE layer's shared expert), the token's word row read by all of them, give the joined
    stacks' rows bit for bit, the last row named or left to name the second stack's expert."""
    from pallas_kernels import _e2m1_half2 as h2
    from pallas_kernels import _quant_common as qc

    rng = np.random.default_rng(13)
    e, n, k, top = 16, 40, 256, 4
    firsts = _nvfp4_stack(rng, e, n, k), _nvfp4_stack(rng, e, n, k)
    seconds = _nvfp4_stack(rng, 1, n, k), _nvfp4_stack(rng, 1, n, k)
    token = _x(rng, 1, k) * 40
    experts = jnp.asarray([*rng.permutation(e)[:top], e], jnp.int32)  # the shared row last
    x = jnp.repeat(token, top + 1, axis=0)
    common = {"fmt": "nvfp4", "variant": variant, "block_m": block_m, "out_dtype": jnp.float32, "interpret": True,
              "row_experts": True}  # fmt: skip
    want = grouped_matmuls(x, tuple(_joined(a, b) for a, b in zip(firsts, seconds, strict=True)), experts, **common)
    x16, inverse = qc.f16_rows(token)
    words = h2.word_x_pairs(x16) if variant == "gemv_h2w" else None
    for named in (experts, experts[:top]):
        got = grouped_matmuls(x, firsts, named, second=seconds, x_words=None if words is None else (words, inverse),
                              **common)  # fmt: skip
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
            assert np.abs(np.asarray(w)[-1]).max() > 0
    with pytest.raises(ValueError, match="needs each row's expert"):  # two rows unnamed, one second expert
        grouped_matmuls(x, firsts, experts[: top - 1], second=seconds, **common)
    if words is not None:  # one token's inverse factor rides in its word row, the launch's one x operand
        jaxpr = str(jax.make_jaxpr(lambda w, i: grouped_matmuls(x, firsts, experts, second=seconds, x_words=(w, i),
                                                                **common))(words, inverse))  # fmt: skip
        assert f"u32[1,{k // 2 + 1}]" in jaxpr


@pytest.mark.parametrize(
    "experts,options,match",
    [((9,), {"variant": "gemv_h2w"}, r"row_experts needs each row's expert, integers \[M=10\]"),
     ((10,), {"variant": "gemv_ws", "block_m": 1}, "not for the streamed variants")],
)  # fmt: skip
def test_rows_naming_their_experts_refuse_what_they_cannot_serve(experts, options, match):
    rng = np.random.default_rng(2)
    stack = _nvfp4_stack(rng, 16, 32, 256)
    with pytest.raises(ValueError, match=match):
        grouped_matmuls(_x(rng, 10, 256), (stack,), jnp.zeros(experts, jnp.int32), fmt="nvfp4", row_experts=True,
                        interpret=True, **options)  # fmt: skip


def test_rows_naming_their_experts_lower_for_cuda_as_one_call():
    """The 80B-A3B's gate and up at one token with the token's word row: one Triton call, nothing
    before it but the launch's operands."""
    fn = functools.partial(grouped_matmuls, fmt="nvfp4", variant="gemv_h2w", block_m=1, block_n=32, block_k=512,
                           row_experts=True)  # fmt: skip
    stack = _nvfp4_shapes(512, 512, 2048)
    text = compat.lower_for_cuda(
        jax.jit(lambda x, a, b, ids, w, inv: fn(x, (a, b), ids, x_words=(w, inv))),
        jax.ShapeDtypeStruct((10, 2048), jnp.bfloat16), stack, stack, jax.ShapeDtypeStruct((10,), jnp.int32),
        jax.ShapeDtypeStruct((1, 1024), jnp.uint32), jax.ShapeDtypeStruct((1,), jnp.float32),
    )  # fmt: skip
    assert text.count("xla.gpu.triton") == 1 and "grouped_nvfp4_matmul_gemv_h2w" in text
    shared = _nvfp4_shapes(1, 512, 2048)  # and the shared expert as an eleventh row, left unnamed
    text = compat.lower_for_cuda(
        jax.jit(lambda x, a, b, c, d, ids, w, inv: fn(x, (a, b), ids, second=(c, d), x_words=(w, inv))),
        jax.ShapeDtypeStruct((11, 2048), jnp.bfloat16), stack, stack, shared, shared,
        jax.ShapeDtypeStruct((10,), jnp.int32), jax.ShapeDtypeStruct((1, 1024), jnp.uint32),
        jax.ShapeDtypeStruct((1,), jnp.float32),
    )  # fmt: skip
    assert text.count("xla.gpu.triton") == 1 and "grouped_nvfp4_matmul_gemv_h2w" in text
