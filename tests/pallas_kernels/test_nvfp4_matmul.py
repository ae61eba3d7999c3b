"""The NVFP4 decode and prefill kernels equal its float32 reference (interpret mode) and lowers to Triton."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _e2m1_half2 as h2
from pallas_kernels import _quant_common as qc
from pallas_kernels import compat
from pallas_kernels.nvfp4_matmul import (
    DECODE_VARIANTS,
    DEFAULT_CONFIGS,
    E2M1_VALUES,
    GEMV_W_TOLERANCE,
    STREAMED_WORD_VARIANTS,
    VARIANTS,
    WORD_MIN_BLOCK_K,
    WORD_VARIANTS,
    decode_e2m1,
    joined_columns,
    nvfp4_matmul,
    nvfp4_matmuls,
    reference_nvfp4_matmul,
    x_words_layout,
)

# Formulations that sum products in float16 (exact products, rounded sums): GEMV_W_TOLERANCE.
F16_SUM_VARIANTS = ("gemv_w", "gemv_wp", "gemv_ws", "gemv_bs_ws", "gemv_bsx_ws", "gemv_h2_ws", "gemv_h2w_ws", "gemv_h2wx_ws")


def _random_nvfp4(rng, m, n, k, x_dtype=jnp.bfloat16):
    x = jnp.asarray(rng.standard_normal((m, k)), x_dtype)
    packed = jnp.asarray(rng.integers(0, 256, (n, k // 2)), jnp.uint8)
    block_scale = jnp.asarray(rng.uniform(2.0**-6, 8.0, (n, k // 16)), jnp.float8_e4m3fn)
    tensor_scale = jnp.float32(rng.uniform(0.01, 1.0))
    return x, packed, block_scale, tensor_scale


def test_arithmetic_e2m1_decode_matches_the_table():
    codes = jnp.arange(16, dtype=jnp.int32)
    np.testing.assert_array_equal(np.asarray(decode_e2m1(codes)), np.asarray(E2M1_VALUES, np.float32))


def test_float16_bit_decode_matches_the_table_for_every_byte():
    """Both nibbles of all 256 bytes: value * 2**14 is the E2M1 table entry, sign of zero included."""
    byte = np.arange(256)
    codes = jnp.asarray(byte, jnp.uint8)
    table = np.asarray(E2M1_VALUES, np.float32)
    for high, want in ((False, table[byte & 0xF]), (True, table[byte >> 4])):
        got = np.asarray(qc.e2m1_f16_bits(codes, high=high) * qc.E2M1_F16_SCALE)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


def test_word_decode_matches_the_table_for_every_byte_in_every_position():
    """All 256 bytes in each of a word's four bytes: element p of the word is nibble p (low nibble
    first), and value * 2**14 is its E2M1 table entry, sign of zero included."""
    table = np.asarray(E2M1_VALUES, np.float32)
    byte = np.arange(256, dtype=np.uint8)
    for position in range(4):
        b = np.zeros((256, 4), np.uint8)
        b[:, position] = byte
        b[:, (position + 1) % 4] = byte[::-1]  # a neighbour that must not leak in
        words = jax.lax.bitcast_convert_type(jnp.asarray(b), jnp.uint32)
        got = np.stack([np.asarray(e, np.float32) * qc.E2M1_F16_SCALE for e in qc.e2m1_word_f16(words)], -1)
        want = np.stack([table[b & 0xF], table[b >> 4]], -1).reshape(256, 8)
        np.testing.assert_array_equal(got, want)
        np.testing.assert_array_equal(np.signbit(got), np.signbit(want))


def test_word_columns_put_element_p_of_each_word_together():
    x = jnp.arange(2 * 32).reshape(2, 32)
    got = np.asarray(qc.word_columns(x))
    for p in range(8):
        np.testing.assert_array_equal(got[:, p * 4 : (p + 1) * 4], np.asarray(x)[:, p::8])


@pytest.mark.parametrize("variant", WORD_VARIANTS)
def test_word_variants_keep_rows_of_any_size_exact(variant):
    """float16 activations are scaled per row: rows far past float16's range (3e5) and far below
    its normal range (1e-7) give the float32 reference's result beside an ordinary row."""
    m = 65 if variant == "tiled_w" else 3
    x, packed, block_scale, tensor_scale = _random_nvfp4(np.random.default_rng(11), m, 96, 512)
    x = x * jnp.asarray(np.resize([3e5, 1.0, 1e-7], m)[:, None], jnp.bfloat16)
    tiles = {"block_m": 32} if variant == "tiled_w" else {}
    got = nvfp4_matmul(x, packed, block_scale, tensor_scale, variant=variant, block_n=32, block_k=128,
                       out_dtype=jnp.float32, interpret=True, **tiles)  # fmt: skip
    want = reference_nvfp4_matmul(x, packed, block_scale, tensor_scale)
    assert np.isfinite(np.asarray(got)).all()
    tol = GEMV_W_TOLERANCE if variant in F16_SUM_VARIANTS else 1e-5  # gemv_w rounds its float16 sums
    for row in range(3):  # each row against its own scale
        np.testing.assert_allclose(
            np.asarray(got[row]), np.asarray(want[row]), rtol=tol, atol=tol * float(jnp.abs(want[row]).max())
        )


def test_gemv_w_stays_well_inside_its_tolerance_on_long_rows():
    """The float16 sums cover only the 8 products of one word, so the error does not grow with K:
    a 27B-like row (K = 5120) stays near bf16's own rounding of y, not at the bound."""
    x, packed, block_scale, tensor_scale = _random_nvfp4(np.random.default_rng(13), 1, 64, 5120)
    got = nvfp4_matmul(x, packed, block_scale, tensor_scale, variant="gemv_w", block_n=64, block_k=1024,
                       out_dtype=jnp.float32, interpret=True)  # fmt: skip
    want = reference_nvfp4_matmul(x, packed, block_scale, tensor_scale)
    assert float(jnp.max(jnp.abs(got - want)) / jnp.max(jnp.abs(want))) < GEMV_W_TOLERANCE / 4


def test_word_variants_refuse_short_k_steps():
    args = _random_nvfp4(np.random.default_rng(12), 2, 32, 256)
    with pytest.raises(ValueError, match="block_k=64 must be >= 128 for variant='dot_w'"):
        nvfp4_matmul(*args, variant="dot_w", block_k=64, interpret=True)


CASES = [
    (1, 64, 256, {"block_n": 64, "block_k": 256}),  # decode, tiles divide evenly: no masks
    (3, 70, 96, {"block_n": 32, "block_k": 64}),  # ragged N and K
    (8, 130, 544, {"block_n": 64, "block_k": 128, "split_k": 2}),  # ragged, split K
]


@pytest.mark.parametrize("variant", DECODE_VARIANTS)
@pytest.mark.parametrize("m,n,k,tiles", CASES)
def test_kernel_matches_reference(variant, m, n, k, tiles):
    rng = np.random.default_rng(m * 1000 + n + k)
    args = _random_nvfp4(rng, m, n, k)
    if variant in WORD_VARIANTS:  # their dots span block_k / 8 words
        tiles = {**tiles, "block_k": max(tiles["block_k"], WORD_MIN_BLOCK_K)}
    if qc.is_streamed(variant):  # its programs share K themselves: a few, so runs cross tiles
        tiles = {**{t: v for t, v in tiles.items() if t != "split_k"}, "programs": 3}
    got = nvfp4_matmul(*args, variant=variant, out_dtype=jnp.float32, interpret=True, **tiles)
    want = reference_nvfp4_matmul(*args)
    assert got.shape == (m, n)
    # Weight tiles are exact in bf16 and accumulation is float32: only summation order differs
    # (gemv_w also rounds its 8-product float16 sums: GEMV_W_TOLERANCE of max |y|).
    rtol, atol = (GEMV_W_TOLERANCE, GEMV_W_TOLERANCE) if variant in F16_SUM_VARIANTS else (1e-5, 1e-4)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=rtol, atol=atol * float(jnp.abs(want).max()))


@pytest.mark.parametrize(
    "m,n,k,tiles",
    [
        (16, 48, 160, {"variant": "dot", "block_n": 16, "block_k": 32}),
        (17, 33, 48, {"variant": "dot_t", "block_n": 16, "block_k": 32, "split_k": 3}),  # idle split tail
    ],
)
def test_dot_formulations_take_more_than_one_row_tile(m, n, k, tiles):
    args = _random_nvfp4(np.random.default_rng(m + n), m, n, k)
    got = nvfp4_matmul(*args, out_dtype=jnp.float32, interpret=True, **tiles)
    want = reference_nvfp4_matmul(*args)
    np.testing.assert_allclose(
        np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4 * float(jnp.abs(want).max())
    )


def test_gemv_refuses_more_than_eight_rows():
    args = _random_nvfp4(np.random.default_rng(4), 9, 32, 64)
    with pytest.raises(ValueError, match="M <= 8"):
        nvfp4_matmul(*args, variant="gemv", interpret=True)


@pytest.mark.parametrize("m", [1, 8, 16])
def test_default_formulation_comes_from_the_table_by_m(m):
    shapes = (
        jax.ShapeDtypeStruct((m, 1024), jnp.bfloat16),
        jax.ShapeDtypeStruct((384, 512), jnp.uint8),
        jax.ShapeDtypeStruct((384, 64), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((), jnp.float32),
    )
    want = qc.pick_config(DEFAULT_CONFIGS, m).variant
    assert f"nvfp4_matmul_{want}" in compat.lower_for_cuda(nvfp4_matmul, *shapes)


def test_default_output_dtype_is_the_activation_dtype():
    args = _random_nvfp4(np.random.default_rng(1), 2, 32, 64)
    assert nvfp4_matmul(*args, block_n=32, block_k=64, interpret=True).dtype == jnp.bfloat16


@pytest.mark.parametrize("variant", DECODE_VARIANTS)
@pytest.mark.parametrize("n,k,split_k", [(384, 1024, 2), (100, 1536, 3)])  # mask-free, masked
def test_kernel_lowers_to_a_triton_call_for_cuda(variant, n, k, split_k):
    shapes = (
        jax.ShapeDtypeStruct((8, k), jnp.bfloat16),
        jax.ShapeDtypeStruct((n, k // 2), jnp.uint8),
        jax.ShapeDtypeStruct((n, k // 16), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((), jnp.float32),
    )
    split_k = 1 if qc.is_streamed(variant) else split_k  # streamed: its programs share K themselves
    fn = jax.jit(functools.partial(nvfp4_matmul, variant=variant, block_n=64, block_k=256, split_k=split_k))
    text = compat.lower_for_cuda(fn, *shapes)
    assert "xla.gpu.triton" in text and f"nvfp4_matmul_{variant}" in text


STREAMED_CASES = [  # m, n, k, block_n, block_k, programs
    (1, 64, 1024, 32, 128, 3),  # 16 units in runs of 6: tiles shared by 2 programs, a third slot zeroed
    (3, 70, 512, 32, 128, 5),  # ragged N: the last tile's rows past N are neither read nor written
    (2, 130, 544, 64, 128, 7),  # ragged K
    (1, 64, 2048, 32, 128, 9),  # runs of 4 in 16-step tiles: a tile spans 5 programs
    (8, 48, 256, 16, 128, 100),  # more programs asked for than units
    (20, 48, 512, 16, 128, 4),  # two M tiles of 16, the second ragged (dot_ws only: gemv serves M <= 8)
]


@pytest.mark.parametrize(
    "variant,m,n,k,block_n,block_k,programs",
    [
        (v, *c)
        for v in ("gemv_ws", "gemv_bs_ws", "gemv_bsx_ws", "gemv_h2_ws", "gemv_h2w_ws", "gemv_h2wx_ws", "dot_ws")
        for c in STREAMED_CASES
        if v == "dot_ws" or c[0] <= 8
    ],
)
def test_streamed_formulations_match_reference_for_any_number_of_programs(
    variant, m, n, k, block_n, block_k, programs
):
    """Each program's run of (tile, K step) units may start and end inside tiles: the slots add up
    to the reference (the interpreter starts outputs as NaN, so a slot nobody wrote would show)."""
    args = _random_nvfp4(np.random.default_rng(m + n + k + programs), m, n, k)
    got = nvfp4_matmul(*args, variant=variant, block_n=block_n, block_k=block_k, programs=programs,
                       out_dtype=jnp.float32, interpret=True)  # fmt: skip
    want = reference_nvfp4_matmul(*args)
    tol = GEMV_W_TOLERANCE if variant in F16_SUM_VARIANTS else 1e-5  # float16 sums of exact products
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol, atol=tol * float(jnp.abs(want).max()))


@pytest.mark.parametrize("n_tiles,steps", [(1, 1), (5, 1), (3, 2), (7, 10), (80, 34), (1088, 10)])
def test_streamed_plan_covers_every_unit_once_within_its_slots(n_tiles, steps):
    for programs in (1, 2, 3, 7, 64, 264, 10_000):
        plan = qc.StreamedPlan.make(n_tiles * 16, 16, steps, programs)
        units = n_tiles * steps
        assert plan.grid <= programs and (plan.grid - 1) * plan.per_program < units <= plan.grid * plan.per_program
        owners = np.arange(units) // plan.per_program  # the program of each unit
        spans = [len(set(owners[t * steps : (t + 1) * steps])) for t in range(n_tiles)]
        assert max(spans) <= plan.slots


def test_streamed_gemv_refuses_split_k():
    args = _random_nvfp4(np.random.default_rng(9), 1, 32, 256)
    with pytest.raises(ValueError, match="spreads K over its programs itself"):
        nvfp4_matmul(*args, variant="gemv_ws", split_k=2, block_k=128, interpret=True)


@pytest.mark.parametrize("variant", ["gemv_ws", "gemv_h2w_ws", "gemv_wp", "gemv_w", "dot_w"])
@pytest.mark.parametrize("m,n,k", [(2, 70, 512), (1, 64, 544)])  # ragged N, ragged K
def test_scales_gathered_per_word_give_the_same_result_as_spread_by_reshape(variant, m, n, k):
    """`scale_spread` changes only how each word meets its block scale (the dots keep block bytes)."""
    args = _random_nvfp4(np.random.default_rng(5), m, n, k)
    tiles = {"variant": variant, "block_n": 32, "block_k": 128, "out_dtype": jnp.float32, "interpret": True}
    if qc.is_streamed(variant):
        tiles["programs"] = 5
    gathered = nvfp4_matmul(*args, scale_spread="gather", **tiles)
    spread = nvfp4_matmul(*args, scale_spread="reshape", **tiles)
    np.testing.assert_array_equal(np.asarray(gathered), np.asarray(spread))
    tol = GEMV_W_TOLERANCE if variant in F16_SUM_VARIANTS else 1e-5
    want = reference_nvfp4_matmul(*args)
    np.testing.assert_allclose(np.asarray(gathered), np.asarray(want), rtol=tol, atol=tol * float(jnp.abs(want).max()))


@pytest.mark.parametrize(
    "change,match",
    [
        ({"packed": jnp.zeros((32, 30), jnp.uint8)}, "implies K=60"),
        ({"packed": jnp.zeros((32, 32), jnp.int8)}, "packed must be uint8"),
        ({"block_scale": jnp.ones((32, 3), jnp.float8_e4m3fn)}, r"block_scale must be \[N, K/16\]"),
        ({"block_scale": jnp.ones((32, 4), jnp.float32)}, "float8_e4m3fn"),
        ({"tensor_scale": jnp.ones((2,), jnp.float32)}, "tensor_scale must be a scalar"),
        ({"x": jnp.ones((2, 64), jnp.int32)}, "x must be bf16"),
        ({"tiles": {"block_n": 48}}, "block_n=48"),
        ({"tiles": {"block_k": 16}}, "block_k=16"),
        ({"tiles": {"split_k": 0}}, "split_k=0"),
        ({"tiles": {"variant": "gemv_ws", "block_k": 128, "programs": -1}}, "programs=-1"),
        ({"tiles": {"variant": "gemv_ws", "block_k": 128, "scale_spread": "l1"}}, "scale_spread='l1'"),
        ({"tiles": {"variant": "wide"}}, "variant='wide'"),
    ],
)
def test_rejects_bad_inputs_naming_the_value(change, match):
    x, packed, block_scale, tensor_scale = _random_nvfp4(np.random.default_rng(2), 2, 32, 64)
    kwargs = {"x": x, "packed": packed, "block_scale": block_scale, "tensor_scale": tensor_scale}
    change = dict(change)
    tiles = change.pop("tiles", {})
    kwargs.update(change)
    with pytest.raises(ValueError, match=match):
        nvfp4_matmul(**kwargs, interpret=True, **tiles)


def test_rejects_k_not_a_multiple_of_16():
    x = jnp.ones((1, 40), jnp.bfloat16)
    with pytest.raises(ValueError, match="K=40 must be a multiple of 16"):
        nvfp4_matmul(
            x,
            jnp.zeros((16, 20), jnp.uint8),
            jnp.ones((16, 2), jnp.float8_e4m3fn),
            jnp.float32(1),
            interpret=True,
        )


# Prefill ("tiled"): M past the decode range, ragged M / N / K edges and a mask-free case.
TILED_CASES = [
    (65, 70, 96, {"block_m": 32, "block_n": 32, "block_k": 32, "group_m": 2}),  # all edges ragged
    (200, 130, 160, {"block_m": 64, "block_n": 64, "block_k": 64, "group_m": 3}),  # short last group
    (256, 128, 256, {"block_m": 64, "block_n": 64, "block_k": 128}),  # tiles divide: no masks
]


@pytest.mark.parametrize("m,n,k,tiles", TILED_CASES)
@pytest.mark.parametrize("variant", ["tiled", "tiled_w"])
def test_tiled_formulation_matches_reference(m, n, k, tiles, variant):
    args = _random_nvfp4(np.random.default_rng(m + n + k), m, n, k)
    if variant == "tiled_w":
        tiles = {**tiles, "block_k": max(tiles["block_k"], WORD_MIN_BLOCK_K)}
    if qc.is_streamed(variant):  # its programs share K themselves: a few, so runs cross tiles
        tiles = {**{t: v for t, v in tiles.items() if t != "split_k"}, "programs": 3}
    got = nvfp4_matmul(*args, variant=variant, out_dtype=jnp.float32, interpret=True, **tiles)
    want = reference_nvfp4_matmul(*args)
    assert got.shape == (m, n)
    np.testing.assert_allclose(
        np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4 * float(jnp.abs(want).max())
    )


def test_tiled_is_the_default_past_the_decode_table_and_writes_the_activation_dtype():
    args = _random_nvfp4(np.random.default_rng(7), 65, 64, 128)
    got = nvfp4_matmul(*args, block_m=32, block_n=32, block_k=64, interpret=True)
    assert qc.pick_config(DEFAULT_CONFIGS, 65).variant == "tiled"
    assert got.dtype == jnp.bfloat16
    want = reference_nvfp4_matmul(*args)
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want), rtol=1e-2, atol=1e-2 * float(jnp.abs(want).max())
    )


@pytest.mark.parametrize(
    "m,n,k,block_m,block_n,block_k",
    [(4096, 384, 1024, 256, 256, 128), (4096, 384, 1024, 128, 128, 64), (1000, 100, 1536, 128, 256, 128)],
)
@pytest.mark.parametrize("variant", ["tiled", "tiled_w"])
def test_tiled_large_tiles_lower_to_a_triton_call_for_cuda(m, n, k, block_m, block_n, block_k, variant):
    block_k = max(block_k, WORD_MIN_BLOCK_K) if variant == "tiled_w" else block_k
    shapes = (
        jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
        jax.ShapeDtypeStruct((n, k // 2), jnp.uint8),
        jax.ShapeDtypeStruct((n, k // 16), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((), jnp.float32),
    )
    fn = jax.jit(
        functools.partial(nvfp4_matmul, variant=variant, block_m=block_m, block_n=block_n, block_k=block_k)
    )
    text = compat.lower_for_cuda(fn, *shapes)
    assert "xla.gpu.triton" in text and f"nvfp4_matmul_{variant}" in text


def test_tiled_refuses_split_k():
    args = _random_nvfp4(np.random.default_rng(8), 65, 32, 64)
    with pytest.raises(ValueError, match="split_k=2"):
        nvfp4_matmul(*args, variant="tiled", split_k=2, interpret=True)


def test_decode_tiles_with_split_k_keep_a_split_k_formulation_past_the_decode_table():
    """Callers passing split-K decode tiles (weights.quant.nvfp4_tiles) at M > 64 still run."""
    cfg = qc.resolve_config(
        DEFAULT_CONFIGS,
        200,
        variants=VARIANTS,
        variant=None,
        block_n=64,
        block_k=256,
        split_k=2,
        num_warps=None,
        num_stages=None,
    )
    assert cfg.variant == DEFAULT_CONFIGS[64].variant and cfg.split_k == 2


@pytest.mark.parametrize("m_tiles,n_tiles,group_m", [(5, 3, 2), (4, 4, 8), (7, 2, 1), (3, 5, 3)])
def test_grouped_program_order_visits_every_tile_once(m_tiles, n_tiles, group_m):
    pids = jnp.arange(m_tiles * n_tiles)
    i, j = jax.vmap(lambda p: qc.grouped_tile(p, m_tiles, n_tiles, group_m))(pids)
    tiles = set(zip(np.asarray(i).tolist(), np.asarray(j).tolist()))
    assert tiles == {(a, b) for a in range(m_tiles) for b in range(n_tiles)}
    # The first group's programs cover group_m M tiles before moving to the next N tile.
    first = min(group_m, m_tiles)
    assert np.asarray(i)[:first].tolist() == list(range(first))
    assert np.asarray(j)[:first].tolist() == [0] * first


@pytest.mark.parametrize("variant", ["gemv_ws", "gemv_h2_ws", "dot_ws"])
@pytest.mark.parametrize("m,sizes,programs", [(1, (96, 40, 8, 8), 7), (3, (64, 130), 3), (2, (50,), 5)])
def test_several_weights_in_one_launch_equal_each_alone(variant, m, sizes, programs):
    """Weights of one input laid end to end (ragged sizes: segments start on tile boundaries,
    their padding is neither read nor returned) give each weight's own result, tensor scale
    included, whatever the programs' runs cut across segments."""
    rng = np.random.default_rng(sum(sizes) + m)
    x, *_ = _random_nvfp4(rng, m, 8, 512)
    weights = tuple(_random_nvfp4(rng, m, n, 512)[1:] for n in sizes)
    tiles = {
        "variant": variant,
        "block_n": 16 if variant == "dot_ws" else 32,
        "block_k": 256,
        "programs": programs,
    }
    got = nvfp4_matmuls(x, weights, out_dtype=jnp.float32, interpret=True, **tiles)
    assert [g.shape for g in got] == [(m, n) for n in sizes]
    for g, w in zip(got, weights, strict=True):
        alone = nvfp4_matmul(x, *w, out_dtype=jnp.float32, interpret=True, **tiles)
        np.testing.assert_allclose(
            np.asarray(g), np.asarray(alone), rtol=1e-6, atol=1e-6 * float(jnp.abs(alone).max())
        )
        want = reference_nvfp4_matmul(x, *w)
        tol = GEMV_W_TOLERANCE if variant in F16_SUM_VARIANTS else 1e-5
        np.testing.assert_allclose(
            np.asarray(g), np.asarray(want), rtol=tol, atol=tol * float(jnp.abs(want).max())
        )


@pytest.mark.parametrize("variant", ["gemv_ws", "dot_ws"])
def test_several_weights_joined_hold_each_result_at_its_column(variant):
    """joined=True: one array with every weight's result at `joined_columns` (segments start on
    tile boundaries), bit for bit the separate results, in the output dtype."""
    rng = np.random.default_rng(17)
    sizes = (96, 40, 8, 8)
    x, *_ = _random_nvfp4(rng, 2, 8, 512)
    weights = tuple(_random_nvfp4(rng, 2, n, 512)[1:] for n in sizes)
    tiles = {"variant": variant, "block_n": 32, "block_k": 256, "programs": 5, "interpret": True}
    apart = nvfp4_matmuls(x, weights, **tiles)
    (joined,) = nvfp4_matmuls(x, weights, joined=True, **tiles)
    columns = joined_columns(sizes, 32)
    assert columns == (0, 96, 160, 192) and joined.shape == (2, 200) and joined.dtype == x.dtype
    for alone, col, n in zip(apart, columns, sizes, strict=True):
        np.testing.assert_array_equal(np.asarray(joined[:, col : col + n]), np.asarray(alone))


def test_several_weights_refuse_other_formulations_and_mixed_k():
    rng = np.random.default_rng(5)
    x, *w1 = _random_nvfp4(rng, 1, 64, 256)
    with pytest.raises(ValueError, match="must be one of"):
        nvfp4_matmuls(x, (tuple(w1),), variant="dot", interpret=True)
    w2 = _random_nvfp4(rng, 1, 64, 512)[1:]
    with pytest.raises(ValueError, match="implies K=512"):
        nvfp4_matmuls(x, (tuple(w1), w2), block_k=128, interpret=True)


@pytest.mark.parametrize(
    "variant,m,n,k,tiles",
    [
        ("gemv_ws", 1, 96, 512, {"block_n": 32, "block_k": 256, "programs": 5}),
        ("gemv_ws", 3, 80, 400, {"block_n": 32, "block_k": 256, "programs": 3}),  # ragged N and K
        ("gemv_w", 2, 64, 512, {"block_n": 32, "block_k": 256}),
        ("gemv_wp", 2, 64, 400, {"block_n": 32, "block_k": 256, "split_k": 2}),
        ("dot_jw", 5, 72, 400, {"block_n": 32, "block_k": 256, "block_m": 16}),
        ("dot_jw", 20, 64, 512, {"block_n": 32, "block_k": 256, "block_m": 16, "split_k": 2}),  # two row tiles
    ],
)
def test_rows_made_in_the_kernel_equal_those_made_before_it(variant, m, n, k, tiles):
    """x_rows="kernel": the word kernel takes x as given and scales its rows to float16 itself (no
    reduce, convert or transpose before the launch). Rows of very different sizes and an all-zero
    row give the same bits as rows made by `f16_rows` / `word_columns` before the kernel."""
    rng = np.random.default_rng(m * n + k)
    _, packed, block_scale, tensor_scale = _random_nvfp4(rng, m, n, k)
    row_size = np.resize([1.0, 3e3, 2e-3, 40.0, 0.0], m)[:, None]
    x = jnp.asarray(rng.standard_normal((m, k)) * row_size, jnp.bfloat16)
    options = {"variant": variant, "out_dtype": jnp.float32, "interpret": True, **tiles}
    want = nvfp4_matmul(x, packed, block_scale, tensor_scale, **options)
    got = nvfp4_matmul(x, packed, block_scale, tensor_scale, x_rows="kernel", **options)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert np.abs(np.asarray(want)).max() > 0


def test_several_weights_make_their_rows_in_the_kernel_too():
    rng = np.random.default_rng(11)
    x = jnp.asarray(rng.standard_normal((2, 512)) * [[1.0], [300.0]], jnp.bfloat16)
    weights = tuple(_random_nvfp4(rng, 2, n, 512)[1:] for n in (40, 100))
    options = {"block_n": 32, "block_k": 256, "programs": 5, "out_dtype": jnp.float32, "interpret": True}
    want = nvfp4_matmuls(x, weights, **options)
    got = nvfp4_matmuls(x, weights, x_rows="kernel", **options)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize(
    "m,n,k,tiles",
    [
        (1, 34816, 5120, {"variant": "gemv_ws", "block_n": 32, "block_k": 512, "num_warps": 8}),  # 27B gate_up
        (2, 100, 1552, {"variant": "gemv_ws", "block_n": 32, "block_k": 512}),  # masked N and K
        (1, 5120, 6144, {"variant": "gemv_w", "block_n": 32, "block_k": 512, "split_k": 2}),  # 27B o_proj
        (8, 5120, 17408, {"variant": "dot_jw", "block_n": 64, "block_k": 256, "split_k": 2, "block_m": 16}),
    ],
)
def test_rows_made_in_the_kernel_lower_for_cuda_with_nothing_before_it(m, n, k, tiles):
    """One Triton call, and x handed to it as given (no XLA op on x before the launch)."""
    fn = jax.jit(functools.partial(nvfp4_matmul, x_rows="kernel", **tiles))
    shapes = (
        jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
        jax.ShapeDtypeStruct((n, k // 2), jnp.uint8),
        jax.ShapeDtypeStruct((n, k // 16), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((), jnp.float32),
    )
    text = compat.lower_for_cuda(fn, *shapes)
    assert text.count("xla.gpu.triton") == 1 and f"nvfp4_matmul_{tiles['variant']}" in text
    jaxpr = jax.make_jaxpr(fn)(*shapes).jaxpr
    while not any(eq.primitive.name == "pallas_call" for eq in jaxpr.eqns):  # into the nested jits
        jaxpr = next(eq.params["jaxpr"] for eq in jaxpr.eqns if "jaxpr" in eq.params).jaxpr
    call = next(eq for eq in jaxpr.eqns if eq.primitive.name == "pallas_call")
    assert call.invars[0] is jaxpr.invars[0]


@pytest.mark.parametrize("variant", ["dot_w", "gemv_h2w_ws", "dot", "tiled_w"])
def test_rows_made_in_the_kernel_are_refused_where_the_kernel_cannot(variant):
    rng = np.random.default_rng(2)
    x, *w = _random_nvfp4(rng, 2, 64, 512)
    with pytest.raises(ValueError, match="x_rows='kernel' is for"):
        nvfp4_matmul(x, *w, variant=variant, block_k=256, x_rows="kernel", interpret=True)
    with pytest.raises(ValueError, match="x_rows='gpu' must be one of"):
        nvfp4_matmul(x, *w, variant="gemv_ws", x_rows="gpu", interpret=True)


def _made_rows(x, layout):
    x16, inverse = qc.f16_rows(x)
    return (qc.word_columns(x16) if layout == "columns" else h2.word_x_pairs(x16)), inverse


@pytest.mark.parametrize(
    "variant,m,tiles",
    [
        ("gemv_ws", 1, {"block_n": 32, "block_k": 256, "programs": 5}),
        ("gemv_h2w_ws", 1, {"block_n": 32, "block_k": 256, "programs": 3}),
        ("gemv_bs_ws", 2, {"block_n": 32, "block_k": 256, "programs": 3}),
        ("dot_ws", 3, {"block_n": 16, "block_k": 256, "programs": 4}),
        ("gemv_w", 2, {"block_n": 32, "block_k": 256, "split_k": 2}),
        ("dot_w", 5, {"block_n": 32, "block_k": 256, "block_m": 16}),
        ("dot_t_w", 3, {"block_n": 64, "block_k": 256}),
        ("tiled_w", 20, {"block_m": 16, "block_n": 32, "block_k": 256}),
    ],
)
def test_rows_made_before_the_call_equal_rows_made_from_x(variant, m, tiles):
    """x_words (a norm's launch made x's float16 rows in the formulation's layout): the same bits
    as the rows the call makes from x itself, with and without several weights in one launch."""
    rng = np.random.default_rng(m + len(variant))
    n, k = 72, 512
    _, packed, block_scale, tensor_scale = _random_nvfp4(rng, m, n, k)
    x = jnp.asarray(rng.standard_normal((m, k)) * np.resize([1.0, 3e3, 2e-3], m)[:, None], jnp.bfloat16)
    options = {"variant": variant, "out_dtype": jnp.float32, "interpret": True, **tiles}
    x_words = _made_rows(x, x_words_layout(variant))
    want = nvfp4_matmul(x, packed, block_scale, tensor_scale, **options)
    got = nvfp4_matmul(x, packed, block_scale, tensor_scale, x_words=x_words, **options)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    if variant in STREAMED_WORD_VARIANTS:
        weights = ((packed, block_scale, tensor_scale), _random_nvfp4(rng, m, 40, k)[1:])
        options.pop("block_m", None)
        want_all = nvfp4_matmuls(x, weights, **options)
        got_all = nvfp4_matmuls(x, weights, x_words=x_words, **options)
        for g, w in zip(got_all, want_all, strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_rows_made_before_the_call_leave_nothing_before_the_launch():
    fn = jax.jit(functools.partial(nvfp4_matmul, variant="gemv_ws", block_n=32, block_k=512))
    m, n, k = 1, 4096, 2048
    shapes = (
        jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
        jax.ShapeDtypeStruct((n, k // 2), jnp.uint8),
        jax.ShapeDtypeStruct((n, k // 16), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct((), jnp.float32),
        (jax.ShapeDtypeStruct((m, k), jnp.float16), jax.ShapeDtypeStruct((m,), jnp.float32)),
    )
    jaxpr = jax.make_jaxpr(lambda x, p, b, t, w: fn(x, p, b, t, x_words=w))(*shapes).jaxpr
    while not any(eq.primitive.name == "pallas_call" for eq in jaxpr.eqns):  # into the nested jits
        jaxpr = next(eq.params["jaxpr"] for eq in jaxpr.eqns if "jaxpr" in eq.params).jaxpr
    call = next(eq for eq in jaxpr.eqns if eq.primitive.name == "pallas_call")
    assert call.invars[0] is jaxpr.invars[4]  # the words go in as given


@pytest.mark.parametrize(
    "variant,layout_of_words,match",
    [
        ("dot_jw", "columns", "takes none"),
        ("gemv_h2_ws", "columns", "takes none"),
        ("gemv_ws", "pairs", "'columns' layout"),
        ("gemv_h2w_ws", "columns", "'pairs' layout"),
    ],
)
def test_rows_made_before_the_call_are_refused_in_the_wrong_layout(variant, layout_of_words, match):
    rng = np.random.default_rng(4)
    x, *w = _random_nvfp4(rng, 1, 64, 512)
    with pytest.raises(ValueError, match=match):
        nvfp4_matmul(x, *w, variant=variant, block_k=256, x_words=_made_rows(x, layout_of_words), interpret=True)


@pytest.mark.parametrize("rows, k", [(1, 64), (3, 2048)])
def test_word_x_pairs_holds_each_words_activation_pairs_bit_for_bit(rows, k):
    """Column p * K/8 + j of `word_x_pairs` is the float16 pair (x[8j + p], x[8j + p + 4]), low
    half first, bit for bit (signed zeros, infinities and NaNs included): the half2 gemvs read
    their operands from it (built from 16-bit halves, so XLA fuses it with the row scaling)."""
    rng = np.random.default_rng(k)
    x = (rng.standard_normal((rows, k)) * 1e3).astype(np.float16)
    x[0, :4] = [0.0, -0.0, np.inf, np.nan]
    got = np.asarray(h2.word_x_pairs(jnp.asarray(x)))
    bits = x.view(np.uint16).astype(np.uint32).reshape(rows, k // 8, 2, 4)  # [m, j, half, p]
    want = (bits[:, :, 0, :] | (bits[:, :, 1, :] << 16)).transpose(0, 2, 1).reshape(rows, k // 2)
    assert got.dtype == np.uint32
    np.testing.assert_array_equal(got, want)
