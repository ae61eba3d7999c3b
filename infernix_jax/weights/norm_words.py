"""The float16 word rows of an RMSNorm's output, their scale taken from the norm's input (XLA).

Before an NVFP4 word kernel, XLA makes its input's float16 rows (`_quant_common.f16_rows`): a
row-max reduce of the input, then a scale / convert / reorder fusion. Where the input is an
RMSNorm's output, the norm's own sum of squares is a reduce before that one, and the row max,
reading the norm's output, cannot start until it ends: three launches (norm, max, reorder). Here
the max is taken from the norm's input instead,

    max |rms_norm(x)| <= max |x * w'| * rsqrt(mean(x^2) + eps) * (1 + 2**-7)

(w' the weight as the style applies it: 1 + w or w; the margin covers the bfloat16 roundings of the
norm's output), so both reductions read x and XLA fuses them into one launch: two launches a norm.

The bound picks `f16_rows`' power of two or half of it (when a row's max lies within the margin
below a power of two): the rows' max |x| lands in [2**12, 2**14) instead of [2**13, 2**14), still far
inside float16's range, and scaling by a power of two keeps every bit of a bfloat16 value in
float16's normal range. So words * inverse is the norm's output exactly, as with `f16_rows`, and
a kernel's sums differ at most where float16 rounds a product differently at a different scale.

The GDN output norm (`gated_rms_norm_words`: each head's own 1/rms, times silu of the gate) takes
the max over heads of each head's bound; its reductions are two launches, its words one, where
XLA's norm, row max and words were three.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from infernix_jax.model.norm import gated_rms_norm, rms_norm
from pallas_kernels import _e2m1_half2 as h2
from pallas_kernels import _quant_common as qc

LAYOUTS = ("columns", "pairs")
MARGIN = 1.0 + 2.0**-7  # over the f32 bound: the norm output's two bfloat16 roundings (each <= 2**-9)
GATED_MARGIN = 1.0 + 2.0**-6  # three bfloat16 roundings in the gated output


def rms_norm_words(
    x: jax.Array, weight: jax.Array, *, eps: float, zero_centered: bool, layout: str
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x [M, K], weight [K] -> (normed [M, K] as `model.norm.rms_norm` gives it, words in `layout`
    ("columns": float16 [M, K] in `word_columns` order; "pairs": uint32 [M, K/2], `word_x_pairs`),
    inverse row factors [M] float32), the factors from the norm's input (module docstring)."""
    _check_layout(layout)
    xf = x.astype(jnp.float32)
    w = weight.astype(jnp.float32) + (1.0 if zero_centered else 0.0)
    # the sum of squares and the bound's max in one reduce: XLA could otherwise split them in two
    total, peak = jax.lax.reduce(
        (xf * xf, jnp.abs(xf * w)), (jnp.float32(0), jnp.float32(0)),
        lambda a, b: (a[0] + b[0], jnp.maximum(a[1], b[1])), (x.ndim - 1,),
    )  # fmt: skip
    mean_square = total / x.shape[-1]
    normed = rms_norm(x, weight, eps, zero_centered, mean_square=mean_square[..., None])
    bound = peak * jax.lax.rsqrt(mean_square + eps) * MARGIN
    return (normed, *_words(normed, bound, layout))


def gated_rms_norm_words(
    x: jax.Array, gate: jax.Array, weight: jax.Array, *, eps: float, layout: str
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The GDN output norm's form of `rms_norm_words`: x and gate [M, H * Dv], weight [Dv] ->
    (gated [M, H * Dv] as `model.norm.gated_rms_norm` gives it, words, inverse), the row factors
    from the bound max over heads h of rsqrt(mean(x_h^2) + eps) * max |x_h * w * silu(gate_h)|."""
    _check_layout(layout)
    m, k = x.shape
    d = weight.shape[0]
    heads = (m, k // d, d)
    gated = gated_rms_norm(x.reshape(heads), gate.reshape(heads), weight, eps).reshape(m, k)
    xf = x.reshape(heads).astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1) + eps)
    silu = jax.nn.silu(gate.reshape(heads).astype(jnp.float32))
    per_head = jnp.max(jnp.abs(xf * weight.astype(jnp.float32) * silu), axis=-1) * r
    bound = jnp.max(per_head, axis=-1) * GATED_MARGIN
    return (gated, *_words(gated, bound, layout))


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


def _words(values: jax.Array, bound: jax.Array, layout: str) -> tuple[jax.Array, jax.Array]:
    """(words, inverse) of rows [M, K] whose max |x| is at most bound [M] (within the margin)."""
    factor, inverse = qc.f16_row_factors(bound)
    # the values as rounded to their dtype: XLA may otherwise keep a fused producer's float32
    # (excess precision), and the words would not be the norm's output
    info = jnp.finfo(values.dtype)
    exact = jax.lax.reduce_precision(
        values.astype(jnp.float32), exponent_bits=info.nexp, mantissa_bits=info.nmant
    )
    x16 = (exact * factor[:, None]).astype(jnp.float16)
    return (qc.word_columns(x16) if layout == "columns" else h2.word_x_pairs(x16)), inverse
