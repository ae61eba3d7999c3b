"""FP8 (e4m3) weight x bf16 activation matmul (decode and prefill): a Pallas GPU (Triton) kernel.

    y[m, n] = sum_k x[m, k] * W[n, k],   W[n, k] = fp8[n, k] * s

where s is either one float32 per tensor (ModelOpt "FP8": `weight_scale`) or one float32 per
block_size x block_size block (Qwen / DeepSeek "-FP8": `weight_scale_inv` [ceil(N/b), ceil(K/b)],
the dequant multiplier despite its name). e4m3 values are exact in bf16, so the weight tile is
widened in registers; block scales multiply each K step's partial product (a tile never
straddles a scale block: block_n and block_k divide block_size), the per-tensor scale multiplies
the float32 sum once.

Formulations (`variant`, see pallas_kernels/_quant_common.py and docs/pallas.md): "gemv"
(float32 FMAs on CUDA cores, one [block_n, block_k] accumulator per row, M <= 8; a block scale
is folded into the activation row), "dot" (x [16, bk] @ W.T, M padded to 16) and "dot_t"
(W [bn, bk] @ x.T), "gemv_ws" (gemv streamed: a fixed grid of `programs`, each walking an equal
run of (N tile, K step) units with its loads one unit ahead, `_quant_common.streamed_gemv`), and
for prefill "tiled" ([block_m, block_n] output tiles on a flat grid in
grouped order, the weight tile cast to bf16 once per K step for all block_m rows, y written
directly; with block scales a tile may span several scale rows: block_n a multiple of
block_size, each row's scale applied to the K step's float32 product). The entry picks one by M
from `DEFAULT_CONFIGS` unless told.

Grid: (M tiles, N tiles, split_k), as in nvfp4_matmul; mask-free when N and K divide the tiles.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _quant_common as qc
from pallas_kernels import compat

DECODE_VARIANTS = (*qc.DECODE_VARIANTS, "gemv_ws")
VARIANTS = (*DECODE_VARIANTS, "tiled")

# Default configuration by the largest M it serves (qc.pick_config): fill in from
# `python -m bench.kernels --sweep` (bench/results/kernels-sweep-<machine>.json).
# From the H200 sweep (bench/results/kernels-nvidia-h200.json): per-tensor FP8 at batch 1 was
# fastest as "gemv" with 16-row, 256-element tiles on most shapes; at batch 8 "dot" with 64 x 128
# tiles. Block-scaled weights need tiles that divide the scale block (weights.quant passes them).
DEFAULT_CONFIGS: dict[int, qc.MatmulConfig] = {
    1: qc.MatmulConfig("gemv", block_n=16, block_k=256, split_k=1, num_warps=4, num_stages=3),
    8: qc.MatmulConfig("dot", block_n=64, block_k=128, split_k=2, num_warps=4, num_stages=3),
    64: qc.MatmulConfig("dot", block_n=64, block_k=128, split_k=1, num_warps=4, num_stages=3),
    # Prefill: not yet measured (`python -m bench.kernels --prefill` sweeps it).
    qc.PREFILL_M: qc.MatmulConfig(
        "tiled", block_n=128, block_k=128, split_k=1, num_warps=8, num_stages=3, block_m=128, group_m=8
    ),
}


def reference_fp8_matmul(
    x: jax.Array, w: jax.Array, scale: jax.Array, *, block_size: int | None = None
) -> jax.Array:
    """Plain-jnp reference in float32: x [M, K] @ dequant(W [N, K]).T -> float32 [M, N]."""
    wf = w.astype(jnp.float32)
    if block_size is None:
        wf = wf * jnp.asarray(scale, jnp.float32)
    else:
        n, k = w.shape
        s = jnp.repeat(jnp.repeat(scale.astype(jnp.float32), block_size, 0), block_size, 1)
        wf = wf * s[:n, :k]
    return jnp.dot(x.astype(jnp.float32), wf.T, precision=jax.lax.Precision.HIGHEST)


def _mask2(rows: jax.Array | None, cols: jax.Array | None, shape: tuple[int, int]) -> jax.Array | None:
    """The [rows, cols] load mask from optional 1-D row and column masks (None: no mask at all)."""
    if rows is None and cols is None:
        return None
    if rows is None:
        return jnp.broadcast_to(cols[None, :], shape)
    if cols is None:
        return jnp.broadcast_to(rows[:, None], shape)
    return rows[:, None] & cols[None, :]


def _fp8_kernel(
    x_ref,  # [Mp, K] activations (gemv: [M, K], unpadded)
    w_ref,  # [N, K] uint8: the bits of the float8_e4m3fn weight
    scale_ref,  # [ceil(N/b), ceil(K/b)] float32 block scales (unused when per-tensor)
    out_ref,  # float32 partial sums: [split_k, Mp, N] (dot, gemv) or [split_k, N, Mp] (dot_t)
    *,
    variant: str,
    rows: int,  # gemv: M; dot*: block_m
    n_size: int,
    k_size: int,
    block_n: int,
    block_k: int,
    steps: int,
    scale_block: int | None,
    even_n: bool,
    even_k: bool,
):
    i, j, split = compat.program_id(0), compat.program_id(1), compat.program_id(2)
    col0, bn, bk = j * block_n, block_n, block_k
    n_mask = None if even_n else (col0 + jnp.arange(bn)) < n_size
    compute_dtype = x_ref.dtype
    gemv = qc.is_gemv(variant)

    def step(t, acc):
        k0 = (split * steps + t) * bk
        k_mask = None if even_k else (k0 + jnp.arange(bk)) < k_size
        bits = qc.load(w_ref.at[compat.ds(col0, bn), compat.ds(k0, bk)], _mask2(n_mask, k_mask, (bn, bk)))
        w8 = jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn)
        s = None
        if scale_block is not None:  # one scale for the whole tile: block_n, block_k divide b
            kb = jnp.minimum(k0 // scale_block, scale_ref.shape[1] - 1)  # a masked tail step may overshoot
            s = scale_ref[col0 // scale_block, kb]
        if gemv:
            w = w8.astype(jnp.float32)
            out = []
            for r in range(rows):
                x = qc.load(x_ref.at[compat.ds(r, 1), compat.ds(k0, bk)], _mask2(None, k_mask, (1, bk)))
                x = x.astype(jnp.float32)
                out.append(acc[r] + w * (x if s is None else x * s))
            return tuple(out)
        x = qc.load(x_ref.at[compat.ds(i * rows, rows), compat.ds(k0, bk)], _mask2(None, k_mask, (rows, bk)))
        w = w8.astype(compute_dtype)
        if variant == "dot":  # [rows, bk] x [bn, bk] -> [rows, bn]
            part = jax.lax.dot_general(x, w, qc.dims_nt(), preferred_element_type=jnp.float32)
        else:  # dot_t: [bn, bk] x [rows, bk] -> [bn, rows]
            part = jax.lax.dot_general(w, x, qc.dims_nt(), preferred_element_type=jnp.float32)
        return acc + (part if s is None else part * s)

    qc.accumulate_and_store(
        step, steps, variant=variant, rows=rows, bn=bn, gemv_width=bk, out_ref=out_ref, split=split,
        row0=i * rows, col0=col0, n_mask=n_mask,
    )  # fmt: skip


def _fp8_streamed_kernel(
    x_ref,  # [M, K] activations, unpadded
    w_ref,  # [N, K] uint8: the bits of the float8_e4m3fn weight
    scale_ref,  # [ceil(N/b), ceil(K/b)] float32 block scales (unused when per-tensor)
    out_ref,  # [slots, M, N] float32 partial sums
    *,
    plan: qc.StreamedPlan,
    rows: int,
    n_size: int,
    k_size: int,
    block_n: int,
    block_k: int,
    scale_block: int | None,
    even_k: bool,
):
    """"gemv_ws": gemv's float32 products over a streamed plan (`_quant_common.streamed_gemv`), each
    unit's weight tile (and its block scale) loaded one unit ahead."""
    bn, bk = block_n, block_k

    def k_mask_at(k0):
        return None if even_k else (k0 + jnp.arange(bk)) < k_size

    def loads(col0, ks, valid):
        k0 = ks * bk
        n_mask = ((col0 + jnp.arange(bn)) < n_size) & valid
        bits = qc.load(w_ref.at[compat.ds(col0, bn), compat.ds(k0, bk)], _mask2(n_mask, k_mask_at(k0), (bn, bk)))
        if scale_block is None:
            return (bits,)
        kb = jnp.minimum(k0 // scale_block, scale_ref.shape[1] - 1)  # a masked tail step may overshoot
        return bits, scale_ref[col0 // scale_block, kb]

    def products(acc, ks, loaded):
        k0 = ks * bk
        w = jax.lax.bitcast_convert_type(loaded[0], jnp.float8_e4m3fn).astype(jnp.float32)
        out = []
        for r in range(rows):
            x = qc.load(x_ref.at[compat.ds(r, 1), compat.ds(k0, bk)], _mask2(None, k_mask_at(k0), (1, bk)))
            x = x.astype(jnp.float32)
            out.append(acc[r] + w * (x if scale_block is None else x * loaded[1]))
        return tuple(out)

    qc.streamed_gemv(loads, products, plan=plan, n_size=n_size, rows=rows, bn=bn, width=bk, out_ref=out_ref)


def _fp8_tiled_kernel(
    x_ref,  # [M, K] activations (unpadded: rows past M are masked)
    w_ref,  # [N, K] uint8: the bits of the float8_e4m3fn weight
    scale_ref,  # [ceil(N/b), ceil(K/b)] float32 block scales; [1, 1] the per-tensor scale
    out_ref,  # [M, N] in the output dtype, written once (no partial sums)
    *,
    m_size: int,
    n_size: int,
    k_size: int,
    block_m: int,
    block_n: int,
    block_k: int,
    group_m: int,
    scale_block: int | None,
    even_m: bool,
    even_n: bool,
    even_k: bool,
):
    """One [block_m, block_n] output tile of the prefill formulation ("tiled").

    Per K step the [block_n, block_k] fp8 tile is cast to bf16 (exact) once and multiplied by
    all block_m activation rows on tensor cores, accumulating in float32. Block scales multiply
    each step's float32 product (block_k divides the scale block, so a step has one scale per
    weight row); the per-tensor scale multiplies the sum once.
    """
    m_tiles, n_tiles = qc.tiled_grid(m_size, n_size, block_m, block_n)
    i, j = qc.grouped_tile(compat.program_id(0), m_tiles, n_tiles, group_m)
    row0, col0 = i * block_m, j * block_n
    bm, bn, bk = block_m, block_n, block_k
    m_mask = None if even_m else (row0 + jnp.arange(bm)) < m_size
    n_mask = None if even_n else (col0 + jnp.arange(bn)) < n_size
    compute_dtype = x_ref.dtype
    f32 = jnp.float32
    # Scale rows one tile spans: 1 when block_n <= b (one scalar), else block_n / b.
    scale_rows = 1 if scale_block is None else max(1, bn // scale_block)

    def row_scales(k0):
        """The K step's scales: a scalar, or [1, bn] (one per weight row) when the tile spans rows."""
        kb = jnp.minimum(k0 // scale_block, scale_ref.shape[1] - 1)  # a masked tail may overshoot
        if scale_rows == 1:
            return scale_ref[col0 // scale_block, kb]
        first = col0 // scale_block
        mask = None
        if scale_ref.shape[0] % scale_rows:  # the last tile runs past the scale rows
            mask = ((first + jnp.arange(scale_rows)) < scale_ref.shape[0])[:, None]
        s = qc.load(scale_ref.at[compat.ds(first, scale_rows), compat.ds(kb, 1)], mask)  # [rows, 1]
        return jnp.broadcast_to(s, (scale_rows, scale_block)).reshape(1, bn)

    def step(t, acc):
        k0 = t * bk
        k_mask = None if even_k else (k0 + jnp.arange(bk)) < k_size
        bits = qc.load(w_ref.at[compat.ds(col0, bn), compat.ds(k0, bk)], _mask2(n_mask, k_mask, (bn, bk)))
        w = jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn).astype(compute_dtype)
        x = qc.load(x_ref.at[compat.ds(row0, bm), compat.ds(k0, bk)], _mask2(m_mask, k_mask, (bm, bk)))
        part = jax.lax.dot_general(x, w, qc.dims_nt(), preferred_element_type=f32)  # [bm, bn]
        return acc + (part if scale_block is None else part * row_scales(k0))

    steps = compat.cdiv(k_size, bk)
    acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((bm, bn), f32))
    if scale_block is None:
        acc = acc * scale_ref[0, 0]
    view = out_ref.at[compat.ds(row0, bm), compat.ds(col0, bn)]
    compat.store(view, acc.astype(out_ref.dtype), mask=_mask2(m_mask, n_mask, (bm, bn)))


def validate_fp8_matmul(x, w, scale, block_size, block_m, block_n, block_k, split_k, variant="dot") -> None:
    """Raise ValueError naming the offending value when the inputs or tile sizes do not fit."""
    if x.ndim != 2:
        raise ValueError(f"x must be [M, K]; got shape {x.shape}")
    if w.ndim != 2 or w.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"w must be float8_e4m3fn [N, K]; got {w.dtype} {w.shape}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"x has K={x.shape[1]} but w [N, K]={w.shape}")
    if x.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        raise ValueError(f"x must be bf16, f16 or f32; got {x.dtype}")
    n, k = w.shape
    if block_size is None:
        if jnp.size(scale) != 1:
            raise ValueError(f"a per-tensor scale must be a scalar; got shape {jnp.shape(scale)}")
    else:
        want = (compat.cdiv(n, block_size), compat.cdiv(k, block_size))
        if tuple(scale.shape) != want:
            raise ValueError(
                f"block scale must be [ceil(N/{block_size}), ceil(K/{block_size})]={want}; "
                f"got {tuple(scale.shape)}"
            )
        if block_size % block_k:
            raise ValueError(f"block_k={block_k} must divide the scale block_size={block_size}")
        if variant == "tiled":  # a tile may span whole scale rows
            if block_size % block_n and (block_n % block_size or not qc.is_pow2(block_size)):
                raise ValueError(
                    f"block_n={block_n} must divide the scale block_size={block_size} or be a "
                    "multiple of it (a power of two)"
                )
        elif block_size % block_n:
            raise ValueError(f"block_n={block_n} must divide the scale block_size={block_size}")
    for name, v in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if not qc.is_pow2(v) or v < 16:
            raise ValueError(f"{name}={v} must be a power of two >= 16")
    if split_k < 1:
        raise ValueError(f"split_k={split_k} must be >= 1")


@functools.partial(
    jax.jit,
    static_argnames=(
        "block_size",
        "variant",
        "block_m",
        "block_n",
        "block_k",
        "split_k",
        "num_warps",
        "num_stages",
        "group_m",
        "programs",
        "out_dtype",
        "interpret",
    ),
)
def fp8_matmul(
    x: jax.Array,
    w: jax.Array,
    scale: jax.Array,
    *,
    block_size: int | None = None,
    variant: str | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    group_m: int | None = None,
    programs: int | None = None,
    out_dtype=None,
    interpret: bool = False,
) -> jax.Array:
    """x [M, K] @ dequant(FP8 W [N, K]).T -> [M, N] in `out_dtype` (default x.dtype).

    `block_size=None`: `scale` is one float32; otherwise `scale` is float32
    [ceil(N/block_size), ceil(K/block_size)]. Every option left None comes from
    `DEFAULT_CONFIGS` for this M (the formulation too), given values override it; with block
    scales the default tiles are capped to block_size ("tiled": block_k only). Tile sizes are
    powers of two; block_m is the row tile of the dot formulations ("gemv" takes all M <= 8 rows
    in one program); group_m the M tiles per launch group of "tiled".
    """
    m = x.shape[0] if x.ndim == 2 else 0
    cfg = qc.resolve_config(
        DEFAULT_CONFIGS,
        m,
        variants=VARIANTS,
        variant=variant,
        block_n=block_n,
        block_k=block_k,
        split_k=split_k,
        num_warps=num_warps,
        num_stages=num_stages,
        block_m=block_m,
        group_m=group_m,
        programs=programs,
    )
    if block_size is not None:  # defaults (not explicit tiles) shrink to fit inside a scale block
        cfg = dataclasses.replace(
            cfg,
            block_n=cfg.block_n
            if block_n is not None or (cfg.variant == "tiled" and qc.is_pow2(block_size))
            else min(cfg.block_n, block_size),
            block_k=cfg.block_k if block_k is not None else min(cfg.block_k, block_size),
        )
    variant = cfg.variant
    block_m = min(compat.pow2_at_least(m, 16), 64) if cfg.block_m is None else cfg.block_m
    validate_fp8_matmul(x, w, scale, block_size, block_m, cfg.block_n, cfg.block_k, cfg.split_k, variant)
    k = x.shape[1]
    n = w.shape[0]
    out_dtype = x.dtype if out_dtype is None else out_dtype
    compute_dtype = jnp.float32 if x.dtype == jnp.float32 else x.dtype
    if variant == "tiled":
        return _tiled_call(x.astype(compute_dtype), w, scale, block_size, cfg, block_m, out_dtype, interpret)
    scale_arr = jnp.ones((1, 1), jnp.float32) if block_size is None else jnp.asarray(scale, jnp.float32)
    if qc.is_streamed(variant):
        steps = compat.cdiv(k, cfg.block_k)
        plan = qc.StreamedPlan.make(n, cfg.block_n, steps, cfg.programs or 2 * compat.sm_count())
        kernel = functools.partial(
            _fp8_streamed_kernel, plan=plan, rows=m, n_size=n, k_size=k, block_n=cfg.block_n,
            block_k=cfg.block_k, scale_block=block_size, even_k=k % cfg.block_k == 0,
        )  # fmt: skip
        partial = compat.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((plan.slots, m, n), jnp.float32),
            grid=(plan.grid,),
            compiler_params=qc.compiler_params(cfg),
            interpret=interpret,
            name=f"fp8_matmul_{variant}",
        )(x.astype(compute_dtype), jax.lax.bitcast_convert_type(w, jnp.uint8), scale_arr)
        y = qc.split_sum(partial)
    else:
        y = _decode_call(x.astype(compute_dtype), w, scale_arr, block_size, cfg, block_m, interpret)
    if block_size is None:
        y = y * jnp.asarray(scale, jnp.float32).reshape(())
    return y.astype(out_dtype)


def _decode_call(x, w, scale_arr, block_size, cfg: qc.MatmulConfig, block_m: int, interpret) -> jax.Array:
    """The gemv / dot / dot_t pallas_call and the split-K sum: float32 [M, N], before any
    per-tensor scale."""
    (m, k), n, variant = x.shape, w.shape[0], cfg.variant
    gemv = qc.is_gemv(variant)
    rows = m if gemv else block_m
    m_pad = m if gemv else compat.cdiv(m, block_m) * block_m
    xp = jnp.pad(x, ((0, m_pad - m), (0, 0)))
    steps = compat.cdiv(compat.cdiv(k, cfg.block_k), cfg.split_k)
    kernel = functools.partial(
        _fp8_kernel,
        variant=variant,
        rows=rows,
        n_size=n,
        k_size=k,
        block_n=cfg.block_n,
        block_k=cfg.block_k,
        steps=steps,
        scale_block=block_size,
        even_n=n % cfg.block_n == 0,
        even_k=k % (cfg.block_k * cfg.split_k) == 0,
    )
    out_shape = (cfg.split_k, n, m_pad) if variant == "dot_t" else (cfg.split_k, m_pad, n)
    partial = compat.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(out_shape, jnp.float32),
        grid=(1 if gemv else m_pad // block_m, compat.cdiv(n, cfg.block_n), cfg.split_k),
        compiler_params=qc.compiler_params(cfg),
        interpret=interpret,
        name=f"fp8_matmul_{variant}",
    )(xp, jax.lax.bitcast_convert_type(w, jnp.uint8), scale_arr)
    y = qc.split_sum(partial)
    return y.T[:m] if variant == "dot_t" else y[:m]


def _tiled_call(x, w, scale, block_size, cfg: qc.MatmulConfig, block_m: int, out_dtype, interpret):
    """The "tiled" (prefill) pallas_call: y [M, N] written by the kernel, nothing after it."""
    (m, k), n = x.shape, w.shape[0]
    m_tiles, n_tiles = qc.tiled_grid(m, n, block_m, cfg.block_n)
    kernel = functools.partial(
        _fp8_tiled_kernel,
        m_size=m,
        n_size=n,
        k_size=k,
        block_m=block_m,
        block_n=cfg.block_n,
        block_k=cfg.block_k,
        group_m=cfg.group_m,
        scale_block=block_size,
        even_m=m % block_m == 0,
        even_n=n % cfg.block_n == 0,
        even_k=k % cfg.block_k == 0,
    )
    scale_arr = jnp.asarray(scale, jnp.float32)
    return compat.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(m_tiles * n_tiles,),
        compiler_params=qc.compiler_params(cfg),
        interpret=interpret,
        name="fp8_matmul_tiled",
    )(
        x,
        jax.lax.bitcast_convert_type(w, jnp.uint8),
        scale_arr.reshape(1, 1) if block_size is None else scale_arr,
    )
