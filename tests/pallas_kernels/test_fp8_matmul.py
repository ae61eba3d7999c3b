"""The FP8 decode and prefill kernels equal its float32 reference (interpret mode) and lowers to Triton."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels import _quant_common as qc
from pallas_kernels import compat
from pallas_kernels.fp8_matmul import DECODE_VARIANTS, DEFAULT_CONFIGS, fp8_matmul, reference_fp8_matmul


def _random_fp8(rng, m, n, k, block_size):
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((n, k)) * 16, jnp.float8_e4m3fn)
    if block_size is None:
        scale = jnp.float32(rng.uniform(0.001, 0.1))
    else:
        scale = jnp.asarray(rng.uniform(0.001, 0.1, (-(-n // block_size), -(-k // block_size))), jnp.float32)
    return x, w, scale


@pytest.mark.parametrize(
    "m,n,k,block_size,tiles",
    [
        (1, 64, 256, None, {"block_n": 64, "block_k": 128}),
        (3, 70, 96, None, {"block_n": 32, "block_k": 32}),  # ragged N and K
        (5, 300, 260, 128, {"block_n": 64, "block_k": 128, "split_k": 2}),  # ragged scale blocks
        (8, 33, 48, 32, {"block_n": 16, "block_k": 16, "split_k": 4}),  # idle split tail
    ],
)
@pytest.mark.parametrize("variant", DECODE_VARIANTS)
def test_kernel_matches_reference(variant, m, n, k, block_size, tiles):
    rng = np.random.default_rng(m * 1000 + n + k)
    if qc.is_streamed(variant):  # its programs share K themselves: a few, so runs cross tiles
        tiles = {**{t: v for t, v in tiles.items() if t != "split_k"}, "programs": 3}
    x, w, scale = _random_fp8(rng, m, n, k, block_size)
    got = fp8_matmul(
        x, w, scale, block_size=block_size, variant=variant, out_dtype=jnp.float32, interpret=True, **tiles
    )
    want = reference_fp8_matmul(x, w, scale, block_size=block_size)
    assert got.shape == (m, n)
    np.testing.assert_allclose(
        np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4 * float(jnp.abs(want).max())
    )


@pytest.mark.parametrize("m,block_size", [(16, None), (17, 32)])
def test_dot_formulations_take_more_than_one_row_tile(m, block_size):
    x, w, scale = _random_fp8(np.random.default_rng(m), m, 40, 96, block_size)
    want = reference_fp8_matmul(x, w, scale, block_size=block_size)
    for variant in ("dot", "dot_t"):
        got = fp8_matmul(
            x,
            w,
            scale,
            block_size=block_size,
            variant=variant,
            block_n=16,
            block_k=32,
            out_dtype=jnp.float32,
            interpret=True,
        )
        np.testing.assert_allclose(
            np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4 * float(jnp.abs(want).max())
        )


def _shapes(m, n, k, block_size):
    scale_shape = () if block_size is None else (-(-n // block_size), -(-k // block_size))
    return (
        jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
        jax.ShapeDtypeStruct((n, k), jnp.float8_e4m3fn),
        jax.ShapeDtypeStruct(scale_shape, jnp.float32),
    )


@pytest.mark.parametrize("variant", DECODE_VARIANTS)
@pytest.mark.parametrize("n,k,block_size", [(384, 512, None), (384, 512, 128), (100, 1000, None)])
def test_kernel_lowers_to_a_triton_call_for_cuda(variant, n, k, block_size):
    split_k = 1 if qc.is_streamed(variant) else 2
    fn = jax.jit(functools.partial(fp8_matmul, block_size=block_size, variant=variant, split_k=split_k))
    text = compat.lower_for_cuda(fn, *_shapes(4, n, k, block_size))
    assert "xla.gpu.triton" in text and f"fp8_matmul_{variant}" in text


@pytest.mark.parametrize("m", [1, 8, 16])
def test_default_formulation_comes_from_the_table_by_m(m):
    want = qc.pick_config(DEFAULT_CONFIGS, m).variant
    assert f"fp8_matmul_{want}" in compat.lower_for_cuda(fp8_matmul, *_shapes(m, 256, 512, None))


def test_default_tiles_fit_inside_small_scale_blocks():
    x, w, scale = _random_fp8(np.random.default_rng(5), 2, 40, 96, 32)
    got = fp8_matmul(x, w, scale, block_size=32, out_dtype=jnp.float32, interpret=True)
    want = reference_fp8_matmul(x, w, scale, block_size=32)
    np.testing.assert_allclose(
        np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4 * float(jnp.abs(want).max())
    )


@pytest.mark.parametrize(
    "change,match",
    [
        ({"w": jnp.zeros((32, 64), jnp.bfloat16)}, "w must be float8_e4m3fn"),
        ({"w": jnp.zeros((32, 48), jnp.float8_e4m3fn)}, "x has K=64"),
        ({"scale": jnp.ones((2,), jnp.float32)}, "per-tensor scale must be a scalar"),
        ({"block_size": 32, "scale": jnp.ones((2, 2), jnp.float32)}, r"got \(2, 2\)"),
        (
            {"block_size": 32, "scale": jnp.ones((1, 2), jnp.float32), "tiles": {"block_n": 64}},
            "block_n=64 must divide",
        ),
        ({"tiles": {"block_k": 24}}, "block_k=24"),
        ({"tiles": {"variant": "gemv"}, "x": jnp.ones((9, 64), jnp.bfloat16)}, "M <= 8"),
    ],
)
def test_rejects_bad_inputs_naming_the_value(change, match):
    x, w, scale = _random_fp8(np.random.default_rng(3), 2, 32, 64, None)
    kwargs = {"x": x, "w": w, "scale": scale}
    change = dict(change)
    tiles = change.pop("tiles", {})
    kwargs.update(change)
    with pytest.raises(ValueError, match=match):
        fp8_matmul(**kwargs, interpret=True, **tiles)


# Prefill ("tiled"): ragged M / N / K, block scales with tiles inside and across scale blocks.
TILED_CASES = [
    (65, 70, 96, None, {"block_m": 32, "block_n": 32, "block_k": 32, "group_m": 2}),
    (200, 130, 160, 32, {"block_m": 64, "block_n": 16, "block_k": 32, "group_m": 3}),  # tile inside a block
    (256, 100, 96, 32, {"block_m": 64, "block_n": 64, "block_k": 32}),  # tile spans 2 scale rows, ragged
    (256, 128, 256, None, {"block_m": 64, "block_n": 64, "block_k": 128}),  # no masks
]


@pytest.mark.parametrize("m,n,k,block_size,tiles", TILED_CASES)
def test_tiled_formulation_matches_reference(m, n, k, block_size, tiles):
    x, w, scale = _random_fp8(np.random.default_rng(m + n + k), m, n, k, block_size)
    got = fp8_matmul(
        x, w, scale, block_size=block_size, variant="tiled", out_dtype=jnp.float32, interpret=True, **tiles
    )
    want = reference_fp8_matmul(x, w, scale, block_size=block_size)
    assert got.shape == (m, n)
    np.testing.assert_allclose(
        np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-4 * float(jnp.abs(want).max())
    )


def test_tiled_is_the_default_past_the_decode_table():
    assert qc.pick_config(DEFAULT_CONFIGS, 65).variant == "tiled"
    assert "fp8_matmul_tiled" in compat.lower_for_cuda(fp8_matmul, *_shapes(4096, 256, 512, None))


@pytest.mark.parametrize(
    "m,n,k,block_size,block_m,block_n,block_k",
    [
        (4096, 384, 1024, None, 256, 256, 128),
        (4096, 384, 1024, 128, 128, 256, 128),  # a tile spans two scale rows
        (1000, 300, 1000, 128, 128, 128, 64),  # ragged everywhere
    ],
)
def test_tiled_large_tiles_lower_to_a_triton_call_for_cuda(m, n, k, block_size, block_m, block_n, block_k):
    fn = jax.jit(
        functools.partial(
            fp8_matmul,
            block_size=block_size,
            variant="tiled",
            block_m=block_m,
            block_n=block_n,
            block_k=block_k,
        )
    )
    text = compat.lower_for_cuda(fn, *_shapes(m, n, k, block_size))
    assert "xla.gpu.triton" in text and "fp8_matmul_tiled" in text


def test_tiled_rejects_a_block_n_that_straddles_scale_blocks_unevenly():
    x, w, scale = _random_fp8(np.random.default_rng(9), 65, 96, 64, 32)
    with pytest.raises(ValueError, match="block_k=64 must divide"):
        fp8_matmul(x, w, scale, block_size=32, variant="tiled", block_n=32, block_k=64, interpret=True)
    x, w, scale = _random_fp8(np.random.default_rng(9), 65, 96, 96, 48)
    with pytest.raises(ValueError, match="block_n=32 must divide"):
        fp8_matmul(x, w, scale, block_size=48, variant="tiled", block_n=32, block_k=16, interpret=True)
