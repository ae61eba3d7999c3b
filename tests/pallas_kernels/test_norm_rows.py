"""The RMSNorm-and-word-rows kernel (one launch from a layer's residual to the float16 rows an
NVFP4 word kernel reads) equals its plain-JAX reference bit for bit in interpret mode, in both of
Qwen's norm styles and both word layouts; the reference is the model's norm followed by the word
kernels' own row preparation; it refuses what it cannot take; it lowers to one Triton call. The
same holds for its SwiGLU form (the rows of silu(gate) * up for a down projection)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infernix_jax.model.norm import gated_rms_norm, rms_norm
from pallas_kernels import _e2m1_half2 as h2
from pallas_kernels import _quant_common as qc
from pallas_kernels import compat
from pallas_kernels.norm_rows import (
    MAX_ROWS,
    gated_rms_norm_rows,
    reference_gated_rms_norm_rows,
    reference_rms_norm_rows,
    reference_swiglu_rows,
    rms_norm_rows,
    swiglu_rows,
)


def _inputs(m: int, k: int, weight_dtype=jnp.bfloat16, scale: float = 7.0):
    x = jax.random.normal(jax.random.PRNGKey(m * 1000 + k), (m, k), jnp.bfloat16) * scale
    w = (jax.random.normal(jax.random.PRNGKey(k), (k,), jnp.float32) * 0.3).astype(weight_dtype)
    return x, w


def _same_bits(a, b, name):
    assert a.shape == b.shape and a.dtype == b.dtype, name
    np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8), err_msg=name)


@pytest.mark.parametrize(
    "m,k,zero_centered,layout",
    [
        (1, 2048, True, "columns"),  # the 80B-A3B's norms at one token
        (1, 5120, True, "pairs"),  # the 27B's, its projections on the half2 word gemv
        (3, 96, False, "columns"),  # Qwen3's style: back to x's dtype before the weight
        (5, 136, False, "pairs"),  # K / 8 = 17 words: one word a program
        (16, 64, True, "columns"),
    ],
)
def test_kernel_equals_the_reference(m, k, zero_centered, layout):
    x, w = _inputs(m, k)
    want = reference_rms_norm_rows(x, w, eps=1e-6, zero_centered=zero_centered, layout=layout)
    got = rms_norm_rows(x, w, eps=1e-6, zero_centered=zero_centered, layout=layout, interpret=True)
    for name, a, b in zip(("normed", "words", "inverse"), want, got, strict=True):
        _same_bits(b, a, name)


def test_a_float32_weight_gives_float32_rows_as_the_model_norm_does():
    x, w = _inputs(2, 64, weight_dtype=jnp.float32)
    normed, _, _ = rms_norm_rows(x, w, eps=1e-6, zero_centered=False, interpret=True)
    _same_bits(normed, rms_norm(x, w, 1e-6, False), "normed")


def test_rows_far_apart_in_size_each_get_their_own_factor():
    x, w = _inputs(4, 128)
    x = x * jnp.asarray([1e-3, 1.0, 1e3, 0.0], jnp.bfloat16)[:, None]  # a zero row included
    want = reference_rms_norm_rows(x, w, eps=1e-6, zero_centered=True)
    got = rms_norm_rows(x, w, eps=1e-6, zero_centered=True, interpret=True)
    for name, a, b in zip(("normed", "words", "inverse"), want, got, strict=True):
        _same_bits(b, a, name)
    assert np.all(np.isfinite(np.asarray(got[1], np.float32)))


@pytest.mark.parametrize("zero_centered", [True, False])
def test_reference_is_the_model_norm_then_the_word_kernels_rows(zero_centered):
    x, w = _inputs(3, 64)
    normed, columns, inverse = reference_rms_norm_rows(x, w, eps=1e-5, zero_centered=zero_centered)
    _, pairs, _ = reference_rms_norm_rows(x, w, eps=1e-5, zero_centered=zero_centered, layout="pairs")
    _same_bits(normed, rms_norm(x, w, 1e-5, zero_centered), "normed")
    x16, want_inverse = qc.f16_rows(normed)
    _same_bits(columns, qc.word_columns(x16), "columns")
    _same_bits(pairs, h2.word_x_pairs(x16), "pairs")
    _same_bits(inverse, want_inverse, "inverse")


@pytest.mark.parametrize(
    "shape,weight,layout,match",
    [
        ((MAX_ROWS + 1, 64), (64,), "columns", "rows"),
        ((2, 60), (60,), "columns", "divisible by 8"),
        ((2, 64), (32,), "columns", "weight"),
        ((2, 64), (64,), "rows", "layout"),
    ],
)
def test_refuses_what_it_cannot_take(shape, weight, layout, match):
    with pytest.raises(ValueError, match=match):
        rms_norm_rows(
            jnp.zeros(shape, jnp.bfloat16), jnp.ones(weight, jnp.bfloat16), eps=1e-6, zero_centered=True,
            layout=layout, interpret=True,
        )  # fmt: skip


@pytest.mark.parametrize("layout", ["columns", "pairs"])
def test_lowers_to_one_triton_call(layout):
    def fn(x, w):
        return rms_norm_rows(x, w, eps=1e-6, zero_centered=True, layout=layout)

    shapes = (jax.ShapeDtypeStruct((8, 2048), jnp.bfloat16), jax.ShapeDtypeStruct((2048,), jnp.bfloat16))
    assert compat.lower_for_cuda(jax.jit(fn), *shapes).count("xla.gpu.triton") == 1


@pytest.mark.parametrize(
    "m,heads,head_dim,layout,weight_dtype",
    [
        (1, 32, 128, "columns", jnp.bfloat16),  # the 80B-A3B's GDN output (out_proj K = 4096)
        (1, 48, 128, "pairs", jnp.bfloat16),  # the 27B's (K = 6144)
        (3, 4, 16, "columns", jnp.float32),  # a float32 weight: float32 before the gate, as the model
        (16, 2, 64, "pairs", jnp.bfloat16),
    ],
)
def test_gated_kernel_equals_the_reference_and_the_model_norm(m, heads, head_dim, layout, weight_dtype):
    k = heads * head_dim
    rng = np.random.default_rng(k + m)
    x = jnp.asarray(rng.standard_normal((m, k)) * 3, jnp.bfloat16)
    gate = jnp.asarray(rng.standard_normal((m, k)) * 2, jnp.bfloat16)
    w = jnp.asarray(1 + 0.3 * rng.standard_normal(head_dim), weight_dtype)
    want = reference_gated_rms_norm_rows(x, gate, w, eps=1e-6, layout=layout)
    got = gated_rms_norm_rows(x, gate, w, eps=1e-6, layout=layout, interpret=True)
    for name, a, b in zip(("gated", "words", "inverse"), want, got, strict=True):
        _same_bits(b, a, name)
    model = gated_rms_norm(x.reshape(m, heads, head_dim), gate.reshape(m, heads, head_dim), w, 1e-6)
    _same_bits(want[0], model.reshape(m, k), "model")


@pytest.mark.parametrize("shape,head_dim,match", [((1, 96), 24, "power-of-two"), ((1, 100), 20, "multiple of 8")])
def test_gated_kernel_refuses_heads_it_cannot_split(shape, head_dim, match):
    x = jnp.zeros(shape, jnp.bfloat16)
    with pytest.raises(ValueError, match=match):
        gated_rms_norm_rows(x, x, jnp.ones(head_dim, jnp.bfloat16), eps=1e-6, interpret=True)


def test_gated_kernel_lowers_to_one_triton_call():
    def fn(x, gate, w):
        return gated_rms_norm_rows(x, gate, w, eps=1e-6, layout="columns")

    rows = jax.ShapeDtypeStruct((1, 4096), jnp.bfloat16)
    shapes = (rows, rows, jax.ShapeDtypeStruct((128,), jnp.bfloat16))
    assert compat.lower_for_cuda(jax.jit(fn), *shapes).count("xla.gpu.triton") == 1


@pytest.mark.parametrize(
    "m,k,layout",
    [
        (10, 512, "columns"),  # the 80B-A3B's routed experts at one token (10 pairs, I = 512)
        (1, 17408, "pairs"),  # a 27B MLP's down projection input
        (16, 64, "columns"),
        (3, 136, "pairs"),  # 17 words: one word a program
    ],
)
def test_swiglu_kernel_equals_the_reference_and_the_model_mlp(m, k, layout):
    rng = np.random.default_rng(m * k)
    gate = jnp.asarray(rng.standard_normal((m, k)) * 3, jnp.bfloat16)
    up = jnp.asarray(rng.standard_normal((m, k)) * 3, jnp.bfloat16)
    up = up.at[m // 2].set(0)  # a zero row keeps a factor of its own
    want = reference_swiglu_rows(gate, up, layout=layout)
    got = swiglu_rows(gate, up, layout=layout, interpret=True)
    for name, a, b in zip(("h", "words", "inverse"), want, got, strict=True):
        _same_bits(b, a, name)
    _same_bits(want[0], jax.jit(lambda g, u: jax.nn.silu(g) * u)(gate, up), "model")  # as model.mlp computes it


def test_swiglu_kernel_refuses_what_it_cannot_take():
    with pytest.raises(ValueError, match="rows"):
        swiglu_rows(jnp.zeros((MAX_ROWS + 1, 64), jnp.bfloat16), jnp.zeros((MAX_ROWS + 1, 64), jnp.bfloat16))
    with pytest.raises(ValueError, match="one dtype"):
        swiglu_rows(jnp.zeros((2, 64), jnp.bfloat16), jnp.zeros((2, 64), jnp.float32))


def test_swiglu_kernel_lowers_to_one_triton_call():
    rows = jax.ShapeDtypeStruct((10, 512), jnp.bfloat16)
    assert compat.lower_for_cuda(jax.jit(swiglu_rows), rows, rows).count("xla.gpu.triton") == 1
