"""Pieces shared by the quantized matmul kernels (nvfp4_matmul, fp8_matmul).

* `MatmulConfig`: one kernel configuration (formulation + tiles + Triton knobs), the unit the
  benchmark sweeps over and the default tables are made of.
* Three formulations of y = x @ W.T for small M, chosen per call (docs/pallas.md, "Quantized
  decode matmuls"):
    - ``"gemv"``  no tensor cores: W tile in float32 times each activation row, accumulated
      elementwise in a [block_n, block_k] float32 register tile and reduced over K once at the
      end (no cross-thread reduction inside the K loop). Built for M = 1..8. (NVFP4 adds
      ``"gemv_bs"``, which sums products within each scale block before scaling.)
    - ``"dot"``   x_tile [16, bk] @ W_tile.T: M padded up to Triton's minimum dot size of 16.
    - ``"dot_t"`` W_tile [bn, bk] @ x_tile.T -> [bn, 16] ("swap AB"): the big weight tile is the
      left operand, so with block_n >= 64 Hopper can issue wgmma with the dequantized tile
      straight from registers; x is the small right operand.
* ``"gemv_ws"`` (streamed gemv, `streamed_gemv`): the gemv's products on a fixed grid of
  programs, each walking an equal run of (N tile, K step) units in one loop with its loads one
  unit ahead; partial sums of tiles shared by programs go to separate slots (`StreamedPlan`).
* For large M (prefill), ``"tiled"``: the classic tensor-core GEMM. Grid of
  (M tiles x N tiles) programs, each an x tile [block_m, bk] @ W_tile.T into a float32
  [block_m, block_n] accumulator, the weight tile unpacked to bf16 in registers once per K step
  and shared by all block_m rows. Programs are launched in grouped order (`grouped_tile`).
* `e2m1_f16_bits`: NVFP4 (E2M1) decode by placing the 3 magnitude bits and the sign into a
  float16 bit pattern: value = fp16(bits) * 2**14 exactly, subnormals included (0.5 is the
  fp16 subnormal 2**-15; fp16 -> fp32 conversion keeps it, so no float32 subnormal ever exists).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping

import jax
import jax.numpy as jnp

from pallas_kernels import compat

DECODE_VARIANTS = ("gemv", "dot", "dot_t")  # small M; split_k allowed
VARIANTS = (*DECODE_VARIANTS, "tiled")
GEMV_MAX_M = 8  # the gemv formulation unrolls one accumulator per activation row
DOT_BLOCK_M = 16  # Triton's minimum dot dimension: decode rows are padded up to it
E2M1_F16_SCALE = 2.0**14  # e2m1(code) == float16(e2m1_f16_bits(code)) * E2M1_F16_SCALE
PREFILL_M = 1 << 30  # DEFAULT_CONFIGS key of the entry serving every M above the decode entries


@dataclasses.dataclass(frozen=True)
class MatmulConfig:
    """One configuration of a quantized decode matmul kernel."""

    variant: str  # "gemv", "dot" or "dot_t" (see module docstring)
    block_n: int  # weight rows (output columns) per program; power of two
    block_k: int  # K elements per loop step; power of two
    split_k: int = 1  # programs sharing one K loop; partial sums are added outside the kernel
    num_warps: int = 4
    num_stages: int = 3  # Triton software-pipelining depth of the K loop
    block_m: int | None = None  # activation rows per program (None: the entry's default for M)
    group_m: int = 8  # "tiled": M tiles per launch group (programs sharing a weight tile run together)
    programs: int = 0  # streamed formulations ("gemv_ws"): programs in the grid (0: 2 per SM)
    scale_spread: str = "reshape"  # NVFP4 word gemvs: block scales spread by a reshape or read per word
    x_rows: str = "xla"  # NVFP4 word kernels: x's float16 rows made by XLA before the kernel, or inside it

    def as_kwargs(self) -> dict:
        return dataclasses.asdict(self)


SCALE_SPREADS = ("reshape", "gather")  # MatmulConfig.scale_spread (nvfp4_matmul._word_loads)
# MatmulConfig.x_rows (and the grouped kernel's): where a word kernel's float16 rows are made.
# "xla": `f16_rows` (and `word_columns`) before the launch; "kernel": x enters as given, in
# natural order, and the kernel scales its rows itself (`row_max_abs`, `f16_row_factors`): the
# same bits, and no reduce / convert / transpose launches before the kernel.
X_ROWS = ("xla", "kernel")


def pick_config(table: Mapping[int, MatmulConfig], m: int) -> MatmulConfig:
    """The entry of `table` (keyed by the largest M it serves) for M rows: the smallest key >= m,
    else the largest key."""
    for max_m in sorted(table):
        if m <= max_m:
            return table[max_m]
    return table[max(table)]


def resolve_config(
    table: Mapping[int, MatmulConfig],
    m: int,
    *,
    variants: tuple[str, ...] = VARIANTS,
    variant: str | None,
    block_n: int | None,
    block_k: int | None,
    split_k: int | None,
    num_warps: int | None,
    num_stages: int | None,
    block_m: int | None = None,
    group_m: int | None = None,
    programs: int | None = None,
    scale_spread: str | None = None,
    x_rows: str | None = None,
) -> MatmulConfig:
    """The default configuration for M rows with every explicitly given field overriding it.

    An explicit variant that differs from the default keeps the default's tiles (they are valid
    for every variant) unless those are given too. An explicit split_k > 1 without a variant
    keeps callers that pass decode tiles at any M working: where the table says "tiled" (no
    split K) the largest decode entry is the base instead.
    """
    base = pick_config(table, m)
    if variant is None and split_k is not None and split_k > 1 and is_tiled(base.variant):
        base = pick_config({k: c for k, c in table.items() if not is_tiled(c.variant)}, m)
    if variant is not None and variant not in variants:
        raise ValueError(f"variant={variant!r} must be one of {variants}")
    if variant is not None and is_streamed(variant) and split_k is None:
        split_k = 1  # a base entry's split K is not the streamed formulation's to keep
    chosen = {
        "variant": variant,
        "block_n": block_n,
        "block_k": block_k,
        "split_k": split_k,
        "num_warps": num_warps,
        "num_stages": num_stages,
        "block_m": block_m,
        "group_m": group_m,
        "programs": programs,
        "scale_spread": scale_spread,
        "x_rows": x_rows,
    }
    cfg = dataclasses.replace(base, **{k: v for k, v in chosen.items() if v is not None})
    if is_gemv(cfg.variant) and m > GEMV_MAX_M:
        raise ValueError(f"variant='gemv' serves M <= {GEMV_MAX_M}; got M={m}")
    if is_tiled(cfg.variant) and cfg.split_k != 1:
        raise ValueError(f"variant={cfg.variant!r} takes split_k=1; got split_k={cfg.split_k}")
    if cfg.group_m < 1:
        raise ValueError(f"group_m={cfg.group_m} must be >= 1")
    if cfg.scale_spread not in SCALE_SPREADS:
        raise ValueError(f"scale_spread={cfg.scale_spread!r} must be one of {SCALE_SPREADS}")
    if cfg.x_rows not in X_ROWS:
        raise ValueError(f"x_rows={cfg.x_rows!r} must be one of {X_ROWS}")
    if cfg.programs < 0:
        raise ValueError(f"programs={cfg.programs} must be >= 0 (0: two per SM)")
    if is_streamed(cfg.variant) and cfg.split_k != 1:
        raise ValueError(f"variant={cfg.variant!r} spreads K over its programs itself; got split_k={cfg.split_k}")
    return cfg


def is_gemv(variant: str) -> bool:
    """True for the CUDA-core formulations ("gemv" and its variants), which take all rows at once."""
    return variant.startswith("gemv")


def is_streamed(variant: str) -> bool:
    """True for the streamed decode formulations ("gemv_ws"): a fixed grid walking (tile, K step)
    units in one long loop (`streamed_gemv`)."""
    return variant.endswith("_ws")


def is_tiled(variant: str) -> bool:
    """True for the prefill formulations ("tiled" and NVFP4's "tiled_w"): flat grid, no split K."""
    return variant.startswith("tiled")


def grouped_tile(pid: jax.Array, m_tiles: int, n_tiles: int, group_m: int) -> tuple[jax.Array, jax.Array]:
    """(M tile, N tile) of program `pid` of a flat grid of m_tiles * n_tiles, in grouped order.

    Consecutive programs walk down a group of `group_m` M tiles before moving to the next N
    tile (the Triton matmul tutorial's "super-grouping"): the programs running at one time
    share a few weight tiles and a few activation tiles, so both stay in L2, instead of every
    program of a row-major order reading a different weight tile. The last group may be
    shorter. A bijection of [0, m_tiles * n_tiles) onto the tiles (tests check it).
    """
    width = group_m * n_tiles
    group = pid // width
    first_m = group * group_m
    size_m = jnp.minimum(m_tiles - first_m, group_m)
    within = pid % width
    return first_m + within % size_m, within // size_m


def is_pow2(v: int) -> bool:
    return v > 0 and (v & (v - 1)) == 0


def e2m1_f16_bits(byte: jax.Array, *, high: bool) -> jax.Array:
    """uint8 NVFP4 bytes -> float32 of one nibble's E2M1 value divided by E2M1_F16_SCALE.

    E2M1 is sign | 2 exponent bits (bias 1) | 1 mantissa bit. Moving the three magnitude bits to
    float16's lowest exponent bits and its top mantissa bit (bits 11..9) and the sign to bit 15
    gives a float16 of the same shape with exponent bias 15 instead of 1: exactly 2**-14 times the
    E2M1 value, and E2M1's subnormal 0.5 lands on float16's subnormal 2**-15. Four integer ops and
    one conversion per element, no compares or selects; the 2**14 is folded into the block scale.
    """
    b = byte.astype(jnp.uint16)
    if high:
        bits = ((b & 0x70) << 5) | ((b & 0x80) << 8)
    else:
        bits = ((b & 0x7) << 9) | ((b & 0x8) << 12)
    return jax.lax.bitcast_convert_type(bits, jnp.float16).astype(jnp.float32)


E2M1_WORD_MAGNITUDE = 0x0E000E00  # float16 bits 11..9 of both halves of a uint32
E2M1_WORD_SIGN = 0x80008000  # float16 bit 15 of both halves


def e2m1_word_f16(words: jax.Array) -> list[jax.Array]:
    """uint32 words of packed NVFP4 (4 bytes = 8 elements, element 2i in the low nibble of byte i)
    -> the 8 elements as float16 arrays of the words' shape, in element order, each E2M1 / 2**14.

    The float16 bit placement of `e2m1_f16_bits`, done on whole 32-bit words: one shift pair and
    one and-or (a single LOP3 on the GPU) places the nibbles of two elements, four bytes apart, in
    the two float16 halves of a word at once, and each half is then a float16 by a bitcast alone.
    About 1.4 integer ops per element and no float conversion at all: on Hopper a conversion
    issues at 16 per clock per SM, an eighth of the float32 rate, which is what held the nibble
    decode (two conversions per element) to a fifth of HBM bandwidth.
    """
    mag, sign = jnp.uint32(E2M1_WORD_MAGNITUDE), jnp.uint32(E2M1_WORD_SIGN)
    pairs = (  # (element j, element j + 4) in the (low, high) halves: nibble j of each half
        ((words << 9) & mag) | ((words << 12) & sign),
        ((words << 5) & mag) | ((words << 8) & sign),
        ((words << 1) & mag) | ((words << 4) & sign),
        ((words >> 3) & mag) | (words & sign),
    )
    low = [jax.lax.bitcast_convert_type(p.astype(jnp.uint16), jnp.float16) for p in pairs]
    high = [jax.lax.bitcast_convert_type((p >> 16).astype(jnp.uint16), jnp.float16) for p in pairs]
    return low + high


F16_ROW_MAX = 2.0**14  # `f16_rows` scales each activation row's max |x| to below this


def f16_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [M, K] -> (x * 2**s[m] as float16, 2**-s[m] as float32 [M]): each row scaled by a power of
    two so its max |x| lands in [2**13, 2**14), far inside float16's range (65504) whatever the
    activations' size, and bf16 values keep every bit (float16 has 3 more mantissa bits). The
    caller multiplies row m of its float32 result by the second output. The exponent is clipped
    to +-60 (all-zero and denormal rows stay finite)."""
    xf = x.astype(jnp.float32)
    factor, inverse = f16_row_factors(jnp.max(jnp.abs(xf), axis=1))
    return (xf * factor[:, None]).astype(jnp.float16), inverse


def f16_row_factors(max_abs: jax.Array) -> tuple[jax.Array, jax.Array]:
    """float32 max |x| of each row -> (2**s, 2**-s) float32 with s = clip(14 - e, -60, 60), where
    max |x| is in [2**(e-1), 2**e): `f16_rows`' factors, from the exponent bits alone (integer and
    bit ops that kernels lower too, so a kernel that scales its own rows gets the same bits). Zero
    and denormal maxima give s = 60 (their rows stay zero or tiny either way)."""
    bits = jax.lax.bitcast_convert_type(max_abs.astype(jnp.float32), jnp.int32)
    e = jax.lax.shift_right_logical(bits, 23) - 126  # frexp's exponent of a normal float (sign bit 0)
    s = jnp.clip(14 - e, -60, 60)
    factor = jax.lax.bitcast_convert_type(jax.lax.shift_left(s + 127, 23), jnp.float32)
    inverse = jax.lax.bitcast_convert_type(jax.lax.shift_left(127 - s, 23), jnp.float32)
    return factor, inverse


def row_max_abs(x_ref, r0, rows: int, rows_ok: jax.Array | None, k: int, width: int) -> jax.Array:
    """Inside a kernel: float32 max |x| over all K columns of rows r0 .. r0 + rows of x_ref (rows
    where `rows_ok` is False: 0), `width` columns (a power of two) a step: the input of
    `f16_row_factors` for a kernel that makes its own float16 rows (x_rows="kernel"), which need
    the whole row whatever part of K the program sums."""

    def body(i, running):
        c0 = i * width
        mask = None if k % width == 0 else ((c0 + jnp.arange(width)) < k)[None, :]
        if rows_ok is not None:
            mask = rows_ok[:, None] if mask is None else mask & rows_ok[:, None]
        if mask is not None:
            mask = jnp.broadcast_to(mask, (rows, width))
        tile = load(x_ref.at[compat.ds(r0, rows), compat.ds(c0, width)], mask)
        return jnp.maximum(running, jnp.max(jnp.abs(tile.astype(jnp.float32)), axis=1))

    return jax.lax.fori_loop(0, compat.cdiv(k, width), body, jnp.zeros((rows,), jnp.float32))


def word_columns(x: jax.Array) -> jax.Array:
    """x [M, K] -> [M, K] with column p * K/8 + j holding x[:, 8j + p]: the activation columns in
    the order `e2m1_word_f16` yields weight elements (element p of word j), so a kernel reads the
    columns that multiply element p of a run of words as one contiguous [rows, words] tile."""
    m, k = x.shape
    return x.reshape(m, k // 8, 8).transpose(0, 2, 1).reshape(m, k)


def load(view, mask: jax.Array | None) -> jax.Array:
    """Load a ref view; zeros where `mask` is False. mask=None: a plain load (the static
    mask-free path taken when N and K divide the tiles)."""
    if mask is None:
        return compat.load(view)
    return compat.load(view, mask=mask, other=0)


def dims_nt() -> tuple:
    """dot_general dimension numbers for a [a, k] x [b, k] -> [a, b] product."""
    return (((1,), (1,)), ((), ()))


SPLIT_ADDS_MAX = 4  # `split_sum` adds up to this many partial sums elementwise instead of reducing


def split_sum(partial: jax.Array) -> jax.Array:
    """Sum the split-K (or streamed slot) partial sums [split_k, ...] (a no-op reshape when
    split_k == 1). A few parts are added as elementwise slices rather than reduced: XLA fuses an
    elementwise producer into each of its consumers (the scales after the kernel, the activation
    or norm that reads the result), where a reduction over the leading axis stays a kernel of its
    own, one more launch after every decode matmul."""
    parts = partial.shape[0]
    if parts > SPLIT_ADDS_MAX:
        return partial.sum(axis=0)
    total = partial[0]
    for i in range(1, parts):
        total = total + partial[i]
    return total


def accumulate_and_store(
    step, steps, *, variant, rows, bn, gemv_width, out_ref, split, row0, col0, n_mask, carry_extra=(),
    row_scale=None,
):  # fmt: skip
    """Run a decode kernel's K loop (`step(t, acc)`) and store its float32 partial sums in
    out_ref [split_k, M, N] ("dot": [M, N] tiles; "dot_t": [N, M] tiles; gemv formulations: one
    [bn, gemv_width] accumulator per activation row, summed over K once after the loop). gemv
    formulations may carry more values after the accumulators (`carry_extra`: their start).
    row_scale: float32 [rows] multiplying each row's sums before the store (a kernel that made its
    own float16 rows undoes their factors; gemv: a tuple of scalars)."""
    if is_gemv(variant):
        zeros = tuple(jnp.zeros((bn, gemv_width), jnp.float32) for _ in range(rows))
        acc = jax.lax.fori_loop(0, steps, step, (*zeros, *carry_extra))
        for r in range(rows):
            value = acc[r].sum(axis=1)[None, :]
            compat.store(
                out_ref.at[split, compat.ds(r, 1), compat.ds(col0, bn)],
                value if row_scale is None else value * row_scale[r],
                mask=None if n_mask is None else n_mask[None, :],
            )
        return
    transposed = variant.startswith("dot_t")  # "dot_t" and NVFP4's "dot_t_w": [N, M] tiles
    shape = (bn, rows) if transposed else (rows, bn)
    acc = jax.lax.fori_loop(0, steps, step, jnp.zeros(shape, jnp.float32))
    if row_scale is not None:  # rows are acc's columns in the transposed tiles
        acc = acc * (row_scale[None, :] if transposed else row_scale[:, None])
    if not transposed:
        view = out_ref.at[split, compat.ds(row0, rows), compat.ds(col0, bn)]
        mask = None if n_mask is None else jnp.broadcast_to(n_mask[None, :], shape)
    else:
        view = out_ref.at[split, compat.ds(col0, bn), compat.ds(row0, rows)]
        mask = None if n_mask is None else jnp.broadcast_to(n_mask[:, None], shape)
    compat.store(view, acc, mask=mask)


@dataclasses.dataclass(frozen=True)
class StreamedPlan:
    """How a streamed decode kernel spreads its work: the N tiles' K steps, numbered tile by tile
    (`units` = tiles * steps), in equal runs of `per_program` consecutive units, one run per
    program of the `grid`. A tile's units may fall into the runs of up to `slots` programs; each
    writes its partial sums into its own slot of the float32 output [slots, M, N] (summed outside
    the kernel), so the result does not depend on the order programs run in."""

    steps: int  # K steps per tile
    per_program: int
    grid: int
    slots: int

    @classmethod
    def make(cls, n_size: int, block_n: int, steps: int, programs: int) -> StreamedPlan:
        units = compat.cdiv(n_size, block_n) * steps
        per_program = compat.cdiv(units, max(1, min(programs, units)))
        # a tile of s units starting r units into a run of p spans floor((r + s - 1) / p) + 1 runs:
        # at most floor((s - 2) / p) + 2, as r <= p - 1
        slots = 1 if steps == 1 else (steps - 2) // per_program + 2
        return cls(steps, per_program, compat.cdiv(units, per_program), slots)


@dataclasses.dataclass(frozen=True)
class Segments:
    """Weights that share one activation, laid end to end on a streamed kernel's N axis so that
    one launch serves them all (a layer's q / k / v, or its GDN input projections). Segment s
    starts at tile `first_tiles[s]` (each starts on a tile boundary; the tail of its last tile
    is padding, neither read nor used); the last one ends at `n_size` exactly, so one segment is
    a plain [N, K] weight."""

    sizes: tuple[int, ...]  # N of each weight
    block_n: int

    @property
    def first_tiles(self) -> tuple[int, ...]:
        firsts, t = [], 0
        for n in self.sizes:
            firsts.append(t)
            t += compat.cdiv(n, self.block_n)
        return tuple(firsts)

    @property
    def n_size(self) -> int:
        """Columns of the kernel's output: every segment but the last padded to whole tiles."""
        return self.first_tiles[-1] * self.block_n + self.sizes[-1]

    def columns(self, s: int) -> slice:
        """Segment s's columns of the kernel's output."""
        start = self.first_tiles[s] * self.block_n
        return slice(start, start + self.sizes[s])

    def loads(self, per_segment):
        """One `loads(col0, ks, valid)` over all segments from `per_segment(s)`, segment s's own
        (called with col0 relative to the segment and its N): a unit reads from the segment its
        tile lies in, picked by a branch (`lax.switch`, uniform over the program), so a unit
        issues the loads of one segment only (masked loads of the others would still cost their
        address arithmetic, and these kernels are bound by instruction issue)."""
        if len(self.sizes) == 1:
            return per_segment(0)
        firsts, bn = self.first_tiles, self.block_n
        parts = [per_segment(s) for s in range(len(self.sizes))]
        branches = [
            functools.partial(lambda part, first, col0, ks, valid: part(col0 - first * bn, ks, valid), part, first)
            for part, first in zip(parts, firsts, strict=True)
        ]

        def loads(col0, ks, valid):
            tile = jax.lax.div(col0, bn)
            index = sum((tile >= first).astype(jnp.int32) for first in firsts[1:])
            return jax.lax.switch(index, branches, col0, ks, valid)

        return loads


def streamed_loop(loads, products, *, plan: StreamedPlan, n_size, bn, init, store):
    """The loop of a streamed formulation, for program `program_id(0)`: its run of (tile, K step)
    units in one pass, the weights of unit u + 1 loaded while unit u's products run (Triton
    pipelines only the loads that feed dots; issuing them a unit early by hand keeps bytes in
    flight across tile boundaries too), each tile's accumulators stored at its end.

    Against one program per tile, the loads stay in flight across tiles and every program has the
    same work (no tail wave, no split-K choice). `loads(col0, ks, valid)` returns one unit's
    weights (rows col0 .., K step ks; nothing read where `valid` is false, a traced bool);
    `products(acc, ks, loaded)` returns the accumulators (a tuple, `init()`'s zeros at each tile's
    start) with that unit added; `store(acc, slot, col0, mask)` writes a tile's accumulators, or
    zeros where acc is None, to output slot `slot` for the rows (N) where `mask` holds."""
    p, steps, per = compat.program_id(0), plan.steps, plan.per_program
    units = compat.cdiv(n_size, bn) * steps
    start = p * per
    end = jnp.minimum(start + per, units)

    def unit_loads(u, valid):
        return loads(jax.lax.div(u, steps) * bn, jax.lax.rem(u, steps), valid)

    def tile_body(tile, ahead):
        base = tile * steps
        zeros = init()
        n_acc = len(zeros)

        def step(ks, carry):
            u = base + ks
            nxt = unit_loads(jnp.minimum(u + 1, units - 1), u + 1 < end)
            return (*products(carry[:n_acc], ks, carry[n_acc:]), *nxt)

        first, last = jnp.maximum(start - base, 0), jnp.minimum(end - base, steps)
        carry = jax.lax.fori_loop(first, last, step, (*zeros, *ahead))
        col0 = tile * bn
        slot = p - jax.lax.div(base, per)  # this program's place among the tile's
        n_mask = (col0 + jnp.arange(bn)) < n_size
        store(carry[:n_acc], slot, col0, n_mask)
        for s in range(1, plan.slots):  # the program ending the tile zeroes the slots nobody wrote
            store(None, jnp.int32(s), col0, (s > slot) & (last == steps) & n_mask)
        return carry[n_acc:]

    first_tile, last_tile = jax.lax.div(start, steps), jax.lax.div(end - 1, steps)
    jax.lax.fori_loop(first_tile, last_tile + 1, tile_body, unit_loads(start, start < end))


def streamed_gemv(loads, products, *, plan: StreamedPlan, n_size, rows, bn, width, out_ref, row_scale=None):
    """`streamed_loop` for a gemv formulation: one [bn, width] float32 accumulator per activation
    row, summed over its width once per tile into out_ref [slots, M, N] (times row_scale[r], a
    float32 scalar per row, when given)."""

    def init():
        return tuple(jnp.zeros((bn, width), jnp.float32) for _ in range(rows))

    def store(acc, slot, col0, mask):
        for r in range(rows):
            value = jnp.zeros((1, bn), jnp.float32) if acc is None else acc[r].sum(axis=1)[None, :]
            if acc is not None and row_scale is not None:
                value = value * row_scale[r]
            compat.store(out_ref.at[slot, compat.ds(r, 1), compat.ds(col0, bn)], value, mask=mask[None, :])

    streamed_loop(loads, products, plan=plan, n_size=n_size, bn=bn, init=init, store=store)


def tiled_grid(m: int, n: int, block_m: int, block_n: int) -> tuple[int, int]:
    """(M tiles, N tiles) of the "tiled" formulation; its flat grid has their product."""
    return compat.cdiv(m, block_m), compat.cdiv(n, block_n)


def compiler_params(cfg: MatmulConfig):
    return compat.triton_compiler_params(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
