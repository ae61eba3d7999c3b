"""Causal prefill flash attention over a paged KV prefix: a Pallas GPU (Triton) kernel.

A chunk of T new tokens per batch row, at positions [B, T], attends causally to everything the
row holds before it in its pages plus itself (the chunk's own K/V already written there, as
`PagedKV.attend` runs after `PagedKV.write`):

    out[b, t, h] = softmax(q[b, t, h] . K[b, :p+1, k]^T * scale) V[b, :p+1, k],
                   p = positions[b, t],  k = h // (H / K)

Positions < 0 (padding) give zeros. The KV layout is the decode kernel's (paged_attention.py,
docs/kv_cache.md): k_pages / v_pages [N, 64, K, Dh], token p of row b at
(block_table[b, p // 64], p % 64); int8 / fp8 pages carry per-token k_scales / v_scales [N, 64, K].

Prefill is compute-bound (every K/V tile meets block_q queries), so the kernel is a flash
attention forward built for tensor cores:

* Grid (H, query tiles, B): one program per q head and `block_q` queries of one row. Heads are
  the fastest grid axis, so the G = H / K programs sharing a KV head run side by side and read
  its K/V tiles through L2 rather than HBM; query tiles run last-first (the longest loops start
  first, the causal triangle's short ones fill the tail).
* Each program loops over KV steps of `block_kv` tokens from position 0 up to its last query's
  position (tiles past it are skipped, not masked). The steps below the tile's first query
  position need no causal mask and run in a mask-free loop; only the diagonal steps mask. A step
  of 128 or 256 tokens spans whole 64-token pages, one sub-tile a page (a step of 16 or 32 stays
  inside one page); the scores of all sub-tiles share one running-max update.
* Online softmax in float32; Q.K^T and P.V as `lax.dot_general` in bf16 (or the wider dtype of q
  and unscaled pages) with float32 accumulation.
* Quantized pages are only cast (int8 and e4m3 values are exact in bf16); the K scale multiplies
  the score columns, the V scale the probabilities before P.V, as in the decode kernel.
* `qk_int8=True` (Infernix's INT8 prompt attention): q is quantized per (token, head) and k per
  token (int8 pages as stored; bf16 / fp8 tiles are quantized in the kernel) to int8 with
  scale max|x| / 127, and Q.K^T runs as an int8 dot with int32 accumulation, rescaled by the two
  scales. P.V stays bf16. `reference_prefill_attention(..., qk_int8=True)` applies the same
  quantization, so the kernel equals it to bf16 rounding; against exact scores the int8 rounding
  adds about 1% of max|out| (QK_INT8_TOLERANCE, tested).

Only attention: Qwen's sigmoid output gate is applied by the caller.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import compat
from pallas_kernels.paged_attention import (
    PAGE_SIZE,
    QUERY_DTYPES,
    SCALED_PAGE_DTYPES,
    validate_paged_kv,
)

BLOCK_Q_CHOICES = (16, 32, 64, 128, 256)
BLOCK_KV_CHOICES = (16, 32, 64, 128, 256)
INT8_MAX = 127.0
LOG2_E = 1.4426950408889634
# max |out - exact| / max |exact| that qk_int8 adds on random (standard normal) q and k at
# head_dim 16..256 (tests/pallas_kernels/test_flash_prefill.py checks it).
QK_INT8_TOLERANCE = 3e-2


def quantize_int8_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [..., D] float -> (int8 codes [..., D], float32 scales [...]): x ~ codes * scale per row.

    scale = max|x| / 127 (1 for an all-zero row), codes = clip(floor(x / scale + 0.5), -127, 127).
    The kernel computes the same formula on its tiles (floor(. + 0.5) rather than round: it
    lowers to Triton everywhere).
    """
    x = x.astype(jnp.float32)
    absmax = jnp.max(jnp.abs(x), axis=-1)
    scale = jnp.where(absmax > 0, absmax / INT8_MAX, 1.0)
    codes = jnp.clip(jnp.floor(x / scale[..., None] + 0.5), -INT8_MAX, INT8_MAX)
    return codes.astype(jnp.int8), scale


def reference_prefill_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_table: jax.Array,
    positions: jax.Array,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    *,
    scale: float | None = None,
    qk_int8: bool = False,
) -> jax.Array:
    """Plain-jnp reference in float32: q [B, T, H, Dh] at positions [B, T] -> float32 [B, T, H, Dh].

    Gathers each row's blocks into a contiguous [B, M*64, K, Dh] view (dequantized in float32),
    masks slot s for the query at position p unless 0 <= s <= p, and runs the softmax; padding
    queries (p < 0) give zeros. qk_int8 quantizes q per (token, head) and the stored keys per
    (token, KV head) as the kernel does (int8 pages are taken as stored) before the score dot.
    """
    b, t, h, dh = q.shape
    kv_heads = k_pages.shape[2]
    scale = dh**-0.5 if scale is None else scale
    hi = jax.lax.Precision.HIGHEST

    def contiguous(x):
        return x[block_table].reshape(b, -1, *x.shape[2:])  # [B, S, K, ...]

    def dequantized(pages, scales):
        x = contiguous(pages).astype(jnp.float32)
        return x if scales is None else x * contiguous(scales)[..., None]

    values = dequantized(v_pages, v_scales)
    qg = q.astype(jnp.float32).reshape(b, t, kv_heads, h // kv_heads, dh)
    if qk_int8:
        q_codes, q_scale = quantize_int8_rows(qg)  # [B, T, K, G, Dh], [B, T, K, G]
        stored = contiguous(k_pages)
        if stored.dtype == jnp.int8:
            k_codes, k_scale = stored, jnp.ones(stored.shape[:3], jnp.float32)
        else:
            k_codes, k_scale = quantize_int8_rows(stored)
        if k_scales is not None:
            k_scale = k_scale * contiguous(k_scales)
        dots = jnp.einsum(
            "btkgd,bskd->bkgts", q_codes.astype(jnp.float32), k_codes.astype(jnp.float32), precision=hi
        )  # integers below 2**24: exact
        scores = dots * jnp.moveaxis(q_scale, 1, 3)[..., None] * jnp.moveaxis(k_scale, 1, 2)[:, :, None, None]
    else:
        keys = dequantized(k_pages, k_scales)
        scores = jnp.einsum("btkgd,bskd->bkgts", qg, keys, precision=hi)
    scores = scores * scale
    slot = jnp.arange(values.shape[1])
    visible = (slot[None, None, :] <= positions[:, :, None]) & (positions[:, :, None] >= 0)  # [B, T, S]
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(jnp.isnan(probs), 0.0, probs)  # padding queries see nothing
    out = jnp.einsum("bkgts,bskd->btkgd", probs, values, precision=hi)
    return out.reshape(b, t, h, dh)


def _prefill_kernel(
    positions_ref,  # [B, T] int32: each query's position (< 0: padding)
    block_table_ref,  # [B, M] int32: block of each row's 64-token page
    q_ref,  # [B, T, H, Dh] queries
    k_ref,  # [N, P, K, Dh] key pages (fp8 passed as its uint8 bits)
    v_ref,  # [N, P, K, Dh] value pages
    *rest,  # (k_scales [N, P, K], v_scales [N, P, K]) when scaled, then out [B, T, H, Dh]
    scaled: bool,
    fp8: bool,
    qk_int8: bool,
    sm_scale: float,
    group: int,
    capacity: int,
    max_blocks: int,
    block_q: int,
    block_kv: int,
    num_q_tiles: int,
    compute_dtype,
):
    if scaled:
        ks_ref, vs_ref, out_ref = rest
    else:
        (out_ref,) = rest
    h, b = compat.program_id(0), compat.program_id(2)
    q_tile = num_q_tiles - 1 - compat.program_id(1)  # longest loops first
    kh = h // group
    seq_len, dh = q_ref.shape[1], q_ref.shape[3]
    t0 = q_tile * block_q
    rows = (t0 + jnp.arange(block_q)) < seq_len  # [bq] queries inside the chunk
    pos = compat.load(positions_ref.at[b, compat.ds(t0, block_q)], mask=rows, other=-1)  # [bq]
    real = pos >= 0
    # A padding query attends like position 0 (finite, never NaN) and is zeroed at the store.
    seen = jnp.clip(pos, 0, capacity - 1)  # last visible slot of each query
    last = jnp.max(jnp.where(real, seen, -1))  # -1: nothing to attend to
    first = jnp.min(jnp.where(real, seen, capacity))
    # lax.div / lax.rem on these non-negative ints: jnp's floor // and % (a select on the sign)
    # fail to lower to Triton inside the loop ("AssertionError: ('i32', 'i1')" in _mod).
    total_steps = jax.lax.div(last + block_kv, block_kv)
    free_steps = jnp.minimum(jax.lax.div(first + 1, block_kv), total_steps)  # every query sees all of them

    # Scores are kept in log2 units and exponentiated with exp2 (one ex2.approx instruction on
    # the GPU; exp lowers to libdevice's __nv_expf, a range reduction around it).
    score_scale = sm_scale * LOG2_E
    q = compat.load(q_ref.at[b, compat.ds(t0, block_q), h], mask=rows[:, None], other=0)  # [bq, Dh]
    if qk_int8:
        qf = q.astype(jnp.float32)
        q_absmax = jnp.max(jnp.abs(qf), axis=1)
        q_scale = jnp.where(q_absmax > 0, q_absmax / INT8_MAX, 1.0)  # [bq]
        q = jnp.clip(jnp.floor(qf / q_scale[:, None] + 0.5), -INT8_MAX, INT8_MAX).astype(jnp.int8)
        row_scale = q_scale * score_scale
    else:
        q = q.astype(compute_dtype)
    sub = min(block_kv, PAGE_SIZE)  # tokens a page sub-tile holds
    dims_qk = (((1,), (1,)), ((), ()))  # [bq, Dh] x [sub, Dh] -> [bq, sub]
    dims_pv = (((1,), (0,)), ((), ()))  # [bq, sub] x [sub, Dh] -> [bq, Dh]

    def load_tile(ref, page, offset, valid):
        view = ref.at[page, compat.ds(offset, sub), kh]
        x = compat.load(view) if valid is None else compat.load(view, mask=valid[:, None], other=0)
        return jax.lax.bitcast_convert_type(x, jnp.float8_e4m3fn) if fp8 else x  # [sub, Dh]

    def load_scale(ref, page, offset, valid):
        view = ref.at[page, compat.ds(offset, sub), kh]  # [sub] per-token scales
        return compat.load(view) if valid is None else compat.load(view, mask=valid, other=0.0)

    def scores(k, page, offset, valid):
        """[bq, sub] float32 scores of one page sub-tile, in log2 units (softmax scale * log2 e included)."""
        if qk_int8:
            if k.dtype == jnp.int8:
                k_codes, col_scale = k, None
            else:
                kf = k.astype(jnp.float32)
                k_absmax = jnp.max(jnp.abs(kf), axis=1)
                col_scale = jnp.where(k_absmax > 0, k_absmax / INT8_MAX, 1.0)
                k_codes = jnp.clip(jnp.floor(kf / col_scale[:, None] + 0.5), -INT8_MAX, INT8_MAX)
                k_codes = k_codes.astype(jnp.int8)
            dots = jax.lax.dot_general(q, k_codes, dims_qk, preferred_element_type=jnp.int32)
            s = dots.astype(jnp.float32) * row_scale[:, None]
        else:
            col_scale = None
            s = jax.lax.dot_general(q, k.astype(compute_dtype), dims_qk, preferred_element_type=jnp.float32)
            s = s * score_scale
        if scaled:
            k_scale = load_scale(ks_ref, page, offset, valid)
            col_scale = k_scale if col_scale is None else col_scale * k_scale
        return s if col_scale is None else s * col_scale[None, :]

    def step(t, carry, masked: bool):
        m, l, acc = carry
        parts = []
        for j in range(block_kv // sub):  # static: the pages of one step
            token0 = t * block_kv + j * sub
            page = block_table_ref[b, jnp.minimum(jax.lax.div(token0, PAGE_SIZE), max_blocks - 1)]
            offset = jax.lax.rem(token0, PAGE_SIZE)
            cols = token0 + jnp.arange(sub)  # [sub] slots of this sub-tile
            valid = (cols <= last) if masked else None  # nothing past the tile's last query is read
            s = scores(load_tile(k_ref, page, offset, valid), page, offset, valid)
            if masked:
                s = jnp.where(cols[None, :] <= seen[:, None], s, -jnp.inf)
            parts.append((s, page, offset, valid))
        m_new = m
        for s, *_ in parts:
            m_new = jnp.maximum(m_new, jnp.max(s, axis=1))  # finite: slot 0 is every query's first step
        alpha = jnp.exp2(m - m_new)
        acc = acc * alpha[:, None]
        l = l * alpha
        for s, page, offset, valid in parts:
            p = jnp.exp2(s - m_new[:, None])  # [bq, sub]
            l = l + jnp.sum(p, axis=1)
            if scaled:
                p = p * load_scale(vs_ref, page, offset, valid)[None, :]
            v = load_tile(v_ref, page, offset, valid).astype(compute_dtype)
            acc = acc + jax.lax.dot_general(
                p.astype(compute_dtype), v, dims_pv, preferred_element_type=jnp.float32
            )
        return m_new, l, acc

    init = (
        jnp.full((block_q,), -jnp.inf, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
        jnp.zeros((block_q, dh), jnp.float32),
    )
    carry = jax.lax.fori_loop(0, free_steps, functools.partial(step, masked=False), init)
    _m, l, acc = jax.lax.fori_loop(free_steps, total_steps, functools.partial(step, masked=True), carry)
    out = jnp.where(real[:, None], acc / jnp.where(l > 0, l, 1.0)[:, None], 0.0)
    compat.store(
        out_ref.at[b, compat.ds(t0, block_q), h],
        out.astype(out_ref.dtype),
        mask=jnp.broadcast_to(rows[:, None], (block_q, dh)),
    )


def validate_prefill_attention(
    q, k_pages, v_pages, block_table, positions, k_scales, v_scales, block_q, block_kv
) -> None:
    """Raise ValueError naming the offending value when the inputs or tile sizes do not fit."""
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, H, Dh] (a chunk of T tokens per row); got shape {q.shape}")
    if q.dtype not in QUERY_DTYPES:
        raise ValueError(f"q must be bf16, f16 or f32; got {q.dtype}")
    batch, tokens, heads, head_dim = q.shape
    validate_paged_kv(heads, head_dim, batch, k_pages, v_pages, block_table, k_scales, v_scales)
    if positions.shape != (batch, tokens) or positions.dtype != jnp.int32:
        raise ValueError(
            f"positions must be int32 [B={batch}, T={tokens}]; got {positions.dtype} {positions.shape}"
        )
    if block_q not in BLOCK_Q_CHOICES:
        raise ValueError(f"block_q={block_q} must be one of {BLOCK_Q_CHOICES} (a power of two >= 16)")
    if block_kv not in BLOCK_KV_CHOICES:
        raise ValueError(
            f"block_kv={block_kv} must be one of {BLOCK_KV_CHOICES} (inside one page, or whole pages)"
        )


_TILE_ARGS = ("scale", "block_q", "block_kv", "num_warps", "num_stages", "qk_int8", "out_dtype", "interpret")


@functools.partial(jax.jit, static_argnames=_TILE_ARGS)
def paged_prefill_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_table: jax.Array,
    positions: jax.Array,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    *,
    scale: float | None = None,
    block_q: int = 128,
    block_kv: int = 64,
    num_warps: int = 8,
    num_stages: int = 2,
    qk_int8: bool = False,
    out_dtype=None,
    interpret: bool = False,
) -> jax.Array:
    """Causal attention of a chunk q [B, T, H, Dh] at positions [B, T] over paged KV -> [B, T, H, Dh].

    k_pages / v_pages [N, 64, K, Dh]: bf16 / f16 / f32, or int8 / float8_e4m3fn with k_scales /
    v_scales [N, 64, K] float32, holding every position the chunk attends to (its own K/V
    included). block_table int32 [B, M]. The query at position p sees slots 0..p (clipped to
    M * 64); p < 0 marks padding and gives zeros. `scale` defaults to Dh ** -0.5.

    Tiles: `block_q` queries (16..256) and `block_kv` KV tokens (16, 32, 64 inside a page; 128,
    256 whole pages) per loop step. `qk_int8` runs Q.K^T as an int8 dot (module docstring).
    Output in `out_dtype` (default q.dtype). `interpret=True` runs the Pallas interpreter (CPU).
    """
    validate_prefill_attention(
        q, k_pages, v_pages, block_table, positions, k_scales, v_scales, block_q, block_kv
    )
    batch, tokens, heads, head_dim = q.shape
    kv_heads = k_pages.shape[2]
    scaled = k_pages.dtype in SCALED_PAGE_DTYPES
    fp8 = k_pages.dtype == jnp.float8_e4m3fn
    compute_dtype = jnp.bfloat16 if scaled else jnp.promote_types(q.dtype, k_pages.dtype)
    if fp8:  # a masked fp8 load cannot take a fill value: pass the bits (docs/pallas.md)
        k_pages = jax.lax.bitcast_convert_type(k_pages, jnp.uint8)
        v_pages = jax.lax.bitcast_convert_type(v_pages, jnp.uint8)
    operands = (positions, block_table, q, k_pages, v_pages) + ((k_scales, v_scales) if scaled else ())
    kernel = functools.partial(
        _prefill_kernel,
        scaled=scaled,
        fp8=fp8,
        qk_int8=qk_int8,
        sm_scale=float(head_dim**-0.5 if scale is None else scale),
        group=heads // kv_heads,
        capacity=block_table.shape[1] * PAGE_SIZE,
        max_blocks=block_table.shape[1],
        block_q=block_q,
        block_kv=block_kv,
        num_q_tiles=compat.cdiv(tokens, block_q),
        compute_dtype=compute_dtype,
    )
    return compat.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype if out_dtype is None else out_dtype),
        grid=(heads, kernel.keywords["num_q_tiles"], batch),
        compiler_params=compat.triton_compiler_params(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="paged_prefill_attention",
    )(*operands)
