"""NVFP4 weight x bf16 activation matmul (decode and prefill): a Pallas GPU (Triton) kernel.

    y[m, n] = sum_k x[m, k] * W[n, k],
    W[n, k] = e2m1(code[n, k]) * float(block_scale[n, k // 16]) * tensor_scale

with the weight in ModelOpt's layout (docs/quant_formats.md): `packed` uint8 [N, K/2] holding
element 2j in the low nibble of byte j and element 2j+1 in the high nibble, `block_scale`
float8_e4m3fn [N, K/16], `tensor_scale` (ModelOpt's `weight_scale_2`) a float32 scalar.

Decode is memory bound: the kernel streams the packed bytes and their scales once and unpacks
them in registers. Each byte holds an even and an odd element of K, so instead of interleaving
nibbles in registers the activation is split once outside the kernel into its even and odd
columns and every product is done twice per K step (low nibbles x even columns, high nibbles x
odd columns). Nibbles are decoded with the float16 bit trick of `_quant_common.e2m1_f16_bits`
(exact for all 16 codes); code * block_scale has at most 6 significant bits, so it is exact in
bf16 and float32; the tensor scale is applied once to the float32 sum.

Formulations (`variant`, see pallas_kernels/_quant_common.py and docs/pallas.md):
  "gemv"     float32 FMAs on CUDA cores, one [block_n, block_k/2] accumulator per row (M <= 8);
  "gemv_bs"  as gemv, but products are first summed within each 16-element block and the block
             scale multiplies the [block_n, block_k/16] block sums (no scale broadcast);
  "dot"      x [16, bk] @ W.T on tensor cores, M padded to 16;
  "dot_t"    W [bn, bk] @ x.T on tensor cores (weight tile as the left operand);
  "tiled"    prefill (large M): [block_m, block_n] output tiles on a flat grid in grouped order,
             each weight tile decoded to bf16 once per K step for all block_m rows; writes y
             directly (tensor scale applied, no split K, no padding of x).
  "gemv_w"   word decode (below) on CUDA cores, no tensor cores (M <= 8): each weight element
             times its float16 activation is exact in float16 (<= 3 + 8 significant bits), the 8
             products of a word are summed in float16 and the sum converted once, times the block
             scale, into float32 accumulators. The only rounding is that of the 8-term float16
             sums (GEMV_W_TOLERANCE of max |y| at most; below a bf16 output's own rounding). On
             the H200 the tensor-core dots of the word decode cost more than the decode itself
             (bench/kernel_bounds.py: 27B gate_up read 2083 GB/s, + decode 1735, + dots 719);
  "gemv_wp"  gemv_w with the next K step's words and scales loaded before this step's products
             (carried through the loop): Triton pipelines only the loads that feed dots, so a
             CUDA-core kernel keeps bytes in flight only by asking for them early;
  "gemv_ws"  gemv_wp's loads and products streamed (`_quant_common.streamed_gemv`): a fixed grid
             of `programs` (default two per SM), each walking an equal run of (N tile, K step)
             units in one loop, its loads one unit ahead across tile boundaries; partial sums of a
             tile shared by several programs go to separate slots, summed after the kernel;
  "gemv_bs_ws", "gemv_bsx_ws"
             gemv_ws on [block_n, block_k / 16, 2] word tiles (a scale block's two words side by
             side): the 16 products of a block summed in float16, the block scale applied to the
             block sum in float32 (no spread of the scales over the words, half the conversions);
             "gemv_bsx_ws" also loads the unit's activation a unit ahead with its words;
  "gemv_h2w_ws", "gemv_h2wx_ws"
             gemv_ws's loads and tiles with each word's 8 products in packed half2 PTX
             (`_e2m1_half2.word_dots`); the interpreter computes the same float16 sums;
             "gemv_h2wx_ws" also loads the activation pairs a unit ahead, in the words' layout;
  "dot_ws"   dot_w's float16 dots on the same streamed plan (M in tiles of block_m);
  "gemv_h2_ws"
             gemv_ws with each 16-element scale block's products done in packed half2 PTX
             (`_e2m1_half2`): 8 `fma.rn.f16x2` a block instead of 16 float16 operations and one
             conversion to float32 a block instead of two, the block scale applied to the block
             sum (no broadcast of the scales over words); the words are read as two stride-2
             tiles, even and odd, aligned with the scale tile (an [N, K/16, 2] view). Inline
             PTX runs only compiled on a GPU; the interpreter computes the same sums with
             float16 jnp operations;
  "dot_jw"   dot_w with the 8 element tiles joined back into element order in registers and one
             dot of depth block_k a K step, x in its natural order (`_joined_word_dot`; offline,
             bench.kernel_ir: 638 against dot_w's 734 SASS a step);
  "dot_w", "dot_t_w", "tiled_w"
             the dot formulations on float16 tensor cores with the weight decoded from whole 32-bit
             words (`_quant_common.e2m1_word_f16`: no float conversion per element, which bounds
             the nibble decode above); the activation enters as float16, each row scaled by a
             power of two (`_quant_common.f16_rows`: exact for bf16 inputs) and its columns
             reordered to the words' element order (`_quant_common.word_columns`).
  With x_rows="kernel" (KERNEL_ROWS_VARIANTS) x enters as given, in natural order: the kernel
  takes its rows' max |x| first, scales what it loads to float16 with `f16_rows`' factors (the
  same bits) and undoes them before its store; the word gemvs load each K step's x contiguously
  and split it into the 8 element positions in registers. XLA's reduce, convert and transpose
  launches before each call go; on an H100 the kernels' extra work cost more than those launches
  (docs/pallas.md), so "xla" stays the default.
The entry picks the formulation by M from `DEFAULT_CONFIGS` unless told.

Grid: (M tiles, N tiles, split_k). split_k > 1 splits the K loop over programs (more programs
in flight when N / block_n is smaller than the number of SMs); the partial sums are added
outside the kernel. When N and K divide the tiles the kernel is built without any load masks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import _e2m1_half2 as h2
from pallas_kernels import _quant_common as qc
from pallas_kernels import compat

# The 16 E2M1 values indexed by their 4-bit code (bit 3 = sign).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 16  # elements of K per block scale
DECODE_VARIANTS = (
    "gemv", "gemv_bs", "dot", "dot_t", "dot_w", "dot_t_w", "gemv_w", "gemv_wp", "gemv_ws", "dot_ws", "gemv_h2_ws",
    "gemv_bs_ws", "gemv_bsx_ws", "gemv_h2w_ws", "gemv_h2wx_ws", "dot_jw",
)  # fmt: skip
VARIANTS = (*DECODE_VARIANTS, "tiled", "tiled_w")
# Weights decoded from uint32 words: float16 dots, or (gemv_w) float16 products on CUDA cores.
WORD_VARIANTS = (
    "dot_w", "dot_t_w", "tiled_w", "gemv_w", "gemv_wp", "gemv_ws", "dot_ws", "gemv_h2_ws", "gemv_bs_ws", "gemv_bsx_ws",
    "gemv_h2w_ws", "gemv_h2wx_ws", "dot_jw",
)  # fmt: skip
# The word variants that can take x as given and make its float16 rows themselves
# (MatmulConfig.x_rows="kernel", `_x_word_tiles`); the others need XLA's `f16_rows` before the launch.
KERNEL_ROWS_VARIANTS = ("gemv_w", "gemv_wp", "gemv_ws", "dot_jw")
# gemv_w sums the 8 products of a word in float16 (each product is exact there): its result differs
# from the float32 reference by rounding, at most about this fraction of max |y| (tests use it).
GEMV_W_TOLERANCE = 4e-3

# Default configuration by the largest M it serves (qc.pick_config): fill in from
# `python -m bench.kernels --sweep` (bench/results/kernels-sweep-<machine>.json).
# From the H200 sweep (bench/results/kernels-nvidia-h200.json): "dot" with 256-element K steps won
# every Qwen3.5-27B and Qwen3-Next-80B shape at batch 1 and 8 but one (a 4 MB layer); the best
# split_k depends on N (`weights.quant.nvfp4_tiles` picks it per shape).
DEFAULT_CONFIGS: dict[int, qc.MatmulConfig] = {
    1: qc.MatmulConfig("dot", block_n=64, block_k=256, split_k=1, num_warps=4, num_stages=3),
    8: qc.MatmulConfig("dot", block_n=64, block_k=256, split_k=1, num_warps=4, num_stages=3),
    64: qc.MatmulConfig("dot", block_n=64, block_k=256, split_k=1, num_warps=4, num_stages=3),
    # Prefill: not yet measured (`python -m bench.kernels --prefill` sweeps it).
    qc.PREFILL_M: qc.MatmulConfig(
        "tiled", block_n=128, block_k=128, split_k=1, num_warps=8, num_stages=3, block_m=128, group_m=8
    ),
}


def decode_e2m1(codes: jax.Array) -> jax.Array:
    """int32 codes in [0, 16) -> float32 E2M1 values, with arithmetic only (no table gather).

    Magnitude codes 0..7 are 0, .5, 1, 1.5, 2, 3, 4, 6: half the code below 4, code - 2 for 4
    and 5, 2 * code - 8 for 6 and 7. Bit 3 negates.
    """
    c = (codes & 7).astype(jnp.float32)
    mag = jnp.where(c < 4.0, 0.5 * c, jnp.where(c < 6.0, c - 2.0, 2.0 * c - 8.0))
    return jnp.where(codes >= 8, -mag, mag)


def reference_nvfp4_matmul(
    x: jax.Array, packed: jax.Array, block_scale: jax.Array, tensor_scale: jax.Array
) -> jax.Array:
    """Plain-jnp reference in float32: x [M, K] @ dequant(W [N, K]).T -> float32 [M, N]."""
    table = jnp.asarray(E2M1_VALUES, jnp.float32)
    low = table[(packed & 0xF).astype(jnp.int32)]
    high = table[(packed >> 4).astype(jnp.int32)]
    n, kh = packed.shape
    values = jnp.stack([low, high], axis=-1).reshape(n, 2 * kh)
    scales = jnp.repeat(block_scale.astype(jnp.float32), BLOCK, axis=-1)
    w = values * scales * jnp.asarray(tensor_scale, jnp.float32)
    return jnp.dot(x.astype(jnp.float32), w.T, precision=jax.lax.Precision.HIGHEST)


def _mask2(rows: jax.Array | None, cols: jax.Array | None, shape: tuple[int, int]) -> jax.Array | None:
    """The [rows, cols] load mask from optional 1-D row and column masks (None: no mask at all)."""
    if rows is None and cols is None:
        return None
    if rows is None:
        return jnp.broadcast_to(cols[None, :], shape)
    if cols is None:
        return jnp.broadcast_to(rows[:, None], shape)
    return rows[:, None] & cols[None, :]


def _nvfp4_kernel(
    x_even_ref,  # [Mp, K/2] activation columns 0, 2, 4, ... (gemv: [M, K/2], unpadded)
    x_odd_ref,  # [Mp, K/2] activation columns 1, 3, 5, ...
    packed_ref,  # [N, K/2] uint8, low nibble = even element
    scale_ref,  # [N, K/16] uint8: the bits of the float8_e4m3fn block scales
    out_ref,  # float32 partial sums: [split_k, Mp, N] (dot, gemv*) or [split_k, N, Mp] (dot_t)
    *,
    variant: str,
    rows: int,  # gemv*: M; dot*: block_m
    n_size: int,
    half_k: int,
    block_n: int,
    half_block_k: int,
    steps: int,
    even_n: bool,
    even_k: bool,
):
    i, j, split = compat.program_id(0), compat.program_id(1), compat.program_id(2)
    col0 = j * block_n
    bn, bkh, bs = block_n, half_block_k, half_block_k // 8  # bs: block scales per row per step
    n_mask = None if even_n else (col0 + jnp.arange(bn)) < n_size
    compute_dtype = x_even_ref.dtype
    gemv = qc.is_gemv(variant)

    def step(t, acc):
        kb = (split * steps + t) * bkh  # byte column of this K step
        k_mask = None if even_k else (kb + jnp.arange(bkh)) < half_k
        s_mask = None if even_k else (kb // 8 + jnp.arange(bs)) < half_k // 8
        packed = qc.load(
            packed_ref.at[compat.ds(col0, bn), compat.ds(kb, bkh)], _mask2(n_mask, k_mask, (bn, bkh))
        )
        # Loaded as uint8 (a masked fp8 load cannot take a fill value in Triton), then bitcast.
        scale_bits = qc.load(
            scale_ref.at[compat.ds(col0, bn), compat.ds(kb // 8, bs)], _mask2(n_mask, s_mask, (bn, bs))
        )
        scale = jax.lax.bitcast_convert_type(scale_bits, jnp.float8_e4m3fn).astype(jnp.float32)
        scale = scale * qc.E2M1_F16_SCALE  # [bn, bs]; exact (a power of two)
        low = qc.e2m1_f16_bits(packed, high=False)  # [bn, bkh] float32, e2m1 / 2**14
        high = qc.e2m1_f16_bits(packed, high=True)

        def load_x(ref, r):
            if gemv:  # row r, [1, bkh]
                mask = None if k_mask is None else k_mask[None, :]
                return qc.load(ref.at[compat.ds(r, 1), compat.ds(kb, bkh)], mask)
            return qc.load(
                ref.at[compat.ds(i * rows, rows), compat.ds(kb, bkh)], _mask2(None, k_mask, (rows, bkh))
            )

        if variant == "gemv_bs":  # per-block sums first, then one scale multiply per block
            out = []
            for r in range(rows):
                xe = load_x(x_even_ref, r).astype(jnp.float32)
                xo = load_x(x_odd_ref, r).astype(jnp.float32)
                prod = low * xe + high * xo
                out.append(acc[r] + prod.reshape(bn, bs, 8).sum(axis=2) * scale)
            return tuple(out)
        # [bn, bs] -> [bn, bkh]: one block scale covers 8 bytes (16 elements).
        scale = jnp.broadcast_to(scale[:, :, None], (bn, bs, 8)).reshape(bn, bkh)
        w_low, w_high = low * scale, high * scale  # exact: <= 6 significant bits
        if variant == "gemv":
            out = []
            for r in range(rows):
                xe = load_x(x_even_ref, r).astype(jnp.float32)
                xo = load_x(x_odd_ref, r).astype(jnp.float32)
                out.append(acc[r] + w_low * xe + w_high * xo)
            return tuple(out)
        xe, xo = load_x(x_even_ref, 0), load_x(x_odd_ref, 0)
        w_low, w_high = w_low.astype(compute_dtype), w_high.astype(compute_dtype)
        f32 = jnp.float32
        if variant == "dot":  # [rows, bkh] x [bn, bkh] -> [rows, bn]
            acc += jax.lax.dot_general(xe, w_low, qc.dims_nt(), preferred_element_type=f32)
            acc += jax.lax.dot_general(xo, w_high, qc.dims_nt(), preferred_element_type=f32)
        else:  # dot_t: [bn, bkh] x [rows, bkh] -> [bn, rows]
            acc += jax.lax.dot_general(w_low, xe, qc.dims_nt(), preferred_element_type=f32)
            acc += jax.lax.dot_general(w_high, xo, qc.dims_nt(), preferred_element_type=f32)
        return acc

    qc.accumulate_and_store(
        step, steps, variant=variant, rows=rows, bn=bn, gemv_width=bs if variant == "gemv_bs" else bkh,
        out_ref=out_ref, split=split, row0=i * rows, col0=col0, n_mask=n_mask,
    )  # fmt: skip


def _nvfp4_tiled_kernel(
    x_even_ref,  # [M, K/2] activation columns 0, 2, 4, ... (unpadded: rows past M are masked)
    x_odd_ref,  # [M, K/2] activation columns 1, 3, 5, ...
    packed_ref,  # [N, K/2] uint8, low nibble = even element
    scale_ref,  # [N, K/16] uint8: the bits of the float8_e4m3fn block scales
    tensor_scale_ref,  # [1, 1] float32
    out_ref,  # [M, N] in the output dtype, written once (no partial sums)
    *,
    m_size: int,
    n_size: int,
    half_k: int,
    block_m: int,
    block_n: int,
    half_block_k: int,
    group_m: int,
    even_m: bool,
    even_n: bool,
    even_k: bool,
):
    """One [block_m, block_n] output tile of the prefill formulation ("tiled").

    Per K step the [block_n, block_k/2] packed tile and its [block_n, block_k/16] scales are
    decoded once into two bf16 tiles (low / high nibbles, exact) and multiplied by the even and
    odd activation columns of all block_m rows on tensor cores, accumulating in float32.
    """
    m_tiles, n_tiles = qc.tiled_grid(m_size, n_size, block_m, block_n)
    i, j = qc.grouped_tile(compat.program_id(0), m_tiles, n_tiles, group_m)
    row0, col0 = i * block_m, j * block_n
    bm, bn, bkh, bs = block_m, block_n, half_block_k, half_block_k // 8
    m_mask = None if even_m else (row0 + jnp.arange(bm)) < m_size
    n_mask = None if even_n else (col0 + jnp.arange(bn)) < n_size
    compute_dtype = x_even_ref.dtype
    f32 = jnp.float32

    def step(t, acc):
        kb = t * bkh  # byte column of this K step
        k_mask = None if even_k else (kb + jnp.arange(bkh)) < half_k
        s_mask = None if even_k else (kb // 8 + jnp.arange(bs)) < half_k // 8
        packed = qc.load(
            packed_ref.at[compat.ds(col0, bn), compat.ds(kb, bkh)], _mask2(n_mask, k_mask, (bn, bkh))
        )
        scale_bits = qc.load(
            scale_ref.at[compat.ds(col0, bn), compat.ds(kb // 8, bs)], _mask2(n_mask, s_mask, (bn, bs))
        )
        scale = jax.lax.bitcast_convert_type(scale_bits, jnp.float8_e4m3fn).astype(f32)
        scale = scale * qc.E2M1_F16_SCALE  # [bn, bs]; exact (a power of two)
        scale = jnp.broadcast_to(scale[:, :, None], (bn, bs, 8)).reshape(bn, bkh)
        w_low = (qc.e2m1_f16_bits(packed, high=False) * scale).astype(compute_dtype)  # exact
        w_high = (qc.e2m1_f16_bits(packed, high=True) * scale).astype(compute_dtype)
        x_mask = _mask2(m_mask, k_mask, (bm, bkh))
        xe = qc.load(x_even_ref.at[compat.ds(row0, bm), compat.ds(kb, bkh)], x_mask)
        xo = qc.load(x_odd_ref.at[compat.ds(row0, bm), compat.ds(kb, bkh)], x_mask)
        acc += jax.lax.dot_general(xe, w_low, qc.dims_nt(), preferred_element_type=f32)
        acc += jax.lax.dot_general(xo, w_high, qc.dims_nt(), preferred_element_type=f32)
        return acc

    steps = compat.cdiv(half_k, bkh)
    acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((bm, bn), f32))
    y = (acc * tensor_scale_ref[0, 0]).astype(out_ref.dtype)
    view = out_ref.at[compat.ds(row0, bm), compat.ds(col0, bn)]
    compat.store(view, y, mask=_mask2(m_mask, n_mask, (bm, bn)))


def _word_loads(words_ref, scale_ref, *, kw, col0, bn, bw, n_mask, words_k, even_k, scale_spread="reshape"):
    """The [bn, bw] uint32 words of the K step at word column kw and their scale bits: [bn, bw / 2]
    (scale_spread "reshape": one byte per scale block), or [bn, bw] ("gather": each word's own
    block byte, read through an index tile of the words' shape). The gather is for the
    CUDA-core gemv: Triton gives the index tile the words' register layout, so no word waits on
    a shared-memory round trip and barrier to meet its scale, where spreading the block bytes
    over the words with a reshape costs both in every K step (bench.kernel_counters on an H100:
    barrier stalls ~15% of the gemv_ws samples)."""
    bs = bw // 2
    k_mask = None if even_k else (kw + jnp.arange(bw)) < words_k
    s_mask = None if even_k else (kw // 2 + jnp.arange(bs)) < words_k // 2
    view = words_ref.at[compat.ds(col0, bn), compat.ds(kw, bw)]
    words = qc.load(view, _mask2(n_mask, k_mask, (bn, bw)))
    if scale_spread == "gather":  # indices clamped in range: masked-off lanes read nothing anyway
        rows_i = jnp.minimum(col0 + jnp.arange(bn), scale_ref.shape[0] - 1)[:, None]
        blocks_i = jnp.minimum((kw + jnp.arange(bw)) // 2, scale_ref.shape[1] - 1)[None, :]
        return words, qc.load(scale_ref.at[rows_i, blocks_i], _mask2(n_mask, k_mask, (bn, bw)))
    bits = qc.load(
        scale_ref.at[compat.ds(col0, bn), compat.ds(kw // 2, bs)], _mask2(n_mask, s_mask, (bn, bs))
    )
    return words, bits


def _word_step(acc, x_ref, words_ref, scale_ref, *, kw, col0, bn, bw, n_mask, words_k, even_k, row0, rows,
               m_mask, transposed):  # fmt: skip
    """acc += x [rows, 8 * bw elements] @ W.T for the K step of `bw` weight words starting at word
    column kw: the [bn, bw] words and their block scales (one e4m3 scale covers two words, loaded
    as uint8 bits as in `_nvfp4_kernel`; exact in float16), then 8 float16 dots, one per element
    position p of the words (x columns p * K/8 + kw ..., see `_quant_common.word_columns`).
    code / 2**14 times an e4m3 scale is exact in float16 (<= 6 significant bits, >= 2**-24)."""
    words, bits = _word_loads(
        words_ref, scale_ref, kw=kw, col0=col0, bn=bn, bw=bw, n_mask=n_mask, words_k=words_k, even_k=even_k
    )
    return _word_dots(acc, x_ref, words, bits, kw=kw, bn=bn, bw=bw, words_k=words_k, even_k=even_k,
                      row0=row0, rows=rows, m_mask=m_mask, transposed=transposed)  # fmt: skip


def _word_scales(bits: jax.Array, bn: int, bw: int, dtype) -> jax.Array:
    """The [bn, bw] block scales of a word tile as `dtype`, from the e4m3 bits `_word_loads` gave:
    one byte per block ([bn, bw / 2], spread over its two words) or already one per word."""
    scale = jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn).astype(dtype)
    if bits.shape[1] == bw:
        return scale
    return jnp.broadcast_to(scale[:, :, None], (bn, bw // 2, 2)).reshape(bn, bw)


def _word_dots(acc, x_ref, words, bits, *, kw, bn, bw, words_k, even_k, row0, rows, m_mask, transposed):
    """`_word_step`'s 8 float16 dots on loaded words and scale bits."""
    f32 = jnp.float32
    k_mask = None if even_k else (kw + jnp.arange(bw)) < words_k
    scale = _word_scales(bits, bn, bw, jnp.float16)
    x_mask = _mask2(m_mask, k_mask, (rows, bw))
    for p, w in enumerate(qc.e2m1_word_f16(words)):
        w = w * scale
        xp = qc.load(x_ref.at[compat.ds(row0, rows), compat.ds(p * words_k + kw, bw)], x_mask)
        if transposed:  # [bn, bw] x [rows, bw] -> [bn, rows]
            acc += jax.lax.dot_general(w, xp, qc.dims_nt(), preferred_element_type=f32)
        else:  # [rows, bw] x [bn, bw] -> [rows, bn]
            acc += jax.lax.dot_general(xp, w, qc.dims_nt(), preferred_element_type=f32)
    return acc


def _joined_word_dot(acc, x_ref, words, bits, *, kw, bn, bw, words_k, even_k, row0, rows, m_mask, x_factor=None):
    """"dot_jw": `_word_dots`' 8 scaled element tiles interleaved back into element order in
    registers (`jnp.stack` on a new last axis lowers to `tt.join`, kept in-thread: pairs (p, p + 4),
    then two apart, then one apart give [bn, bw, 2, 2, 2] holding element p at (p // 4, p // 2 % 2,
    p % 2), and a reshape puts element 8j + p at column 8j + p), then ONE float16 dot of depth
    8 bw with x in its natural column order: no `word_columns` reorder of x before the kernel, and
    no float32 add after each of 8 dots (Pallas starts every dot from a zero accumulator).
    With `x_factor` (float32 [rows]) x holds the raw rows, scaled here to float16 as `qc.f16_rows`
    does (the grouped kernel's x_rows="kernel")."""
    scale = _word_scales(bits, bn, bw, jnp.float16)
    tiles = [w * scale for w in qc.e2m1_word_f16(words)]
    pairs = [jnp.stack([tiles[k], tiles[k + 4]], axis=-1) for k in range(4)]
    quads = [jnp.stack([pairs[k], pairs[k + 2]], axis=-1) for k in range(2)]
    w_all = jnp.stack([quads[0], quads[1]], axis=-1).reshape(bn, 8 * bw)
    k_mask = None if even_k else (8 * kw + jnp.arange(8 * bw)) < 8 * words_k
    view = x_ref.at[compat.ds(row0, rows), compat.ds(8 * kw, 8 * bw)]
    xn = qc.load(view, _mask2(m_mask, k_mask, (rows, 8 * bw)))
    if x_factor is not None:
        xn = (xn.astype(jnp.float32) * x_factor[:, None]).astype(jnp.float16)
    return acc + jax.lax.dot_general(xn, w_all, qc.dims_nt(), preferred_element_type=jnp.float32)


def _x_word_tiles(x_ref, row, kw, bw: int, words_k: int, even_k: bool, x_factor) -> list[jax.Array]:
    """x_rows="kernel" for the word gemvs: row `row` of x as given (natural order) at words kw ..
    kw + bw, as the 8 float16 [1, bw] tiles of element positions p = 0..7 (columns 8 (kw + j) + p):
    one contiguous load of the 8 bw columns, scaled to float16 with the row's factor (float32 [1],
    `qc.f16_row_factors`) as `qc.f16_rows` does, then split in registers (a reshape to
    [1, bw, 2, 2, 2] and three `unstack`s of the last axis, which lower to `tt.split`: p = 4a + 2b + c
    for the indices (a, b, c) of those three axes)."""
    mask = None if even_k else ((8 * kw + jnp.arange(8 * bw)) < 8 * words_k)[None, :]
    xn = qc.load(x_ref.at[compat.ds(row, 1), compat.ds(8 * kw, 8 * bw)], mask)
    xn = (xn.astype(jnp.float32) * x_factor[:, None]).astype(jnp.float16).reshape(1, bw, 2, 2, 2)
    by_c = jax.lax.unstack(xn, axis=4)
    by_bc = [jax.lax.unstack(t, axis=3) for t in by_c]  # [c][b] -> [1, bw, 2] over a
    tiles = {}
    for c in range(2):
        for b in range(2):
            for a, t in enumerate(jax.lax.unstack(by_bc[c][b], axis=2)):
                tiles[4 * a + 2 * b + c] = t
    return [tiles[p] for p in range(8)]


ROW_MAX_WIDTH = 8192  # the widest tile of the row-max pass of the gemvs that make their own rows


def _own_row_factors(x_ref, rows: int, k: int) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
    """x_rows="kernel" for the gemvs (all M rows in one program): each row's (factor, inverse),
    float32 [1] each, from its max |x| over all of K (`qc.row_max_abs`, `qc.f16_row_factors`),
    in tiles as wide as the row up to ROW_MAX_WIDTH columns: every program pays this pass's
    latency before its first product, so it takes as few steps as the registers allow."""
    width = min(compat.pow2_at_least(k, 16), ROW_MAX_WIDTH)
    pairs = [qc.f16_row_factors(qc.row_max_abs(x_ref, r, 1, None, k, width)) for r in range(rows)]
    return tuple(f for f, _ in pairs), tuple(i for _, i in pairs)


def _word_gemv_products(acc, x_ref, words, bits, *, kw, bn, bw, words_k, even_k, rows, row0=0, last_row=None,
                        x_factors=None):  # fmt: skip
    """gemv_w: acc[r] [bn, bw] float32 += block scale * (sum over the 8 element positions p of
    word-decoded weight p times x row row0 + r's columns p * K/8 + kw ...), the sum in float16.
    row0 may be traced (the grouped kernel's work item); rows past `last_row` read it instead.
    `bits`: [bn, bw / 2] block bytes, or [bn, bw] already one per word (`_word_loads`' gather).
    x_factors (one float32 [1] per row): x holds the rows as given, in natural order
    (`_x_word_tiles`)."""
    scale = _word_scales(bits, bn, bw, jnp.float32)
    weights = qc.e2m1_word_f16(words)
    x_mask = None if even_k else ((kw + jnp.arange(bw)) < words_k)[None, :]
    out = []
    for r in range(rows):
        row = row0 + r if last_row is None else jnp.minimum(row0 + r, last_row)
        if x_factors is not None:
            x_tiles = _x_word_tiles(x_ref, row, kw, bw, words_k, even_k, x_factors[r])
        total = None
        for p, w in enumerate(weights):
            if x_factors is None:
                xp = qc.load(x_ref.at[compat.ds(row, 1), compat.ds(p * words_k + kw, bw)], x_mask)
            else:
                xp = x_tiles[p]
            total = w * xp if total is None else total + w * xp
        out.append(acc[r] + total.astype(jnp.float32) * scale)
    return tuple(out)


def _nvfp4_word_kernel(
    x_ref,  # [M, K] float16, rows scaled (qc.f16_rows), columns in word order (qc.word_columns);
    # raw_rows: x as given, natural order (dot_jw: natural order either way)
    words_ref,  # [N, K/8] uint32: bytes 4j .. 4j+3 of each packed row (elements 8j .. 8j+7)
    scale_ref,  # [N, K/16] uint8: the bits of the float8_e4m3fn block scales
    out_ref,  # float32 partial sums: [split_k, Mp, N] (dot_w) or [split_k, N, Mp] (dot_t_w)
    *,
    variant: str,
    rows: int,  # block_m
    m_size: int,
    n_size: int,
    words_k: int,  # K / 8
    block_n: int,
    block_w: int,  # words per row per K step (block_k / 8)
    steps: int,
    even_n: bool,
    even_k: bool,
    scale_spread: str = "reshape",
    raw_rows: bool = False,
):
    """raw_rows (x_rows="kernel"): the program scales its x rows to float16 itself, with factors
    from their max |x| over all of K, and multiplies its partial sums back before the store."""
    i, j, split = compat.program_id(0), compat.program_id(1), compat.program_id(2)
    col0, bn, bw = j * block_n, block_n, block_w
    n_mask = None if even_n else (col0 + jnp.arange(bn)) < n_size
    # x rows past M are masked, not padded: at decode (M = 1 in a 16-row dot) the padding would
    # be read on every K step, twice the weight tile's bytes.
    m_mask = None if m_size % rows == 0 else (i * rows + jnp.arange(rows)) < m_size
    x_factors = row_scale = None
    if raw_rows and variant == "dot_jw":
        factor, row_scale = qc.f16_row_factors(qc.row_max_abs(x_ref, i * rows, rows, m_mask, 8 * words_k, 8 * bw))
        x_factors = factor
    elif raw_rows:
        x_factors, row_scale = _own_row_factors(x_ref, rows, 8 * words_k)

    def kw_of(t):
        return (split * steps + t) * bw

    def loads(t):
        spread = scale_spread if qc.is_gemv(variant) else "reshape"  # the dots take block bytes
        return _word_loads(words_ref, scale_ref, kw=kw_of(t), col0=col0, bn=bn, bw=bw, n_mask=n_mask,
                           words_k=words_k, even_k=even_k, scale_spread=spread)  # fmt: skip

    def products(acc, t, words, bits):
        return _word_gemv_products(acc, x_ref, words, bits, kw=kw_of(t), bn=bn, bw=bw, words_k=words_k,
                                   even_k=even_k, rows=rows, x_factors=x_factors)  # fmt: skip

    if variant == "gemv_wp":  # the next step's words are loaded before this step's products

        def prefetching_step(t, carry):
            acc, words, bits = carry[:rows], carry[rows], carry[rows + 1]
            ahead = loads(jnp.minimum(t + 1, steps - 1))  # the last step reloads itself
            return (*products(acc, t, words, bits), *ahead)

        qc.accumulate_and_store(
            prefetching_step, steps, variant=variant, rows=rows, bn=bn, gemv_width=bw, out_ref=out_ref,
            split=split, row0=i * rows, col0=col0, n_mask=n_mask, carry_extra=loads(0), row_scale=row_scale,
        )  # fmt: skip
        return

    def step(t, acc):
        kw = kw_of(t)
        if variant == "gemv_w":
            return products(acc, t, *loads(t))
        if variant == "dot_jw":
            return _joined_word_dot(acc, x_ref, *loads(t), kw=kw, bn=bn, bw=bw, words_k=words_k, even_k=even_k,
                                    row0=i * rows, rows=rows, m_mask=m_mask, x_factor=x_factors)  # fmt: skip
        return _word_dots(
            acc, x_ref, *loads(t), kw=kw, bn=bn, bw=bw, words_k=words_k, even_k=even_k, row0=i * rows,
            rows=rows, m_mask=m_mask, transposed=variant == "dot_t_w",
        )  # fmt: skip

    qc.accumulate_and_store(
        step, steps, variant=variant, rows=rows, bn=bn, gemv_width=bw,
        out_ref=out_ref, split=split, row0=i * rows, col0=col0, n_mask=n_mask, row_scale=row_scale,
    )  # fmt: skip


def _streamed_word_loads(words_ref, scale_ref, *, bn, bw, n_size, words_k, even_k, scale_spread="reshape"):
    """The `loads(col0, ks, valid)` of the streamed word formulations (`_quant_common.streamed_loop`):
    one unit's words and scale bits, nothing read for rows past N or where `valid` is false."""

    def loads(col0, ks, valid):
        n_mask = ((col0 + jnp.arange(bn)) < n_size) & valid
        return _word_loads(words_ref, scale_ref, kw=ks * bw, col0=col0, bn=bn, bw=bw, n_mask=n_mask,
                           words_k=words_k, even_k=even_k, scale_spread=scale_spread)  # fmt: skip

    return loads


def _nvfp4_streamed_kernel(
    x_ref,  # [M, K] float16, rows scaled (qc.f16_rows), columns in word order (qc.word_columns);
    # half2: [M, K/2] uint32 activation pairs, column p * K/8 + j (`_e2m1_half2.word_x_pairs`)
    *refs,  # per segment: words [N_s, K/8] uint32, scale bits [N_s, K/16] uint8; then out_ref
    plan: qc.StreamedPlan,
    segments: qc.Segments,
    rows: int,
    words_k: int,
    block_w: int,
    even_k: bool,
    scale_spread: str,
    half2: bool = False,
    x_ahead: bool = False,
    interpret: bool = False,
    raw_rows: bool = False,
):
    """The "gemv_ws" formulation: gemv_w's loads and products over a streamed plan
    (`_quant_common.streamed_gemv`); out_ref [slots, M, segments.n_size] float32 partial sums.
    half2 ("gemv_h2w_ws"): each word's 8 products in packed half2 PTX (`_e2m1_half2.word_dots`:
    the decoded pairs are the operands, 1 mul and 3 `fma.rn.f16x2` a word, one conversion), where
    the float16 code unpacks every pair into two halves first; an H100 profile of gemv_ws put it
    at ~64% issue use, bound by its ~44 instructions a word (docs/pallas.md).
    x_ahead ("gemv_h2wx_ws", with half2): each unit's activation pairs are loaded a unit ahead with
    its words, through index tiles of the words' shape, so Triton gives them the words' register
    layout and carries them without a conversion (on the H200 the half2 form waits on memory:
    long-scoreboard stalls 3.3 cycles an issue; bench.kernel_ir: 277 -> 297 SASS instructions a
    unit, 64 -> 80 registers, no conversion).
    raw_rows (x_rows="kernel", gemv_ws only): x as given in natural order; each program takes the
    rows' factors first and scales its stores back (`_own_row_factors`)."""
    bn, bw, out_ref = segments.block_n, block_w, refs[-1]
    x_factors = row_scale = None
    if raw_rows:
        x_factors, row_scale = _own_row_factors(x_ref, rows, 8 * words_k)

    def per_segment(s):
        return _streamed_word_loads(refs[2 * s], refs[2 * s + 1], bn=bn, bw=bw, n_size=segments.sizes[s],
                                    words_k=words_k, even_k=even_k, scale_spread=scale_spread)  # fmt: skip

    weight_loads = segments.loads(per_segment)

    def x_pairs(ks, valid):
        """Unit ks's activation pairs, rows in the words' [bn, bw] shape (indices not clamped:
        contiguous columns keep the loads vectorized; masked lanes read nothing)."""
        cols = ks * bw + jnp.arange(bw)
        mask = jnp.broadcast_to(((cols < words_k) & valid)[None, :], (bn, bw))
        return tuple(
            qc.load(x_ref.at[jnp.full((bn, 1), r, jnp.int32), (p * words_k + cols)[None, :]], mask)
            for r in range(rows) for p in range(4)
        )  # fmt: skip

    def loads(col0, ks, valid):
        loaded = weight_loads(col0, ks, valid)
        return (*loaded, *x_pairs(ks, valid)) if x_ahead else loaded

    def products(acc, ks, loaded):
        if not half2:
            return _word_gemv_products(acc, x_ref, *loaded, kw=ks * bw, bn=bn, bw=bw, words_k=words_k,
                                       even_k=even_k, rows=rows, x_factors=x_factors)  # fmt: skip
        words, bits = loaded[:2]
        kw = ks * bw
        scale = _word_scales(bits, bn, bw, jnp.float32)
        x_mask = None if even_k else ((kw + jnp.arange(bw)) < words_k)[None, :]
        out = []
        for r in range(rows):
            if x_ahead:
                pairs = list(loaded[2 + 4 * r : 6 + 4 * r])
            else:
                views = [x_ref.at[compat.ds(r, 1), compat.ds(p * words_k + kw, bw)] for p in range(4)]
                pairs = [jnp.broadcast_to(qc.load(v, x_mask), (bn, bw)) for v in views]
            out.append(acc[r] + h2.word_dots(words, pairs, interpret=interpret) * scale)
        return tuple(out)

    qc.streamed_gemv(loads, products, plan=plan, n_size=segments.n_size, rows=rows, bn=bn,
                     width=bw, out_ref=out_ref, row_scale=row_scale)  # fmt: skip


def _block_tile(col0, ks, valid, n_size, bn, bs, blocks_k, even_k):
    """(mask, row view, block view) of one streamed unit over [N, K/16, ...] block-major tiles:
    rows col0 .. col0 + bn, scale blocks ks * bs .., nothing past N or K or where `valid` is false."""
    n_mask = ((col0 + jnp.arange(bn)) < n_size) & valid
    k_mask = None if even_k else (ks * bs + jnp.arange(bs)) < blocks_k
    return _mask2(n_mask, k_mask, (bn, bs)), compat.ds(col0, bn), compat.ds(ks * bs, bs)


def _nvfp4_streamed_block_kernel(
    x_ref,  # [M, 8, K/16, 2] float16, rows scaled (qc.f16_rows): x[m, 8w + p] at [m, p, w // 2, w % 2]
    *refs,  # per segment: words [N_s, K/16, 2] uint32 (a block's even and odd word), scale bits
    # [N_s, K/16] uint8; then out_ref [slots, M, segments.n_size] float32 partial sums
    plan: qc.StreamedPlan,
    segments: qc.Segments,
    rows: int,
    words_k: int,
    block_w: int,
    even_k: bool,
    x_ahead: bool,
):
    """The "gemv_bs_ws" formulation: gemv_ws's loads and products on [bn, block_w / 2, 2] tiles (a
    scale block's two words side by side), the 16 products of a block summed in float16 and the
    block scale applied to the block sum, with [bn, block_w / 2] float32 accumulators: one
    conversion to float32 serves two words and no scale is spread over the words, but Triton
    converts the block sums to the scale tile's layout instead (a shared-memory round trip again).
    x_ahead ("gemv_bsx_ws"): the unit's activation is loaded a unit ahead with its words (in
    gemv_ws the products wait on activation loads issued in their own step); Triton converts the
    carried tiles at each use. Sweep variants: on the H100 they beat gemv_ws at 3-4 programs an
    SM by 2-10% a layer and lost end to end at 2 (docs/pallas.md)."""
    bn, bs, out_ref = segments.block_n, block_w // 2, refs[-1]
    blocks_k = words_k // 2

    def x_loads(ks):
        x_mask = None if even_k else jnp.broadcast_to(((ks * bs + jnp.arange(bs)) < blocks_k)[:, None], (bs, 2))
        return tuple(
            qc.load(x_ref.at[jnp.int32(r), jnp.int32(p), compat.ds(ks * bs, bs), :], x_mask)
            for r in range(rows) for p in range(8)
        )  # fmt: skip

    def per_segment(s):
        words_ref, scale_ref, n_size = refs[2 * s], refs[2 * s + 1], segments.sizes[s]

        def loads(col0, ks, valid):
            mask, rows_view, blocks_view = _block_tile(col0, ks, valid, n_size, bn, bs, blocks_k, even_k)
            words3 = words_ref.at[rows_view, blocks_view, :]
            words = qc.load(words3, jnp.broadcast_to(mask[:, :, None], (bn, bs, 2)))
            bits = qc.load(scale_ref.at[rows_view, blocks_view], mask)
            return (words, bits, *x_loads(ks)) if x_ahead else (words, bits)

        return loads

    def products(acc, ks, loaded):
        words, bits = loaded[:2]
        xs = loaded[2:] if x_ahead else x_loads(ks)
        scale = jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn).astype(jnp.float32)
        weights = qc.e2m1_word_f16(words)
        out = []
        for r in range(rows):
            total = None
            for p, w in enumerate(weights):
                xp = xs[8 * r + p]
                total = w * xp[None] if total is None else total + w * xp[None]
            block = jax.lax.reduce(total, np.float16(0), jax.lax.add, (2,))  # reduce_sum in float16: no upcast
            out.append(acc[r] + block.astype(jnp.float32) * scale)
        return tuple(out)

    qc.streamed_gemv(segments.loads(per_segment), products, plan=plan, n_size=segments.n_size, rows=rows, bn=bn,
                     width=bs, out_ref=out_ref)  # fmt: skip


def _nvfp4_streamed_half2_kernel(
    pairs_ref,  # [M, 8, K/16] uint32: half2 activation pairs (`_e2m1_half2.half2_x_pairs`)
    *refs,  # per segment: words [N_s, K/16, 2] uint32 (a block's even and odd word), scale bits
    # [N_s, K/16] uint8; then out_ref [slots, M, segments.n_size] float32 partial sums
    plan: qc.StreamedPlan,
    segments: qc.Segments,
    rows: int,
    words_k: int,
    block_w: int,
    even_k: bool,
    interpret: bool,
):
    """The "gemv_h2_ws" formulation: the streamed plan of gemv_ws with [bn, block_w / 2]
    accumulators, one column per scale block, fed by `_e2m1_half2.block_dots` (module docstring)."""
    bn, bs, out_ref = segments.block_n, block_w // 2, refs[-1]
    blocks_k = words_k // 2

    def per_segment(s):
        words_ref, scale_ref, n_size = refs[2 * s], refs[2 * s + 1], segments.sizes[s]

        def loads(col0, ks, valid):
            mask, rows_view, blocks_view = _block_tile(col0, ks, valid, n_size, bn, bs, blocks_k, even_k)
            even = qc.load(words_ref.at[rows_view, blocks_view, jnp.int32(0)], mask)
            odd = qc.load(words_ref.at[rows_view, blocks_view, jnp.int32(1)], mask)
            bits = qc.load(scale_ref.at[rows_view, blocks_view], mask)
            return even, odd, bits

        return loads

    def products(acc, ks, loaded):
        even, odd, bits = loaded
        scale = jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn).astype(jnp.float32)
        k_mask = None if even_k else (ks * bs + jnp.arange(bs)) < blocks_k
        pairs = [
            [jnp.broadcast_to(p[None, :], (bn, bs)) for p in h2.pairs_view(pairs_ref, r, ks * bs, bs, k_mask)]
            for r in range(rows)
        ]
        sums = h2.block_dots(even, odd, pairs, interpret=interpret)
        return tuple(a + s * scale for a, s in zip(acc, sums, strict=True))

    qc.streamed_gemv(segments.loads(per_segment), products, plan=plan, n_size=segments.n_size, rows=rows, bn=bn,
                     width=bs, out_ref=out_ref)  # fmt: skip


def _nvfp4_streamed_dot_kernel(
    x_ref,  # [M, K] float16, rows scaled (qc.f16_rows), columns in word order (qc.word_columns)
    *refs,  # per segment: words [N_s, K/8] uint32, scale bits [N_s, K/16] uint8; then out_ref
    plan: qc.StreamedPlan,
    segments: qc.Segments,
    rows: int,  # block_m
    m_size: int,
    words_k: int,
    block_w: int,
    even_k: bool,
):
    """The "dot_ws" formulation: dot_w's float16 dots over a streamed plan (`_quant_common.streamed_loop`), one
    [block_m, block_n] accumulator per tile; grid axis 1 walks the M tiles; out_ref
    [slots, Mp, segments.n_size] float32 partial sums."""
    bn, bw, out_ref = segments.block_n, block_w, refs[-1]
    row0 = compat.program_id(1) * rows
    m_mask = None if m_size % rows == 0 else (row0 + jnp.arange(rows)) < m_size

    def per_segment(s):
        return _streamed_word_loads(refs[2 * s], refs[2 * s + 1], bn=bn, bw=bw, n_size=segments.sizes[s],
                                    words_k=words_k, even_k=even_k)  # fmt: skip

    def products(acc, ks, loaded):
        return (_word_dots(acc[0], x_ref, *loaded, kw=ks * bw, bn=bn, bw=bw, words_k=words_k, even_k=even_k,
                           row0=row0, rows=rows, m_mask=m_mask, transposed=False),)  # fmt: skip

    def init():
        return (jnp.zeros((rows, bn), jnp.float32),)

    def store(acc, slot, col0, mask):
        value = jnp.zeros((rows, bn), jnp.float32) if acc is None else acc[0]
        view = out_ref.at[slot, compat.ds(row0, rows), compat.ds(col0, bn)]
        compat.store(view, value, mask=jnp.broadcast_to(mask[None, :], (rows, bn)))

    qc.streamed_loop(segments.loads(per_segment), products, plan=plan, n_size=segments.n_size, bn=bn, init=init,
                     store=store)  # fmt: skip


def _nvfp4_word_tiled_kernel(
    x_ref,  # [M, K] float16, rows scaled (qc.f16_rows), columns in word order (qc.word_columns)
    row_scale_ref,  # [M, 1] float32: tensor scale * 2**14 / each row's power-of-two factor
    words_ref,  # [N, K/8] uint32
    scale_ref,  # [N, K/16] uint8: the bits of the float8_e4m3fn block scales
    out_ref,  # [M, N] in the output dtype, written once
    *,
    m_size: int,
    n_size: int,
    words_k: int,
    block_m: int,
    block_n: int,
    block_w: int,
    group_m: int,
    even_m: bool,
    even_n: bool,
    even_k: bool,
):
    """One [block_m, block_n] output tile of "tiled_w": the prefill GEMM of "tiled" on float16
    tensor cores, the weight tile decoded from words once per K step for all block_m rows."""
    m_tiles, n_tiles = qc.tiled_grid(m_size, n_size, block_m, block_n)
    i, j = qc.grouped_tile(compat.program_id(0), m_tiles, n_tiles, group_m)
    row0, col0, bm, bn, bw = i * block_m, j * block_n, block_m, block_n, block_w
    m_mask = None if even_m else (row0 + jnp.arange(bm)) < m_size
    n_mask = None if even_n else (col0 + jnp.arange(bn)) < n_size

    def step(t, acc):
        return _word_step(
            acc, x_ref, words_ref, scale_ref, kw=t * bw, col0=col0, bn=bn, bw=bw, n_mask=n_mask,
            words_k=words_k, even_k=even_k, row0=row0, rows=bm, m_mask=m_mask, transposed=False,
        )  # fmt: skip

    acc = jax.lax.fori_loop(0, compat.cdiv(words_k, bw), step, jnp.zeros((bm, bn), jnp.float32))
    row_scale = qc.load(row_scale_ref.at[compat.ds(row0, bm), compat.ds(0, 1)], _mask2(m_mask, None, (bm, 1)))
    view = out_ref.at[compat.ds(row0, bm), compat.ds(col0, bn)]
    compat.store(view, (acc * row_scale).astype(out_ref.dtype), mask=_mask2(m_mask, n_mask, (bm, bn)))


WORD_MIN_BLOCK_K = 128  # word variants: a dot spans block_k / 8 words, and Triton dots need >= 16


def validate_nvfp4_matmul(
    x, packed, block_scale, tensor_scale, block_m, block_n, block_k, split_k, variant: str = "dot"
) -> None:
    """Raise ValueError naming the offending value when the inputs or tile sizes do not fit."""
    if x.ndim != 2:
        raise ValueError(f"x must be [M, K]; got shape {x.shape}")
    if packed.ndim != 2 or packed.dtype != jnp.uint8:
        raise ValueError(f"packed must be uint8 [N, K/2]; got {packed.dtype} {packed.shape}")
    _m, k = x.shape
    n, kh = packed.shape
    if k != 2 * kh:
        raise ValueError(f"x has K={k} but packed [N, K/2]={packed.shape} implies K={2 * kh}")
    if k % BLOCK:
        raise ValueError(f"K={k} must be a multiple of {BLOCK} (the NVFP4 block)")
    if block_scale.shape != (n, k // BLOCK):
        raise ValueError(f"block_scale must be [N, K/16]={(n, k // BLOCK)}; got {block_scale.shape}")
    if block_scale.dtype != jnp.float8_e4m3fn:
        raise ValueError(f"block_scale must be float8_e4m3fn; got {block_scale.dtype}")
    if jnp.size(tensor_scale) != 1:
        raise ValueError(f"tensor_scale must be a scalar; got shape {jnp.shape(tensor_scale)}")
    if x.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        raise ValueError(f"x must be bf16, f16 or f32; got {x.dtype}")
    for name, v, low in (("block_m", block_m, 16), ("block_n", block_n, 16), ("block_k", block_k, 32)):
        if not qc.is_pow2(v) or v < low:
            raise ValueError(f"{name}={v} must be a power of two >= {low}")
    if split_k < 1:
        raise ValueError(f"split_k={split_k} must be >= 1")
    if variant in WORD_VARIANTS and block_k < WORD_MIN_BLOCK_K:
        raise ValueError(
            f"block_k={block_k} must be >= {WORD_MIN_BLOCK_K} for variant={variant!r} "
            "(its dots run over block_k / 8 words, and Triton dots need 16)"
        )


def x_words_layout(variant: str, x_rows: str | None = None) -> str | None:
    """How a formulation reads x's float16 rows when they are made before its launch (`x_words`
    of `nvfp4_matmul` / `nvfp4_matmuls`): "columns" (`_quant_common.word_columns` order), "pairs"
    (`_e2m1_half2.word_x_pairs`), or None where it takes no such rows (the bfloat16 decode,
    "dot_jw"'s natural order, x_rows="kernel", and "gemv_h2_ws"'s own pairs)."""
    if x_rows == "kernel" or variant not in WORD_VARIANTS or variant in ("dot_jw", "gemv_h2_ws"):
        return None
    return "pairs" if variant in ("gemv_h2w_ws", "gemv_h2wx_ws") else "columns"


def _check_x_words(x_words, cfg: qc.MatmulConfig, m: int, k: int) -> None:
    if x_words is None:
        return
    layout = x_words_layout(cfg.variant, cfg.x_rows)
    if layout is None:
        raise ValueError(f"x_words are for formulations reading float16 word rows; {cfg.variant!r} "
                         f"(x_rows={cfg.x_rows!r}) takes none")  # fmt: skip
    words, inverse = x_words
    want = (m, k) if layout == "columns" else (m, k // 2)
    dtype = jnp.float16 if layout == "columns" else jnp.uint32
    if words.shape != want or words.dtype != dtype or inverse.shape != (m,):
        raise ValueError(
            f"{cfg.variant!r} takes x_words in the {layout!r} layout: {dtype.__name__} {want} and inverse "
            f"[{m}]; got {words.dtype} {words.shape} and {inverse.shape}"
        )


def _check_x_rows(cfg: qc.MatmulConfig) -> None:
    if cfg.x_rows == "kernel" and cfg.variant not in KERNEL_ROWS_VARIANTS:
        raise ValueError(
            f"x_rows='kernel' is for {KERNEL_ROWS_VARIANTS} (x in natural order, rows scaled in the kernel); "
            f"got variant={cfg.variant!r}"
        )


def default_block_m(m: int) -> int:
    """Smallest power-of-two row tile >= M, between 16 (Triton's minimum dot) and 64."""
    return min(compat.pow2_at_least(m, 16), 64)


@functools.partial(
    jax.jit,
    static_argnames=(
        "variant",
        "block_m",
        "block_n",
        "block_k",
        "split_k",
        "num_warps",
        "num_stages",
        "group_m",
        "programs",
        "scale_spread",
        "x_rows",
        "out_dtype",
        "interpret",
    ),
)
def nvfp4_matmul(
    x: jax.Array,
    packed: jax.Array,
    block_scale: jax.Array,
    tensor_scale: jax.Array,
    *,
    variant: str | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    group_m: int | None = None,
    programs: int | None = None,
    scale_spread: str | None = None,
    x_rows: str | None = None,
    out_dtype=None,
    interpret: bool = False,
    x_words: tuple[jax.Array, jax.Array] | None = None,
) -> jax.Array:
    """x [M, K] @ dequant(NVFP4 W [N, K]).T -> [M, N] in `out_dtype` (default x.dtype).

    Every option left None comes from `DEFAULT_CONFIGS` for this M (the formulation too: see the
    module docstring); given values override it. Tile sizes are powers of two; block_k counts K
    elements (block_k / 2 bytes per row per step). block_m is the row tile of the dot
    formulations (default: the table's, else M rounded up to a power of two in [16, 64]); "gemv"
    and "gemv_bs" take all M <= 8 rows in one program. group_m: M tiles per launch group of
    "tiled" (`_quant_common.grouped_tile`). programs: the grid of "gemv_ws" (default two per SM).
    scale_spread: how the CUDA-core word gemvs (gemv_w, gemv_wp, gemv_ws) meet each word with its
    block scale: "reshape" (default) or "gather" (read per word; `_word_loads`).
    x_rows: "xla" (default) or "kernel": KERNEL_ROWS_VARIANTS take x as given and make its
    float16 rows themselves (module docstring); the result is the same.
    x_words: x's float16 rows already made (words in the formulation's `x_words_layout`, inverse
    row factors [M] float32; as `norm_rows.rms_norm_rows` gives them), so no XLA op runs before
    the launch; the result is the same as from x.
    `interpret=True` runs the same kernel through the Pallas
    interpreter (the CPU test path).
    """
    m, _k = x.shape if x.ndim == 2 else (0, 0)
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
        scale_spread=scale_spread,
        x_rows=x_rows,
    )
    _check_x_rows(cfg)
    _check_x_words(x_words, cfg, m, _k)
    variant = cfg.variant
    gemv = qc.is_gemv(variant)
    block_m = default_block_m(m) if cfg.block_m is None else cfg.block_m
    validate_nvfp4_matmul(
        x, packed, block_scale, tensor_scale, block_m, cfg.block_n, cfg.block_k, cfg.split_k, variant
    )
    n, half_k = packed.shape
    out_dtype = x.dtype if out_dtype is None else out_dtype
    compute_dtype = jnp.float32 if x.dtype == jnp.float32 else x.dtype
    if variant in WORD_VARIANTS:
        return _word_call(x, packed, block_scale, tensor_scale, cfg, block_m, out_dtype, interpret, x_words)
    if variant == "tiled":
        return _tiled_call(
            x.astype(compute_dtype), packed, block_scale, tensor_scale, cfg, block_m, out_dtype, interpret
        )
    rows = m if gemv else block_m
    m_pad = m if gemv else compat.cdiv(m, block_m) * block_m
    xp = jnp.pad(x.astype(compute_dtype), ((0, m_pad - m), (0, 0)))
    x_even, x_odd = xp[:, 0::2], xp[:, 1::2]
    half_block_k = cfg.block_k // 2
    steps = compat.cdiv(compat.cdiv(half_k, half_block_k), cfg.split_k)
    kernel = functools.partial(
        _nvfp4_kernel,
        variant=variant,
        rows=rows,
        n_size=n,
        half_k=half_k,
        block_n=cfg.block_n,
        half_block_k=half_block_k,
        steps=steps,
        even_n=n % cfg.block_n == 0,
        even_k=half_k % (half_block_k * cfg.split_k) == 0,
    )
    out_shape = (cfg.split_k, n, m_pad) if variant == "dot_t" else (cfg.split_k, m_pad, n)
    partial = compat.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(out_shape, jnp.float32),
        grid=(1 if gemv else m_pad // block_m, compat.cdiv(n, cfg.block_n), cfg.split_k),
        compiler_params=qc.compiler_params(cfg),
        interpret=interpret,
        name=f"nvfp4_matmul_{variant}",
    )(x_even, x_odd, packed, jax.lax.bitcast_convert_type(block_scale, jnp.uint8))
    y = qc.split_sum(partial)
    y = y.T[:m] if variant == "dot_t" else y[:m]
    y = y * jnp.asarray(tensor_scale, jnp.float32).reshape(())
    return y.astype(out_dtype)


# the formulations `nvfp4_matmuls` takes
STREAMED_WORD_VARIANTS = ("gemv_ws", "gemv_bs_ws", "gemv_bsx_ws", "gemv_h2_ws", "gemv_h2w_ws", "gemv_h2wx_ws", "dot_ws")


@functools.partial(
    jax.jit,
    static_argnames=("variant", "block_m", "block_n", "block_k", "num_warps", "num_stages", "programs",
                     "scale_spread", "x_rows", "joined", "out_dtype", "interpret"),
)  # fmt: skip
def nvfp4_matmuls(
    x: jax.Array,
    weights: tuple[tuple[jax.Array, jax.Array, jax.Array], ...],
    *,
    variant: str = "gemv_ws",
    block_m: int | None = None,
    block_n: int = 32,
    block_k: int = 512,
    num_warps: int = 8,
    num_stages: int = 3,
    programs: int | None = None,
    scale_spread: str | None = None,
    x_rows: str | None = None,
    out_dtype=None,
    interpret: bool = False,
    x_words: tuple[jax.Array, jax.Array] | None = None,
    joined: bool = False,
) -> list[jax.Array]:
    """x [M, K] times each of several NVFP4 weights (packed, block_scale, tensor_scale) of that K
    -> one [M, N_s] result per weight, in one launch of a streamed formulation ("gemv_ws",
    "gemv_h2_ws" or "dot_ws"): the weights lie end to end on the kernel's N axis
    (`_quant_common.Segments`), so the projections of one input (a layer's q / k / v) cost one
    launch and one pass over x's preparation, and small weights ride along with large ones
    instead of paying a launch each. Equal, weight by weight, to `nvfp4_matmul` with the same
    formulation and tiles. x_words: x's float16 rows already made, as for `nvfp4_matmul`.

    joined: one [M, n_size] result instead, weight s at columns `joined_columns(N_s..., block_n)[s]`
    (the kernel's own layout; the columns between weights are padding): a consumer that reads
    each weight at its offset (a Pallas kernel) then needs no slice launch per weight, and the
    scales after the kernel are one launch. The same values as the separate results."""
    if variant not in STREAMED_WORD_VARIANTS:
        raise ValueError(f"variant={variant!r} must be one of {STREAMED_WORD_VARIANTS}")
    if not weights:
        raise ValueError("nvfp4_matmuls needs at least one weight")
    m = x.shape[0] if x.ndim == 2 else 0
    block_m = default_block_m(m) if block_m is None else block_m
    cfg = qc.resolve_config(
        DEFAULT_CONFIGS, m, variants=VARIANTS, variant=variant, block_n=block_n, block_k=block_k, split_k=1,
        num_warps=num_warps, num_stages=num_stages, block_m=block_m, programs=programs, scale_spread=scale_spread,
        x_rows=x_rows,
    )  # fmt: skip
    _check_x_rows(cfg)
    _check_x_words(x_words, cfg, m, x.shape[-1])
    for packed, block_scale, tensor_scale in weights:
        validate_nvfp4_matmul(x, packed, block_scale, tensor_scale, block_m, block_n, block_k, 1, variant)
    out_dtype = x.dtype if out_dtype is None else out_dtype
    return _streamed_call(x, list(weights), cfg, block_m, out_dtype, interpret, x_words, joined)


def joined_columns(sizes: tuple[int, ...], block_n: int) -> tuple[int, ...]:
    """Where each weight of N = sizes[s] starts in `nvfp4_matmuls(joined=True)`'s result."""
    segments = qc.Segments(tuple(sizes), block_n)
    return tuple(segments.columns(s).start for s in range(len(sizes)))


def _tiled_call(
    x, packed, block_scale, tensor_scale, cfg: qc.MatmulConfig, block_m: int, out_dtype, interpret
):
    """The "tiled" (prefill) pallas_call: y [M, N] written by the kernel, nothing after it."""
    m = x.shape[0]
    n, half_k = packed.shape
    half_block_k = cfg.block_k // 2
    m_tiles, n_tiles = qc.tiled_grid(m, n, block_m, cfg.block_n)
    kernel = functools.partial(
        _nvfp4_tiled_kernel,
        m_size=m,
        n_size=n,
        half_k=half_k,
        block_m=block_m,
        block_n=cfg.block_n,
        half_block_k=half_block_k,
        group_m=cfg.group_m,
        even_m=m % block_m == 0,
        even_n=n % cfg.block_n == 0,
        even_k=half_k % half_block_k == 0,
    )
    return compat.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
        grid=(m_tiles * n_tiles,),
        compiler_params=qc.compiler_params(cfg),
        interpret=interpret,
        name="nvfp4_matmul_tiled",
    )(
        x[:, 0::2],
        x[:, 1::2],
        packed,
        jax.lax.bitcast_convert_type(block_scale, jnp.uint8),
        jnp.asarray(tensor_scale, jnp.float32).reshape(1, 1),
    )


def _word_call(
    x, packed, block_scale, tensor_scale, cfg: qc.MatmulConfig, block_m: int, out_dtype, interpret, x_words=None
):
    """The word-decoded formulations: one XLA op before the kernel (x scaled per row to float16 and
    its columns put in word order; none with x_rows="kernel"), and for "dot_w" / "dot_t_w" the
    split-K sum and the per-row scales after it; "tiled_w" writes y itself."""
    m = x.shape[0]
    n, half_k = packed.shape
    words_k = half_k // 4
    words = _words(packed)
    scale_bits = jax.lax.bitcast_convert_type(block_scale, jnp.uint8)
    block_w = cfg.block_k // 8
    tensor_factor = jnp.asarray(tensor_scale, jnp.float32).reshape(()) * qc.E2M1_F16_SCALE
    raw = cfg.x_rows == "kernel"  # the kernel makes its own float16 rows and undoes their factors
    if raw:
        x_rows, row_scale = x, tensor_factor[None]
    else:
        if x_words is not None:  # made before, in word-column order
            x_cols, inv = x_words
        else:
            x_rows, inv = qc.f16_rows(x)
            x_cols = None if cfg.variant == "dot_jw" else qc.word_columns(x_rows)  # dot_jw: natural order
        row_scale = inv * tensor_factor
    params = qc.compiler_params(cfg)
    if cfg.variant == "tiled_w":
        m_tiles, n_tiles = qc.tiled_grid(m, n, block_m, cfg.block_n)
        kernel = functools.partial(
            _nvfp4_word_tiled_kernel, m_size=m, n_size=n, words_k=words_k, block_m=block_m,
            block_n=cfg.block_n, block_w=block_w, group_m=cfg.group_m, even_m=m % block_m == 0,
            even_n=n % cfg.block_n == 0, even_k=words_k % block_w == 0,
        )  # fmt: skip
        return compat.pallas_call(
            kernel,
            out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
            grid=(m_tiles * n_tiles,),
            compiler_params=params,
            interpret=interpret,
            name="nvfp4_matmul_tiled_w",
        )(x_cols, row_scale[:, None], words, scale_bits)
    if qc.is_streamed(cfg.variant):
        weights = [(packed, block_scale, tensor_scale)]
        return _streamed_call(x, weights, cfg, block_m, out_dtype, interpret, x_words)[0]
    if qc.is_gemv(cfg.variant):  # all M rows in one program, unpadded
        block_m = m
    m_pad = compat.cdiv(m, block_m) * block_m
    steps = compat.cdiv(compat.cdiv(words_k, block_w), cfg.split_k)
    kernel = functools.partial(
        _nvfp4_word_kernel, variant=cfg.variant, rows=block_m, m_size=m, n_size=n, words_k=words_k,
        block_n=cfg.block_n, block_w=block_w, steps=steps, even_n=n % cfg.block_n == 0,
        even_k=words_k % (block_w * cfg.split_k) == 0, scale_spread=cfg.scale_spread, raw_rows=raw,
    )  # fmt: skip
    transposed = cfg.variant == "dot_t_w"
    out_shape = (cfg.split_k, n, m_pad) if transposed else (cfg.split_k, m_pad, n)
    partial = compat.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct(out_shape, jnp.float32),
        grid=(m_pad // block_m, compat.cdiv(n, cfg.block_n), cfg.split_k),
        compiler_params=params,
        interpret=interpret,
        name=f"nvfp4_matmul_{cfg.variant}",
    )(x_rows if raw or cfg.variant == "dot_jw" else x_cols, words, scale_bits)  # natural order
    y = qc.split_sum(partial)
    y = y.T[:m] if transposed else y[:m]
    return (y * row_scale[:, None]).astype(out_dtype)


def _words(packed: jax.Array) -> jax.Array:
    """uint8 [N, K/2] -> uint32 [N, K/8] (bytes 4j .. 4j+3 of a row, little-endian)."""
    n, half_k = packed.shape
    return jax.lax.bitcast_convert_type(packed.reshape(n, half_k // 4, 4), jnp.uint32)


def _streamed_call(
    x, weights, cfg: qc.MatmulConfig, block_m: int, out_dtype, interpret, x_words=None, joined=False
) -> list[jax.Array]:
    """The streamed formulations for x [M, K] and one or more NVFP4 weights (packed, block scale,
    tensor scale) of that K, all in one launch (`_quant_common.Segments`): one XLA op before the
    kernel (x scaled per row to float16, its columns regrouped for the formulation; none with
    x_rows="kernel"), the slot sum and the scales after it; one [M, N_s] result per weight."""
    m = x.shape[0]
    words_k = weights[0][0].shape[1] // 4
    block_w = cfg.block_k // 8
    segments = qc.Segments(tuple(w[0].shape[0] for w in weights), cfg.block_n)
    steps = compat.cdiv(words_k, block_w)
    plan = qc.StreamedPlan.make(segments.n_size, cfg.block_n, steps, cfg.programs or 2 * compat.sm_count())
    common = {"plan": plan, "segments": segments, "words_k": words_k, "block_w": block_w,
              "even_k": words_k % block_w == 0}  # fmt: skip
    raw = cfg.x_rows == "kernel"  # gemv_ws makes its own float16 rows and undoes their factors
    if raw:
        x_in, row_factor = x, qc.E2M1_F16_SCALE
    elif x_words is not None:  # made before, in the formulation's layout (`x_words_layout`)
        x_in, inv = x_words
        row_factor = (inv * qc.E2M1_F16_SCALE)[:, None]
    else:
        x16, inv = qc.f16_rows(x)
        x_in, row_factor = qc.word_columns(x16), (inv * qc.E2M1_F16_SCALE)[:, None]
    operands = []
    for packed, block_scale, _ in weights:
        words = _words(packed)
        if cfg.variant in ("gemv_h2_ws", "gemv_bs_ws", "gemv_bsx_ws"):  # a block's even and odd word side by side
            words = words.reshape(words.shape[0], words_k // 2, 2)
        operands += [words, jax.lax.bitcast_convert_type(block_scale, jnp.uint8)]
    if cfg.variant == "gemv_ws":  # all M rows in one program
        kernel = functools.partial(_nvfp4_streamed_kernel, rows=m, scale_spread=cfg.scale_spread, raw_rows=raw,
                                   **common)  # fmt: skip
        m_pad, m_tiles = m, 1
    elif cfg.variant in ("gemv_h2w_ws", "gemv_h2wx_ws"):
        kernel = functools.partial(_nvfp4_streamed_kernel, rows=m, scale_spread=cfg.scale_spread, half2=True,
                                   x_ahead=cfg.variant == "gemv_h2wx_ws", interpret=interpret, **common)  # fmt: skip
        m_pad, m_tiles = m, 1
        x_in = x_in if x_words is not None else h2.word_x_pairs(x16)
    elif cfg.variant == "gemv_h2_ws":
        kernel = functools.partial(_nvfp4_streamed_half2_kernel, rows=m, interpret=interpret, **common)
        m_pad, m_tiles, x_in = m, 1, h2.half2_x_pairs(x16)
    elif cfg.variant in ("gemv_bs_ws", "gemv_bsx_ws"):  # x_in's columns p * K/8 + w as [8, K/16, 2]: a reshape
        block = functools.partial(_nvfp4_streamed_block_kernel, x_ahead=cfg.variant == "gemv_bsx_ws")
        kernel, m_pad, m_tiles = functools.partial(block, rows=m, **common), m, 1
        x_in = x_in.reshape(m, 8, words_k // 2, 2)
    else:  # dot_ws: M in tiles of block_m on grid axis 1
        m_tiles = compat.cdiv(m, block_m)
        m_pad = m_tiles * block_m
        kernel = functools.partial(_nvfp4_streamed_dot_kernel, rows=block_m, m_size=m, **common)
    partial = compat.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((plan.slots, m_pad, segments.n_size), jnp.float32),
        grid=(plan.grid, m_tiles),
        compiler_params=qc.compiler_params(cfg),
        interpret=interpret,
        name=f"nvfp4_matmul_{cfg.variant}",
    )(x_in, *operands)
    y = qc.split_sum(partial)[:m] * row_factor
    if joined:  # each column times its weight's tensor scale (a weight's padding tail takes its scale too)
        starts = [segments.columns(s).start for s in range(len(weights))] + [segments.n_size]
        scale = jnp.concatenate([
            jnp.broadcast_to(jnp.asarray(w[2], jnp.float32).reshape(()), (starts[s + 1] - starts[s],))
            for s, w in enumerate(weights)
        ])  # fmt: skip
        return [(y * scale).astype(out_dtype)]
    return [
        (y[:, segments.columns(s)] * jnp.asarray(w[2], jnp.float32).reshape(())).astype(out_dtype)
        for s, w in enumerate(weights)
    ]
