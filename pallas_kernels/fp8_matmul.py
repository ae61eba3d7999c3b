"""FP8 (e4m3) weight x bf16 activation matmul for small M (decode): a Pallas GPU (Triton) kernel.

    y[m, n] = sum_k x[m, k] * W[n, k],   W[n, k] = fp8[n, k] * s

where s is either one float32 per tensor (ModelOpt "FP8": `weight_scale`) or one float32 per
block_size x block_size block (Qwen / DeepSeek "-FP8": `weight_scale_inv` [ceil(N/b), ceil(K/b)],
the dequant multiplier despite its name). e4m3 values are exact in bf16, so the weight tile is
widened in registers and fed to the dot as is; block scales multiply each K step's partial dot
(a tile never straddles a scale block: block_n and block_k divide block_size), the per-tensor
scale multiplies the float32 sum once.

Grid: (M tiles, N tiles, split_k), as in nvfp4_matmul.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import compat


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


def _fp8_kernel(
    x_ref,  # [Mp, K] activations
    w_ref,  # [N, K] uint8: the bits of the float8_e4m3fn weight
    scale_ref,  # [ceil(N/b), ceil(K/b)] float32 block scales (unused when per-tensor)
    out_ref,  # [split_k, Mp, N] float32 partial sums
    *,
    n_size: int,
    k_size: int,
    block_m: int,
    block_n: int,
    block_k: int,
    steps: int,
    scale_block: int | None,
):
    i, j, split = compat.program_id(0), compat.program_id(1), compat.program_id(2)
    row0, col0 = i * block_m, j * block_n
    n_mask = (col0 + jnp.arange(block_n)) < n_size
    compute_dtype = x_ref.dtype

    def step(t, acc):
        k0 = (split * steps + t) * block_k
        k_mask = (k0 + jnp.arange(block_k)) < k_size
        x = compat.load(
            x_ref.at[compat.ds(row0, block_m), compat.ds(k0, block_k)], mask=k_mask[None, :], other=0
        )
        bits = compat.load(
            w_ref.at[compat.ds(col0, block_n), compat.ds(k0, block_k)],
            mask=n_mask[:, None] & k_mask[None, :],
            other=0,
        )
        w = jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn).astype(compute_dtype)
        part = jax.lax.dot_general(x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
        if scale_block is not None:
            kb = jnp.minimum(k0 // scale_block, scale_ref.shape[1] - 1)  # the tail step is all masked
            part = part * scale_ref[col0 // scale_block, kb]
        return acc + part

    acc = jax.lax.fori_loop(0, steps, step, jnp.zeros((block_m, block_n), jnp.float32))
    compat.store(
        out_ref.at[split, compat.ds(row0, block_m), compat.ds(col0, block_n)],
        acc,
        mask=jnp.broadcast_to(n_mask[None, :], (block_m, block_n)),
    )


def _is_pow2(v: int) -> bool:
    return v > 0 and (v & (v - 1)) == 0


def validate_fp8_matmul(x, w, scale, block_size, block_m, block_n, block_k, split_k) -> None:
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
        for name, v in (("block_n", block_n), ("block_k", block_k)):
            if block_size % v:
                raise ValueError(f"{name}={v} must divide the scale block_size={block_size}")
    for name, v in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if not _is_pow2(v) or v < 16:
            raise ValueError(f"{name}={v} must be a power of two >= 16")
    if split_k < 1:
        raise ValueError(f"split_k={split_k} must be >= 1")


@functools.partial(
    jax.jit,
    static_argnames=(
        "block_size",
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
def fp8_matmul(
    x: jax.Array,
    w: jax.Array,
    scale: jax.Array,
    *,
    block_size: int | None = None,
    block_m: int | None = None,
    block_n: int = 64,
    block_k: int = 128,
    split_k: int = 1,
    num_warps: int = 4,
    num_stages: int = 3,
    out_dtype=None,
    interpret: bool = False,
) -> jax.Array:
    """x [M, K] @ dequant(FP8 W [N, K]).T -> [M, N] in `out_dtype` (default x.dtype).

    `block_size=None`: `scale` is one float32; otherwise `scale` is float32
    [ceil(N/block_size), ceil(K/block_size)]. Tile sizes are powers of two.
    """
    block_m = min(compat.pow2_at_least(x.shape[0], 16), 64) if block_m is None else block_m
    validate_fp8_matmul(x, w, scale, block_size, block_m, block_n, block_k, split_k)
    m, k = x.shape
    n = w.shape[0]
    out_dtype = x.dtype if out_dtype is None else out_dtype
    compute_dtype = jnp.float32 if x.dtype == jnp.float32 else x.dtype
    m_pad = compat.cdiv(m, block_m) * block_m
    xp = jnp.pad(x.astype(compute_dtype), ((0, m_pad - m), (0, 0)))
    steps = compat.cdiv(compat.cdiv(k, block_k), split_k)
    scale_arr = jnp.ones((1, 1), jnp.float32) if block_size is None else jnp.asarray(scale, jnp.float32)
    kernel = functools.partial(
        _fp8_kernel,
        n_size=n,
        k_size=k,
        block_m=block_m,
        block_n=block_n,
        block_k=block_k,
        steps=steps,
        scale_block=block_size,
    )
    partial = compat.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((split_k, m_pad, n), jnp.float32),
        grid=(m_pad // block_m, compat.cdiv(n, block_n), split_k),
        compiler_params=compat.triton_compiler_params(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="fp8_matmul",
    )(xp, jax.lax.bitcast_convert_type(w, jnp.uint8), scale_arr)
    y = partial.sum(axis=0)[:m]
    if block_size is None:
        y = y * jnp.asarray(scale, jnp.float32).reshape(())
    return y.astype(out_dtype)
