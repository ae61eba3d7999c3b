"""Partial NeoX-style rotary embedding with optional YaRN frequencies."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from infernix_jax.config import RopeConfig


def rope_cos_sin(rope: RopeConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin [..., rotary_dim] for integer positions [...], scaled by YaRN's attention factor."""
    inv_freq = jnp.asarray(rope.inv_freq())
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb) * rope.attention_factor, jnp.sin(emb) * rope.attention_factor


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the first rotary_dim dims of each head of x [B, T, H, Dh]; cos/sin are [B, T, rotary_dim]."""
    rd = cos.shape[-1]
    rot, rest = x[..., :rd], x[..., rd:]
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    half = rd // 2
    rotated_half = jnp.concatenate([-rot[..., half:], rot[..., :half]], axis=-1)
    return jnp.concatenate([rot * cos + rotated_half * sin, rest], axis=-1)
