"""RMSNorm in Qwen's two styles, and the gated RMSNorm of the GDN output."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rms_norm(
    x: jax.Array, weight: jax.Array, eps: float, zero_centered: bool, mean_square: jax.Array | None = None
) -> jax.Array:
    """y = x / rms(x) * (1 + w) (Qwen3-Next/3.5, Gemma style) or * w (Qwen3); computed in fp32.
    mean_square: each row's mean of x^2 in float32 [..., 1], where the caller reduced it already."""
    xf = x.astype(jnp.float32)
    if mean_square is None:
        mean_square = jnp.mean(xf * xf, axis=-1, keepdims=True)
    normed = xf * jax.lax.rsqrt(mean_square + eps)
    w = weight.astype(jnp.float32)
    if zero_centered:
        return (normed * (1.0 + w)).astype(x.dtype)
    # transformers' Qwen3RMSNorm casts back to the input dtype before multiplying by the weight
    return weight * normed.astype(x.dtype)


def gated_rms_norm(x: jax.Array, gate: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """GDN output norm: w * (x / rms(x)) * silu(gate), variance in fp32, plain (not 1 + w) weight."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    out = weight * normed.astype(x.dtype)
    return (out.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))).astype(x.dtype)
