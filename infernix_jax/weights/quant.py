"""Weight formats as pytree types, and the few ops that dispatch on them.

Layer code calls `matmul(x, w)` (and `expert_matmul` for MoE experts) whatever `w` is: a plain
array in Hugging Face's [out, in] = [N, K] layout, or one of the quantized types here. Quantized
weights stay packed until a kernel (on the GPU) or the float32 reference (on the CPU) unpacks
them; `.nbytes` is the packed size that memory budgets count.

Formats (weight [.., N, K]; docs/quant_formats.md has the full table):

- NVFP4Weight: packed u8 [.., N, K/2], block_scale e4m3 [.., N, K/16], tensor_scale f32 [..];
  value = e2m1 * block_scale * tensor_scale.
- FP8Weight: data e4m3 [.., N, K], scale f32 [..] (per tensor) or [.., ceil(N/b), ceil(K/b)].
- Int8Weight: data i8 [.., N, K], scale f32 [.., N].
- Q8Weight: data i8 [.., N, K], scale [.., N, K/g]; value = q * scale.
- Q4Weight: packed u8 [.., N, K/2], scale and minimum [.., N, K/g]; value = q * scale + minimum.

Leading dimensions (`..`) stack experts: [E, N, K] weights carry per-expert scales, so
`take(w, ids)` gathers experts from every leaf alike. docs/quant_formats.md has the byte layouts
and the quantization formulas (ModelOpt's, reproduced bit for bit).

Kernel dispatch: `matmul` uses a Pallas kernel when the default backend is a GPU, the weight is
2-D, the format has a kernel, and the activation has at most `SMALL_M_MAX` rows (decode);
per-tensor FP8 decode rows take XLA's own convert-fused dot instead where the H200 measured it
faster (`fp8_decode_way`; `fp8_decode_mode` / INFERNIX_FP8_DECODE override it). Past those rows
(prefill), and for formats without a kernel (INT8), a GPU runs the format's `_gpu_matmul` for
bf16 / f16 activations (NVFP4, per-tensor FP8 and INT8: one XLA dot in the activation dtype with
float32 accumulation, the kernels' numerics; block-scaled FP8: the tiled Pallas kernel, which
applies each block's scale exactly); otherwise `matmul` dequantizes to float32 and lets XLA do a
full-precision dot (the reference: the CPU path, and the GPU path of Q8 and Q4). MoE expert stacks [E, N, K] in NVFP4 or
FP8 (and plain bf16 stacks, whose `ragged_dot` XLA would expand densely) go through the grouped
kernel (`pallas_kernels/moe_matmul.py`) on a GPU for any token count: `grouped_kernel_ready`
says whether it runs, `grouped_expert_matmul` runs it on rows sorted by expert.
`kernel_mode(...)` overrides all of these. The mode is read when a function is traced, so a
jitted function keeps the choice it was traced with.

`matmuls(x, ws)` runs one input through several weights (a layer's q / k / v, its GDN input
projections, an MLP's gate and up): NVFP4 weights served by a streamed decode kernel run as one
launch (`nvfp4_matmuls`; at 2-16 rows too, through "dot_ws"), everything else as separate
`matmul`s. `fused_projections(False)` (or INFERNIX_FUSED_PROJECTIONS=off) keeps them separate,
for measuring. `grouped_expert_matmuls` does the same for an expert's gate and up stacks in the
grouped kernel (`fused_experts`, INFERNIX_FUSED_EXPERTS, on: it won end to end on an H100,
docs/quant_formats.md).

`matmul(x, w, norm)` / `matmuls(x, ws, norm)`: a `NormSource` says x is an RMSNorm's output (or
the GDN output norm's); under `norm_rows("kernel")` (INFERNIX_NORM_ROWS) the NVFP4 word kernels
then take x's float16 rows from one launch that norms too (pallas_kernels/norm_rows.py) instead
of XLA's norm, row-max reduce and reorder before them (docs/pallas.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from collections.abc import Iterator
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from infernix_jax.switches import env_mode, switched
from infernix_jax.weights.norm_words import gated_rms_norm_words, rms_norm_words
from pallas_kernels import compat
from pallas_kernels import moe_routing as routing_kernel
from pallas_kernels import norm_rows as norm_rows_kernel
from pallas_kernels._quant_common import SCALE_SPREADS
from pallas_kernels.fp8_matmul import fp8_matmul
from pallas_kernels.moe_matmul import (
    PLAIN_DTYPES,
    STREAMED_VARIANTS,
    grouped_matmul,
    grouped_matmuls,
    resolve_config,
)
from pallas_kernels.moe_matmul import x_words_layout as grouped_x_words_layout
from pallas_kernels.nvfp4_matmul import (
    E2M1_VALUES,
    KERNEL_ROWS_VARIANTS,
    STREAMED_WORD_VARIANTS,
    joined_columns,
    nvfp4_matmul,
    nvfp4_matmuls,
    x_words_layout,
)

Array = jax.Array
KernelMode = Literal["auto", "reference", "kernel", "interpret"]

SMALL_M_MAX = 64  # rows up to which the decode kernels beat dequantize + XLA dot
GROUPED_DECODE_MAX_TOKENS = 16  # tokens up to which the grouped kernel reads each expert once (dot_t)
NVFP4_BLOCK = 16
E4M3_MAX = 448.0
E2M1_MAX = 6.0
# ModelOpt's rounding to E2M1: bounds between neighbouring magnitudes; a value exactly on
# 0.75, 1.75 or 3.5 rounds up (to the even code), on the others down (also the even code).
_E2M1_BOUNDS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
_E2M1_ROUND_UP_TIES = (0.75, 1.75, 3.5)

_mode: KernelMode = "auto"


@contextlib.contextmanager
def kernel_mode(mode: KernelMode) -> Iterator[None]:
    """Choose how quantized matmuls run while tracing inside this block.

    "auto": Pallas kernels on a GPU for small M, the reference elsewhere; "reference": always
    dequantize + XLA dot; "kernel": always the Pallas kernel when the format has one;
    "interpret": the Pallas kernel through the interpreter (CPU tests of the dispatch path).
    """
    global _mode
    if mode not in ("auto", "reference", "kernel", "interpret"):
        raise ValueError(f"kernel mode must be auto, reference, kernel or interpret; got {mode!r}")
    previous, _mode = _mode, mode
    try:
        yield
    finally:
        _mode = previous


def _kernel_choice(rows: int, ndim: int) -> tuple[bool, bool]:
    """(use the kernel, in interpret mode) for an activation with `rows` rows and a weight of ndim."""
    if ndim != 2:
        return False, False
    use, interpret = compat.kernel_choice(_mode)
    return use and (_mode != "auto" or rows <= SMALL_M_MAX), interpret


def _gpu_choice(dtype, ndim: int) -> bool:
    """Whether a 2-D weight's matmul past the kernels' rows takes the format's `_gpu_matmul`
    ("auto" on a GPU, bf16 / f16 activations) instead of the float32 reference, whose full
    precision float32 dot runs on CUDA cores at a fraction of the tensor-core rate on a GPU."""
    return (
        _mode == "auto" and ndim == 2 and compat.on_gpu()
        and jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    )  # fmt: skip


def _expert_kernel_choice() -> tuple[bool, bool]:
    """(use the grouped expert kernel, in interpret mode). "auto": on a GPU, for any token count:
    XLA's GPU lowering of `jax.lax.ragged_dot` expands the groups into a dense [M, E*K] operand
    (40 GiB for a 2048-token chunk over 512 experts of K = 2048, an out-of-memory on the H200),
    so the kernel serves prefill too. "kernel" / "interpret": any token count; "reference": never.
    (The token count only picks the tiles: `grouped_tiles`.)"""
    return compat.kernel_choice(_mode)


def leaf_nbytes(a: Any) -> int:
    """Bytes of one array (or `jax.ShapeDtypeStruct`) from its shape and dtype."""
    return int(math.prod(a.shape)) * np.dtype(a.dtype).itemsize


def _reference_matmul(x: Array, w_float32: Array) -> Array:
    y = jnp.einsum("...k,nk->...n", x.astype(jnp.float32), w_float32, precision=jax.lax.Precision.HIGHEST)
    return y.astype(x.dtype)


class QuantizedWeight:
    """Behaviour shared by the quantized types: bytes, reference matmul, expert gather."""

    @property
    def shape(self) -> tuple[int, ...]:
        raise NotImplementedError

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of every stored leaf (packed data and scales): what the weight costs in memory."""
        return sum(leaf_nbytes(a) for a in jax.tree.leaves(self))

    def dequantize(self, dtype=jnp.bfloat16) -> Array:
        raise NotImplementedError

    def __jax_array__(self) -> Array:
        """The float32 value, so that jnp functions accept a quantized weight as an array.

        A correctness fallback for code that indexes expert stacks with plain jnp ops
        (`jnp.take(w, ids, axis=0)`): it dequantizes the whole tensor. Code that should read
        packed bytes calls `matmul`, `expert_matmul` or `take` instead.
        """
        return self.dequantize(jnp.float32)

    def _kernel_matmul(self, x2d: Array, interpret: bool, norm: NormSource | None = None) -> Array | None:
        """The Pallas path for x [M, K]; None when this format has no kernel. norm: x is that
        norm's output (`NormSource`), which a kernel may take its rows from."""
        return None

    def _grouped_operands(self) -> tuple[str, tuple[Array, ...], int | None] | None:
        """(format, stored leaves, scale block size) for the grouped expert kernel over this
        [E, N, K] stack; None when the kernel cannot read this format."""
        return None

    def _gpu_matmul(self, x2d: Array) -> Array | None:
        """x [M, K] (bf16 / f16) @ W.T on a GPU where no decode kernel serves it (past its rows,
        or a format without one), at the tensor cores' rate and with the kernels' numerics (no
        value rounded beyond what they round): one XLA dot in x's dtype with float32
        accumulation, or a tiled kernel; None when this format has no such form (then the
        float32 reference runs)."""
        return None

    def matmul(self, x: Array, norm: NormSource | None = None) -> Array:
        """x [..., K] @ W.T -> [..., N] in x's dtype (W is this weight, [N, K]). norm: x is that
        RMSNorm's output, so a kernel may take x's float16 rows from the norm's launch."""
        if x.shape[-1] != self.shape[-1]:
            raise ValueError(f"x has K={x.shape[-1]} but the weight is {self.shape}")
        rows = math.prod(x.shape[:-1])
        use_kernel, interpret = _kernel_choice(rows, self.ndim)
        if use_kernel:
            y = self._kernel_matmul(x.reshape(rows, x.shape[-1]), interpret, norm)
            if y is not None:
                return y.reshape(*x.shape[:-1], self.shape[-2])
        if _gpu_choice(x.dtype, self.ndim):  # prefill on a GPU: no float32 matmul at full precision
            y = self._gpu_matmul(x.reshape(rows, x.shape[-1]))
            if y is not None:
                return y.reshape(*x.shape[:-1], self.shape[-2])
        return _reference_matmul(x, self.dequantize(jnp.float32))


def _register(cls, data: tuple[str, ...], meta: tuple[str, ...] = ()):
    return jax.tree_util.register_dataclass(cls, data_fields=list(data), meta_fields=list(meta))


def _bcast_tail(a: Array, ndim: int) -> Array:
    """Per-tensor (per-expert) scalars [..] -> [.., 1, 1] against a [.., N, K] weight."""
    a = jnp.asarray(a, jnp.float32)
    return a.reshape(a.shape + (1,) * (ndim - a.ndim))


def _unpack_nibbles(packed: Array) -> Array:
    """uint8 [.., K/2] -> int32 codes [.., K]: byte j holds element 2j low, 2j+1 high."""
    low = (packed & 0xF).astype(jnp.int32)
    high = (packed >> 4).astype(jnp.int32)
    return jnp.stack([low, high], axis=-1).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def _pack_nibbles(codes: Array) -> Array:
    """int codes [.., K] in [0, 16) -> uint8 [.., K/2], element 2j in the low nibble."""
    c = codes.astype(jnp.uint8)
    return (c[..., 0::2] | (c[..., 1::2] << 4)).astype(jnp.uint8)


def _exact_divide(a: Array, b: Array) -> Array:
    """a / b, correctly rounded, with b broadcast to a's shape.

    XLA rewrites a / broadcast(b) into a * broadcast(1 / b), which is off by an ulp now and then;
    quantization must match the published formulas bit for bit, so the broadcast divisor is
    hidden behind an optimization barrier.
    """
    a = jnp.asarray(a, jnp.float32)
    b = jax.lax.optimization_barrier(jnp.broadcast_to(jnp.asarray(b, jnp.float32), a.shape))
    return a / b


def _group_expand(s: Array, group: int) -> Array:
    return jnp.repeat(s.astype(jnp.float32), group, axis=-1)


# --------------------------------------------------------------------------------------- NVFP4


@dataclasses.dataclass(frozen=True)
class NVFP4Weight(QuantizedWeight):
    """NVIDIA FP4 in ModelOpt's layout: E2M1 codes, an e4m3 scale per 16 values, a float32 scale."""

    packed: Array  # uint8 [.., N, K/2]; byte j = element 2j (low nibble) | element 2j+1 (high)
    block_scale: Array  # float8_e4m3fn [.., N, K/16]
    tensor_scale: Array  # float32 [..] (ModelOpt weight_scale_2)
    input_scale: Array | None = None  # float32 [..]: ModelOpt's static activation scale (W4A4 only)

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], 2 * self.packed.shape[-1])

    def dequantize(self, dtype=jnp.bfloat16) -> Array:
        values = jnp.asarray(E2M1_VALUES, jnp.float32)[_unpack_nibbles(self.packed)]
        w = values * _group_expand(self.block_scale, NVFP4_BLOCK) * _bcast_tail(self.tensor_scale, self.ndim)
        return w.astype(dtype)

    def _kernel_matmul(self, x2d: Array, interpret: bool, norm: NormSource | None = None) -> Array:
        tiles = nvfp4_tiles(*x2d.shape, self.shape[0], x2d.dtype)
        return nvfp4_matmul(
            x2d,
            self.packed,
            self.block_scale,
            self.tensor_scale,
            interpret=interpret,
            scale_spread=_modes["nvfp4_scale_spread"],
            x_words=_norm_words(norm, x2d, x_words_layout(tiles["variant"], tiles.get("x_rows")), interpret),
            **tiles,
        )

    def _grouped_operands(self) -> tuple[str, tuple[Array, ...], int | None] | None:
        if self.ndim != 3 or jnp.ndim(self.tensor_scale) != 1:
            return None
        return "nvfp4", (self.packed, self.block_scale, self.tensor_scale), None

    def _gpu_matmul(self, x2d: Array) -> Array:
        return nvfp4_xla_matmul(x2d, self.packed, self.block_scale, self.tensor_scale)


_register(NVFP4Weight, ("packed", "block_scale", "tensor_scale", "input_scale"))


def e2m1_codes(packed: Array) -> Array:
    """uint8 [.., N, K/2] -> float4_e2m1fn [.., N, K], a reinterpretation XLA does not copy:
    element 2j is byte j's low nibble, ModelOpt's order."""
    f4 = jax.lax.bitcast_convert_type(packed, jnp.float4_e2m1fn)
    return f4.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def nvfp4_block_values(packed: Array, block_scale: Array, dtype=jnp.bfloat16) -> Array:
    """[.., N, K] e2m1 * block scale in `dtype`, without the tensor scale: exact in bf16, float16
    and float32 (at most 6 significant bits, magnitudes 2**-10 .. 2688)."""
    codes = e2m1_codes(packed).astype(dtype).reshape(*block_scale.shape, NVFP4_BLOCK)
    return (codes * block_scale.astype(dtype)[..., None]).reshape(*packed.shape[:-1], 2 * packed.shape[-1])


def nvfp4_xla_matmul(x: Array, packed: Array, block_scale: Array, tensor_scale: Array) -> Array:
    """x [M, K] (bf16 / f16) @ NVFP4 W [N, K].T through XLA: the block values in x's dtype (exact),
    one dot with float32 accumulation, the tensor scale on the float32 result: the kernels'
    numerics. XLA writes the block values out before its GEMM (it does not fuse the block-scale
    multiply), so this is the prefill form, where the GEMM's arithmetic dwarfs that pass; decode
    rows take the kernels (docs/pallas.md, "XLA's own fusions")."""
    w = nvfp4_block_values(packed, block_scale, x.dtype)
    y = jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    return (y * jnp.asarray(tensor_scale, jnp.float32).reshape(())).astype(x.dtype)


def nvfp4_tiles(m: int, k: int, n: int, dtype=jnp.bfloat16) -> dict:
    """`nvfp4_decode_tiles`, with x_rows="kernel" added where `nvfp4_word_rows` says so and the
    formulation can make its own float16 rows."""
    return _with_word_rows(nvfp4_decode_tiles(m, k, n, dtype))


def _with_word_rows(tiles: dict) -> dict:
    if _modes["nvfp4_word_rows"] == "kernel" and tiles["variant"] in KERNEL_ROWS_VARIANTS:
        return {**tiles, "x_rows": "kernel"}
    return tiles


def nvfp4_decode_tiles(m: int, k: int, n: int, dtype=jnp.bfloat16) -> dict:
    """Formulation and tiles for the NVFP4 decode kernel (H200 sweeps at 58a6e08 and efc37c1,
    bench/results/kernels-nvidia-h200.json).

    With bf16 / f16 rows (word decode, float16 products):
    - one row on a layer with K >= 4096 and either N >= 8192 or >= 2**26 weights (the 27B
      gate_up, down, q_gated, gdn_in) takes a streamed gemv: by default (`nvfp4_streamed_gemv`
      "auto") the half2 word gemv "gemv_h2w_ws" with its own tiles below; "gemv_ws" ran over
      two programs per SM in 32-row tiles, 512-element K steps (1024 for N < 16384 at K <= 8192:
      q_gated 1275 against 1100 GB/s); gate_up 1772 GB/s, down 1553 against gemv_w's 1721, 1265
      on a 3277 GB/s H200;
    - one row on a smaller layer with K >= 4096 (the 80B o_proj, 2048 x 4096) and 2-8 rows on
      it take "gemv_ws" 64 x 512 / 32 x 512 (406 and 282 GB/s against 300 and 219 for dot_w);
    - other single rows on layers of > 2**24 weights take "gemv_w" 512-element K steps, 8 warps,
      split in two while there are fewer than ~2.7 programs per SM (K >= 4096), in four below
      (the 80B gdn_in 12288 x 2048: 1043 GB/s against 680 at two);
    - one row on a layer of <= 2**24 weights takes the bf16-decode "dot" 64 x 256 with K split
      up to four ways (it beat dot_w on every such 80B layer: 569 against 348 GB/s on q_gated);
    - the rest take the word-decoded float16 dot ("dot_w", or the joined "dot_jw" under
      `nvfp4_word_dot`), split K until there are ~2 programs per SM. float32 activations keep
      "dot" (float16 would round them)."""
    words = jnp.dtype(dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    streamed = {"variant": _streamed_gemv(wide_k=False), "split_k": 1, "num_warps": 8}
    if words and m == 1 and k >= 4096 and (n >= 8192 or n * k >= 1 << 26):
        streamed["variant"] = _streamed_gemv(wide_k=True)
        if streamed["variant"] in ("gemv_h2w_ws", "gemv_h2wx_ws"):
            # the H200 sweep of gemv_h2w_ws (bf564ff): 1024-element steps on the widest layers,
            # three programs per SM elsewhere (its 64 registers a thread leave room for them)
            wide = n >= 16384
            return {**streamed, "block_n": 32, "block_k": 1024 if wide else 512,
                    "programs": (2 if wide else 3) * compat.sm_count()}  # fmt: skip
        return {**streamed, "block_n": 32, "block_k": 1024 if n < 16384 and k <= 8192 else 512}
    if words and m <= 8 and k >= 4096 and n * k < 1 << 24:
        return {**streamed, "block_n": 64 if m == 1 else 32, "block_k": 512}
    if words and m == 1 and n * k > 1 << 24:
        block_n = 32 if k >= 4096 else 64
        split_k = (2 if -(-n // block_n) < 352 else 1) if k >= 4096 else 4
        return {"variant": "gemv_w", "block_n": block_n, "block_k": 512, "split_k": split_k, "num_warps": 8}
    block_k = 256
    k_steps = -(-k // block_k)
    if m == 1 and n * k <= 1 << 24:
        return {"variant": "dot", "block_n": 64, "block_k": block_k, "split_k": max(1, min(k_steps // 2, 4))}
    block_n = 32 if words and n >= 32 * 4 * 132 else 64
    n_tiles = -(-n // block_n)
    split_k = max(1, min(k_steps // 4, -(-264 // n_tiles)))
    return {"variant": _modes["nvfp4_word_dot"] if words else "dot", "block_n": block_n, "block_k": block_k,
            "split_k": split_k}  # fmt: skip


def _streamed_gemv(wide_k: bool) -> str:
    """The streamed gemv of one row: `nvfp4_streamed_gemv`'s choice, "auto" resolved by whether
    the layer is one of the wide K >= 4096 ones (STREAMED_GEMV_MODES)."""
    mode = _modes["nvfp4_streamed_gemv"]
    if mode != "auto":
        return mode
    return "gemv_h2w_ws" if wide_k else "gemv_ws"


def _cast_e2m1(scaled: Array) -> Array:
    """float32 values (already divided by their scales) -> int32 E2M1 codes, ModelOpt's rounding."""
    mag = jnp.abs(scaled)
    code = jnp.searchsorted(jnp.asarray(_E2M1_BOUNDS, jnp.float32), mag, side="left").astype(jnp.int32)
    tie_up = jnp.zeros(mag.shape, jnp.bool_)
    for t in _E2M1_ROUND_UP_TIES:
        tie_up = tie_up | (mag == t)
    code = code + tie_up.astype(jnp.int32)
    return code + 8 * (scaled < 0).astype(jnp.int32)


@jax.jit
def quantize_nvfp4(w: Array, *, tensor_scale: Array | None = None) -> NVFP4Weight:
    """Quantize [.., N, K] weights with ModelOpt's published NVFP4 formula (K a multiple of 16).

    weight_scale_2 = amax(|W|) / (6 * 448) per tensor (per expert when stacked);
    block_scale = e4m3(max(block_amax / (6 * weight_scale_2), 2^-9)), 1 where the block is all 0;
    code = E2M1 round-to-nearest-even of W / (block_scale * weight_scale_2).
    """
    if w.ndim < 2 or w.shape[-1] % NVFP4_BLOCK:
        raise ValueError(f"NVFP4 needs a [.., N, K] weight with K % 16 == 0; got shape {w.shape}")
    w = jnp.asarray(w)
    if tensor_scale is None:
        tensor_scale = jnp.max(jnp.abs(w), axis=(-2, -1)).astype(jnp.float32) / jnp.float32(
            E2M1_MAX * E4M3_MAX
        )
    tensor_scale = jnp.asarray(tensor_scale, jnp.float32)
    blocks = w.astype(jnp.float32).reshape(*w.shape[:-1], w.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK)
    block_amax = jnp.max(jnp.abs(blocks), axis=-1)
    per_block = _exact_divide(block_amax, E2M1_MAX * _bcast_tail(tensor_scale, w.ndim))
    per_block = jnp.where(per_block == 0, 1.0, per_block)
    block_scale = jnp.clip(per_block, 2.0**-9, E4M3_MAX).astype(jnp.float8_e4m3fn)
    scaled = _exact_divide(
        blocks, (block_scale.astype(jnp.float32) * _bcast_tail(tensor_scale, w.ndim))[..., None]
    )
    codes = _cast_e2m1(scaled.reshape(w.shape))
    return NVFP4Weight(packed=_pack_nibbles(codes), block_scale=block_scale, tensor_scale=tensor_scale)


# ----------------------------------------------------------------------------------------- FP8


@dataclasses.dataclass(frozen=True)
class FP8Weight(QuantizedWeight):
    """FP8 e4m3 with one float32 scale per tensor (block_size None) or per block_size^2 block."""

    data: Array  # float8_e4m3fn [.., N, K]
    scale: Array  # float32 [..] per tensor, or [.., ceil(N/b), ceil(K/b)] (weight_scale_inv)
    block_size: int | None = None  # static
    input_scale: Array | None = None  # float32 [..]: a static activation scale when the checkpoint has one

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    def _scale_full(self) -> Array:
        if self.block_size is None:
            return _bcast_tail(self.scale, self.ndim)
        b = self.block_size
        s = jnp.repeat(jnp.repeat(self.scale.astype(jnp.float32), b, axis=-2), b, axis=-1)
        return s[..., : self.shape[-2], : self.shape[-1]]

    def dequantize(self, dtype=jnp.bfloat16) -> Array:
        return (self.data.astype(jnp.float32) * self._scale_full()).astype(dtype)

    def _kernel_matmul(self, x2d: Array, interpret: bool, norm: NormSource | None = None) -> Array:
        per_tensor = self.block_size is None
        if per_tensor and _mode == "auto" and fp8_decode_way(x2d.shape[0], *self.shape[::-1]) == "xla":
            return fp8_xla_matmul(x2d, self.data, self.scale)  # ("kernel" mode: always the kernel)
        tiles = fp8_tiles(x2d.shape[0], *self.shape[::-1]) if self.ndim == 2 else {}
        if self.block_size is not None:  # tiles must divide the scale block; "dot" won at 128 blocks
            tiles = {
                "variant": "dot",
                "block_n": min(64, self.block_size),
                "block_k": min(128, self.block_size),
            }
        return fp8_matmul(
            x2d, self.data, self.scale, block_size=self.block_size, interpret=interpret, **tiles
        )

    def _gpu_matmul(self, x2d: Array) -> Array:
        if self.block_size is None:
            return fp8_xla_matmul(x2d, self.data, self.scale)
        # Block scales vary along K, so no single dot can take them out: the tiled kernel scales
        # each block's float32 partial sum (`FP8_BLOCK_PREFILL_TILES`).
        block_k = min(FP8_BLOCK_PREFILL_TILES["block_k"], self.block_size)  # within a scale block
        tiles = {**FP8_BLOCK_PREFILL_TILES, "block_k": block_k}
        return fp8_matmul(x2d, self.data, self.scale, block_size=self.block_size, **tiles)

    def _grouped_operands(self) -> tuple[str, tuple[Array, ...], int | None] | None:
        b = self.block_size
        if self.ndim != 3 or (b is not None and (b < 16 or b & (b - 1))):
            return None  # kernel tiles (powers of two >= 16) must divide the scale block
        if b is None and jnp.ndim(self.scale) != 1:
            return None
        return "fp8", (self.data, self.scale), b


_register(FP8Weight, ("data", "scale", "input_scale"), ("block_size",))

ON_OFF = ("on", "off")
FP8_DECODE_MODES = ("auto", "kernel", "xla")
FUSED_PROJECTION_MODES = ("on", "off", "rows")
# The streamed NVFP4 gemv of single rows (pallas_kernels/nvfp4_matmul.py): products summed per word
# with the block scale spread over the words ("gemv_ws"), or per 16-element block ("gemv_bs_ws";
# "gemv_bsx_ws" also loads the activation a unit ahead), or per word in packed half2 ("gemv_h2w_ws";
# "gemv_h2wx_ws" with the activation a unit ahead).
STREAMED_GEMVS = ("gemv_ws", "gemv_bs_ws", "gemv_bsx_ws", "gemv_h2w_ws", "gemv_h2wx_ws")
# `nvfp4_streamed_gemv`'s choices: one of those everywhere, or "auto": "gemv_h2w_ws" on the wide
# layers with K >= 4096 (the 27B's: decode 94.3 / 93.8 against 90.1 / 89.8 tok/s on an H100 at
# 62b6a87, runs in both orders) and "gemv_ws" on the rest (the 80B-A3B's K = 2048 fused projections
# and its o_proj: 273.1 against 262.3 and 291.7 against 266.7 with gemv_h2w_ws there).
STREAMED_GEMV_MODES = ("auto", *STREAMED_GEMVS)
# The float16 word dot of NVFP4 weights at 2-64 rows (`nvfp4_word_dot`) and of NVFP4 experts at
# decode batches (`nvfp4_grouped_dot`): 8 dots a K step on x in word order ("dot_w"), or the 8
# element tiles joined into one dot on x in natural order ("dot_jw"; pallas_kernels/nvfp4_matmul.py,
# moe_matmul.py).
WORD_DOTS = ("dot_w", "dot_jw")
# The grouped kernel's decode formulation of NVFP4 experts (`nvfp4_grouped_dot`): the word dots,
# or "gemv_h2w", the rows of an item unrolled with each word's products in packed half2 on CUDA
# cores (no 16-row tensor-core tile for one or two rows; pallas_kernels/moe_matmul.py), or "auto":
# "gemv_h2w" at one token, "dot_w" past it. On an H100 (80B-A3B shape, 24 layers, 8K, 075b26c) one
# token's decode step took 2.47 ms of device time with gemv_h2w against 2.63-2.66 with dot_w (the
# gate_up 8.9 against 15.1 us a call, the down 5.4 against 8.0); at eight tokens the gate_up took
# 99.9 against 65.0 us a call (bench/results/moe-h2w-nvidia-h100-80gb-hbm3.json, docs/pallas.md).
GROUPED_DOTS = ("auto", *WORD_DOTS, "gemv_h2w")
# Where the grouped "dot_jw" makes its float16 rows: "xla" (`f16_rows`, a reduce and a convert
# launched before each grouped call) or "kernel" (each program scales its own rows; the same bits).
GROUPED_ROWS = ("xla", "kernel")
# The same choice for the dense NVFP4 word kernels that can make their own rows (gemv_w, gemv_wp,
# gemv_ws, dot_jw: `pallas_kernels.nvfp4_matmul.KERNEL_ROWS_VARIANTS`), where "xla" launches a
# reduce, a convert and (but for dot_jw) a transpose before each call.
WORD_ROWS = GROUPED_ROWS
# Where an NVFP4 word kernel whose input is an RMSNorm's output (`NormSource`) gets its float16
# rows: "xla" (the norm, then a reduce and a reorder: three launches), "kernel" (one launch that
# norms and makes the rows, pallas_kernels/norm_rows.py; the norm's arithmetic may differ from
# XLA's by an ulp, as two XLA builds may) or "source" (the default: XLA, the rows' scale bounded
# from the norm's input, so that the norm's sum of squares and the row max are one reduce launch;
# two launches, weights/norm_words.py).
NORM_ROWS = ("xla", "kernel", "source")
# Where the grouped down projection of NVFP4 experts gets the float16 rows of its input, the
# SwiGLU of the gate / up outputs: "xla" (a reduce with the SwiGLU fused in, then a scale /
# reorder: two launches) or "kernel" (one launch, `norm_rows.swiglu_rows`; the same bits).
SWIGLU_ROWS = ("xla", "kernel")
# The choices `matmul` and friends read while tracing: each starts from its environment variable
# and is changed for a block by its context manager (`fp8_decode_mode`, `fused_projections`,
# `streamed_experts`, `fused_experts`, `nvfp4_scale_spread`, `nvfp4_streamed_gemv`,
# `nvfp4_word_dot`, `nvfp4_grouped_dot`, `nvfp4_grouped_rows`, `nvfp4_word_rows`, `norm_rows`,
# `swiglu_rows`).
_modes = {
    "fp8_decode": env_mode("INFERNIX_FP8_DECODE", "auto", FP8_DECODE_MODES),
    "fused_projections": env_mode("INFERNIX_FUSED_PROJECTIONS", "rows", FUSED_PROJECTION_MODES),
    "streamed_experts": env_mode("INFERNIX_STREAMED_EXPERTS", "off", ON_OFF),
    "fused_experts": env_mode("INFERNIX_FUSED_EXPERTS", "on", ON_OFF),
    "nvfp4_scale_spread": env_mode("INFERNIX_NVFP4_SCALE_SPREAD", "reshape", SCALE_SPREADS),
    "nvfp4_streamed_gemv": env_mode("INFERNIX_NVFP4_STREAMED_GEMV", "auto", STREAMED_GEMV_MODES),
    "nvfp4_word_dot": env_mode("INFERNIX_NVFP4_WORD_DOT", "dot_w", WORD_DOTS),
    "nvfp4_grouped_dot": env_mode("INFERNIX_NVFP4_GROUPED_DOT", "auto", GROUPED_DOTS),
    "nvfp4_grouped_rows": env_mode("INFERNIX_NVFP4_GROUPED_ROWS", "xla", GROUPED_ROWS),
    "nvfp4_word_rows": env_mode("INFERNIX_NVFP4_WORD_ROWS", "xla", WORD_ROWS),
    "norm_rows": env_mode("INFERNIX_NORM_ROWS", "source", NORM_ROWS),
    "swiglu_rows": env_mode("INFERNIX_SWIGLU_ROWS", "xla", SWIGLU_ROWS),
}


def current_modes() -> dict[str, str]:
    """The switches above as they stand now (their environment variables or an enclosing block):
    what a benchmark record names as measured."""
    return dict(_modes)


@contextlib.contextmanager
def fp8_decode_mode(mode: str) -> Iterator[None]:
    """Choose, while tracing inside this block, how per-tensor FP8 decode matmuls run on a GPU:
    "kernel" (the Pallas kernel), "xla" (`fp8_xla_matmul`) or "auto" (`fp8_decode_way`).
    The default comes from the environment variable INFERNIX_FP8_DECODE."""
    with switched(_modes, "fp8_decode", mode, FP8_DECODE_MODES, "FP8 decode mode"):
        yield


def fp8_decode_way(m: int, k: int, n: int) -> str:
    """"xla" or "kernel": which runs x [m, k] @ W [n, k].T for per-tensor FP8 W on a GPU.

    From the H200 (`python -m bench.xla_quant`, bench/results/xla-quant-nvidia-h200.json, HBM probe
    3558 GB/s): XLA's fused dot read more bytes per second than the tuned kernel at 8 rows on every
    27B and 80B layer (27B gate_up 3588 against 2400 GB/s, gdn_in 2805 / 1794, down 3183 / 2263),
    and at one row on the 27B layers with K >= 4096 below the widest (q_gated 2561 / 2263, gdn_in
    2308 / 2121, down 2474 / 2319); the kernel kept one row on the widest layer (gate_up: a tie),
    on 5120 x 6144 (1618 / 1480) and on the 80B layers (gdn_in 1504 / 1232)."""
    if _modes["fp8_decode"] != "auto":
        return _modes["fp8_decode"]
    if m >= 2:
        return "xla"
    if k >= 4096 and n * k < 1 << 27 and (n >= 8192 or k >= 16384):
        return "xla"
    return "kernel"


def fp8_xla_matmul(x: Array, data: Array, scale: Array) -> Array:
    """x [M, K] @ (FP8 W [N, K] * scale).T as one XLA dot whose operand convert XLA fuses into its
    GEMM (on the H200 a Triton GEMM fusion reading the e4m3 bytes directly): e4m3 values are exact
    in bf16 and float16, so bf16 / float16 activations meet them in their own dtype with float32
    accumulation, the kernel's numerics; other activations go in as float32 (full precision)."""
    return (_stored_values_dot(x, data) * jnp.asarray(scale, jnp.float32).reshape(())).astype(x.dtype)


def _stored_values_dot(x: Array, data: Array) -> Array:
    """float32 x [M, K] @ data [N, K].T for stored values exact in bf16 and float16 (e4m3, int8):
    converted to bf16 / float16 activations' own dtype (a convert XLA can fuse into its GEMM) with
    float32 accumulation; other activations at full float32 precision."""
    dtype = x.dtype if x.dtype in (jnp.bfloat16, jnp.float16) else jnp.float32
    precision = jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None
    return jax.lax.dot_general(
        x.astype(dtype), data.astype(dtype), (((1,), (1,)), ((), ())),
        precision=precision, preferred_element_type=jnp.float32,
    )  # fmt: skip


# Block-scaled FP8 prefill rows on a GPU: the tiled kernel with the tiles that won the H200 sweep
# at M = 4096 on the 27B gate_up with 128 x 128 scale blocks (bench/results/kernels-prefill-
# nvidia-h200.json: 303.8 TFLOP/s, 45.7% of the bf16 rate; the kernel's defaults took 5.6 against
# 4.8 ms), where the float32 reference they replace runs on CUDA cores (~50 TFLOP/s on that layer).
FP8_BLOCK_PREFILL_TILES = {"variant": "tiled", "block_n": 128, "block_k": 64, "num_warps": 4, "num_stages": 4,
                           "block_m": 128, "group_m": 8}  # fmt: skip


def fp8_tiles(m: int, k: int, n: int) -> dict:
    """Formulation and tiles for the per-tensor FP8 decode kernel where the H200 sweep at efc37c1
    (bench/results/kernels-nvidia-h200.json) beat the kernel's own table; {} (the table: "gemv"
    16 x 256 for one row, "dot" 64 x 128 split 2 up to 8) elsewhere.

    One row: the widest layer (>= 2**27 weights, the 27B gate_up) takes "gemv" 16 x 512, 8 warps,
    4 stages (2520 GB/s of a 3277 GB/s H200); layers with K >= 4096 and N >= 4096 (the other 27B
    projections) take "dot" 64 x 128 with K split until there are ~4 programs per SM (down 2283
    GB/s at split 8, q_gated 2199 at 4, o_proj 1786 at 8). 2-8 rows with K >= 8192 (the 27B down)
    split K 8 ways (2251 GB/s)."""
    if m == 1 and n * k >= 1 << 27:
        return {"variant": "gemv", "block_n": 16, "block_k": 512, "split_k": 1, "num_warps": 8, "num_stages": 4}
    if m == 1 and k >= 4096 and n >= 4096:
        n_tiles, k_steps = -(-n // 64), -(-k // 128)
        split_k = 1
        while split_k < 8 and n_tiles * split_k < 4 * 132 and k_steps // (2 * split_k) >= 4:
            split_k *= 2
        return {"variant": "dot", "block_n": 64, "block_k": 128, "split_k": split_k}
    if 1 < m <= 8 and k >= 8192:
        return {"variant": "dot", "block_n": 64, "block_k": 128, "split_k": 8}
    return {}


def _to_e4m3(v: Array) -> Array:
    return jnp.clip(v, -E4M3_MAX, E4M3_MAX).astype(jnp.float8_e4m3fn)


@functools.partial(jax.jit, static_argnames=("block_size",))
def quantize_fp8(w: Array, *, block_size: int | None = None) -> FP8Weight:
    """Per-tensor: scale = amax / 448 (ModelOpt FP8). Per block: scale = block_amax / 448
    (Qwen/DeepSeek `weight_scale_inv`). fp8 = e4m3(W / scale), round to nearest even."""
    w = jnp.asarray(w)
    wf = w.astype(jnp.float32)
    if block_size is None:
        scale = jnp.max(jnp.abs(wf), axis=(-2, -1)) / E4M3_MAX
        scale = jnp.where(scale == 0, 1.0, scale)
        return FP8Weight(data=_to_e4m3(_exact_divide(wf, _bcast_tail(scale, w.ndim))), scale=scale)
    n, k = w.shape[-2:]
    nb, kb = -(-n // block_size), -(-k // block_size)
    padded = jnp.pad(wf, [(0, 0)] * (w.ndim - 2) + [(0, nb * block_size - n), (0, kb * block_size - k)])
    blocks = padded.reshape(*w.shape[:-2], nb, block_size, kb, block_size)
    scale = jnp.max(jnp.abs(blocks), axis=(-3, -1)) / E4M3_MAX
    scale = jnp.where(scale == 0, 1.0, scale)
    weight = FP8Weight(data=jnp.zeros(w.shape, jnp.float8_e4m3fn), scale=scale, block_size=block_size)
    return dataclasses.replace(weight, data=_to_e4m3(_exact_divide(wf, weight._scale_full())))


# ---------------------------------------------------------------------------------------- INT8


@dataclasses.dataclass(frozen=True)
class Int8Weight(QuantizedWeight):
    """Symmetric int8 with one float32 scale per output channel (row n)."""

    data: Array  # int8 [.., N, K]
    scale: Array  # float32 [.., N]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    def dequantize(self, dtype=jnp.bfloat16) -> Array:
        return (self.data.astype(jnp.float32) * self.scale.astype(jnp.float32)[..., None]).astype(dtype)

    def _gpu_matmul(self, x2d: Array) -> Array | None:
        if self.ndim == 2 and int8_decode_way(x2d.shape[0], self.shape[-1]) == "reference":
            return None  # the float32 reference: one reduction fusion reading the int8 bytes once
        return int8_xla_matmul(x2d, self.data, self.scale)


_register(Int8Weight, ("data", "scale"))


def int8_decode_way(m: int, k: int) -> str:
    """"xla" (`int8_xla_matmul`) or "reference" (the float32 path): which runs x [m, k] @ W.T for
    INT8 W on a GPU. From the H200 (`bench.xla_quant --formats int8`, 5332098): the dot won at 8
    rows (2194-3303 against 425-502 GB/s) and at M = 4096 (609-652 against ~50 TFLOP/s); at one
    row the float32 path, which XLA turns into one reduction reading the int8 bytes, won every
    layer with K <= 6144 (27B gate_up 2473 against 2136 GB/s, q_gated 2346 / 2124, o_proj 2118 /
    1776, gdn_in 2222 / 2045; the 80B's three by 4-30%), and lost the 27B down (K = 17408: 1305
    against 2218)."""
    return "reference" if m == 1 and k < 16384 else "xla"


def int8_xla_matmul(x: Array, data: Array, scale: Array) -> Array:
    """x [M, K] @ (int8 W [N, K] * scale[N, None]).T as one XLA dot whose operand convert XLA can
    fuse into its GEMM (as it does FP8's), the per-row scale on the float32 result: int8 values
    are exact in bf16 and float16, so bf16 / float16 activations meet them in their own dtype with
    float32 accumulation; other activations go in as float32 (full precision). On a GPU INT8 has
    no Pallas kernel: this serves its decode rows too (one row of a layer with K < 16384 aside:
    `int8_decode_way`)."""
    return (_stored_values_dot(x, data) * jnp.asarray(scale, jnp.float32)).astype(x.dtype)


@jax.jit
def quantize_int8(w: Array) -> Int8Weight:
    """scale[n] = amax(|W[n, :]|) / 127; q = round(W / scale) (half to even), in [-127, 127]."""
    wf = jnp.asarray(w).astype(jnp.float32)
    scale = jnp.max(jnp.abs(wf), axis=-1) / 127.0
    scale = jnp.where(scale == 0, 1.0, scale)
    q = jnp.clip(jnp.round(_exact_divide(wf, scale[..., None])), -127, 127).astype(jnp.int8)
    return Int8Weight(data=q, scale=scale)


# -------------------------------------------------------------------------------------- Q8 / Q4


def _check_group(k: int, group_size: int) -> None:
    if group_size <= 0 or k % group_size:
        raise ValueError(f"group_size={group_size} must divide K={k}")


@dataclasses.dataclass(frozen=True)
class Q8Weight(QuantizedWeight):
    """Symmetric int8 with one scale per `group_size` values of a row (GGUF Q8_0 is group 32, f16)."""

    data: Array  # int8 [.., N, K]
    scale: Array  # float16/float32 [.., N, K/group_size]
    group_size: int = 32  # static

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    def dequantize(self, dtype=jnp.bfloat16) -> Array:
        return (self.data.astype(jnp.float32) * _group_expand(self.scale, self.group_size)).astype(dtype)


_register(Q8Weight, ("data", "scale"), ("group_size",))


@functools.partial(jax.jit, static_argnames=("group_size", "scale_dtype"))
def quantize_q8(w: Array, *, group_size: int = 32, scale_dtype=jnp.float16) -> Q8Weight:
    """scale = amax(group) / 127 stored in scale_dtype; q = round(W / stored scale) in [-127, 127]."""
    wf = jnp.asarray(w).astype(jnp.float32)
    _check_group(wf.shape[-1], group_size)
    groups = wf.reshape(*wf.shape[:-1], wf.shape[-1] // group_size, group_size)
    scale = jnp.max(jnp.abs(groups), axis=-1) / 127.0
    scale = jnp.where(scale == 0, 1.0, scale).astype(scale_dtype)
    q = jnp.clip(jnp.round(_exact_divide(groups, scale.astype(jnp.float32)[..., None])), -127, 127)
    return Q8Weight(data=q.reshape(wf.shape).astype(jnp.int8), scale=scale, group_size=group_size)


@dataclasses.dataclass(frozen=True)
class Q4Weight(QuantizedWeight):
    """Asymmetric 4-bit: q in [0, 15], value = q * scale + minimum per group (GGUF Q4_K's form)."""

    packed: Array  # uint8 [.., N, K/2], element 2j in the low nibble
    scale: Array  # float16/float32 [.., N, K/group_size]
    minimum: Array  # float16/float32 [.., N, K/group_size] (the value of q = 0)
    group_size: int = 32  # static

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], 2 * self.packed.shape[-1])

    def dequantize(self, dtype=jnp.bfloat16) -> Array:
        q = _unpack_nibbles(self.packed).astype(jnp.float32)
        g = self.group_size
        return (q * _group_expand(self.scale, g) + _group_expand(self.minimum, g)).astype(dtype)


_register(Q4Weight, ("packed", "scale", "minimum"), ("group_size",))


@functools.partial(jax.jit, static_argnames=("group_size", "scale_dtype"))
def quantize_q4(w: Array, *, group_size: int = 32, scale_dtype=jnp.float16) -> Q4Weight:
    """minimum = min(group), scale = (max - min) / 15, both stored in scale_dtype;
    q = round((W - minimum) / scale) in [0, 15] with the stored values."""
    wf = jnp.asarray(w).astype(jnp.float32)
    _check_group(wf.shape[-1], group_size)
    if wf.shape[-1] % 2:
        raise ValueError(f"Q4 packs two values a byte; K={wf.shape[-1]} must be even")
    groups = wf.reshape(*wf.shape[:-1], wf.shape[-1] // group_size, group_size)
    lo, hi = jnp.min(groups, axis=-1), jnp.max(groups, axis=-1)
    scale = (hi - lo) / 15.0
    scale = jnp.where(scale == 0, 1.0, scale).astype(scale_dtype)
    minimum = lo.astype(scale_dtype)
    q = jnp.round(
        _exact_divide(groups - minimum.astype(jnp.float32)[..., None], scale.astype(jnp.float32)[..., None])
    )
    q = jnp.clip(q, 0, 15).reshape(wf.shape)
    return Q4Weight(packed=_pack_nibbles(q), scale=scale, minimum=minimum, group_size=group_size)


# ------------------------------------------------------------------------------- dispatching ops

QUANTIZED_TYPES = (NVFP4Weight, FP8Weight, Int8Weight, Q8Weight, Q4Weight)


def matmul(x: Array, w: Any, norm: NormSource | None = None) -> Array:
    """x [..., K] times a weight w [N, K] (HF [out, in] layout) -> [..., N] in x's dtype. norm:
    x is that RMSNorm's output (`NormSource`; a kernel may take its rows from the norm's launch)."""
    if isinstance(w, QuantizedWeight):
        return w.matmul(x, norm)
    return jnp.einsum("...k,nk->...n", x, w.astype(x.dtype), preferred_element_type=jnp.float32).astype(
        x.dtype
    )


FUSED_ROWS_MAX = 16  # "rows": decode rows up to which a group fuses through "dot_ws" (one M tile)


@contextlib.contextmanager
def fused_projections(enabled: bool | str) -> Iterator[None]:
    """Whether `matmuls` may run several NVFP4 weights in one launch while tracing inside this
    block (default: the environment variable INFERNIX_FUSED_PROJECTIONS, "rows"): "rows" at one
    decode row and at 2-16 rows through the streamed float16 dots ("dot_ws": fewer launches at small
    batches, each slower than "dot_w" alone; at eight rows on an H100 the 80B-A3B's decode step
    took 4.5% less device time, the 27B's 2.5%), True / "on" at one row only, False / "off" never."""
    mode = ("on" if enabled else "off") if isinstance(enabled, bool) else enabled
    with switched(_modes, "fused_projections", mode, FUSED_PROJECTION_MODES, "fused projections"):
        yield


def _fusable(x: Array, w: Any) -> bool:
    """Whether w may share a launch with other weights of x (a 2-D NVFP4 weight of x's K)."""
    return isinstance(w, NVFP4Weight) and w.ndim == 2 and w.shape[1] == x.shape[-1]


FUSE_BELOW_WEIGHTS = 1 << 26  # a group fuses only if one of its weights is smaller (elements)


def _fused_tiles(x: Array, ws: tuple[Any, ...]) -> dict | None:
    """The streamed kernel tiles that run x through all of `ws` (>= 2 NVFP4 weights of its K) in
    one launch, or None where they run apart: float32 rows, no kernel here, more than one row
    where the combined shape's own choice is not streamed (the tensor-core dots serve 2-8 rows
    better than a fused CUDA-core pass, unless `fused_projections("rows")`, the default, fuses
    them through "dot_ws"), or only weights of >= FUSE_BELOW_WEIGHTS elements. One
    row on a combined shape that the table gives to a split-K formulation (K < 4096: the 80B's
    layers) takes "gemv_ws" 32 x 512: one launch instead of several weighs more there.

    Measured on an H100 (`python -m bench.fused_projections`, one row): fused against apart, the
    27B GDN input projections x1.52, q / k / v x1.29, the 80B's x1.65 / x1.62, its shared
    expert's gate / up x1.32; the 27B gate / up (two 17408 x 5120 weights) x0.96, so two large
    weights stay apart (a launch is small next to reading either)."""
    if _modes["fused_projections"] == "off" or len(ws) < 2:
        return None
    if min(math.prod(w.shape) for w in ws) >= FUSE_BELOW_WEIGHTS:
        return None
    if jnp.dtype(x.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return None
    rows = math.prod(x.shape[:-1])
    use_kernel, interpret = _kernel_choice(rows, 2)
    if not use_kernel:
        return None
    tiles = nvfp4_decode_tiles(rows, x.shape[-1], sum(w.shape[0] for w in ws), x.dtype)
    if tiles["variant"] not in STREAMED_WORD_VARIANTS:
        if rows == 1:
            tiles = {"variant": _streamed_gemv(wide_k=False), "block_n": 32, "block_k": 512, "num_warps": 8}
        elif _modes["fused_projections"] == "rows" and rows <= FUSED_ROWS_MAX:  # dot_w's tiles, streamed
            tiles = {"variant": "dot_ws", "block_m": 16, "block_n": tiles["block_n"], "block_k": 256, "num_warps": 4}
        else:
            return None
    tiles = _with_word_rows({key: v for key, v in tiles.items() if key != "split_k"})
    return {**tiles, "interpret": interpret, "scale_spread": _modes["nvfp4_scale_spread"]}


def matmuls(x: Array, ws: tuple[Any, ...] | list[Any], norm: NormSource | None = None) -> list[Array]:
    """x [..., K] times each weight of `ws` -> one [..., N_i] per weight, in x's dtype: its NVFP4
    weights in one kernel launch at decode rows on a GPU (`_fused_tiles`), every other weight (and
    all of them where the launch does not apply) through `matmul`. norm: as for `matmul`."""
    ws = tuple(ws)
    picked = [i for i, w in enumerate(ws) if _fusable(x, w)]
    tiles = _fused_tiles(x, tuple(ws[i] for i in picked))
    if tiles is None:
        return [matmul(x, w, norm) for w in ws]
    fused = dict(zip(picked, _one_launch(x, tuple(ws[i] for i in picked), norm, tiles), strict=True))
    return [
        fused[i].reshape(*x.shape[:-1], w.shape[0]) if i in fused else matmul(x, w, norm) for i, w in enumerate(ws)
    ]


def matmuls_joined(
    x: Array, ws: tuple[Any, ...] | list[Any], norm: NormSource | None = None
) -> tuple[Array, tuple[int, ...]] | None:
    """`matmuls` as one array [..., C] and each weight's first column in it, where all of `ws` take
    the one-launch path (`nvfp4_matmuls(joined=True)`: a Pallas consumer reads each weight at its
    column, with no slice launch between); None elsewhere (callers take `matmuls`)."""
    ws = tuple(ws)
    if not ws or not all(_fusable(x, w) for w in ws):
        return None
    tiles = _fused_tiles(x, ws)
    if tiles is None:
        return None
    (joined,) = _one_launch(x, ws, norm, tiles, joined=True)
    columns = joined_columns(tuple(w.shape[0] for w in ws), tiles["block_n"])
    return joined.reshape(*x.shape[:-1], joined.shape[-1]), columns


def _one_launch(x: Array, ws: tuple[Any, ...], norm: NormSource | None, tiles: dict, joined: bool = False) -> list:
    """NVFP4 weights `ws` over x's rows in one `nvfp4_matmuls` launch with `_fused_tiles`' tiles
    (x's rows from the norm where it makes them): [rows, N] results, or one joined."""
    x2d = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    weights = tuple((w.packed, w.block_scale, w.tensor_scale) for w in ws)
    x_words = _norm_words(norm, x2d, x_words_layout(tiles["variant"], tiles.get("x_rows")), tiles["interpret"])
    return nvfp4_matmuls(x2d, weights, x_words=x_words, joined=joined, **tiles)


@dataclasses.dataclass(frozen=True, eq=False)
class NormSource:
    """Says that a matmul's input x is `rms_norm(source, weight)` (model.norm, either style), or with
    `gate` the GDN output norm `gated_rms_norm` of each weight-sized head of `source`. With
    `norm_rows("kernel")` an NVFP4 word kernel then takes x's float16 rows from one launch that
    norms `source` itself (pallas_kernels/norm_rows.py), in place of XLA's norm, row-max reduce and
    reorder before it; x still serves every other path. Made while tracing a layer, and used
    within that trace only: the rows it makes are kept per layout, so the projections of one
    norm share one launch."""

    source: Array  # [..., K]: the norm's input, with x's rows
    weight: Array  # [K], or [head dim] with a gate
    eps: float
    zero_centered: bool = False
    gate: Array | None = None  # [..., K]: the gated norm's gate (its heads of weight.shape[0] columns)
    made: dict = dataclasses.field(default_factory=dict, repr=False)  # layout -> (normed, words, inverse)

    def kernel_output(self) -> Array | None:
        """The norm's output [..., K] from a launch already made for it (any layout), or None.
        Code that reads x besides the projections (a MoE layer's router and routing) takes this
        instead, so that XLA's own norm of x, read by nothing else, is not computed at all."""
        if not self.made:
            return None
        normed, _, _ = next(iter(self.made.values()))
        return normed.reshape(self.source.shape)


def _norm_words(norm: NormSource | None, x2d: Array, layout: str | None, interpret: bool):
    """x's float16 rows in `layout` made with the norm, as `norm_rows` says ("kernel": the norm's
    own launch; "source": `_source_norm_words`), or None: no norm given, `norm_rows("xla")`, no such
    layout for the formulation, or rows the way does not take."""
    if norm is None or layout is None or _modes["norm_rows"] == "xla":
        return None
    rows, k = x2d.shape
    if _modes["norm_rows"] == "source":
        return _source_norm_words(norm, x2d, layout)
    takes = (
        norm_rows_kernel.supports(rows, k)
        if norm.gate is None
        else norm_rows_kernel.supports_gated(rows, k, norm.weight.shape[0])
    )
    if (
        jnp.dtype(x2d.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        or not takes
        or norm.source.shape[-1] != k
        or math.prod(norm.source.shape[:-1]) != rows
    ):
        return None
    if layout not in norm.made:
        source = norm.source.reshape(rows, k)
        if norm.gate is None:
            normed, words, inverse = norm_rows_kernel.rms_norm_rows(
                source, norm.weight, eps=norm.eps, zero_centered=norm.zero_centered, layout=layout,
                interpret=interpret,
            )  # fmt: skip
        else:
            normed, words, inverse = norm_rows_kernel.gated_rms_norm_rows(
                source, norm.gate.reshape(rows, k), norm.weight, eps=norm.eps, layout=layout, interpret=interpret
            )
        norm.made[layout] = (normed, words, inverse)
    return norm.made[layout][1:]


def _source_norm_words(norm: NormSource, x2d: Array, layout: str):
    """`_norm_words` under norm_rows("source"): XLA's rows with their scale bounded from the norm's
    input (weights/norm_words.py; the gated GDN output norm's too), or None for rows the norm does
    not give."""
    rows, k = x2d.shape
    if (
        jnp.dtype(x2d.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
        or norm.source.shape[-1] != k
        or math.prod(norm.source.shape[:-1]) != rows
        or (norm.gate is not None and k % norm.weight.shape[0])
    ):
        return None
    if layout not in norm.made:
        source = norm.source.reshape(rows, k)
        if norm.gate is None:
            norm.made[layout] = rms_norm_words(
                source, norm.weight, eps=norm.eps, zero_centered=norm.zero_centered, layout=layout
            )
        else:
            gate = norm.gate.reshape(rows, k)
            norm.made[layout] = gated_rms_norm_words(source, gate, norm.weight, eps=norm.eps, layout=layout)
    return norm.made[layout][1:]


def take(w: Any, expert_ids: Array) -> Any:
    """Gather experts from a stacked [E, N, K] weight (plain or quantized) -> [*ids.shape, N, K]."""
    if len(w.shape) != 3:
        raise ValueError(f"take needs stacked expert weights [E, N, K]; got shape {tuple(w.shape)}")
    return jax.tree.map(lambda a: a[expert_ids], w)


def dequantize(w: Any, dtype=jnp.bfloat16) -> Array:
    """The float value of a weight of any format."""
    if isinstance(w, ExpertStackPair):
        return dequantize(w.joined(), dtype)
    return w.dequantize(dtype) if isinstance(w, QuantizedWeight) else jnp.asarray(w).astype(dtype)


@dataclasses.dataclass(frozen=True)
class ExpertStackPair:
    """Two expert stacks of one format and [N, K], first [E1, N, K] then second [E2, N, K], that
    the grouped expert matmuls read as their concatenation [E1 + E2, N, K] (expert ids past E1
    are the second's) without making it: the grouped kernel's programs read their expert from the
    stack it is in. A slotted MoE layer passes its slots and the experts fetched for the step this
    way (`mlp.slot_reads("in_place")`) instead of copying every routed expert into one stack (~40
    us a layer at one token on an H100). Where the kernel does not run, or runs a formulation that
    takes one stack, the stacks are concatenated (`joined`)."""

    first: Any
    second: Any

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.first.shape[0] + self.second.shape[0], *self.first.shape[1:])

    def joined(self) -> Any:
        """The concatenated stack (every leaf of both formats stacks experts on its first axis)."""
        return jax.tree.map(lambda a, b: jnp.concatenate([a, b]), self.first, self.second)


_register(ExpertStackPair, ("first", "second"))


def expert_matmul(
    x: Array, w: Any, *, expert_ids: Array | None = None, group_sizes: Array | None = None
) -> Array:
    """MoE expert matmul with stacked expert weights w [E, N, K]; give exactly one of:

    expert_ids [...] (shape x.shape[:-1]): row r uses expert expert_ids[r] (decode: a few tokens,
        x repeated per chosen expert) -> [..., N];
    group_sizes [E] int32: x [T, K] is sorted by expert and group e holds the next
        group_sizes[e] rows (prefill) -> [T, N]; rows past sum(group_sizes) are zero.
    """
    if (expert_ids is None) == (group_sizes is None):
        raise ValueError("give exactly one of expert_ids or group_sizes")
    if len(w.shape) != 3 or x.shape[-1] != w.shape[-1]:
        raise ValueError(f"expected x [..., K] and w [E, N, K]; got {x.shape} and {tuple(w.shape)}")
    if expert_ids is not None:
        if expert_ids.shape != x.shape[:-1]:
            raise ValueError(f"expert_ids shape {expert_ids.shape} must equal x.shape[:-1] = {x.shape[:-1]}")
        wf = dequantize(take(w, expert_ids), jnp.float32)
        y = jnp.einsum("...k,...nk->...n", x.astype(jnp.float32), wf, precision=jax.lax.Precision.HIGHEST)
        return y.astype(x.dtype)
    if x.ndim != 2 or group_sizes.shape != (w.shape[0],):
        raise ValueError(
            f"group mode needs x [T, K] and group_sizes [E={w.shape[0]}]; "
            f"got {x.shape} and {group_sizes.shape}"
        )
    wf = dequantize(w, jnp.float32).transpose(0, 2, 1)  # [E, K, N]
    y = jax.lax.ragged_dot(
        x.astype(jnp.float32), wf, group_sizes.astype(jnp.int32), precision=jax.lax.Precision.HIGHEST
    )
    return y.astype(x.dtype)


# ----------------------------------------------------------------------- grouped expert kernel


def _grouped_kernel_operands(w: Any) -> tuple[str, tuple[Array, ...], int | None] | None:
    """(format, leaves, block size) the grouped kernel reads for a stack [E, N, K], or None when
    it cannot: NVFP4 and FP8 (per expert, or block-scaled with a power-of-two block >= 16) and
    plain bf16 / f16 / f32 arrays."""
    if isinstance(w, QuantizedWeight):
        return w._grouped_operands()
    if hasattr(w, "dtype") and len(getattr(w, "shape", ())) == 3 and w.dtype in PLAIN_DTYPES:
        return "plain", (w,), None
    return None


def grouped_kernel_ready(*stacks: Any) -> bool:
    """True when the grouped MoE kernel runs for all these expert stacks [E, N, K], at any token
    count: each stack is one the kernel reads (`_grouped_kernel_operands`) and the kernel mode
    allows it ("auto": on a GPU; "interpret" / "kernel": always; "reference": never). Read at
    trace time, like `kernel_mode`."""
    use_kernel, _ = _expert_kernel_choice()
    return use_kernel and all(_grouped_kernel_operands(part) is not None for w in stacks for part in _stack_parts(w))


def row_experts_ready(stacks: tuple[Any, ...], tokens: int, rows: int, x_dtype: Any) -> bool:
    """Whether the grouped kernel takes these stacks with each of `rows` rows (of `tokens` tokens)
    naming its expert (`grouped_expert_matmul(row_experts=True)`): it runs for them, and their
    tiles are not the streamed gemv's."""
    if not grouped_kernel_ready(*stacks) or any(isinstance(w, ExpertStackPair) for w in stacks):
        return False
    for w in stacks:
        fmt, _, block_size = _grouped_kernel_operands(w)
        if grouped_tiles(fmt, tokens, rows, block_size, x_dtype)["variant"] in STREAMED_VARIANTS:
            return False
    return True


def with_expert_rows(stacks: tuple[Any, ...], extra: tuple[Any, ...], tokens: int, rows: int, x_dtype: Any):
    """Each expert stack [E, N, K] of `stacks` paired with the [N, K] weight of `extra` at its place
    as a one-expert stack (`ExpertStackPair`: expert E names it), where the grouped kernel reads the
    pairs in place with `rows` rows naming their experts; None elsewhere. A MoE layer's shared
    expert, shaped like a routed one, so runs as one more pair of each token in the routed experts'
    launches (`mlp._shared_expert_rows`), not in launches of its own."""
    if len(stacks) != len(extra) or not row_experts_ready(stacks, tokens, rows, x_dtype):
        return None
    pairs = []
    for stack, w in zip(stacks, extra, strict=True):
        if type(w) is not type(stack) or tuple(w.shape) != tuple(stack.shape[1:]):
            return None
        one = jax.tree.map(lambda a: a[None], w)  # every leaf gains the expert axis (a scalar scale: [1])
        pairs.append(ExpertStackPair(stack, one))
    if not pairs_read_in_place(tuple(pairs), tokens, rows, x_dtype):
        return None
    return tuple(pairs)


def routing_kernel_takes(tokens: int, num_experts: int, top_k: int) -> bool:
    """Whether `grouped_routing` takes a step of `tokens` tokens (the routing kernel's sizes) in the
    kernel mode of programs traced now (the grouped kernel's: "auto" on a GPU, "interpret" /
    "kernel" always, "reference" never)."""
    return _expert_kernel_choice()[0] and routing_kernel.supports(tokens, num_experts, top_k)


def grouped_routing(
    logits: jax.Array,
    x: jax.Array,
    valid: jax.Array | None,
    *,
    top_k: int,
    renormalize: bool,
    stacks: tuple[Any, ...] = (),
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, tuple[jax.Array, jax.Array] | None]:
    """A decode step's MoE routing for the grouped kernel in one launch (pallas_kernels/moe_routing.py,
    compiled or interpreted as the grouped kernel is): logits [N, E] float32, x [N, D], valid [N] or
    None -> (weights [N, k] in x's dtype, ids [N, k], order [N*k], rank [N*k], group sizes [E], the
    rows x[order // k] [N*k, D], x_words). x_words: where `stacks` (the stacks those rows go
    through, an expert's gate and up) take the grouped word kernel with rows made outside it, the
    rows as it takes them (`grouped_matmuls(x_words=...)`: no XLA op before that launch); else
    None. Only where `routing_kernel_takes`."""
    _, interpret = _expert_kernel_choice()
    tokens = x.shape[0]
    word_rows = bool(stacks) and all(_takes_word_rows(w, tokens, tokens * top_k, x) for w in stacks)
    out = routing_kernel.moe_routing(
        logits, x, valid, top_k=top_k, renormalize=renormalize, word_rows=word_rows, interpret=interpret
    )
    return (*out[:6], tuple(out[6:]) if word_rows else None)


def grouped_norm_words(
    norm: NormSource | None, x: Array, stacks: tuple[Any, ...], token_of_row: Array
) -> tuple[Array, Array] | None:
    """The rows x[token_of_row] of a MoE layer's grouped gate / up as the grouped kernel over
    `stacks` reads them (`grouped_matmuls(x_words=...)`), made from the tokens' rows of the norm x
    is the output of, under norm_rows("source"): the row scales come with the norm's own reduce
    (weights/norm_words.py) and each token's words are gathered for its pairs, where XLA would take
    a row max of every pair's row and make its words (two launches more). None where the norm's
    rows do not serve (another way, no norm, stacks that make their rows otherwise)."""
    made = _token_norm_words(norm, x, stacks, token_of_row.shape[0])
    if made is None:
        return None
    words, inverse, _ = made
    return jnp.take(words, token_of_row, axis=0), jnp.take(inverse, token_of_row)


def pair_norm_words(norm: NormSource | None, x: Array, stacks: tuple[Any, ...], top_k: int) -> tuple[Array, Array] | None:
    """`grouped_norm_words` for the pairs of x's tokens in (token, slot) order, as the grouped kernel
    takes them under `row_experts`: the half2 gemv reads each token's word row for all of its k
    pairs (the tokens' rows [T, K/2], no gather); other formulations get each token's row repeated."""
    made = _token_norm_words(norm, x, stacks, x.shape[0] * top_k)
    if made is None:
        return None
    words, inverse, layout = made
    if layout == "pairs":
        return words, inverse
    return jnp.repeat(words, top_k, axis=0), jnp.repeat(inverse, top_k)


def _token_norm_words(
    norm: NormSource | None, x: Array, stacks: tuple[Any, ...], rows: int
) -> tuple[Array, Array, str] | None:
    """The tokens' word rows [T, ...], inverse factors [T] and layout of a grouped gate / up over
    `rows` pairs of the T tokens of x, from the norm x is the output of; None where they do not
    serve (`grouped_norm_words`)."""
    if norm is None or _modes["norm_rows"] != "source" or not stacks:
        return None
    tokens = x.shape[0]
    layouts = {_grouped_words_layout(w, tokens, rows, x) for w in stacks}
    if len(layouts) != 1 or None in layouts:
        return None
    layout = layouts.pop()
    made = _source_norm_words(norm, x, layout)
    if made is None:
        return None
    words, inverse = made
    return words.reshape(tokens, -1), inverse, layout


def swiglu_words(gate: Array, up: Array, w: Any, tokens: int) -> tuple[Array, Array] | None:
    """The float16 word rows of silu(gate) * up (gate, up [M, I] sorted by expert) as the grouped
    kernel over the down stack w reads them, from one launch (`norm_rows.swiglu_rows`), under
    `swiglu_rows("kernel")`; else None (the kernel does not run, takes other rows, or not these)."""
    if _modes["swiglu_rows"] != "kernel" or jnp.dtype(gate.dtype) not in (
        jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)
    ):
        return None
    use_kernel, interpret = _expert_kernel_choice()
    rows = gate.shape[0]
    if not use_kernel or not norm_rows_kernel.supports(*gate.shape) or not _takes_word_rows(w, tokens, rows, gate):
        return None
    _, words, inverse = norm_rows_kernel.swiglu_rows(gate, up, layout="columns", interpret=interpret)
    return words, inverse


def _takes_word_rows(w: Any, tokens: int, rows: int, x: jax.Array) -> bool:
    """Whether the grouped kernel reads x [tokens, K] for `rows` pairs through stack w with the
    float16 word rows made outside it in word-column order (NVFP4, a word variant but dot_jw and
    gemv_h2w, XLA's rows)."""
    return _grouped_words_layout(w, tokens, rows, x) == "columns"


def _grouped_words_layout(w: Any, tokens: int, rows: int, x: jax.Array) -> str | None:
    """The layout in which the grouped kernel over stack w reads x's float16 word rows made outside
    it for `rows` pairs of x [tokens, K] (`moe_matmul.x_words_layout`), or None where it takes none."""
    operands = _grouped_kernel_operands(w)
    if operands is None or operands[0] != "nvfp4" or x.shape[1] % 8:
        return None
    tiles = grouped_tiles("nvfp4", tokens, rows, operands[2], x.dtype)
    return grouped_x_words_layout(tiles["variant"], tiles.get("x_rows"))


def grouped_tiles(
    fmt: str, tokens: int, rows: int, block_size: int | None = None, x_dtype: Any = None
) -> dict[str, Any]:
    """Grouped-kernel options for `rows` (token, expert) pairs of `tokens` tokens, sorted by expert.

    NVFP4 with bf16 / f16 activations (`x_dtype`) up to GROUPED_DECODE_MAX_TOKENS tokens: at one token
    "gemv_h2w" 32 x 512 with 8 warps (`nvfp4_grouped_dot`'s "auto"; the item's rows unrolled, up to 8
    under "gemv_h2w" past one token), past it "dot_w" 16 x 64 x 256 (or, under `nvfp4_grouped_dot`,
    the joined "dot_jw"), block_m 16 >= the rows any expert can get, so each routed
    expert is streamed once (the word-decoded float16 dots: 1202 against 668 GB/s on
    the 80B gate_up at batch 8, 997 against 601 at batch 4, bench/results/moe-kernels-nvidia-h200.json;
    at one token too: the 80B gate_up 28.0 against the gemv's 43.7 us on the H200, 19.7 against 26.8 on
    an H100, the down projection 27.2 against 24.3 and 12.3 against 16.1,
    moe-kernels-nvidia-h100-80gb-hbm3.json). Everything else: one token "gemv", one row per item (no
    expert holds two rows); up to GROUPED_DECODE_MAX_TOKENS tokens "dot_t" with block_m 16 (it won every
    batch 2-8 point before the word variants). More tokens (prefill): "dot" with block_m 64.
    Block-scaled FP8 tiles are cut to divide the scale block. With `streamed_experts` on, NVFP4 (16-bit
    rows) and FP8 stacks take the streamed "gemv_ws" up to STREAMED_EXPERTS_MAX_TOKENS tokens instead.
    """
    sixteen_bit = x_dtype is not None and jnp.dtype(x_dtype) in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
    streamed = _modes["streamed_experts"] == "on" and tokens <= STREAMED_EXPERTS_MAX_TOKENS
    if streamed and (fmt == "fp8" or (fmt == "nvfp4" and sixteen_bit)):
        # the dense layers' streamed gemv over the work items (`streamed_experts`): 8 KB weight
        # tiles; two rows an item past one token (most routed experts get one or two rows)
        tiles = {"variant": "gemv_ws", "block_m": min(tokens, 2), "block_n": 32,
                 "block_k": 512 if fmt == "nvfp4" else 256, "num_warps": 8}  # fmt: skip
    elif tokens <= GROUPED_DECODE_MAX_TOKENS and fmt == "nvfp4" and sixteen_bit:
        variant = _modes["nvfp4_grouped_dot"]
        if variant == "auto":
            variant = "gemv_h2w" if tokens == 1 else "dot_w"
        tiles = {"variant": variant, "block_m": 16, "block_n": 64, "block_k": 256}
        if tiles["variant"] == "gemv_h2w":  # the rows of an item unrolled: the most any expert can get
            tiles = {"variant": "gemv_h2w", "block_m": min(tokens, 8), "block_n": 32, "block_k": 512, "num_warps": 8}
        if tiles["variant"] == "dot_jw":
            tiles["x_rows"] = _modes["nvfp4_grouped_rows"]
    elif tokens <= 1:
        tiles = {"variant": "gemv", "block_m": 1, "block_n": 32}
    elif tokens <= GROUPED_DECODE_MAX_TOKENS:
        tiles = {"variant": "dot_t", "block_m": 16, "block_n": 64}
    else:
        tiles = {"variant": "dot", "block_m": 64, "block_n": 64}
    cfg = resolve_config(fmt, rows, **tiles)
    if block_size is not None:
        cfg = dataclasses.replace(
            cfg, block_n=min(cfg.block_n, block_size), block_k=min(cfg.block_k, block_size)
        )
    return cfg.as_kwargs()


STREAMED_EXPERTS_MAX_TOKENS = 8  # tokens up to which `streamed_experts` takes the grouped "gemv_ws"


@contextlib.contextmanager
def streamed_experts(enabled: bool) -> Iterator[None]:
    """Whether NVFP4 (with 16-bit activations) and FP8 expert stacks run the grouped kernel's
    streamed gemv ("gemv_ws": every SM streams the routed experts' tiles, loads one unit ahead)
    for decode batches of up to STREAMED_EXPERTS_MAX_TOKENS tokens, while tracing inside this block
    (default: INFERNIX_STREAMED_EXPERTS, "off" until a GPU measurement says it pays:
    docs/gpu_runs.md row 6l)."""
    with switched(_modes, "streamed_experts", "on" if enabled else "off", ON_OFF, "streamed experts"):
        yield


@contextlib.contextmanager
def nvfp4_scale_spread(mode: str) -> Iterator[None]:
    """How the NVFP4 CUDA-core decode gemvs meet each word with its block scale while tracing
    inside this block: "reshape" (block bytes spread over the words) or "gather" (read per word;
    `pallas_kernels.nvfp4_matmul._word_loads`). Default: INFERNIX_NVFP4_SCALE_SPREAD, "reshape":
    on an H100 the gather's extra instructions cost more than the barriers it saves (27B decode
    84.3 against 89.3 tok/s, docs/pallas.md)."""
    with switched(_modes, "nvfp4_scale_spread", mode, SCALE_SPREADS, "NVFP4 scale spread"):
        yield


@contextlib.contextmanager
def nvfp4_streamed_gemv(variant: str) -> Iterator[None]:
    """The streamed formulation `nvfp4_tiles` gives single NVFP4 rows while tracing inside this
    block (STREAMED_GEMV_MODES; default: INFERNIX_NVFP4_STREAMED_GEMV, "auto": the half2 word
    gemv on the wide K >= 4096 layers, gemv_ws on the rest)."""
    with switched(_modes, "nvfp4_streamed_gemv", variant, STREAMED_GEMV_MODES, "NVFP4 streamed gemv"):
        yield


@contextlib.contextmanager
def nvfp4_grouped_dot(variant: str) -> Iterator[None]:
    """The formulation `grouped_tiles` gives NVFP4 experts at decode batches while tracing inside
    this block (GROUPED_DOTS; default: INFERNIX_NVFP4_GROUPED_DOT, "auto": "gemv_h2w" at one token,
    where it cut an H100's 80B-A3B decode step from 2.63-2.66 to 2.47 ms, and "dot_w" past it, where
    gemv_h2w's gate_up took 1.5x dot_w's time at eight tokens, docs/gpu_runs.md row 6aa; "dot_jw" lost
    everywhere on an H100, row 6t)."""
    with switched(_modes, "nvfp4_grouped_dot", variant, GROUPED_DOTS, "NVFP4 grouped dot"):
        yield


@contextlib.contextmanager
def nvfp4_grouped_rows(where: str) -> Iterator[None]:
    """Where the grouped "dot_jw" (`nvfp4_grouped_dot`) scales x to float16 rows while tracing
    inside this block: "xla", an op before each grouped call, or "kernel", each program for its
    own rows, which drops a reduce and a convert launch per call (GROUPED_ROWS; default:
    INFERNIX_NVFP4_GROUPED_ROWS, "xla" until a GPU measures it: docs/gpu_runs.md row 6t)."""
    with switched(_modes, "nvfp4_grouped_rows", where, GROUPED_ROWS, "NVFP4 grouped rows"):
        yield


@contextlib.contextmanager
def nvfp4_word_rows(where: str) -> Iterator[None]:
    """Where the dense NVFP4 word kernels that can (gemv_w, gemv_wp, gemv_ws, dot_jw) scale x to
    float16 rows while tracing inside this block: "xla", ops before each call (a reduce, a convert
    and a transpose to word order), or "kernel", each program for its rows, reading x in natural
    order (WORD_ROWS; default: INFERNIX_NVFP4_WORD_ROWS, "xla" until a GPU measures it:
    docs/gpu_runs.md row 6v). The same bits either way."""
    with switched(_modes, "nvfp4_word_rows", where, WORD_ROWS, "NVFP4 word rows"):
        yield


@contextlib.contextmanager
def norm_rows(where: str) -> Iterator[None]:
    """Where NVFP4 word kernels whose input is an RMSNorm's output (`NormSource`) get its float16
    rows while tracing inside this block: "xla" (the norm, a reduce and a reorder launched before
    the kernel), "kernel" (one launch: pallas_kernels/norm_rows.py) or "source" (XLA's norm and
    row max in one reduce launch, the scale bounded from the norm's input: weights/norm_words.py).
    NORM_ROWS; default: INFERNIX_NORM_ROWS, "source": on an H100, two runs each in one call,
    455.6 / 453.7 against 438.4 / 440.1 tok/s with "xla" on the 80B-A3B shape at one token, 99.3 /
    97.4 against 95.8 / 96.5 on the 27B (docs/gpu_runs.md row 6ac). The kernel cut launches too but
    took more device time than XLA's three, 2.88 against 2.61 ms a step on the 80B-A3B, 12.0
    against 10.6 on the 27B (row 6x)."""
    with switched(_modes, "norm_rows", where, NORM_ROWS, "norm rows"):
        yield


@contextlib.contextmanager
def swiglu_rows(where: str) -> Iterator[None]:
    """Where the grouped down projection of NVFP4 experts gets the float16 rows of its SwiGLU input
    while tracing inside this block: "xla" (two launches before it) or "kernel" (one:
    `norm_rows.swiglu_rows`, the same bits). SWIGLU_ROWS; default: INFERNIX_SWIGLU_ROWS, "xla": on
    an H100 the launch took 4.7 us where XLA's two average ~1.5 us each (docs/gpu_runs.md row 6z)."""
    with switched(_modes, "swiglu_rows", where, SWIGLU_ROWS, "SwiGLU rows"):
        yield


@contextlib.contextmanager
def nvfp4_word_dot(variant: str) -> Iterator[None]:
    """The float16 word dot `nvfp4_tiles` gives NVFP4 weights at 16-bit rows past one (one row
    takes a gemv or the bf16-decode dot) while tracing inside this block (WORD_DOTS; default:
    INFERNIX_NVFP4_WORD_DOT, "dot_w" until a GPU measures "dot_jw": docs/gpu_runs.md row 6s)."""
    with switched(_modes, "nvfp4_word_dot", variant, WORD_DOTS, "NVFP4 word dot"):
        yield


@contextlib.contextmanager
def fused_experts(enabled: bool) -> Iterator[None]:
    """Whether `grouped_expert_matmuls` runs an expert's gate and up stacks in one grouped-kernel
    launch while tracing inside this block (default: INFERNIX_FUSED_EXPERTS, "on": the 80B-A3B
    shape's decode 302.8 against 287.2 tok/s at batch 1 and 1273 against 1234 at batch 8 on an
    H100, docs/quant_formats.md)."""
    with switched(_modes, "fused_experts", "on" if enabled else "off", ON_OFF, "fused experts"):
        yield


def grouped_expert_matmuls(
    xs: Array,
    ws: tuple[Any, ...],
    group_sizes: Array,
    *,
    tokens: int,
    x_words: tuple[Array, Array] | None = None,
    row_experts: bool = False,
) -> list[Array]:
    """`grouped_expert_matmul` of the same rows through several stacks [E, N, K] (an expert's gate
    and up): one grouped-kernel launch (`grouped_matmuls`) when `fused_experts` is on, the kernel
    runs and the stacks share format, block size and shapes; else one call per stack. x_words:
    xs already as the word kernels take it (`grouped_routing`), or None. row_experts: see
    `grouped_expert_matmul`."""
    if any(isinstance(w, ExpertStackPair) for w in ws):
        return _pair_matmuls(xs, ws, group_sizes, tokens=tokens, x_words=x_words, row_experts=row_experts)
    use_kernel, interpret = _expert_kernel_choice()
    operands = [_grouped_kernel_operands(w) for w in ws] if _modes["fused_experts"] == "on" and use_kernel else [None]
    if len(ws) < 2 or None in operands or len({(o[0], o[2], tuple(a.shape for a in o[1])) for o in operands}) > 1:
        return [
            grouped_expert_matmul(xs, w, group_sizes, tokens=tokens, x_words=x_words, row_experts=row_experts)
            for w in ws
        ]
    _check_grouped_shapes(xs, ws[0], group_sizes, row_experts)
    fmt, _, block_size = operands[0]
    tiles = grouped_tiles(fmt, tokens, xs.shape[0], block_size, xs.dtype)
    leaves = tuple(o[1] for o in operands)
    return grouped_matmuls(xs, leaves, group_sizes, fmt=fmt, block_size=block_size, x_words=x_words,
                           row_experts=row_experts, interpret=interpret, **tiles)  # fmt: skip


def _stack_parts(w: Any) -> tuple[Any, ...]:
    return (w.first, w.second) if isinstance(w, ExpertStackPair) else (w,)


def pairs_read_in_place(stacks: tuple[Any, ...], tokens: int, rows: int, x_dtype: Any) -> bool:
    """Whether `ExpertStackPair`s of these stacks' formats (or these pairs) would be read in place
    by the grouped kernel for `rows` pairs of `tokens` tokens (the kernel runs, each pair's two
    stacks share format and block size, and the formulation takes two stacks), rather than
    concatenated whole first: a slotted layer asks before it pairs its slots with the fetched
    experts (the whole slot stack joined every step would cost far more than the copy of the
    routed experts it replaces)."""
    if not grouped_kernel_ready(*stacks):
        return False
    for w in stacks:
        kinds = {(o[0], o[2]) for o in (_grouped_kernel_operands(part) for part in _stack_parts(w))}
        if len(kinds) != 1:
            return False
        ((fmt, block_size),) = kinds
        if grouped_tiles(fmt, tokens, rows, block_size, x_dtype)["variant"] in STREAMED_VARIANTS:
            return False
    return True


def _pair_matmuls(
    xs: Array, ws: tuple[Any, ...], group_sizes: Array, *, tokens: int, x_words=None, row_experts: bool = False
) -> list[Array]:
    """`grouped_expert_matmuls` where stacks are `ExpertStackPair`s: the grouped kernel reads each
    pair's two stacks in place (`grouped_matmuls(second=...)`; one launch for all of `ws` when
    `fused_experts` is on and they share format and shapes) where `pairs_read_in_place`;
    otherwise the pairs are concatenated and take the one-stack path (a copy of both stacks
    whole: callers check `pairs_read_in_place` first). x_words, row_experts: as for
    `grouped_expert_matmuls`; with row_experts the last rows may go unnamed, naming the second
    stacks' experts in order (`grouped_matmuls`)."""
    rows = xs.shape[0]
    unnamed = rows - group_sizes.shape[0] if row_experts else 0  # rows naming the second stacks' experts
    if not all(isinstance(w, ExpertStackPair) for w in ws) or not pairs_read_in_place(ws, tokens, rows, xs.dtype):
        joined = tuple(w.joined() if isinstance(w, ExpertStackPair) else w for w in ws)
        if unnamed:  # the joined stacks' ids for them
            first = ws[0].first.shape[0] if isinstance(ws[0], ExpertStackPair) else ws[0].shape[0]
            group_sizes = jnp.concatenate([group_sizes, jnp.arange(first, first + unnamed, dtype=group_sizes.dtype)])
        return grouped_expert_matmuls(xs, joined, group_sizes, tokens=tokens, x_words=x_words, row_experts=row_experts)
    named = jax.ShapeDtypeStruct((rows,), group_sizes.dtype) if unnamed else group_sizes  # the kernel checks ids
    for w in ws:
        _check_grouped_shapes(xs, w, named, row_experts)
    _, interpret = _expert_kernel_choice()
    operands = [(_grouped_kernel_operands(w.first), _grouped_kernel_operands(w.second)) for w in ws]

    def call(pairs):
        fmt, _, block_size = pairs[0][0]
        tiles = grouped_tiles(fmt, tokens, rows, block_size, xs.dtype)
        return grouped_matmuls(xs, tuple(f[1] for f, _ in pairs), group_sizes, second=tuple(s[1] for _, s in pairs),
                               fmt=fmt, block_size=block_size, x_words=x_words, row_experts=row_experts,
                               interpret=interpret, **tiles)  # fmt: skip

    shared = {(f[0], f[2], tuple(a.shape for a in f[1]), tuple(a.shape for a in s[1])) for f, s in operands}
    if _modes["fused_experts"] == "on" and len(shared) == 1:
        return call(operands)
    return [call([pair])[0] for pair in operands]


def _check_grouped_shapes(xs: Array, w: Any, group_sizes: Array, row_experts: bool = False) -> None:
    """Raise ValueError unless xs is [M, K], w [E, N, K] and group_sizes [E] (row_experts: [M])."""
    if len(w.shape) != 3 or xs.ndim != 2 or xs.shape[-1] != w.shape[-1]:
        raise ValueError(f"expected xs [M, K] and w [E, N, K]; got {xs.shape} and {tuple(w.shape)}")
    if row_experts and group_sizes.shape != xs.shape[:1]:
        raise ValueError(f"row experts must be [M={xs.shape[0]}]; got {group_sizes.shape}")
    if not row_experts and group_sizes.shape != (w.shape[0],):
        raise ValueError(f"group_sizes must be [E={w.shape[0]}]; got {group_sizes.shape}")


def grouped_expert_matmul(
    xs: Array,
    w: Any,
    group_sizes: Array,
    *,
    tokens: int,
    x_words: tuple[Array, Array] | None = None,
    row_experts: bool = False,
) -> Array:
    """Rows xs [M, K] sorted by expert (group e = the next group_sizes[e] rows) times the stacked
    expert weights w [E, N, K] -> [M, N] in xs's dtype; rows past sum(group_sizes) are zero.

    Runs the grouped Pallas kernel, which reads only the routed experts' tiles (unpacking packed
    ones in registers), when `grouped_kernel_ready(w)`; otherwise dequantizes the whole stack to
    xs's dtype and runs `jax.lax.ragged_dot` (the CPU path). `tokens` (static) is how many tokens
    the M rows came from: it picks the kernel's tiles (`grouped_tiles`). `w` may be an
    `ExpertStackPair`. x_words: xs as the word kernels take it (`grouped_routing`), or None.

    row_experts: group_sizes is instead each row's expert [M], the rows in any order
    (`grouped_matmuls(row_experts=True)`; off the kernel each row's expert is gathered)."""
    if isinstance(w, ExpertStackPair):
        return _pair_matmuls(xs, (w,), group_sizes, tokens=tokens, x_words=x_words, row_experts=row_experts)[0]
    _check_grouped_shapes(xs, w, group_sizes, row_experts)
    use_kernel, interpret = _expert_kernel_choice()
    operands = _grouped_kernel_operands(w)
    if use_kernel and operands is not None:
        fmt, leaves, block_size = operands
        tiles = grouped_tiles(fmt, tokens, xs.shape[0], block_size, xs.dtype)
        return grouped_matmul(xs, leaves, group_sizes, fmt=fmt, block_size=block_size, x_words=x_words,
                              row_experts=row_experts, interpret=interpret, **tiles)  # fmt: skip
    if row_experts:
        return expert_matmul(xs, w, expert_ids=group_sizes)
    w_t = jnp.swapaxes(dequantize(w, xs.dtype), 1, 2)  # [E, K, N]
    return jax.lax.ragged_dot(xs, w_t, group_sizes.astype(jnp.int32))
