"""Paged decode attention over bf16 / int8 / fp8 KV blocks: a Pallas GPU (Triton) kernel.

One query token per batch row attends over that row's first `lengths[b]` cached tokens:

    out[b, h] = softmax(q[b, h] . K[b, :len, k]^T * scale) V[b, :len, k],   k = h // (H / K)

with the KV in the pool's own layout (infernix_jax/cache/kv_pool.py, docs/kv_cache.md):
k_pages / v_pages [N, P, K, Dh] (P = 64 tokens a block), token position t of row b at
(block_table[b, t // P], t % P); int8 and fp8 pages carry k_scales / v_scales [N, P, K] float32,
one scale per token per KV head (value = stored * scale).

Decode reads every KV byte once, so the kernel is built for bandwidth ("flash decoding"):

* Grid (B, K, partitions): each program takes one batch row, one KV head and one partition of
  `partition_size` tokens of the sequence, so batch 1 with few KV heads still fills the SMs at
  long context. Each program writes a partial (running max m, running sum l, unnormalized acc);
  XLA merges the partitions by log-sum-exp and normalizes (`combine_partitions`: the max and sum
  by one small reduction, then acc's weighted sum).
* All G = H / K query heads of a KV group are processed together as the M side of the dots
  (padded to Gp = max(16, pow2(G)) rows: Triton dots need every dimension >= 16), so each K / V
  tile is loaded once for the whole group.
* Online softmax in float32. Ragged lengths: each program loops only over the steps that hold
  valid tokens (a dynamic trip count: programs past a row's length do no loads) and masks the
  tail of the last step.
* Quantized formats never dequantize the tile: int8 and e4m3 values are exact in bf16, so the
  stored tile is only cast; the K scale multiplies the score columns after q.K^T and the V scale
  multiplies the probabilities before P.V (both are per token, i.e. per column of the scores).

The kernel computes softmax(q K^T * scale) V only; Qwen's sigmoid output gate is applied by the
caller.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import compat

PAGE_SIZE = 64  # tokens per KV block (the pool's BLOCK_SIZE)
QUERY_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
UNSCALED_PAGE_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
SCALED_PAGE_DTYPES = (jnp.int8, jnp.float8_e4m3fn)
SCALE_DTYPE = jnp.float32


def reference_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_table: jax.Array,
    lengths: jax.Array,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    *,
    scale: float | None = None,
) -> jax.Array:
    """Plain-jnp reference in float32: q [B, H, Dh] over each row's paged KV -> float32 [B, H, Dh].

    Gathers each row's blocks into a contiguous [B, M*P, K, Dh] view, dequantizes in float32 and
    runs a masked softmax; rows with length 0 give zeros.
    """
    b, h, dh = q.shape
    kv_heads = k_pages.shape[2]
    scale = dh**-0.5 if scale is None else scale

    def contiguous(pages, scales):
        x = pages[block_table].astype(jnp.float32)  # [B, M, P, K, Dh]
        if scales is not None:
            x = x * scales[block_table].astype(jnp.float32)[..., None]
        return x.reshape(b, -1, kv_heads, dh)

    keys, values = contiguous(k_pages, k_scales), contiguous(v_pages, v_scales)
    qg = q.astype(jnp.float32).reshape(b, kv_heads, h // kv_heads, dh)
    hi = jax.lax.Precision.HIGHEST
    scores = jnp.einsum("bkgd,bskd->bkgs", qg, keys, precision=hi) * scale
    visible = jnp.arange(keys.shape[1])[None, :] < lengths[:, None]  # [B, S]
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(jnp.isnan(probs), 0.0, probs)  # length-0 rows see nothing
    return jnp.einsum("bkgs,bskd->bkgd", probs, values, precision=hi).reshape(b, h, dh)


def _paged_decode_kernel(
    lengths_ref,  # [B] int32: valid tokens per row
    block_table_ref,  # [B, M] int32: block of each row's 64-token page
    q_ref,  # [B*H, Dh] queries; row b*H + kh*G + g is head g of KV group kh
    k_ref,  # [N, P, K, Dh] key pages (fp8 passed as its uint8 bits)
    v_ref,  # [N, P, K, Dh] value pages
    *rest,  # (k_scales [N, P, K], v_scales [N, P, K]) when scaled, then the three outputs
    scaled: bool,
    fp8: bool,
    sm_scale: float,
    kv_heads: int,
    group: int,
    group_pad: int,
    capacity: int,
    partition_size: int,
    block_tokens: int,
    compute_dtype,
):
    if scaled:
        ks_ref, vs_ref, m_ref, l_ref, acc_ref = rest  # outputs: m, l [B, K, NP, Gp]; acc [B, K, NP, Gp, Dh]
    else:
        m_ref, l_ref, acc_ref = rest
    b, kh, part = compat.program_id(0), compat.program_id(1), compat.program_id(2)
    gp, dh = group_pad, q_ref.shape[1]
    length = jnp.minimum(lengths_ref[b], capacity)
    start = part * partition_size
    steps = jnp.clip(compat.cdiv(length - start, block_tokens), 0, partition_size // block_tokens)
    rows = jnp.arange(gp) < group  # the G real query rows of the padded tile
    q_row0 = (b * kv_heads + kh) * group
    q = compat.load(q_ref.at[compat.ds(q_row0, gp)], mask=rows[:, None], other=0)  # [Gp, Dh]
    q = q.astype(compute_dtype)
    dims_qk = (((1,), (1,)), ((), ()))  # [Gp, Dh] x [T, Dh] -> [Gp, T]
    dims_pv = (((1,), (0,)), ((), ()))  # [Gp, T] x [T, Dh] -> [Gp, Dh]

    def tile(ref, page, offset, valid):
        x = compat.load(ref.at[page, compat.ds(offset, block_tokens), kh], mask=valid[:, None], other=0)
        if fp8:
            x = jax.lax.bitcast_convert_type(x, jnp.float8_e4m3fn)
        return x.astype(compute_dtype)  # [T, Dh]

    def step(t, carry):
        m, l, acc = carry
        token0 = start + t * block_tokens
        page = block_table_ref[b, token0 // PAGE_SIZE]
        offset = token0 % PAGE_SIZE
        valid = (token0 + jnp.arange(block_tokens)) < length  # [T]
        k = tile(k_ref, page, offset, valid)
        s = jax.lax.dot_general(q, k, dims_qk, preferred_element_type=jnp.float32)
        if scaled:
            k_scale = compat.load(ks_ref.at[page, compat.ds(offset, block_tokens), kh], mask=valid, other=0.0)
            s = s * k_scale[None, :]
        s = jnp.where(valid[None, :], s * sm_scale, -jnp.inf)
        m_new = jnp.maximum(m, jnp.max(s, axis=1))  # finite: every step holds a valid token
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[:, None])  # [Gp, T]
        l = l * alpha + jnp.sum(p, axis=1)
        if scaled:
            v_scale = compat.load(vs_ref.at[page, compat.ds(offset, block_tokens), kh], mask=valid, other=0.0)
            p = p * v_scale[None, :]
        v = tile(v_ref, page, offset, valid)
        acc = acc * alpha[:, None] + jax.lax.dot_general(
            p.astype(compute_dtype), v, dims_pv, preferred_element_type=jnp.float32
        )
        return m_new, l, acc

    init = (
        jnp.full((gp,), -jnp.inf, jnp.float32),
        jnp.zeros((gp,), jnp.float32),
        jnp.zeros((gp, dh), jnp.float32),
    )
    m, l, acc = jax.lax.fori_loop(0, steps, step, init)
    compat.store(m_ref.at[b, kh, part], m)
    compat.store(l_ref.at[b, kh, part], l)
    # Only the G real rows of acc are written: the combine reads no more (padding rows are
    # most of the tile when G = 6 or 8, and acc is the one partial whose bytes add up).
    compat.store(acc_ref.at[b, kh, part], acc, mask=jnp.broadcast_to(rows[:, None], (gp, dh)))


def _merge_softmax_partials(a, b):
    """The log-sum-exp monoid on (max, sum): associative and commutative, identity (-inf, 0)."""
    (m1, l1), (m2, l2) = a, b
    m = jnp.maximum(m1, m2)
    w1 = jnp.where(m1 == -jnp.inf, 0.0, jnp.exp(m1 - m))  # an empty side weighs nothing (no inf - inf)
    w2 = jnp.where(m2 == -jnp.inf, 0.0, jnp.exp(m2 - m))
    return m, l1 * w1 + l2 * w2


def combine_partitions(m: jax.Array, l: jax.Array, acc: jax.Array) -> jax.Array:
    """Merge per-partition softmax partials into normalized outputs.

    m, l [..., NP, G] (running max and sum of exp(s - m)), acc [..., NP, G, Dh] (sum of
    exp(s - m) v) -> [..., G, Dh] float32. Empty partitions (m = -inf) weigh nothing; a row
    with no token at all gives zeros.

    First the global max and sum over NP from the small m, l (one variadic reduction with the
    log-sum-exp merge as its body), then acc's sum over NP weighted by exp(m - max) (the weights
    [..., NP, G] are one small fusion; the weighted sum reads acc as the kernel wrote it). A single
    variadic reduction over (m, l, acc) needed m and l broadcast to acc's shape, which XLA wrote out
    as arrays of their own: one launch more and two acc-sized temporaries a layer.
    """
    axis = m.ndim - 2
    zero = jnp.zeros((), jnp.float32)
    top, total = jax.lax.reduce(
        (m, l), (jnp.float32(-jnp.inf), zero), _merge_softmax_partials, (axis,)
    )
    weight = jnp.where(m == -jnp.inf, 0.0, jnp.exp(m - jnp.expand_dims(top, axis)))  # [..., NP, G]
    out = jnp.sum(acc * weight[..., None], axis=axis)
    return jnp.where(total[..., None] > 0, out / jnp.where(total > 0, total, 1.0)[..., None], 0.0)


def _is_pow2(v: int) -> bool:
    return v > 0 and (v & (v - 1)) == 0


def validate_paged_kv(heads, head_dim, batch, k_pages, v_pages, block_table, k_scales, v_scales) -> None:
    """Raise ValueError naming the offending value when a paged KV pool (pages, scales, block table)
    does not fit queries of `heads` heads of `head_dim` for `batch` rows (shared by the decode and
    prefill kernels)."""
    if k_pages.ndim != 4:
        raise ValueError(f"k_pages must be [N, P, K, Dh]; got shape {k_pages.shape}")
    if v_pages.shape != k_pages.shape or v_pages.dtype != k_pages.dtype:
        raise ValueError(
            f"v_pages {v_pages.dtype} {v_pages.shape} must match k_pages {k_pages.dtype} {k_pages.shape}"
        )
    _n, page, kv_heads, page_dim = k_pages.shape
    if page != PAGE_SIZE:
        raise ValueError(f"pages must hold {PAGE_SIZE} tokens (k_pages dim 1); got {page}")
    if page_dim != head_dim:
        raise ValueError(f"q head_dim {head_dim} != page head_dim {page_dim}")
    if not _is_pow2(head_dim) or head_dim < 16:
        raise ValueError(f"head_dim={head_dim} must be a power of two >= 16 (a Triton tile)")
    if heads % kv_heads:
        raise ValueError(f"q heads {heads} must be a multiple of the KV heads {kv_heads}")
    scaled = k_pages.dtype in SCALED_PAGE_DTYPES
    if not scaled and k_pages.dtype not in UNSCALED_PAGE_DTYPES:
        raise ValueError(f"pages must be bf16, f16, f32, int8 or float8_e4m3fn; got {k_pages.dtype}")
    if scaled:
        for name, s in (("k_scales", k_scales), ("v_scales", v_scales)):
            if s is None:
                raise ValueError(f"{k_pages.dtype} pages need {name} [N, P, K] float32; got None")
            if s.shape != k_pages.shape[:3] or s.dtype != SCALE_DTYPE:
                raise ValueError(f"{name} must be float32 {k_pages.shape[:3]}; got {s.dtype} {s.shape}")
    elif k_scales is not None or v_scales is not None:
        raise ValueError(f"{k_pages.dtype} pages are unscaled; k_scales / v_scales must be None")
    if block_table.ndim != 2 or block_table.shape[0] != batch or block_table.dtype != jnp.int32:
        raise ValueError(
            f"block_table must be int32 [B={batch}, M]; got {block_table.dtype} {block_table.shape}"
        )


def validate_paged_attention(
    q, k_pages, v_pages, block_table, lengths, k_scales, v_scales, partition_size, block_tokens
) -> None:
    """Raise ValueError naming the offending value when the inputs or tile sizes do not fit.

    partition_size None (the default, chosen from the shapes) is not checked.
    """
    if q.ndim != 3:
        raise ValueError(f"q must be [B, H, Dh] (one decode token per row); got shape {q.shape}")
    if q.dtype not in QUERY_DTYPES:
        raise ValueError(f"q must be bf16, f16 or f32; got {q.dtype}")
    batch, heads, head_dim = q.shape
    validate_paged_kv(heads, head_dim, batch, k_pages, v_pages, block_table, k_scales, v_scales)
    if lengths.shape != (batch,) or lengths.dtype != jnp.int32:
        raise ValueError(f"lengths must be int32 [B={batch}]; got {lengths.dtype} {lengths.shape}")
    if block_tokens not in (16, 32, 64):
        raise ValueError(f"block_tokens={block_tokens} must be 16, 32 or 64 (a power of two dividing a page)")
    if partition_size is not None and (partition_size < block_tokens or partition_size % block_tokens):
        raise ValueError(
            f"partition_size={partition_size} must be a positive multiple of block_tokens={block_tokens}"
        )


def default_partition_size(batch: int, kv_heads: int, capacity: int, target_programs: int = 264) -> int:
    """The largest power-of-two partition (64..4096 tokens) that still gives >= target_programs,
    and no larger than the block table's capacity needs.

    target_programs defaults to two programs per SM of an H200 (132 SMs); fewer, longer
    partitions mean fewer partials to combine.
    """
    size = 4096
    while size > PAGE_SIZE and batch * kv_heads * compat.cdiv(capacity, size) < target_programs:
        size //= 2
    return min(size, compat.pow2_at_least(capacity, PAGE_SIZE))  # one partition covers a short table


_TILE_ARGS = ("scale", "partition_size", "block_tokens", "num_warps", "num_stages", "interpret")


@functools.partial(jax.jit, static_argnames=_TILE_ARGS)
def paged_decode_partials(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_table: jax.Array,
    lengths: jax.Array,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    *,
    scale: float | None = None,
    partition_size: int | None = None,
    block_tokens: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The kernel alone: per-partition softmax partials, before `combine_partitions`.

    Same arguments as `paged_decode_attention`. Returns m, l float32 [B, K, NP, Gp] and acc
    float32 [B, K, NP, Gp, Dh] (NP = ceil(M * 64 / partition_size), Gp = max(16, pow2(H / K)));
    only the first G = H / K rows are meaningful (acc's padding rows are never written).
    """
    validate_paged_attention(
        q, k_pages, v_pages, block_table, lengths, k_scales, v_scales, partition_size, block_tokens
    )
    batch, heads, head_dim = q.shape
    capacity = block_table.shape[1] * PAGE_SIZE
    kv_heads = k_pages.shape[2]
    if partition_size is None:
        partition_size = default_partition_size(batch, kv_heads, capacity)
    group = heads // kv_heads
    group_pad = compat.pow2_at_least(group, 16)
    scaled = k_pages.dtype in SCALED_PAGE_DTYPES
    fp8 = k_pages.dtype == jnp.float8_e4m3fn
    # Dot operands: int8 and e4m3 values are exact in bf16; unscaled pages meet q in the wider dtype.
    compute_dtype = jnp.bfloat16 if scaled else jnp.promote_types(q.dtype, k_pages.dtype)
    num_partitions = compat.cdiv(capacity, partition_size)
    if fp8:  # a masked fp8 load cannot take a fill value: pass the bits (docs/pallas.md)
        k_pages = jax.lax.bitcast_convert_type(k_pages, jnp.uint8)
        v_pages = jax.lax.bitcast_convert_type(v_pages, jnp.uint8)
    # q goes in as [B*H, Dh] (a free reshape); the kernel loads its group's rows masked, so no
    # padding op runs before it.
    operands = (lengths, block_table, q.reshape(batch * heads, head_dim), k_pages, v_pages)
    operands += (k_scales, v_scales) if scaled else ()
    kernel = functools.partial(
        _paged_decode_kernel,
        scaled=scaled,
        fp8=fp8,
        sm_scale=float(head_dim**-0.5 if scale is None else scale),
        kv_heads=kv_heads,
        group=group,
        group_pad=group_pad,
        capacity=capacity,
        partition_size=partition_size,
        block_tokens=block_tokens,
        compute_dtype=compute_dtype,
    )
    partial_shape = (batch, kv_heads, num_partitions, group_pad)
    return compat.pallas_call(
        kernel,
        out_shape=(
            jax.ShapeDtypeStruct(partial_shape, jnp.float32),
            jax.ShapeDtypeStruct(partial_shape, jnp.float32),
            jax.ShapeDtypeStruct((*partial_shape, head_dim), jnp.float32),
        ),
        grid=(batch, kv_heads, num_partitions),
        compiler_params=compat.triton_compiler_params(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="paged_decode_attention",
    )(*operands)


@functools.partial(jax.jit, static_argnames=(*_TILE_ARGS, "out_dtype"))
def paged_decode_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    block_table: jax.Array,
    lengths: jax.Array,
    k_scales: jax.Array | None = None,
    v_scales: jax.Array | None = None,
    *,
    scale: float | None = None,
    partition_size: int | None = None,
    block_tokens: int = 64,
    num_warps: int = 4,
    num_stages: int = 2,
    out_dtype=None,
    interpret: bool = False,
) -> jax.Array:
    """Decode attention of q [B, H, Dh] over paged KV -> [B, H, Dh] in `out_dtype` (default q.dtype).

    k_pages / v_pages [N, 64, K, Dh]: bf16 / f16 / f32, or int8 / float8_e4m3fn with k_scales /
    v_scales [N, 64, K] float32. block_table int32 [B, M]; lengths int32 [B] (row b sees its tokens
    0 .. lengths[b]-1; lengths are clipped to M * 64; 0 gives zeros). `scale` defaults to Dh**-0.5.

    Tiles: `partition_size` tokens per program (default: `default_partition_size`), `block_tokens`
    (16, 32 or 64) tokens per loop step. `interpret=True` runs the kernel through the Pallas
    interpreter (the CPU test path).
    """
    m, l, acc = paged_decode_partials(
        q,
        k_pages,
        v_pages,
        block_table,
        lengths,
        k_scales,
        v_scales,
        scale=scale,
        partition_size=partition_size,
        block_tokens=block_tokens,
        num_warps=num_warps,
        num_stages=num_stages,
        interpret=interpret,
    )
    batch, heads, head_dim = q.shape
    group = heads // k_pages.shape[2]
    g = slice(0, group)
    out = combine_partitions(m[..., g], l[..., g], acc[..., g, :])  # [B, K, G, Dh]
    return out.reshape(batch, heads, head_dim).astype(q.dtype if out_dtype is None else out_dtype)
