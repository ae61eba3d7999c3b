"""An RMSNorm and the float16 word rows of its output in one launch, a Pallas GPU (Triton) kernel.

Before each NVFP4 word kernel, XLA makes the activation's float16 rows (`_quant_common.f16_rows`:
a row-max reduce, then a scale / convert / reorder fusion). Where that activation is an RMSNorm's
output (a decoder layer's input norm before its attention or GDN projections, its post-attention
norm before the MLP or the shared expert), the norm is one more launch before them: three small
launches of a few KB each, twice a layer (three times on a linear-attention layer, whose output
norm precedes its out_proj). Here one launch does all three.

For x [M, K] and the norm's weight [K]:

    normed  = rms_norm(x, weight)        [M, K]   (`model.norm.rms_norm`, both of Qwen's styles)
    words   = normed's float16 rows, each scaled by `f16_rows`' power of two, laid out as the word
              kernels read them:
                "columns": [M, K] float16 in `word_columns` order (gemv_ws, dot_w, dot_ws, ...)
                "pairs":   [M, K/2] uint32, `word_x_pairs` (the half2 word gemvs, gemv_h2w_ws ...)
    inverse = the rows' inverse factors  [M] float32

`gated_rms_norm_rows` does the same for the GDN output norm before a linear-attention layer's
out_proj (`model.norm.gated_rms_norm` of each Dv-column head, times silu of its gate): one head
a program, each head's 1/rms from its own columns. `swiglu_rows` makes the rows of an MLP's
SwiGLU, silu(gate) * up, for its down projection (the routed experts' grouped one), where XLA
spends two launches (the SwiGLU fused into a row-max reduce, then the scale / reorder).

The grid is blocks of `block_w` 8-column words. Every program takes the rows' sums of squares and
then the normed rows' max |x| over all of K (a few KB, from L2), and writes its own block: the
normed columns as they are, and the words by gathered loads in the layout's element order (no
register transposes). The arithmetic is the reference's except the order of the sum of squares,
so a row's norm factor may differ from XLA's by an ulp, as two XLA builds may; the words and the
inverse always follow from this kernel's own normed rows exactly as `f16_rows` would make them.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _e2m1_half2 as h2
from pallas_kernels import _quant_common as qc
from pallas_kernels import compat

LAYOUTS = ("columns", "pairs")
MAX_ROWS = 16  # decode rows; more rows are prefill, where the norm's launches do not matter
MAX_BLOCK_W = 32  # 8-column words a program writes
MAX_CHUNK = 512  # columns a step of the passes over K
DEFAULT_NUM_WARPS = 4


def _out_dtype(x: jax.Array, weight: jax.Array, zero_centered: bool):
    return x.dtype if zero_centered else jnp.result_type(weight.dtype, x.dtype)


def reference_rms_norm_rows(
    x: jax.Array, weight: jax.Array, *, eps: float, zero_centered: bool, layout: str = "columns"
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(normed, words, inverse) in plain JAX: `model.norm.rms_norm`, then `f16_rows` and the
    layout's reorder (`word_columns` or `word_x_pairs`) of the normed rows."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if zero_centered:
        normed = (normed * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)
    else:  # as transformers' Qwen3RMSNorm: back to x's dtype before the weight
        normed = weight * normed.astype(x.dtype)
    return (normed, *_reference_words(normed, layout))


def _reference_words(values: jax.Array, layout: str) -> tuple[jax.Array, jax.Array]:
    """(words, inverse) of an activation as the word kernels' own preparation makes them:
    `f16_rows`, then the layout's reorder (`word_columns` or `word_x_pairs`)."""
    x16, inverse = qc.f16_rows(values)
    return qc.word_columns(x16) if layout == "columns" else h2.word_x_pairs(x16), inverse


def _whole_row_tiles(k: int) -> tuple[int, int]:
    """(block_w, chunk) of a whole-row form: the largest power-of-two word blocks dividing K / 8
    (at most MAX_BLOCK_W) and passes over K in power-of-two chunks dividing K (at most MAX_CHUNK)."""
    words_k = k // 8
    return min(MAX_BLOCK_W, words_k & -words_k), min(MAX_CHUNK, k & -k)


def _normed(tile, w, r, *, zero_centered: bool, in_dtype, out_dtype):
    """The reference's norm of a tile of rows (float32 values, r [rows] the rows' 1/rms) with its
    weight tile w broadcast against it: values of out_dtype (returned as float32)."""
    normed = tile * r
    if zero_centered:
        return (normed * (1.0 + w)).astype(out_dtype).astype(jnp.float32)
    product = w * normed.astype(in_dtype).astype(jnp.float32)  # exact in float32: rounded once below
    return product.astype(out_dtype).astype(jnp.float32)


def _swiglu(gate, up, dtype):
    """silu(gate) * up as the model computes it in `dtype`, float32 values: jax's sigmoid is
    1 / (1 + exp(-x)) in the input's dtype, so every op is rounded to it."""

    def rounded(v):
        return v.astype(dtype).astype(jnp.float32)

    sigmoid = rounded(1.0 / rounded(1.0 + rounded(jnp.exp(-gate))))
    return rounded(rounded(gate * sigmoid) * up)


def _norm_rows_kernel(
    *refs, m: int, k: int, eps: float, zero_centered: bool, layout: str, block_w: int, chunk: int,
    head: int, weight_dtype, swiglu: bool = False,
):  # fmt: skip
    """head > 0: the gated norm of `head`-column groups (x, gate, weight [head]), one group a
    program; head == 0: the plain norm of whole rows (x, weight [K]); swiglu: no norm, the
    SwiGLU of whole rows (gate as x, up as g, no weight)."""
    if swiglu:
        (x_ref, g_ref, normed_ref, words_ref, inverse_ref), w_ref = refs, None
    elif head:
        x_ref, g_ref, w_ref, normed_ref, words_ref, inverse_ref = refs
    else:
        (x_ref, w_ref, normed_ref, words_ref, inverse_ref), g_ref = refs, None
    m_pad = compat.pow2_at_least(m)
    rows = jnp.arange(m_pad, dtype=jnp.int32)
    row_ok = rows < m
    in_dtype, out_dtype = x_ref.dtype, normed_ref.dtype
    steps = k // chunk
    tile_ok = jnp.broadcast_to(row_ok[:, None], (m_pad, chunk))

    def value(t, w, g, r):
        """The activation (float32 values of out_dtype) at loaded x, weight and gate tiles."""
        if swiglu:
            return _swiglu(t, g, out_dtype)
        if not head:
            return _normed(t, w, r, zero_centered=zero_centered, in_dtype=in_dtype, out_dtype=out_dtype)
        out = (w * (t * r).astype(in_dtype).astype(jnp.float32)).astype(jnp.result_type(weight_dtype, in_dtype))
        gated = out.astype(jnp.float32) * (g * jax.nn.sigmoid(g))
        return gated.astype(out_dtype).astype(jnp.float32)

    def chunk_of(ref, i):
        return compat.load(ref.at[compat.ds(0, m_pad), compat.ds(i * chunk, chunk)], mask=tile_ok, other=0).astype(
            jnp.float32
        )

    def w_chunk(i):
        if swiglu:
            return None
        return compat.load(w_ref.at[compat.ds(0 if head else i * chunk, chunk)]).astype(jnp.float32)[None, :]

    def rsqrt_mean(sums, n):
        return jax.lax.rsqrt(sums / n + eps)[:, None]

    if swiglu:  # no norm: one pass for the rows' max
        def row_max(i, running):
            return jnp.maximum(running, jnp.abs(value(chunk_of(x_ref, i), None, chunk_of(g_ref, i), None)))

        r = None
    elif head:  # one pass: each head's 1/rms from its own chunk
        def row_max(i, running):
            t = chunk_of(x_ref, i)
            r = rsqrt_mean(jnp.sum(t * t, axis=1), head)
            return jnp.maximum(running, jnp.abs(value(t, w_chunk(i), chunk_of(g_ref, i), r)))

        r = None
    else:
        def squares(i, acc):  # elementwise: one reduction after the loop
            t = chunk_of(x_ref, i)
            return acc + t * t

        r = rsqrt_mean(jnp.sum(jax.lax.fori_loop(0, steps, squares, jnp.zeros((m_pad, chunk), jnp.float32)), axis=1), k)

        def row_max(i, running):
            return jnp.maximum(running, jnp.abs(value(chunk_of(x_ref, i), w_chunk(i), None, r)))

    running = jax.lax.fori_loop(0, steps, row_max, jnp.zeros((m_pad, chunk), jnp.float32))
    factor, inverse = qc.f16_row_factors(jnp.max(running, axis=1))
    block = compat.program_id(0)
    w0 = block * block_w

    # the activation's own columns, as they are (gated: the program's head, whose 1/rms this is)
    c0 = 8 * w0
    ok = jnp.broadcast_to(row_ok[:, None], (m_pad, 8 * block_w))
    t = compat.load(x_ref.at[compat.ds(0, m_pad), compat.ds(c0, 8 * block_w)], mask=ok, other=0).astype(jnp.float32)
    w = None if swiglu else compat.load(w_ref.at[compat.ds(0 if head else c0, 8 * block_w)]).astype(jnp.float32)[None, :]
    g = None
    if head or swiglu:
        g = compat.load(g_ref.at[compat.ds(0, m_pad), compat.ds(c0, 8 * block_w)], mask=ok, other=0)
        g = g.astype(jnp.float32)
    if head:
        r = rsqrt_mean(jnp.sum(t * t, axis=1), head)
    own = value(t, w, g, r)
    compat.store(normed_ref.at[compat.ds(0, m_pad), compat.ds(c0, 8 * block_w)], own.astype(out_dtype), mask=ok)

    def words_at(col):
        """Scaled float16 values of the activation at columns `col` (any shape, broadcast against
        the rows on a new leading axis)."""
        lead = (m_pad,) + (1,) * col.ndim
        mask = jnp.broadcast_to(row_ok.reshape(lead), (m_pad, *col.shape))
        t = compat.load(x_ref.at[rows.reshape(lead), col[None]], mask=mask, other=0).astype(jnp.float32)
        w = None if swiglu else compat.load(w_ref.at[col % head if head else col]).astype(jnp.float32)[None]
        g = None
        if head or swiglu:
            g = compat.load(g_ref.at[rows.reshape(lead), col[None]], mask=mask, other=0).astype(jnp.float32)
        r_rows = None if r is None else r.reshape(lead)
        return (value(t, w, g, r_rows) * factor.reshape(lead)).astype(jnp.float16), mask

    j = w0 + jnp.arange(block_w, dtype=jnp.int32)
    if layout == "columns":  # [m, p, j] = element p of word j: words_ref is the [M, 8, K/8] view
        col = 8 * j[None, :] + jnp.arange(8, dtype=jnp.int32)[:, None]
        x16, mask = words_at(col)
        compat.store(words_ref.at[compat.ds(0, m_pad), compat.ds(0, 8), compat.ds(w0, block_w)], x16, mask=mask)
    else:  # [m, p, j] = the pair (element p, element p + 4) of word j, low half first: [M, 4, K/8]
        col = 8 * j[None, :] + jnp.arange(4, dtype=jnp.int32)[:, None]
        low, mask = words_at(col)
        high, _ = words_at(col + 4)
        bits = [jax.lax.bitcast_convert_type(h, jnp.uint16).astype(jnp.uint32) for h in (low, high)]
        pairs = bits[0] | jax.lax.shift_left(bits[1], jnp.uint32(16))
        compat.store(words_ref.at[compat.ds(0, m_pad), compat.ds(0, 4), compat.ds(w0, block_w)], pairs, mask=mask)

    @compat.when(block == 0)
    def _():
        compat.store(inverse_ref.at[compat.ds(0, m_pad)], inverse, mask=row_ok)


def supports(rows: int, k: int) -> bool:
    """Whether the kernel takes `rows` rows of K = `k` columns (whole 8-column words)."""
    return 1 <= rows <= MAX_ROWS and k % 8 == 0 and k >= 8


def validate_rms_norm_rows(x: jax.Array, weight: jax.Array, layout: str) -> None:
    if x.ndim != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"x must be [M, K] and weight [K]; got {x.shape} and {weight.shape}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
    if not supports(*x.shape):
        raise ValueError(f"the norm-rows kernel takes 1-{MAX_ROWS} rows of K divisible by 8; got {x.shape}")


@functools.partial(jax.jit, static_argnames=("eps", "zero_centered", "layout", "num_warps", "interpret"))
def rms_norm_rows(
    x: jax.Array,
    weight: jax.Array,
    *,
    eps: float,
    zero_centered: bool,
    layout: str = "columns",
    num_warps: int = DEFAULT_NUM_WARPS,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`reference_rms_norm_rows` in one launch (see the module docstring); the same outputs."""
    validate_rms_norm_rows(x, weight, layout)
    m, k = x.shape
    block_w, chunk = _whole_row_tiles(k)
    kernel = functools.partial(
        _norm_rows_kernel, m=m, k=k, eps=float(eps), zero_centered=zero_centered, layout=layout,
        block_w=block_w, chunk=chunk, head=0, weight_dtype=weight.dtype,
    )  # fmt: skip
    out_dtype = _out_dtype(x, weight, zero_centered)
    return _call(kernel, (x, weight), m, k, block_w, out_dtype, layout, num_warps, interpret, "rms_norm_rows")


def _call(kernel, operands, m, k, block_w, out_dtype, layout, num_warps, interpret, name):
    words_k = k // 8
    words_shape = (m, 8, words_k) if layout == "columns" else (m, 4, words_k)
    words_dtype = jnp.float16 if layout == "columns" else jnp.uint32
    normed, words, inverse = compat.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct((m, k), out_dtype),
            jax.ShapeDtypeStruct(words_shape, words_dtype),
            jax.ShapeDtypeStruct((m,), jnp.float32),
        ),
        grid=(words_k // block_w,),
        compiler_params=compat.triton_compiler_params(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name=name,
    )(*operands)
    return normed, words.reshape(m, k if layout == "columns" else k // 2), inverse


def reference_gated_rms_norm_rows(
    x: jax.Array, gate: jax.Array, weight: jax.Array, *, eps: float, layout: str = "columns"
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(gated, words, inverse) in plain JAX for x and gate [M, H * Dv] and weight [Dv]:
    `model.norm.gated_rms_norm` of each Dv-column head (the GDN output norm), then `f16_rows` and
    the layout's reorder of the [M, H * Dv] result."""
    m, k = x.shape
    d = weight.shape[0]
    xf = x.reshape(m, k // d, d).astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    out = weight * normed.astype(x.dtype)
    gated = (out.astype(jnp.float32) * jax.nn.silu(gate.reshape(xf.shape).astype(jnp.float32))).astype(x.dtype)
    gated = gated.reshape(m, k)
    return (gated, *_reference_words(gated, layout))


def supports_gated(rows: int, k: int, head_dim: int) -> bool:
    """Whether the gated kernel takes `rows` rows of K = `k` columns in heads of `head_dim`: one head a
    program, so head_dim / 8 words must be a power of two."""
    words = head_dim // 8
    return supports(rows, k) and head_dim % 8 == 0 and words & (words - 1) == 0 and k % head_dim == 0


@functools.partial(jax.jit, static_argnames=("eps", "layout", "num_warps", "interpret"))
def gated_rms_norm_rows(
    x: jax.Array,
    gate: jax.Array,
    weight: jax.Array,
    *,
    eps: float,
    layout: str = "columns",
    num_warps: int = DEFAULT_NUM_WARPS,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`reference_gated_rms_norm_rows` in one launch: the GDN output norm of each head, gated, and the
    float16 rows of the result for the output projection's word kernel."""
    if x.ndim != 2 or gate.shape != x.shape or weight.ndim != 1:
        raise ValueError(f"x and gate must be [M, H * Dv] and weight [Dv]; got {x.shape}, {gate.shape}, {weight.shape}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
    m, k = x.shape
    head = weight.shape[0]
    if not supports_gated(m, k, head):
        raise ValueError(
            f"the gated norm-rows kernel takes 1-{MAX_ROWS} rows of heads of a multiple of 8 columns "
            f"(a power-of-two count of words); got x {x.shape}, heads of {head}"
        )
    kernel = functools.partial(
        _norm_rows_kernel, m=m, k=k, eps=float(eps), zero_centered=False, layout=layout, block_w=head // 8,
        chunk=head, head=head, weight_dtype=weight.dtype,
    )  # fmt: skip
    return _call(kernel, (x, gate, weight), m, k, head // 8, x.dtype, layout, num_warps, interpret, "gated_rms_norm_rows")


def reference_swiglu_rows(gate: jax.Array, up: jax.Array, *, layout: str = "columns") -> tuple[jax.Array, ...]:
    """(h, words, inverse) in plain JAX for gate and up [M, I]: h = silu(gate) * up as `model.mlp`
    computes it, then `f16_rows` and the layout's reorder of h."""
    h = jax.nn.silu(gate) * up
    return (h, *_reference_words(h, layout))


@functools.partial(jax.jit, static_argnames=("layout", "num_warps", "interpret"))
def swiglu_rows(
    gate: jax.Array,
    up: jax.Array,
    *,
    layout: str = "columns",
    num_warps: int = DEFAULT_NUM_WARPS,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`reference_swiglu_rows` in one launch: an MLP's SwiGLU and the float16 rows of it that its
    down projection's word kernel reads."""
    if gate.ndim != 2 or up.shape != gate.shape or up.dtype != gate.dtype:
        raise ValueError(f"gate and up must be [M, I] of one dtype; got {gate.dtype} {gate.shape}, {up.dtype} {up.shape}")
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}; got {layout!r}")
    if not supports(*gate.shape):
        raise ValueError(f"the SwiGLU-rows kernel takes 1-{MAX_ROWS} rows of I divisible by 8; got {gate.shape}")
    m, k = gate.shape
    block_w, chunk = _whole_row_tiles(k)
    kernel = functools.partial(
        _norm_rows_kernel, m=m, k=k, eps=0.0, zero_centered=False, layout=layout, block_w=block_w, chunk=chunk,
        head=0, weight_dtype=gate.dtype, swiglu=True,
    )  # fmt: skip
    return _call(kernel, (gate, up), m, k, block_w, gate.dtype, layout, num_warps, interpret, "swiglu_rows")
