"""NVFP4 weight x bf16 activation matmul for small M (decode): a Pallas GPU (Triton) kernel.

    y[m, n] = sum_k x[m, k] * W[n, k],
    W[n, k] = e2m1(code[n, k]) * float(block_scale[n, k // 16]) * tensor_scale

with the weight in ModelOpt's layout (docs/quant_formats.md): `packed` uint8 [N, K/2] holding
element 2j in the low nibble of byte j and element 2j+1 in the high nibble, `block_scale`
float8_e4m3fn [N, K/16], `tensor_scale` (ModelOpt's `weight_scale_2`) a float32 scalar.

Decode is memory bound: the kernel streams the packed bytes and their scales once and unpacks
them in registers. Each byte holds an even and an odd element of K, so instead of interleaving
nibbles in registers the activation is split once outside the kernel into its even and odd
columns, and each K step does two dots: x_even @ low_nibbles.T + x_odd @ high_nibbles.T.
code * block_scale has at most 6 significant bits, so it is exact in bf16 and the dot operands
lose nothing; the tensor scale is applied once to the float32 sum.

Grid: (M tiles, N tiles, split_k). split_k > 1 splits the K loop over programs (more programs
in flight when N / block_n is smaller than the number of SMs); the partial sums are added
outside the kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import compat

# The 16 E2M1 values indexed by their 4-bit code (bit 3 = sign).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 16  # elements of K per block scale


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


def _nvfp4_kernel(
    x_even_ref,  # [Mp, K/2] activation columns 0, 2, 4, ...
    x_odd_ref,  # [Mp, K/2] activation columns 1, 3, 5, ...
    packed_ref,  # [N, K/2] uint8, low nibble = even element
    scale_ref,  # [N, K/16] uint8: the bits of the float8_e4m3fn block scales
    out_ref,  # [split_k, Mp, N] float32 partial sums
    *,
    n_size: int,
    half_k: int,
    block_m: int,
    block_n: int,
    half_block_k: int,
    steps: int,
):
    i, j, split = compat.program_id(0), compat.program_id(1), compat.program_id(2)
    row0, col0 = i * block_m, j * block_n
    n_mask = (col0 + jnp.arange(block_n)) < n_size  # [bn]
    compute_dtype = x_even_ref.dtype

    def step(t, acc):
        kb = (split * steps + t) * half_block_k  # byte column of this K step
        k_mask = (kb + jnp.arange(half_block_k)) < half_k  # [bkh]
        s_mask = (kb // 8 + jnp.arange(half_block_k // 8)) < half_k // 8  # [bkh/8]
        xe = compat.load(
            x_even_ref.at[compat.ds(row0, block_m), compat.ds(kb, half_block_k)],
            mask=k_mask[None, :],
            other=0,
        )
        xo = compat.load(
            x_odd_ref.at[compat.ds(row0, block_m), compat.ds(kb, half_block_k)], mask=k_mask[None, :], other=0
        )
        packed = compat.load(
            packed_ref.at[compat.ds(col0, block_n), compat.ds(kb, half_block_k)],
            mask=n_mask[:, None] & k_mask[None, :],
            other=0,
        )
        scale = compat.load(
            scale_ref.at[compat.ds(col0, block_n), compat.ds(kb // 8, half_block_k // 8)],
            mask=n_mask[:, None] & s_mask[None, :],
            other=0,
        )
        # [bn, bkh/8] -> [bn, bkh]: one block scale covers 8 bytes (16 elements).
        # Loaded as uint8 (a masked fp8 load cannot take a fill value in Triton), then bitcast.
        scale = jax.lax.bitcast_convert_type(scale, jnp.float8_e4m3fn).astype(jnp.float32)
        scale = jnp.broadcast_to(scale[:, :, None], (block_n, half_block_k // 8, 8))
        scale = scale.reshape(block_n, half_block_k)
        codes = packed.astype(jnp.int32)
        w_low = (decode_e2m1(codes & 0xF) * scale).astype(compute_dtype)
        w_high = (decode_e2m1(codes >> 4) * scale).astype(compute_dtype)
        dims = (((1,), (1,)), ((), ()))
        acc += jax.lax.dot_general(xe, w_low, dims, preferred_element_type=jnp.float32)
        acc += jax.lax.dot_general(xo, w_high, dims, preferred_element_type=jnp.float32)
        return acc

    acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((block_m, block_n), jnp.float32))
    compat.store(
        out_ref.at[split, compat.ds(row0, block_m), compat.ds(col0, block_n)],
        acc,
        mask=jnp.broadcast_to(n_mask[None, :], (block_m, block_n)),
    )


def _is_pow2(v: int) -> bool:
    return v > 0 and (v & (v - 1)) == 0


def validate_nvfp4_matmul(x, packed, block_scale, tensor_scale, block_m, block_n, block_k, split_k) -> None:
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
        if not _is_pow2(v) or v < low:
            raise ValueError(f"{name}={v} must be a power of two >= {low}")
    if split_k < 1:
        raise ValueError(f"split_k={split_k} must be >= 1")


def default_block_m(m: int) -> int:
    """Smallest power-of-two row tile >= M, between 16 (Triton's minimum dot) and 64."""
    return min(compat.pow2_at_least(m, 16), 64)


@functools.partial(
    jax.jit,
    static_argnames=(
        "block_m",
        "block_n",
        "block_k",
        "split_k",
        "num_warps",
        "num_stages",
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
    block_m: int | None = None,
    block_n: int = 64,
    block_k: int = 256,
    split_k: int = 1,
    num_warps: int = 4,
    num_stages: int = 3,
    out_dtype=None,
    interpret: bool = False,
) -> jax.Array:
    """x [M, K] @ dequant(NVFP4 W [N, K]).T -> [M, N] in `out_dtype` (default x.dtype).

    Tile sizes are powers of two; block_k counts K elements (block_k / 2 bytes per row per
    step). Any M works (M tiles become a grid axis) but the kernel is built for M <= 64.
    `interpret=True` runs the same kernel through the Pallas interpreter (the CPU test path).
    """
    block_m = default_block_m(x.shape[0]) if block_m is None else block_m
    validate_nvfp4_matmul(x, packed, block_scale, tensor_scale, block_m, block_n, block_k, split_k)
    m, _k = x.shape
    n, half_k = packed.shape
    out_dtype = x.dtype if out_dtype is None else out_dtype
    compute_dtype = jnp.float32 if x.dtype == jnp.float32 else x.dtype
    m_pad = compat.cdiv(m, block_m) * block_m
    xp = jnp.pad(x.astype(compute_dtype), ((0, m_pad - m), (0, 0)))
    x_even, x_odd = xp[:, 0::2], xp[:, 1::2]
    half_block_k = block_k // 2
    steps = compat.cdiv(compat.cdiv(half_k, half_block_k), split_k)
    kernel = functools.partial(
        _nvfp4_kernel,
        n_size=n,
        half_k=half_k,
        block_m=block_m,
        block_n=block_n,
        half_block_k=half_block_k,
        steps=steps,
    )
    partial = compat.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((split_k, m_pad, n), jnp.float32),
        grid=(m_pad // block_m, compat.cdiv(n, block_n), split_k),
        compiler_params=compat.triton_compiler_params(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="nvfp4_matmul",
    )(x_even, x_odd, packed, jax.lax.bitcast_convert_type(block_scale, jnp.uint8))
    y = partial.sum(axis=0)[:m] * jnp.asarray(tensor_scale, jnp.float32).reshape(())
    return y.astype(out_dtype)
