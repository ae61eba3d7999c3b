"""NVFP4 block and word dot products in packed half2 arithmetic, for the "gemv_h2_ws" and
"gemv_h2w_ws" decode formulations (`block_dots`, `word_dots`).

One NVFP4 scale block is 16 elements: two uint32 words of packed E2M1 nibbles (element i of a
word in bits 4i..4i+3). `_quant_common.e2m1_word_f16`'s shifts and masks place two elements of a
word, four apart, in the two float16 halves of one 32-bit register: a half2 operand as it stands.
PTX's `fma.rn.f16x2` multiplies two such pairs and adds them into a half2 accumulator in one
instruction, where Triton's float16 code spends one instruction per element (and a conversion
to float32 per word). So the block's 16 products take 8 packed FMAs, the two halves of the
accumulator are added once, and one conversion to float32 per block remains; the block scale
is applied in float32 outside (`block_dots`' caller).

The activation side is prepared once per call by `half2_x_pairs`: x (float16, rows scaled by
`_quant_common.f16_rows`) regrouped so that the half2 operand meeting pair p of word w of block
s is one uint32, (x[16s + 8w + p], x[16s + 8w + p + 4]).

Numerics are gemv_w's: each product (2 significant bits of E2M1 times the 8 of a bf16
activation) is exact in float16; the sums are rounded to float16. Each half of the accumulator
sums 8 products, then the halves are added: 16 terms in float16 where gemv_w sums 8 (measured
errors stay under `nvfp4_matmul.GEMV_W_TOLERANCE`).

The word form (`word_dots`, "gemv_h2w_ws") takes one word and its 4 pairs
(`word_x_pairs`: (x[8j + p], x[8j + p + 4])), so it keeps gemv_ws's whole-word tiles and 16-byte
loads; its halves each sum 4 products (8 in all, as gemv_w).

Only the compiled GPU kernel runs the PTX. The Pallas interpreter (CPU tests) cannot run inline
assembly, so there `block_dots` and `word_dots` compute the same sums with float16 jnp operations.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import _quant_common as qc
from pallas_kernels import compat

# (left shift of the magnitude, left shift of the sign) placing pair p of a word; p = 3 shifts
# the magnitude right by 3 and leaves the sign where it is.
_PAIR_SHIFTS = ((9, 12), (5, 8), (1, 4), (-3, 0))


def half2_x_pairs(x16: jax.Array) -> jax.Array:
    """x [M, K] float16 -> [M, 8, K/16] uint32: entry [m, 4w + p, s] holds the float16 pair
    (x[m, 16s + 8w + p], x[m, 16s + 8w + p + 4]), low half first: the activation operand of
    pair p of word w (0: even, 1: odd) of scale block s."""
    m, k = x16.shape
    # element 16s + 8w + 4h + p -> [m, s, w, h, p] -> [m, w, p, s, h]
    grouped = x16.reshape(m, k // 16, 2, 2, 4).transpose(0, 2, 4, 1, 3).reshape(m, 8, k // 16, 2)
    return jax.lax.bitcast_convert_type(grouped, jnp.uint32)


def _pairs_ptx(word: str, first: int) -> list[str]:
    """PTX placing the 4 pairs of `word` (`_quant_common.e2m1_word_f16`'s shifts and masks) in
    registers p{first} .. p{first + 3} (scratch registers a, b)."""
    lines = []
    for p, (mag, sign) in enumerate(_PAIR_SHIFTS):
        lines.append(f"shl.b32 a, {word}, {mag};" if mag >= 0 else f"shr.b32 a, {word}, {-mag};")
        lines.append(f"and.b32 a, a, {qc.E2M1_WORD_MAGNITUDE:#010x};")
        lines.append(f"shl.b32 b, {word}, {sign};" if sign else f"mov.b32 b, {word};")
        lines.append(f"and.b32 b, b, {qc.E2M1_WORD_SIGN:#010x};")
        lines.append(f"or.b32 p{first + p}, a, b;")
    return lines


def block_dot_asm() -> str:
    """PTX for one scale block and one activation row: operand $0 is the float32 sum (output),
    $1 and $2 the even and odd words, $3 .. $10 the 8 half2 pairs (`half2_x_pairs`' axis 1).
    One instance per row: this jax's lowering of the asm op takes a single result, and ptxas
    sees the repeated word decode of several rows' instances as common code."""
    lines = ["{", ".reg .b32 a, b, acc;", ".reg .b16 lo, hi, s;"] + [f".reg .b32 p{i};" for i in range(8)]
    for w in range(2):
        lines += _pairs_ptx(f"${1 + w}", first=4 * w)
    lines.append("mul.rn.f16x2 acc, p0, $3;")
    lines += [f"fma.rn.f16x2 acc, p{i}, ${3 + i}, acc;" for i in range(1, 8)]
    lines += ["mov.b32 {lo, hi}, acc;", "add.rn.f16 s, lo, hi;", "cvt.f32.f16 $0, s;", "}"]
    return "\n".join(lines)


BLOCK_DOT_CONSTRAINTS = ",".join(["=f"] + ["r"] * 10)


def block_dots(
    even: jax.Array, odd: jax.Array, pairs: list[list[jax.Array]], *, interpret: bool
) -> list[jax.Array]:
    """Per activation row r, the float32 sum over the 16 elements of each scale block of
    weight * x, weights decoded from the even / odd uint32 words (same shape [..]) and x from
    `pairs[r]` (8 uint32 arrays of that shape: `half2_x_pairs` rows 0..7 of the block's
    column). Weights carry `_quant_common.E2M1_F16_SCALE` (they are E2M1 / 2**14)."""
    if interpret:
        return [_block_dot_jnp(even, odd, row) for row in pairs]
    from jax.experimental.pallas import triton as plgpu  # GPU lowering only

    shape = jax.ShapeDtypeStruct(even.shape, jnp.float32)
    asm = block_dot_asm()
    return [
        plgpu.elementwise_inline_asm(
            asm,
            args=[even, odd, *row],
            constraints=BLOCK_DOT_CONSTRAINTS,
            pack=1,
            result_shape_dtypes=[shape],
        )[0]
        for row in pairs
    ]


def _halves(words: jax.Array) -> tuple[jax.Array, jax.Array]:
    """uint32 -> (low float16, high float16) of each word."""
    low = jax.lax.bitcast_convert_type((words & 0xFFFF).astype(jnp.uint16), jnp.float16)
    high = jax.lax.bitcast_convert_type((words >> 16).astype(jnp.uint16), jnp.float16)
    return low, high


def _block_dot_jnp(even: jax.Array, odd: jax.Array, row: list[jax.Array]) -> jax.Array:
    """`block_dot_asm`'s arithmetic for one row in float16 jnp operations (interpret mode)."""
    decoded = qc.e2m1_word_f16(even) + qc.e2m1_word_f16(odd)  # 16 float16 arrays, element order
    acc_lo = acc_hi = None
    for i in range(8):
        w, p = divmod(i, 4)
        x_lo, x_hi = _halves(row[i])
        lo, hi = decoded[8 * w + p] * x_lo, decoded[8 * w + p + 4] * x_hi
        acc_lo = lo if acc_lo is None else acc_lo + lo
        acc_hi = hi if acc_hi is None else acc_hi + hi
    return (acc_lo + acc_hi).astype(jnp.float32)


def word_x_pairs(x16: jax.Array) -> jax.Array:
    """x [M, K] float16 -> [M, K/2] uint32 whose column p * K/8 + j (p < 4) holds the float16 pair
    (x[m, 8j + p], x[m, 8j + p + 4]), low half first: the activation operand of pair p of word j
    in `word_dots` (the word order of `_quant_common.word_columns`, two elements to a column).
    Each word is built from its two 16-bit halves by integer ops, not by a bitcast of [..., 2]
    float16 to uint32: XLA's GPU compiler fuses the former with the transpose and the row scaling
    before it into one kernel, where the bitcast's change of element size split it into three
    (bench.deviceless: 192 launches a step fewer on the 27B shape, 48 on the 80B-A3B)."""
    m, k = x16.shape
    grouped = x16.reshape(m, k // 8, 2, 4).transpose(0, 3, 1, 2)  # [m, p, j, half]
    halves = jax.lax.bitcast_convert_type(grouped, jnp.uint16).astype(jnp.uint32)
    return (halves[..., 0] | (halves[..., 1] << 16)).reshape(m, k // 2)


def word_dot_asm() -> str:
    """PTX for one word and one activation row: $0 is the float32 sum of the word's 8 products
    (output), $1 the word, $2 .. $5 its 4 half2 activation pairs (`word_x_pairs`). The word's
    pair p decoded in place is already the half2 operand (elements p and p + 4): 1 mul and 3
    `fma.rn.f16x2`, the two halves added once, one conversion to float32."""
    lines = ["{", ".reg .b32 a, b, acc;", ".reg .b16 lo, hi, s;"] + [f".reg .b32 p{i};" for i in range(4)]
    lines += _pairs_ptx("$1", first=0)
    lines.append("mul.rn.f16x2 acc, p0, $2;")
    lines += [f"fma.rn.f16x2 acc, p{i}, ${2 + i}, acc;" for i in range(1, 4)]
    lines += ["mov.b32 {lo, hi}, acc;", "add.rn.f16 s, lo, hi;", "cvt.f32.f16 $0, s;", "}"]
    return "\n".join(lines)


WORD_DOT_CONSTRAINTS = ",".join(["=f"] + ["r"] * 5)


def word_dots(words: jax.Array, pairs: list[jax.Array], *, interpret: bool) -> jax.Array:
    """The float32 sum of each word's 8 products weight * x, weights decoded from `words` (uint32)
    and x from `pairs` (4 uint32 arrays of the words' shape: `word_x_pairs` columns p * K/8 + j).
    Weights carry `_quant_common.E2M1_F16_SCALE` (they are E2M1 / 2**14)."""
    if interpret:
        decoded = qc.e2m1_word_f16(words)
        acc_lo = acc_hi = None
        for p in range(4):
            x_lo, x_hi = _halves(pairs[p])
            lo, hi = decoded[p] * x_lo, decoded[p + 4] * x_hi
            acc_lo = lo if acc_lo is None else acc_lo + lo
            acc_hi = hi if acc_hi is None else acc_hi + hi
        return (acc_lo + acc_hi).astype(jnp.float32)
    from jax.experimental.pallas import triton as plgpu  # GPU lowering only

    return plgpu.elementwise_inline_asm(
        word_dot_asm(),
        args=[words, *pairs],
        constraints=WORD_DOT_CONSTRAINTS,
        pack=1,
        result_shape_dtypes=[jax.ShapeDtypeStruct(words.shape, jnp.float32)],
    )[0]


def pairs_view(pairs_ref, row: int, s0, size: int, mask):
    """The 8 [size] uint32 pair columns of activation row `row` for scale blocks s0 .. s0 + size."""
    return [qc.load(pairs_ref.at[jnp.int32(row), jnp.int32(q), compat.ds(s0, size)], mask) for q in range(8)]
