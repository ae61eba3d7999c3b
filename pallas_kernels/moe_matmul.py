"""Grouped MoE matmul over expert stacks (NVFP4, FP8 or plain bf16/f16/f32): a Pallas GPU (Triton) kernel.

    y[r, n] = sum_k x[r, k] * W[e(r), n, k]

for rows x [M, K] sorted by expert: group e holds the next `group_sizes[e]` rows (the
`jax.lax.ragged_dot` convention), rows past sum(group_sizes) give zeros. The weight stacks are
stored as in `infernix_jax.weights.quant` (docs/quant_formats.md):

    NVFP4  packed uint8 [E, N, K/2], block_scale float8_e4m3fn [E, N, K/16], tensor_scale f32 [E]
    FP8    data float8_e4m3fn [E, N, K], scale f32 [E] (per expert) or
           [E, ceil(N/b), ceil(K/b)] (block_size b)
    plain  w bf16 / f16 / f32 [E, N, K] (fmt="plain": unquantized experts)

The plain format exists because XLA's GPU lowering of `jax.lax.ragged_dot` expands the groups
into a dense [M, E*K] operand: with 512 experts of K = 2048 a 2048-token prefill chunk asks for
40 GiB (an out-of-memory at warm-up on the H200), and a 64-row decode window spends ~60 ms per
forward. This kernel reads each routed expert once instead (docs/quant_formats.md).

One formulation serves decode and prefill. Decode is "pairs": M = tokens x top_k (token, expert)
pairs sorted by expert, most groups empty, a few holding one to `tokens` rows; prefill has many
rows per expert. The groups are cut into work items of at most `block_m` rows, each one
(expert, first row, end row), non-empty groups only, in row order; their number has a static
upper bound, which sizes the grid:

    items <= min(M, E) + M // block_m     (each non-empty group adds at most one partial tile)

The grid is (work items, N tiles, split_k). Each program loads the [E] group sizes and finds
its own item (`locate_item`: two independent cumsums and two masked sums over E, no XLA op before
the kernel), skips all work when its item is past the last one (a `lax.cond`, `scf.if` in
Triton), and otherwise streams its expert's [block_n, K] weight rows once, decoding them in
registers as the dense decode kernels do (pallas_kernels/nvfp4_matmul.py, fp8_matmul.py,
`_quant_common.e2m1_f16_bits`). A group that fits in one item reads its expert's weights exactly
once, whatever the number of rows routed to it, so with block_m >= the rows per expert
(<= tokens in decode) every distinct expert is read once and empty experts cost nothing. The
programs of the last item also write the zeros of rows past sum(group_sizes), so with
split_k = 1 the kernel writes y itself in the output dtype (NVFP4 adds one XLA op before it:
the even / odd column split of x, as in nvfp4_matmul; the word variants' float16 rows instead).

Formulations (`variant`):
  "gemv"   float32 FMAs on CUDA cores, one [block_n, block_k] accumulator per row of the item,
           rows unrolled (block_m in 1..8); for decode, where most groups hold one or two rows;
  "dot"    x [block_m, bk] @ W.T on tensor cores (block_m >= 16, rows past the group masked);
  "dot_t"  W [block_n, bk] @ x.T (the weight tile as the left operand, Hopper wgmma from
           registers); decode batches whose groups hold several rows.
  "dot_w", "dot_t_w"
           NVFP4 only: "dot" and "dot_t" on float16 tensor cores with the weight decoded from
           whole uint32 words (the K step of nvfp4_matmul's word variants, `_word_step`: no float
           conversion per element). x enters as float16, each row scaled by a power of two
           (`_quant_common.f16_rows`, exact for bf16 / f16) with its columns in word order
           (`_quant_common.word_columns`); the kernel multiplies each row back by its factor, the
           expert's tensor scale and 2**14 before the store. float32 x is refused (float16 would
           round it); block_k >= WORD_MIN_BLOCK_K.
  "dot_jw" dot_w with the 8 decoded element tiles joined back into element order in registers
           and one float16 dot of depth block_k a K step, x in its natural column order (the
           dense kernel's `_joined_word_dot`: no `word_columns` reorder before the kernel, no
           float32 add after each of 8 dots; bench.kernel_ir on the 80B gate: docs/pallas.md).
           With x_rows="kernel" x enters as given (bf16 / f16): each program finds its rows'
           max |x| over all of K first and scales them to float16 itself, with `f16_rows`'
           factors (`_quant_common.f16_row_factors`), so no XLA op runs before the launch.
  "gemv_h2w"
           NVFP4 only: the rows of an item unrolled (block_m 1..8) as "gemv", each word's 8
           products in packed half2 arithmetic on CUDA cores (the dense "gemv_h2w_ws"'s
           `_e2m1_half2.word_dots`: the decoded pairs are the operands, 1 mul and 3
           `fma.rn.f16x2` a word): no tensor-core dot on a 16-row tile of which a decode item
           fills one or two rows, no shared-memory round trip for the dot's operands. x enters
           as float16 rows (`f16_rows`) regrouped into the word pairs (`_e2m1_half2.word_x_pairs`).
  "gemv_ws"
           NVFP4 and FP8: the dense kernels' streamed gemv (nvfp4_matmul / fp8_matmul "gemv_ws":
           word-decoded float16 products, or float32 products of the e4m3 weight, on CUDA cores,
           `_quant_common.streamed_loop`) over the work items.
           The (item, N tile, K step) units of the real items, stack after stack within an item,
           are spread in equal runs over a fixed grid of programs, each loading one unit ahead;
           so a decode step's ten experts keep every SM streaming instead of one program per
           (item, tile) walking its K loop alone. The items come from one XLA op before the
           kernel (`work_items`), and the partial sums of tiles shared by programs go to slots
           summed after it, with each row's scales (NVFP4: its float16 factor and its expert's
           tensor scale; FP8: its expert's scale, or the block scales inside); block_m rows per
           item (1..8, unrolled), split_k 1; NVFP4 takes bf16 / f16 x and block_k >= 128.
Stacks are passed flattened to [E * N, ...] (a free reshape), so a tile's rows are
`e * N + n0 ...` and a masked N edge never reads into the next expert. The per-expert scale
(NVFP4 tensor scale, FP8 per-tensor scale) multiplies the float32 sum once; FP8 block scales
multiply each K step's partial product (block_n and block_k divide the block size).

The output is [M, N] in the sorted row order (the caller un-sorts), accumulated in float32; rows
past M are never read or written (masked), so nothing is padded.

`grouped_matmuls` runs the same rows through several stacks of one format and shape (an expert's
gate and up) in one launch: the grid's N axis walks the stacks' tiles one stack after the other,
and each program runs the tile body for its stack in a `lax.switch` branch (uniform over the
program, so only that stack's loads are issued); the output [M, stacks * N] is sliced per stack.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _e2m1_half2 as h2
from pallas_kernels import _quant_common as qc
from pallas_kernels import compat
from pallas_kernels.fp8_matmul import reference_fp8_matmul
from pallas_kernels.nvfp4_matmul import BLOCK as NVFP4_BLOCK
from pallas_kernels.nvfp4_matmul import (
    WORD_MIN_BLOCK_K,
    _joined_word_dot,
    _mask2,
    _word_gemv_products,
    _word_loads,
    _word_scales,
    _word_step,
    reference_nvfp4_matmul,
)

# NVFP4 only: float16 dots on weights decoded from uint32 words, and the half2 word gemv
WORD_VARIANTS = ("dot_w", "dot_t_w", "dot_jw", "gemv_h2w")
ROW_VARIANTS = ("gemv", "gemv_h2w")  # rows of an item unrolled (block_m 1..8), no dot
# NVFP4 and FP8: the dense "gemv_ws" (CUDA-core products over a streamed plan) over work items
STREAMED_VARIANTS = ("gemv_ws",)
VARIANTS = ("gemv", "dot", "dot_t", *WORD_VARIANTS, *STREAMED_VARIANTS)
TRANSPOSED = ("dot_t", "dot_t_w")  # [block_n, block_m] accumulators
X_ROWS = qc.X_ROWS  # where "dot_jw" makes its float16 rows (GroupedConfig.x_rows)
ZERO_ROWS = 16  # rows per masked store when zeroing rows past the groups
FORMATS = ("nvfp4", "fp8", "plain")
PLAIN_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)  # weights the "plain" format takes


@dataclasses.dataclass(frozen=True)
class GroupedConfig:
    """One configuration of the grouped kernel."""

    variant: str  # VARIANTS (module docstring)
    block_m: int  # rows per work item: gemv 1..8 (unrolled), dot* a power of two >= 16
    block_n: int  # weight rows (output columns) per program; power of two >= 16
    block_k: int  # K elements per loop step; power of two
    split_k: int = 1  # programs sharing one K loop; partial sums are added outside the kernel
    num_warps: int = 4
    num_stages: int = 3
    programs: int = 0  # "gemv_ws": programs in its fixed grid (0: two per SM)
    # "dot_jw": where x becomes float16 rows (each scaled by a power of two): "xla", an op before
    # the kernel (`qc.f16_rows`), or "kernel", each program for its own rows (no launch before it)
    x_rows: str = "xla"

    def as_kwargs(self) -> dict:
        return dataclasses.asdict(self)


# Defaults by the largest M (rows = tokens x top_k) they serve. Decode with top-10 (Qwen3-Next):
# M = 10 is one token (each group one row), 20 / 40 two or four tokens; groups then hold at most
# that many rows. Callers that know the token count pass block_m = min(tokens, 8) (gemv) instead.
DEFAULT_CONFIGS: dict[str, dict[int, GroupedConfig]] = {
    "nvfp4": {
        12: GroupedConfig("gemv", block_m=1, block_n=32, block_k=512),
        24: GroupedConfig("gemv", block_m=2, block_n=32, block_k=512),
        48: GroupedConfig("gemv", block_m=4, block_n=32, block_k=256),
        128: GroupedConfig("dot_t", block_m=16, block_n=64, block_k=256),
        1 << 30: GroupedConfig("dot", block_m=64, block_n=64, block_k=256),
    },
    "fp8": {
        12: GroupedConfig("gemv", block_m=1, block_n=32, block_k=256),
        24: GroupedConfig("gemv", block_m=2, block_n=32, block_k=256),
        48: GroupedConfig("gemv", block_m=4, block_n=32, block_k=128),
        128: GroupedConfig("dot_t", block_m=16, block_n=64, block_k=128),
        1 << 30: GroupedConfig("dot", block_m=64, block_n=64, block_k=128),
    },
    "plain": {  # two bytes a weight (bf16): fp8's tiles hold twice the bytes
        12: GroupedConfig("gemv", block_m=1, block_n=32, block_k=256),
        24: GroupedConfig("gemv", block_m=2, block_n=32, block_k=256),
        48: GroupedConfig("gemv", block_m=4, block_n=32, block_k=128),
        128: GroupedConfig("dot_t", block_m=16, block_n=64, block_k=128),
        1 << 30: GroupedConfig("dot", block_m=64, block_n=64, block_k=64),
    },
}


# ------------------------------------------------------------------------------------ references


def _row_experts(group_sizes: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """(expert of each of the M rows, True where the row belongs to a group) from group sizes [E].
    The expert comes from comparing each row with the groups' ends: one fusion on a GPU, where
    `searchsorted` is a loop of launches (the streamed call runs this after its kernel)."""
    ends = jnp.cumsum(group_sizes.astype(jnp.int32))
    rows = jnp.arange(m, dtype=jnp.int32)
    expert = jnp.sum(ends[None, :] <= rows[:, None], axis=1, dtype=jnp.int32)
    valid = rows < ends[-1]
    return jnp.minimum(expert, group_sizes.shape[0] - 1), valid


def reference_grouped_matmul(
    x: jax.Array,
    weight: tuple[jax.Array, ...],
    group_sizes: jax.Array,
    *,
    fmt: str,
    block_size: int | None = None,
) -> jax.Array:
    """Plain-jnp reference in float32: each row gathers its expert's stored leaves, dequantizes them
    and takes the dot -> float32 [M, N] in sorted order; rows past sum(group_sizes) are zero.

    weight: (packed, block_scale, tensor_scale) for fmt="nvfp4", (data, scale) for fmt="fp8"
    (scale [E] per expert, or [E, ceil(N/b), ceil(K/b)] with block_size b), (w,) for fmt="plain".
    """
    if fmt not in FORMATS:
        raise ValueError(f"fmt={fmt!r} must be one of {FORMATS}")
    m = x.shape[0]
    expert, valid = _row_experts(group_sizes, m)
    rows = [leaf[expert] for leaf in weight]  # per-row expert leaves
    if fmt == "plain":

        def one(xr, w):
            return jnp.dot(w.astype(jnp.float32), xr.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST)

    elif fmt == "nvfp4":

        def one(xr, packed, block_scale, tensor_scale):
            return reference_nvfp4_matmul(xr[None], packed, block_scale, tensor_scale)[0]

    else:

        def one(xr, data, scale):
            return reference_fp8_matmul(xr[None], data, scale, block_size=block_size)[0]

    y = jax.vmap(one)(x, *rows)
    return jnp.where(valid[:, None], y, 0.0)


# ------------------------------------------------------------------------------------- work items


def max_work_items(m: int, num_experts: int, block_m: int) -> int:
    """Static upper bound on the work items of M rows in E groups cut into block_m-row tiles."""
    return max(1, min(m, min(m, num_experts) + m // block_m))


PACK_SHIFT = 16  # `locate_item` packs two row counts below 2**15 into one int32


def locate_item(
    t: jax.Array, sizes: jax.Array, m: int, block_m: int
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Work item t (scalar) of groups `sizes` [E] int32 cut into tiles of at most block_m rows,
    non-empty groups only, in row order -> (expert, first row, end row exclusive); past the last
    item all three are 0 (no rows). Group sizes summing past M are cut at M.

    Written with ops the Triton lowering has (cumsum, compare, where, sum), so the kernel runs
    it per program on the group sizes and no XLA op computes the items; `work_items` runs the
    same function for all items outside (tests, callers that want to see them). Every program
    runs it before its first weight load, and each scan or sum over E is a round of warp shuffles
    and barriers: so the tiles are counted from the sizes themselves (the two scans do not wait on
    each other), and the item's first and end rows travel packed in one int32 (M < 2**15), one
    scan pair and two sums in all."""
    e_size = sizes.shape[0]
    if 2 * m + block_m >= 1 << PACK_SHIFT:  # a first row (< 2 M + block_m) or an end row would not fit
        return _locate_item_unpacked(t, sizes, m, block_m)
    sizes = jnp.minimum(sizes, m)  # no group holds more than M rows (and the running sums stay small)
    # Tiles of the sizes as given: the cut ones up to the group that crosses M, where an item of
    # that group or a later one starts at or after M and so gets no rows below.
    tiles = (sizes + (block_m - 1)) // block_m
    cum = jnp.cumsum(sizes)  # rows up to each group, inclusive
    tile_ends = jnp.cumsum(tiles)
    ends = jnp.minimum(cum, m)
    starts = jnp.minimum(cum - sizes, m)
    hit = (tile_ends - tiles <= t) & (t < tile_ends)  # the one group whose tiles hold item t
    first = starts + (t - (tile_ends - tiles)) * block_m  # < 2 M where hit
    end = jnp.minimum(first + block_m, ends)
    group = jnp.sum(jnp.where(hit, jnp.arange(e_size, dtype=jnp.int32), 0))
    rows = jnp.sum(jnp.where(hit, first + (end << PACK_SHIFT), 0))
    first, end = rows & ((1 << PACK_SHIFT) - 1), rows >> PACK_SHIFT
    real = end > first
    return jnp.where(real, group, 0), jnp.where(real, first, 0), jnp.where(real, end, 0)


def _locate_item_unpacked(t: jax.Array, sizes: jax.Array, m: int, block_m: int):
    """`locate_item` for row or item counts too large to pack: two scans and five sums."""
    cum = jnp.cumsum(sizes)
    ends = jnp.minimum(cum, m)
    starts = jnp.minimum(cum - sizes, m)
    tiles = (ends - starts + (block_m - 1)) // block_m  # 0 for empty groups
    tile_ends = jnp.cumsum(tiles)
    group = jnp.sum((tile_ends <= t).astype(jnp.int32))  # E when t is past the last item
    hit = jnp.arange(sizes.shape[0], dtype=jnp.int32) == group

    def pick(v):
        return jnp.sum(jnp.where(hit, v, 0))

    first = pick(starts) + (t - (pick(tile_ends) - pick(tiles))) * block_m
    end = jnp.minimum(first + block_m, pick(ends))
    real = group < sizes.shape[0]
    return jnp.where(real, group, 0), jnp.where(real, first, 0), jnp.where(real, end, 0)


def work_items(group_sizes: jax.Array, m: int, block_m: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Every work item's (expert, first row, end row) as int32 arrays of length
    `max_work_items(m, E, block_m)`, computed as the kernel computes them (`locate_item`)."""
    count = max_work_items(m, group_sizes.shape[0], block_m)
    sizes = group_sizes.astype(jnp.int32)
    return jax.vmap(lambda t: locate_item(t, sizes, m, block_m))(jnp.arange(count, dtype=jnp.int32))


# ----------------------------------------------------------------------------------------- kernel


def _grouped_kernel(
    group_sizes_ref,  # [E] int32
    *refs,
    # refs: the activation refs (`n_x` of them), then per weight (`segments` of them, each
    # [E, N, K]): its per-expert scale [E] float32 (multiplying the float32 sum; 1 for FP8 blocks;
    # the word variants also multiply it by E2M1_F16_SCALE) and its stored refs; last the output.
    # nvfp4: x_even [M, K/2], x_odd [M, K/2] | packed [E*N, K/2] u8, block scale bits [E*N, K/16] u8
    # nvfp4 dot_w / dot_t_w / dot_jw: x [M, K] f16 (qc.f16_rows; in word order by qc.word_columns
    #        except for dot_jw), row factors [M, 1] f32 (or with `row_max` the rows' max |x|)
    #        | words [E*N, K/8] u32 (4 packed bytes each), block scale bits [E*N, K/16] u8
    # fp8:   x [M, K] | data bits [E*N, K] u8, block scales [E*ceil(N/b), ceil(K/b)] f32 (or [1, 1])
    # plain: x [M, K] | w [E*N, K] (bf16 / f16 / f32)
    # out:   [split_k, M, segments * N]: y itself in the output dtype (split_k 1) or float32 partial
    #        sums; weight s fills columns s * N ..
    # With two sources each weight's refs come twice, its first stack's then its second's.
    n_x: int,
    segments: int,
    first_experts: int | None,  # two sources: experts 0 .. first_experts - 1 are the first stack's
    fmt: str,
    variant: str,
    m_size: int,
    num_experts: int,
    block_m: int,
    n_size: int,
    k_width: int,  # K/2 bytes (nvfp4), K/8 words (word variants) or K elements (fp8, plain)
    block_n: int,
    step_width: int,  # block_k/2, block_k/8 or block_k: the same unit per K step
    steps: int,
    scale_block: int | None,  # fp8 block size b, or None
    even_n: bool,
    even_k: bool,
    interpret: bool = False,  # gemv_h2w: its half2 products as jnp ops (the interpreter runs no PTX)
    row_max: bool = False,  # word variants: x's second ref holds each row's max |x|, not its inverse factor
    row_experts: bool = False,  # group_sizes_ref holds each row's expert [M]: program row t works on row t
    x_div: int = 1,  # gemv_h2w: row r reads x's row r // x_div (the pairs of one token read its row)
    inverse_col: int | None = None,  # x's second ref holds the inverse factors' bits at this column
):
    x_refs, out_ref = refs[:n_x], refs[-1]
    sources = 1 if first_experts is None else 2
    per_weight = (len(refs) - n_x - 1) // (segments * sources)
    t, j, split = compat.program_id(0), compat.program_id(1), compat.program_id(2)
    e_pad = compat.pow2_at_least(num_experts)  # Triton tensors have power-of-two sizes
    if row_experts:  # one row an item, in the rows' own order: nothing to locate
        sizes, r0, r1 = None, t, t + 1
        named = group_sizes_ref.shape[0]  # rows past these name the second stack's experts in order
        if named == m_size:
            e = jnp.clip(group_sizes_ref[t], 0, num_experts - 1)
        else:
            e_named = jnp.clip(group_sizes_ref[jnp.minimum(t, named - 1)], 0, num_experts - 1)
            e = jnp.where(t < named, e_named, jnp.minimum(first_experts + t - named, num_experts - 1))
    else:
        sizes_mask = None if e_pad == num_experts else jnp.arange(e_pad) < num_experts
        sizes = qc.load(group_sizes_ref.at[compat.ds(0, e_pad)], sizes_mask)
        e, r0, r1 = locate_item(t, sizes, m_size, block_m)
    bn, bw, bm = block_n, step_width, block_m
    n_tiles = compat.cdiv(n_size, bn)
    seg = jax.lax.div(j, n_tiles)  # the weight this program's N tile belongs to
    col0 = (j - seg * n_tiles) * bn  # within the weight
    n_mask = None if even_n else (col0 + jnp.arange(bn)) < n_size
    gemv = variant in ROW_VARIANTS
    word = variant in WORD_VARIANTS
    raw_rows = word and n_x == 1  # dot_jw with x_rows="kernel": x as given, no row factors
    compute_dtype = x_refs[0].dtype

    def weight_refs(s, source=0):
        first = n_x + (s * sources + source) * per_weight
        return refs[first], (*x_refs, *refs[first + 1 : first + per_weight])

    def run(expert_scale_ref, in_refs, out_col0, e_w):
        """This program's tile of one weight: `in_refs` are the activation refs then the weight's
        stored refs (the single-weight layout), its output columns start at out_col0, and its
        expert is e_w of that stack."""
        w_row0 = e_w * n_size + col0  # first weight row of this tile in the flattened stack
        _grouped_tile(
            expert_scale_ref, in_refs, out_ref, e=e_w, r0=r0, r1=r1, sizes=sizes, col0=col0, out_col0=out_col0,
            w_row0=w_row0, n_mask=n_mask, split=split, t=t, fmt=fmt, variant=variant, gemv=gemv, word=word,
            raw_rows=raw_rows, compute_dtype=compute_dtype, m_size=m_size, num_experts=num_experts, bm=bm, bn=bn, bw=bw,
            n_size=n_size, k_width=k_width, steps=steps, scale_block=scale_block, even_k=even_k, interpret=interpret,
            row_max=row_max, row_experts=row_experts, x_div=x_div, inverse_col=inverse_col,
        )  # fmt: skip

    if segments == 1 and sources == 1:
        run(*weight_refs(0), col0, e)
        return
    # a branch per weight and source, uniform over the program: only the chosen stack's loads are
    # issued (two sources: the program's expert is in the first stack or, past first_experts, in
    # the second, which is how a slotted layer reads its slots and its fetched experts in place)
    branches = [
        functools.partial(
            lambda s, source: run(*weight_refs(s, source), s * n_size + col0, e - source * (first_experts or 0)),
            s, source,
        )
        for s in range(segments)
        for source in range(sources)
    ]  # fmt: skip
    source = 0 if sources == 1 else (e >= first_experts).astype(jnp.int32)
    jax.lax.switch(seg * sources + source, branches)


def _grouped_tile(
    expert_scale_ref, in_refs, out_ref, *, e, r0, r1, sizes, col0, out_col0, w_row0, n_mask, split, t, fmt, variant,
    gemv, word, raw_rows, compute_dtype, m_size, num_experts, bm, bn, bw, n_size, k_width, steps, scale_block,
    even_k, interpret=False, row_max=False, row_experts=False, x_div=1, inverse_col=None,
):  # fmt: skip
    """One program's work on one weight (`_grouped_kernel`): its work item's rows times its N tile,
    and on the last item the zeros of rows past the groups (with `row_experts` every row is an
    item's: none)."""

    def x_row(r):  # the row of x (or of its words and factors) that row r reads
        return r if x_div == 1 else r // x_div

    x_refs = in_refs[:2] if fmt == "nvfp4" and not word else in_refs[:1]
    wi = 1 if raw_rows else 2  # word variants: where the words and scale bits start in in_refs

    def decode(kw):
        """The weight tiles of one K step, float32 [bn, bw] each, paired with their activation
        refs, and the step's block scale (None: none)."""
        k_mask = None if even_k else (kw + jnp.arange(bw)) < k_width
        if fmt == "nvfp4":
            packed_ref, scale_ref = in_refs[2], in_refs[3]
            bs = bw // 8  # block scales per row per step (one per 8 bytes)
            s_mask = None if even_k else (kw // 8 + jnp.arange(bs)) < k_width // 8
            packed = qc.load(
                packed_ref.at[compat.ds(w_row0, bn), compat.ds(kw, bw)], _mask2(n_mask, k_mask, (bn, bw))
            )
            bits = qc.load(
                scale_ref.at[compat.ds(w_row0, bn), compat.ds(kw // 8, bs)], _mask2(n_mask, s_mask, (bn, bs))
            )
            scale = jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn).astype(jnp.float32)
            scale = scale * qc.E2M1_F16_SCALE  # exact (a power of two)
            scale = jnp.broadcast_to(scale[:, :, None], (bn, bs, 8)).reshape(bn, bw)
            low = qc.e2m1_f16_bits(packed, high=False) * scale  # exact: <= 6 significant bits
            high = qc.e2m1_f16_bits(packed, high=True) * scale
            return [(low, x_refs[0]), (high, x_refs[1])], k_mask, None
        if fmt == "plain":
            w = qc.load(
                in_refs[1].at[compat.ds(w_row0, bn), compat.ds(kw, bw)], _mask2(n_mask, k_mask, (bn, bw))
            )
            return [(w.astype(jnp.float32), x_refs[0])], k_mask, None
        data_ref, block_scale_ref = in_refs[1], in_refs[2]
        bits = qc.load(
            data_ref.at[compat.ds(w_row0, bn), compat.ds(kw, bw)], _mask2(n_mask, k_mask, (bn, bw))
        )
        w = jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn).astype(jnp.float32)
        s = None
        if scale_block is not None:  # one scale for the whole tile: block_n, block_k divide b
            nb = compat.cdiv(n_size, scale_block)
            kb = jnp.minimum(kw // scale_block, block_scale_ref.shape[1] - 1)  # masked tail may overshoot
            s = block_scale_ref[e * nb + col0 // scale_block, kb]
        return [(w, x_refs[0])], k_mask, s

    rows_ok = None if gemv else (r0 + jnp.arange(bm)) < r1  # [bm] (gemv: one scalar per row)
    # float32 activations (the tests' models): exact float32 products, not TF32's 10-bit mantissa
    precision = jax.lax.Precision.HIGHEST if compute_dtype == jnp.float32 else None

    def step(i, acc, x_factor=None):
        kw = (split * steps + i) * bw
        if variant == "gemv_h2w":  # x pairs [M, K/2] u32 (h2.word_x_pairs), row factors, words, scale bits
            words, bits = _word_loads(
                in_refs[2], in_refs[3], kw=kw, col0=w_row0, bn=bn, bw=bw, n_mask=n_mask, words_k=k_width,
                even_k=even_k,
            )  # fmt: skip
            scale = _word_scales(bits, bn, bw, jnp.float32)
            k_ok = None if even_k else ((kw + jnp.arange(bw)) < k_width)[None, :]
            def row_products(r):
                mask = jnp.broadcast_to(r0 + r < r1, (1, bw))
                mask = mask if k_ok is None else mask & k_ok
                pairs = [
                    jnp.broadcast_to(
                        qc.load(in_refs[0].at[compat.ds(x_row(r0 + r), 1), compat.ds(p * k_width + kw, bw)], mask),
                        (bn, bw),
                    )
                    for p in range(4)
                ]  # fmt: skip
                return acc[r] + h2.word_dots(words, pairs, interpret=interpret) * scale

            # an item has at least one row; the others run only where the item has them (a branch
            # uniform over the program), so a one-row item of a batch's block pays for one row
            return tuple(
                row_products(r) if r == 0
                else jax.lax.cond(r0 + r < r1, functools.partial(row_products, r), lambda r=r: acc[r])
                for r in range(bm)
            )  # fmt: skip
        if variant == "dot_jw":  # x [M, K] in natural order (f16 rows, or raw with x_factor), words, bits
            words, bits = _word_loads(
                in_refs[wi], in_refs[wi + 1], kw=kw, col0=w_row0, bn=bn, bw=bw, n_mask=n_mask, words_k=k_width,
                even_k=even_k,
            )  # fmt: skip
            return _joined_word_dot(acc, in_refs[0], words, bits, kw=kw, bn=bn, bw=bw, words_k=k_width,
                                    even_k=even_k, row0=r0, rows=bm, m_mask=rows_ok, x_factor=x_factor)  # fmt: skip
        if word:  # x [M, K] f16 in word order, row factors, words, scale bits
            return _word_step(
                acc, in_refs[0], in_refs[2], in_refs[3], kw=kw, col0=w_row0, bn=bn, bw=bw, n_mask=n_mask,
                words_k=k_width, even_k=even_k, row0=r0, rows=bm, m_mask=rows_ok,
                transposed=variant in TRANSPOSED,
            )  # fmt: skip
        parts, k_mask, s = decode(kw)
        if gemv:
            out = list(acc)
            for r in range(bm):
                row_mask = jnp.broadcast_to(r0 + r < r1, (1, bw))
                mask = row_mask if k_mask is None else row_mask & k_mask[None, :]
                for w, x_ref in parts:
                    x = qc.load(x_ref.at[compat.ds(r0 + r, 1), compat.ds(kw, bw)], mask).astype(jnp.float32)
                    out[r] = out[r] + w * (x if s is None else x * s)
            return tuple(out)
        mask = _mask2(rows_ok, k_mask, (bm, bw))
        total = None
        for w, x_ref in parts:
            x = qc.load(x_ref.at[compat.ds(r0, bm), compat.ds(kw, bw)], mask)
            w = w.astype(compute_dtype)
            if variant == "dot":  # [bm, bw] x [bn, bw] -> [bm, bn]
                part = jax.lax.dot_general(
                    x, w, qc.dims_nt(), precision=precision, preferred_element_type=jnp.float32
                )
            else:  # dot_t: [bn, bw] x [bm, bw] -> [bn, bm]
                part = jax.lax.dot_general(
                    w, x, qc.dims_nt(), precision=precision, preferred_element_type=jnp.float32
                )
            total = part if total is None else total + part
        return acc + (total if s is None else total * s)

    out_dtype = out_ref.dtype

    def row_inverse(rows, mask):  # rows' inverse factors from what x's second ref holds (`row_max`)
        if inverse_col is not None:  # uint32 bits in a column of the word pairs' own array
            return jax.lax.bitcast_convert_type(qc.load(in_refs[1].at[rows, compat.ds(inverse_col, 1)], mask),
                                                jnp.float32)  # fmt: skip
        v = qc.load(in_refs[1].at[rows, compat.ds(0, 1)], mask)
        return qc.f16_row_factors(v)[1] if row_max else v

    def work():
        expert_scale = expert_scale_ref[e]
        if word:  # the word decode yields e2m1 values / 2**14 (exact: a power of two)
            expert_scale = expert_scale * qc.E2M1_F16_SCALE
        if gemv:
            init = tuple(jnp.zeros((bn, bw), jnp.float32) for _ in range(bm))
            acc = jax.lax.fori_loop(0, steps, step, init)
            for r in range(bm):
                row_mask = jnp.broadcast_to(r0 + r < r1, (1, bn))
                y = acc[r].sum(axis=1)[None, :] * expert_scale
                if word:  # the row's power-of-two factor (qc.f16_rows) undone
                    row_ok = jnp.broadcast_to(r0 + r < r1, (1, 1))
                    y = y * row_inverse(compat.ds(x_row(r0 + r), 1), row_ok)
                compat.store(
                    out_ref.at[split, compat.ds(r0 + r, 1), compat.ds(out_col0, bn)],
                    y.astype(out_dtype),
                    mask=row_mask if n_mask is None else row_mask & n_mask[None, :],
                )
            return
        shape = (bn, bm) if variant in TRANSPOSED else (bm, bn)
        body, inverse = step, None
        if raw_rows:  # this program's rows to float16 itself: qc.f16_rows' factors, the same bits
            factor, inverse = qc.f16_row_factors(qc.row_max_abs(in_refs[0], r0, bm, rows_ok, 8 * k_width, 8 * bw))
            body = functools.partial(step, x_factor=factor)
        acc = jax.lax.fori_loop(0, steps, body, jnp.zeros(shape, jnp.float32)) * expert_scale
        if variant in TRANSPOSED:
            acc = acc.T
        if raw_rows:
            acc = acc * inverse[:, None]
        elif word:  # each row's power-of-two factor (qc.f16_rows) undone
            acc = acc * row_inverse(compat.ds(r0, bm), rows_ok[:, None])
        compat.store(
            out_ref.at[split, compat.ds(r0, bm), compat.ds(out_col0, bn)],
            acc.astype(out_dtype),
            mask=_mask2(rows_ok, n_mask, (bm, bn)),
        )

    def zero_uncovered_rows():
        """Rows past sum(group_sizes) belong to no item: the last program row writes their zeros."""
        covered = jnp.minimum(jnp.sum(sizes), m_size)

        def chunk(c, carry):
            rows = c * ZERO_ROWS + jnp.arange(ZERO_ROWS)
            mask = _mask2((rows >= covered) & (rows < m_size), n_mask, (ZERO_ROWS, bn))
            compat.store(
                out_ref.at[split, compat.ds(c * ZERO_ROWS, ZERO_ROWS), compat.ds(out_col0, bn)],
                jnp.zeros((ZERO_ROWS, bn), out_dtype),
                mask=mask,
            )
            return carry

        jax.lax.fori_loop(covered // ZERO_ROWS, compat.cdiv(m_size, ZERO_ROWS), chunk, 0)

    jax.lax.cond(r1 > r0, work, lambda: None)
    if not row_experts:  # only the last item's programs sum the sizes (a reduction over E is a few barriers)
        jax.lax.cond(t == max_work_items(m_size, num_experts, bm) - 1, zero_uncovered_rows, lambda: None)


# ------------------------------------------------------------------------------------ validation


def validate_grouped_matmul(
    x, weight: tuple, group_sizes, *, fmt: str, block_size: int | None, cfg: GroupedConfig
) -> None:
    """Raise ValueError naming the offending value when the inputs or the configuration do not fit."""
    if fmt not in FORMATS:
        raise ValueError(f"fmt={fmt!r} must be one of {FORMATS}")
    if x.ndim != 2:
        raise ValueError(f"x must be [M, K]; got shape {x.shape}")
    if x.dtype not in (jnp.bfloat16, jnp.float16, jnp.float32):
        raise ValueError(f"x must be bf16, f16 or f32; got {x.dtype}")
    k = x.shape[1]
    if fmt == "nvfp4":
        packed, block_scale, tensor_scale = weight
        if packed.ndim != 3 or packed.dtype != jnp.uint8:
            raise ValueError(f"packed must be uint8 [E, N, K/2]; got {packed.dtype} {packed.shape}")
        e, n, kh = packed.shape
        if k != 2 * kh:
            raise ValueError(f"x has K={k} but packed [E, N, K/2]={packed.shape} implies K={2 * kh}")
        if k % NVFP4_BLOCK:
            raise ValueError(f"K={k} must be a multiple of {NVFP4_BLOCK} (the NVFP4 block)")
        if block_scale.shape != (e, n, k // NVFP4_BLOCK):
            raise ValueError(
                f"block_scale must be [E, N, K/16]={(e, n, k // NVFP4_BLOCK)}; got {block_scale.shape}"
            )
        if block_scale.dtype != jnp.float8_e4m3fn:
            raise ValueError(f"block_scale must be float8_e4m3fn; got {block_scale.dtype}")
        if tuple(jnp.shape(tensor_scale)) != (e,):
            raise ValueError(
                f"tensor_scale must be one float per expert [E={e}]; got {jnp.shape(tensor_scale)}"
            )
    elif fmt == "plain":
        (w,) = weight
        if w.ndim != 3 or w.dtype not in PLAIN_DTYPES:
            raise ValueError(f"plain weights must be bf16, f16 or f32 [E, N, K]; got {w.dtype} {w.shape}")
        e, n, kw = w.shape
        if k != kw:
            raise ValueError(f"x has K={k} but w [E, N, K]={w.shape}")
    else:
        data, scale = weight
        if data.ndim != 3 or data.dtype != jnp.float8_e4m3fn:
            raise ValueError(f"data must be float8_e4m3fn [E, N, K]; got {data.dtype} {data.shape}")
        e, n, kd = data.shape
        if k != kd:
            raise ValueError(f"x has K={k} but data [E, N, K]={data.shape}")
        if block_size is None:
            if tuple(jnp.shape(scale)) != (e,):
                raise ValueError(f"a per-expert scale must be [E={e}]; got {jnp.shape(scale)}")
        else:
            want = (e, compat.cdiv(n, block_size), compat.cdiv(k, block_size))
            if tuple(scale.shape) != want:
                raise ValueError(
                    f"block scale must be [E, ceil(N/{block_size}), ceil(K/{block_size})]={want}; "
                    f"got {tuple(scale.shape)}"
                )
            for name, v in (("block_n", cfg.block_n), ("block_k", cfg.block_k)):
                if block_size % v:
                    raise ValueError(f"{name}={v} must divide the scale block_size={block_size}")
    if group_sizes.ndim != 1 or group_sizes.shape[0] != e:
        raise ValueError(f"group_sizes must be [E={e}]; got shape {group_sizes.shape}")
    if not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(f"group_sizes must be integers; got {group_sizes.dtype}")
    if cfg.variant not in VARIANTS:
        raise ValueError(f"variant={cfg.variant!r} must be one of {VARIANTS}")
    if cfg.variant in (*ROW_VARIANTS, *STREAMED_VARIANTS):
        if not 1 <= cfg.block_m <= qc.GEMV_MAX_M:
            raise ValueError(
                f"variant={cfg.variant!r} unrolls block_m rows: block_m={cfg.block_m} must be in 1..8"
            )
    elif not qc.is_pow2(cfg.block_m) or cfg.block_m < 16:
        raise ValueError(f"block_m={cfg.block_m} must be a power of two >= 16 for variant={cfg.variant!r}")
    low_k = 32 if fmt == "nvfp4" else 16
    for name, v, low in (("block_n", cfg.block_n, 16), ("block_k", cfg.block_k, low_k)):
        if not qc.is_pow2(v) or v < low:
            raise ValueError(f"{name}={v} must be a power of two >= {low}")
    if cfg.split_k < 1:
        raise ValueError(f"split_k={cfg.split_k} must be >= 1")
    if cfg.variant in STREAMED_VARIANTS and cfg.split_k != 1:
        raise ValueError(
            f"variant={cfg.variant!r} spreads K over its programs itself; got split_k={cfg.split_k}"
        )
    if cfg.programs < 0:
        raise ValueError(f"programs={cfg.programs} must be >= 0 (0: two per SM)")
    if cfg.x_rows not in X_ROWS:
        raise ValueError(f"x_rows={cfg.x_rows!r} must be one of {X_ROWS}")
    if cfg.x_rows == "kernel" and cfg.variant != "dot_jw":
        raise ValueError(
            f"x_rows='kernel' is dot_jw's (x in natural order, its rows scaled in the kernel); got variant={cfg.variant!r}"
        )
    if cfg.variant in STREAMED_VARIANTS and fmt == "plain":
        raise ValueError(f"variant={cfg.variant!r} streams NVFP4 or FP8 stacks, not fmt='plain'")
    if cfg.variant in (*WORD_VARIANTS, *STREAMED_VARIANTS) and (fmt == "nvfp4" or cfg.variant in WORD_VARIANTS):
        if fmt != "nvfp4":
            raise ValueError(
                f"variant={cfg.variant!r} decodes NVFP4 words: it takes fmt='nvfp4', not {fmt!r}"
            )
        if x.dtype == jnp.float32:
            raise ValueError(
                f"variant={cfg.variant!r} runs float16 dots, which would round float32 x: "
                "use 'dot' or 'dot_t' for float32 activations"
            )
        if cfg.block_k < WORD_MIN_BLOCK_K:
            raise ValueError(
                f"block_k={cfg.block_k} must be >= {WORD_MIN_BLOCK_K} for variant={cfg.variant!r} "
                "(its dots run over block_k / 8 words, and Triton dots need 16)"
            )


# ------------------------------------------------------------------------------------------ entry


def resolve_config(fmt: str, m: int, **overrides) -> GroupedConfig:
    """The default configuration for M rows (DEFAULT_CONFIGS[fmt]) with every given field
    overriding it. Choosing a dot variant over a gemv default without a block_m takes 16."""
    base = qc.pick_config(DEFAULT_CONFIGS[fmt] if fmt in DEFAULT_CONFIGS else DEFAULT_CONFIGS["fp8"], m)
    given = {k: v for k, v in overrides.items() if v is not None}
    cfg = dataclasses.replace(base, **given)
    gemv_like = (*ROW_VARIANTS, *STREAMED_VARIANTS)  # rows unrolled: block_m 1..8
    if "block_m" not in given and cfg.variant != base.variant:
        if cfg.variant in gemv_like:  # a gemv default's rows per item suit its streamed form too
            rows = base.block_m if base.variant in gemv_like else qc.GEMV_MAX_M
            cfg = dataclasses.replace(cfg, block_m=rows)
        else:
            cfg = dataclasses.replace(cfg, block_m=16)
    return cfg


_STATIC = (
    "fmt",
    "block_size",
    "variant",
    "block_m",
    "block_n",
    "block_k",
    "split_k",
    "num_warps",
    "num_stages",
    "programs",
    "x_rows",
    "row_experts",
    "out_dtype",
    "interpret",
)


def grouped_matmul(x: jax.Array, weight: tuple[jax.Array, ...], group_sizes: jax.Array, **options) -> jax.Array:
    """x [M, K] sorted by expert, quantized stacks W [E, N, K] -> [M, N] in `out_dtype` (default
    x.dtype): row r of group e is x[r] @ W[e].T; rows past sum(group_sizes) are zero.

    weight: (packed, block_scale, tensor_scale) for fmt="nvfp4"; (data, scale) for fmt="fp8" with
    `block_size` None (scale [E]) or b (scale [E, ceil(N/b), ceil(K/b)]); (w,) for fmt="plain"
    (bf16 / f16 / f32 [E, N, K]). group_sizes: int [E]. Options (`fmt` required) are those of
    `grouped_matmuls`: every one left None comes from `DEFAULT_CONFIGS[fmt]` for this M; given
    values override it. block_k counts K elements. `interpret=True` runs the kernel in the Pallas
    interpreter.
    """
    return grouped_matmuls(x, (weight,), group_sizes, **options)[0]


@functools.partial(jax.jit, static_argnames=_STATIC)
def grouped_matmuls(
    x: jax.Array,
    weights: tuple[tuple[jax.Array, ...], ...],
    group_sizes: jax.Array,
    *,
    fmt: str,
    block_size: int | None = None,
    variant: str | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    programs: int | None = None,
    x_rows: str | None = None,
    second: tuple[tuple[jax.Array, ...], ...] | None = None,
    x_words: tuple[jax.Array, jax.Array] | None = None,
    row_experts: bool = False,
    out_dtype=None,
    interpret: bool = False,
) -> list[jax.Array]:
    """`grouped_matmul` of the same rows through several stacks of one format and shape (an
    expert's gate and up) in one launch: the grid's N axis walks the stacks' tiles one stack after
    the other and each program reads the stack its tile belongs to (a branch, uniform over the
    program). One [M, N] result per stack, each equal to `grouped_matmul` with the same options
    (the options: see `grouped_matmul`).

    second: for each weight, a second stack [E2, N, K] of the same format whose experts follow the
    first's (group_sizes [E1 + E2]): each program reads its expert from the stack it is in, so two
    stacks serve as their concatenation without one being made (a slotted layer's slots and the
    experts fetched for the step). Not for the streamed variants. The result equals that of the
    concatenated stacks bit for bit.

    x_words: x as the word variants but dot_jw take it, made before (the MoE routing kernel makes
    it with the rows; a MoE layer from its norm's rows, `quant.grouped_norm_words`): (float16
    [M, K] in word-column order, or for gemv_h2w uint32 [M, K/2] word pairs, `x_words_layout`;
    inverse row factors [M] float32), what `f16_rows` and the layout's reorder make of x; then no
    XLA op runs before the launch. Other formulations ignore it and read x. One token's word pairs
    take its factor into the launch as one more column of their array (its uint32 bits): XLA
    writes both in one launch, where a factor of its own was a launch of its own.

    row_experts: `group_sizes` is instead each row's expert [M] int32, the rows in any order, each
    row an item of its own (a decode token's (token, expert) pairs in slot order: no count, sort
    or unsort around the launch; an expert's weights are read once for each row that names it).
    Not for the streamed variants. With it, gemv_h2w's x_words may hold the tokens' rows [T, K/2]
    and factors [T] for M = T * k rows in (token, slot) order: row r reads token r // k (no gather
    of a token's row for each of its pairs). With `second` a row names an expert of either stack,
    and `group_sizes` may name only the first M - E2 rows: the last E2 rows then name the second
    stack's experts in order (one token's MoE pairs and its shared expert, a one-expert second
    stack, as the last row: no launch to append its id)."""
    if not weights:
        raise ValueError("grouped_matmuls needs at least one weight")
    shapes = {tuple(tuple(a.shape) for a in w) for w in weights}
    if len(shapes) != 1:
        raise ValueError(f"grouped_matmuls takes stacks of one shape; got {sorted(shapes)}")
    if second is not None and len(second) != len(weights):
        raise ValueError(f"second gives {len(second)} stacks for {len(weights)} weights")
    options = dict(block_size=block_size, variant=variant, block_m=block_m, block_n=block_n, block_k=block_k,  # noqa: C408
                   split_k=split_k, num_warps=num_warps, num_stages=num_stages, programs=programs,
                   x_rows=x_rows)  # fmt: skip
    return _grouped_call(x, tuple(weights), group_sizes, fmt, options, out_dtype, interpret,
                         None if second is None else tuple(second), x_words, row_experts)  # fmt: skip


def _validate_two_sources(x, weights, second, group_sizes, *, fmt, block_size, cfg, row_experts=False) -> int:
    """Check `grouped_matmuls`' second stacks against the first ones -> E1, the first's experts
    (row_experts: group_sizes holds the rows' experts, checked by `_check_row_experts`)."""
    if cfg.variant in STREAMED_VARIANTS:
        raise ValueError(f"second stacks are not for the streamed variant {cfg.variant!r}")
    e1, e2 = weights[0][0].shape[0], second[0][0].shape[0]
    leaf_shapes = {tuple(a.shape[1:] for a in w) for w in (*weights, *second)}  # each leaf past its expert axis
    if len(leaf_shapes) != 1:
        raise ValueError("second stacks must match the first ones but for the expert count")
    if len({w[0].shape[0] for w in second}) != 1:
        raise ValueError("second stacks must have one expert count")
    if not row_experts and (group_sizes.ndim != 1 or group_sizes.shape[0] != e1 + e2):
        raise ValueError(f"group_sizes must be [E1 + E2 = {e1 + e2}]; got shape {group_sizes.shape}")
    for stack in (*weights, *second):
        sizes = jax.ShapeDtypeStruct((stack[0].shape[0],), group_sizes.dtype)
        validate_grouped_matmul(x, stack, sizes, fmt=fmt, block_size=block_size, cfg=cfg)
    return e1


def x_words_layout(variant: str, x_rows: str | None) -> str | None:
    """How a grouped NVFP4 formulation reads x's float16 rows made before its launch
    (`grouped_matmuls(x_words=...)`): "columns" (`word_columns` order: the word variants but dot_jw
    and gemv_h2w), "pairs" (`word_x_pairs`: gemv_h2w), or None (dot_jw's natural order, rows made
    in the kernel, the other formulations)."""
    if variant not in WORD_VARIANTS or variant == "dot_jw" or x_rows == "kernel":
        return None
    return "pairs" if variant == "gemv_h2w" else "columns"


def _grouped_call(
    x, weights, group_sizes, fmt, options, out_dtype, interpret, second=None, x_words=None, row_experts=False
) -> list[jax.Array]:
    """The pallas_call of `grouped_matmul` / `grouped_matmuls`: the activation's preparation once,
    each stack's operands, one launch, one [M, N] result per stack."""
    block_size = options.pop("block_size")
    m = x.shape[0] if x.ndim == 2 else 0
    cfg = resolve_config(fmt, m, **options)
    first_experts = None
    if row_experts:
        _check_row_experts(group_sizes, m, cfg, None if second is None else second[0][0].shape[0])
    if second is not None:
        first_experts = _validate_two_sources(x, weights, second, group_sizes, fmt=fmt, block_size=block_size,
                                              cfg=cfg, row_experts=row_experts)  # fmt: skip
    elif row_experts:
        e_total = weights[0][0].shape[0]
        for weight in weights:
            sizes = jax.ShapeDtypeStruct((e_total,), group_sizes.dtype)
            validate_grouped_matmul(x, weight, sizes, fmt=fmt, block_size=block_size, cfg=cfg)
    else:
        for weight in weights:
            validate_grouped_matmul(x, weight, group_sizes, fmt=fmt, block_size=block_size, cfg=cfg)
    k = x.shape[1]
    num_experts, n = weights[0][0].shape[:2]
    if second is not None:
        num_experts += second[0][0].shape[0]
    out_dtype = x.dtype if out_dtype is None else out_dtype
    compute_dtype = jnp.float32 if x.dtype == jnp.float32 else x.dtype
    bm = cfg.block_m
    if cfg.variant in STREAMED_VARIANTS:
        return _grouped_streamed_call(x, weights, group_sizes, fmt, block_size, cfg, out_dtype, interpret)
    xp = x.astype(compute_dtype)  # rows past M are masked: no padding
    word = fmt == "nvfp4" and cfg.variant in WORD_VARIANTS
    row_max = False  # x's second input: inverse row factors (True: the rows' max |x|, `_grouped_kernel`)
    inverse_col = None  # or the column of x's second input holding them as uint32 bits
    x_div = 1  # rows that read each row of x's inputs (`_x_words_div`)
    if word and cfg.x_rows == "kernel":  # dot_jw scales its rows itself: no op before the kernel
        x_inputs, k_width, step_width = (x,), k // 8, cfg.block_k // 8
    elif word and x_words is not None and (words_layout := x_words_layout(cfg.variant, cfg.x_rows)):  # made before
        x_div = _x_words_div(x_words, x, m, words_layout, cfg.variant, row_experts)
        x_inputs, k_width, step_width = (x_words[0], x_words[1][:, None]), k // 8, cfg.block_k // 8
        if words_layout == "pairs" and x_words[0].shape[0] == 1:  # one token: its factor rides in its words
            inverse_col = x_words[0].shape[1]
            bits = jax.lax.bitcast_convert_type(x_words[1], jnp.uint32)[:, None]
            joined = jnp.concatenate([x_words[0], bits], axis=1)
            x_inputs = (joined, joined)
    elif word:  # one XLA op before the kernel: float16 rows (in word order but for dot_jw; word pairs for gemv_h2w)
        # `f16_rows`' bits; the kernel takes each row's max |x| and makes its inverse factor itself, so
        # that XLA launches no op of its own for the factors (the row max feeds the words' fusion anyway)
        xf = x.astype(jnp.float32)
        peak = jnp.max(jnp.abs(xf), axis=1)
        x16 = (xf * qc.f16_row_factors(peak)[0][:, None]).astype(jnp.float16)
        layout = {"dot_jw": lambda v: v, "gemv_h2w": h2.word_x_pairs}.get(cfg.variant, qc.word_columns)
        x_inputs, row_max = (layout(x16), peak[:, None]), True
        k_width, step_width = k // 8, cfg.block_k // 8
    elif fmt == "nvfp4":
        x_inputs = (xp[:, 0::2], xp[:, 1::2])
        k_width, step_width = k // 2, cfg.block_k // 2
    else:
        x_inputs = (xp,)
        k_width, step_width = k, cfg.block_k
    stacks = weights if second is None else [w for pair in zip(weights, second, strict=True) for w in pair]
    weight_inputs = [a for w in stacks for a in _stack_inputs(w, fmt, word, block_size, k)]
    steps = compat.cdiv(compat.cdiv(k_width, step_width), cfg.split_k)
    kernel = functools.partial(
        _grouped_kernel,
        n_x=len(x_inputs),
        segments=len(weights),
        first_experts=first_experts,
        fmt=fmt,
        variant=cfg.variant,
        m_size=m,
        num_experts=num_experts,
        block_m=bm,
        n_size=n,
        k_width=k_width,
        block_n=cfg.block_n,
        step_width=step_width,
        steps=steps,
        scale_block=block_size if fmt == "fp8" else None,
        even_n=n % cfg.block_n == 0,
        even_k=k_width % (step_width * cfg.split_k) == 0,
        interpret=interpret,
        row_max=row_max,
        row_experts=row_experts,
        x_div=x_div,
        inverse_col=inverse_col,
    )
    # split_k 1: the kernel writes y itself; otherwise float32 partial sums, added here.
    partial_dtype = out_dtype if cfg.split_k == 1 else jnp.float32
    segments = len(weights)
    partial = compat.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((cfg.split_k, m, segments * n), partial_dtype),
        grid=(m if row_experts else max_work_items(m, num_experts, bm), segments * compat.cdiv(n, cfg.block_n),
              cfg.split_k),
        compiler_params=compat.triton_compiler_params(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=f"grouped_{fmt}_matmul_{cfg.variant}",
    )(group_sizes.astype(jnp.int32), *x_inputs, *weight_inputs)
    y = qc.split_sum(partial).astype(out_dtype)
    return [y] if segments == 1 else [y[:, s * n : (s + 1) * n] for s in range(segments)]


def _check_row_experts(row_experts, m: int, cfg: GroupedConfig, second_experts: int | None) -> None:
    """Raise ValueError unless `grouped_matmuls(row_experts=True)` can take these inputs (with a
    second stack of E2 experts, the last E2 rows may go unnamed: they name its experts in order)."""
    if cfg.variant in STREAMED_VARIANTS:
        raise ValueError(f"row_experts is not for the streamed variants; got variant={cfg.variant!r}")
    counts = (m,) if second_experts is None or m <= second_experts else (m, m - second_experts)
    if row_experts.ndim != 1 or row_experts.shape[0] not in counts or not jnp.issubdtype(row_experts.dtype, jnp.integer):
        raise ValueError(
            f"row_experts needs each row's expert, integers [M={m}]; got {row_experts.dtype} {row_experts.shape}"
        )


def _x_words_div(x_words, x, m: int, layout: str, variant: str, row_experts: bool) -> int:
    """How many rows read each row of x_words (1, or a token's pairs under row_experts with
    gemv_h2w); raise ValueError when x_words does not fit the layout."""
    rows = x_words[0].shape[0]
    div = m // rows if row_experts and variant == "gemv_h2w" and rows and m % rows == 0 else 1
    want = (x.shape, jnp.float16) if layout == "columns" else ((m // div, x.shape[1] // 2), jnp.uint32)
    if (x_words[0].shape, x_words[0].dtype) != want or x_words[1].shape != (m // div,):
        raise ValueError(
            f"{variant!r} takes x_words in the {layout!r} layout: {jnp.dtype(want[1]).name} "
            f"{want[0]} rows and [{m // div}] factors; got {x_words[0].dtype} {x_words[0].shape} and {x_words[1].shape}"
        )
    return div


def _stack_inputs(weight: tuple[jax.Array, ...], fmt: str, word: bool, block_size: int | None, k: int) -> list:
    """One stack's kernel operands: its per-expert scale [E] float32, then its stored refs
    flattened over the experts (the layout `_grouped_kernel` reads)."""
    num_experts, n = weight[0].shape[:2]
    if fmt == "nvfp4":
        packed, block_scale, tensor_scale = weight
        scale_bits = jax.lax.bitcast_convert_type(block_scale, jnp.uint8).reshape(num_experts * n, k // NVFP4_BLOCK)
        expert_scale = jnp.asarray(tensor_scale, jnp.float32)
        if word:
            words = jax.lax.bitcast_convert_type(packed.reshape(num_experts * n, k // 8, 4), jnp.uint32)
            # the tensor scale as stored: the kernel multiplies in E2M1_F16_SCALE (a multiply
            # here would be one more XLA launch per stack and call, 3 a MoE layer in decode)
            return [expert_scale, words, scale_bits]
        return [expert_scale, packed.reshape(num_experts * n, k // 2), scale_bits]
    if fmt == "plain":
        (w,) = weight
        return [jnp.ones((num_experts,), jnp.float32), w.reshape(num_experts * n, k)]
    data, scale = weight
    if block_size is None:
        block_scale = jnp.ones((1, 1), jnp.float32)
        expert_scale = jnp.asarray(scale, jnp.float32)
    else:
        block_scale = jnp.asarray(scale, jnp.float32).reshape(-1, scale.shape[-1])
        expert_scale = jnp.ones((num_experts,), jnp.float32)
    bits = jax.lax.bitcast_convert_type(data, jnp.uint8).reshape(num_experts * n, k)
    return [expert_scale, bits, block_scale]


def _grouped_streamed_kernel(
    items_ref,  # [4, I] int32: each work item's expert, first row, end row; [3, 0] the number of items
    x_ref,  # nvfp4: [M, K] float16, rows scaled (qc.f16_rows), columns in word order (qc.word_columns);
    # fp8: [M, K] in the compute dtype
    *refs,  # per stack: nvfp4 words [E*N, K/8] uint32, scale bits [E*N, K/16] uint8 | fp8 data bits
    # [E*N, K] uint8, block scales [E*ceil(N/b), ceil(K/b)] float32 (or [1, 1]); then out_ref
    fmt: str,
    segments: int,
    m_size: int,
    n_size: int,
    rows: int,
    block_n: int,
    step_width: int,  # words (nvfp4) or elements (fp8) per K step
    k_width: int,  # K/8 words (nvfp4) or K elements (fp8)
    steps: int,
    item_bound: int,
    grid: int,
    slots: int,
    scale_block: int | None,  # fp8 block size b, or None
    even_k: bool,
):
    """The "gemv_ws" formulation over work items: out_ref [slots, M, segments * N] float32 partial
    sums of the real items' rows (the kernel writes nothing else). Units are numbered item by
    item, within an item stack by stack, then N tile, then K step; as the number of items is known
    only here, the run length of each program is too (`_quant_common.StreamedPlan` with a traced
    run). NVFP4 takes the dense gemv_ws's word loads and float16 products, FP8 the dense FP8
    gemv_ws's float32 products (with the tile's block scale on the activation)."""
    bn, bw, out_ref = block_n, step_width, refs[-1]
    n_tiles = compat.cdiv(n_size, bn)
    per_item = segments * n_tiles  # tiles of one item, its stacks end to end
    count = items_ref[3, 0]
    tiles = count * per_item
    per_program = jnp.maximum(compat.cdiv(tiles * steps, grid), 1)
    plan = qc.StreamedPlan(steps=steps, per_program=per_program, grid=grid, slots=slots)
    k_mask_at = lambda k0: None if even_k else (k0 + jnp.arange(bw)) < k_width

    def locate(col0):
        """A virtual column (item, stack, tile, laid end to end) -> (item, stack, column in the stack)."""
        tile = jax.lax.div(col0, bn)
        item = jnp.minimum(jax.lax.div(tile, per_item), item_bound - 1)
        within = tile - item * per_item
        seg = jax.lax.div(within, n_tiles)
        return item, seg, (within - seg * n_tiles) * bn

    def stack_loads(s, expert, col, ks, n_mask):
        """Stack s's loads for one unit: NVFP4 (words, scale bits), FP8 (bits,) or with block
        scales (bits, the tile's scale)."""
        row0 = expert * n_size + col
        if fmt == "nvfp4":
            return _word_loads(refs[2 * s], refs[2 * s + 1], kw=ks * bw, col0=row0, bn=bn, bw=bw, n_mask=n_mask,
                               words_k=k_width, even_k=even_k)  # fmt: skip
        k0 = ks * bw
        bits = qc.load(refs[2 * s].at[compat.ds(row0, bn), compat.ds(k0, bw)], _mask2(n_mask, k_mask_at(k0), (bn, bw)))
        if scale_block is None:
            return (bits,)
        scale_ref = refs[2 * s + 1]
        kb = jnp.minimum(k0 // scale_block, scale_ref.shape[1] - 1)  # a masked tail step may overshoot
        return bits, scale_ref[expert * compat.cdiv(n_size, scale_block) + col // scale_block, kb]

    def loads(col0, ks, valid):
        item, seg, col = locate(col0)
        expert, first = items_ref[0, item], items_ref[1, item]
        n_mask = ((col + jnp.arange(bn)) < n_size) & valid
        if segments == 1:
            parts = stack_loads(0, expert, col, ks, n_mask)
        else:  # a branch per stack, uniform over the program: only its loads are issued
            branches = [functools.partial(stack_loads, s) for s in range(segments)]
            parts = jax.lax.switch(seg, branches, expert, col, ks, n_mask)
        return (*parts, first)

    def products(acc, ks, loaded):
        *parts, first = loaded
        if fmt == "nvfp4":
            return _word_gemv_products(acc, x_ref, *parts, kw=ks * bw, bn=bn, bw=bw, words_k=k_width, even_k=even_k,
                                       rows=rows, row0=first, last_row=m_size - 1)  # fmt: skip
        k0 = ks * bw
        w = jax.lax.bitcast_convert_type(parts[0], jnp.float8_e4m3fn).astype(jnp.float32)
        out = []
        for r in range(rows):
            row = jnp.minimum(first + r, m_size - 1)
            x = qc.load(x_ref.at[compat.ds(row, 1), compat.ds(k0, bw)], _mask2(None, k_mask_at(k0), (1, bw)))
            x = x.astype(jnp.float32)
            out.append(acc[r] + w * (x if scale_block is None else x * parts[1]))
        return tuple(out)

    def init():
        return tuple(jnp.zeros((bn, bw), jnp.float32) for _ in range(rows))

    def store(acc, slot, col0, mask):
        item, seg, col = locate(col0)
        first, end = items_ref[1, item], items_ref[2, item]
        mask = mask & ((col + jnp.arange(bn)) < n_size)
        for r in range(rows):
            value = jnp.zeros((1, bn), jnp.float32) if acc is None else acc[r].sum(axis=1)[None, :]
            row = jnp.minimum(first + r, m_size - 1)
            view = out_ref.at[slot, compat.ds(row, 1), compat.ds(seg * n_size + col, bn)]
            compat.store(view, value, mask=(mask & (first + r < end))[None, :])

    qc.streamed_loop(loads, products, plan=plan, n_size=tiles * bn, bn=bn, init=init, store=store)


def _grouped_streamed_call(
    x, weights, group_sizes, fmt, block_size, cfg: GroupedConfig, out_dtype, interpret
) -> list[jax.Array]:
    """The "gemv_ws" pallas_call of `grouped_matmuls`: the work items (and for NVFP4 x's float16
    word-order rows) before it, the slot sum and each row's scales after it (its float16 factor
    and its expert's tensor scale for NVFP4, its expert's scale for per-expert FP8), rows past the
    groups zero."""
    m, k = x.shape
    num_experts, n = weights[0][0].shape[:2]
    segments = len(weights)
    item_bound = max_work_items(m, num_experts, cfg.block_m)
    expert, first, end = work_items(group_sizes, m, cfg.block_m)
    count = jnp.sum((end > first).astype(jnp.int32))
    items = jnp.stack([expert, first, end, jnp.broadcast_to(count, expert.shape)]).astype(jnp.int32)
    operands, expert_scales = [], []
    if fmt == "nvfp4":
        k_width, step_width = k // 8, cfg.block_k // 8
        x16, row_factor = qc.f16_rows(x)
        x_in, factor = qc.word_columns(x16), row_factor * qc.E2M1_F16_SCALE
        for packed, block_scale, tensor_scale in weights:
            operands += [
                jax.lax.bitcast_convert_type(packed.reshape(num_experts * n, k_width, 4), jnp.uint32),
                jax.lax.bitcast_convert_type(block_scale, jnp.uint8).reshape(num_experts * n, k // NVFP4_BLOCK),
            ]
            expert_scales.append(jnp.asarray(tensor_scale, jnp.float32))
    else:
        k_width, step_width = k, cfg.block_k
        x_in, factor = x.astype(jnp.float32 if x.dtype == jnp.float32 else x.dtype), jnp.ones((m,), jnp.float32)
        for data, scale in weights:
            bits = jax.lax.bitcast_convert_type(data, jnp.uint8).reshape(num_experts * n, k)
            if block_size is None:
                operands += [bits, jnp.ones((1, 1), jnp.float32)]
                expert_scales.append(jnp.asarray(scale, jnp.float32))
            else:
                operands += [bits, jnp.asarray(scale, jnp.float32).reshape(-1, scale.shape[-1])]
                expert_scales.append(jnp.ones((num_experts,), jnp.float32))
    steps = compat.cdiv(k_width, step_width)
    grid = cfg.programs or 2 * compat.sm_count()
    slots = 1 if steps == 1 else steps  # a tile's K steps may fall to as many programs (runs of one unit)
    kernel = functools.partial(
        _grouped_streamed_kernel, fmt=fmt, segments=segments, m_size=m, n_size=n, rows=cfg.block_m,
        block_n=cfg.block_n, step_width=step_width, k_width=k_width, steps=steps, item_bound=item_bound, grid=grid,
        slots=slots, scale_block=block_size if fmt == "fp8" else None, even_k=k_width % step_width == 0,
    )  # fmt: skip
    partial = compat.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((slots, m, segments * n), jnp.float32),
        grid=(grid,),
        compiler_params=compat.triton_compiler_params(num_warps=cfg.num_warps, num_stages=cfg.num_stages),
        interpret=interpret,
        name=f"grouped_{fmt}_matmul_gemv_ws",
    )(items, x_in, *operands)
    y = qc.split_sum(partial)
    row_expert, valid = _row_experts(group_sizes, m)  # its cumsum is work_items' (XLA computes it once)
    factor = jnp.where(valid, factor, 0.0)  # rows past the groups: zero
    outs = []
    for s, expert_scale in enumerate(expert_scales):
        ys = y[:, s * n : (s + 1) * n] * (factor * expert_scale[row_expert])[:, None]
        outs.append(jnp.where(valid[:, None], ys, 0.0).astype(out_dtype))  # the unwritten rows hold anything
    return outs


def grouped_nvfp4_matmul(
    x: jax.Array,
    packed: jax.Array,
    block_scale: jax.Array,
    tensor_scale: jax.Array,
    group_sizes: jax.Array,
    **options,
) -> jax.Array:
    """`grouped_matmul` over an NVFP4 stack: packed u8 [E, N, K/2], block_scale e4m3 [E, N, K/16],
    tensor_scale f32 [E] (`NVFP4Weight` leaves). Options as in `grouped_matmul`."""
    return grouped_matmul(x, (packed, block_scale, tensor_scale), group_sizes, fmt="nvfp4", **options)


def grouped_fp8_matmul(
    x: jax.Array,
    data: jax.Array,
    scale: jax.Array,
    group_sizes: jax.Array,
    *,
    block_size: int | None = None,
    **options,
) -> jax.Array:
    """`grouped_matmul` over an FP8 stack: data e4m3 [E, N, K], scale f32 [E] (block_size None) or
    [E, ceil(N/b), ceil(K/b)] (`FP8Weight` leaves). Options as in `grouped_matmul`."""
    return grouped_matmul(x, (data, scale), group_sizes, fmt="fp8", block_size=block_size, **options)
