"""The n-gram memory layer (Engram-style conditional memory), applied before a layer's mixer.

    e   = concat over orders and heads of the table rows the token's n-grams hash to   [B, T, E]
    k   = norm_k(W_k e),  q = norm_q(h)                                                 [B, T, D]
    a   = sigmoid(signed_sqrt(<k, q> / sqrt(D)))      signed_sqrt(s) = sign(s) sqrt(max(|s|, 1e-6))
    h  <- h + a * W_v e

This is DeepSeek's Engram gate with one residual branch (no mHC) and without its ShortConv (a
causal conv over v that would need per-sequence state; docs/ngram_memory.md). The rows arrive as
a forward input, gathered on the host from the table (infernix_jax/ngram), so the jitted forward
stays pure and only the needed rows reach the device.

Letters: b batch, t time, d model, h heads (orders x hash heads), w row width, e = h * w.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from infernix_jax.config import ModelConfig
from infernix_jax.model.norm import rms_norm
from infernix_jax.weights.quant import matmul


@jax.tree_util.register_dataclass
@dataclass
class NgramMemoryParams:
    """The memory layer's small dense weights (they live with the model's weights, not the table)."""

    key_proj: Any  # [D, E]
    value_proj: Any  # [D, E]
    key_norm: Any  # [D]
    query_norm: Any  # [D]


def ngram_memory(p: NgramMemoryParams, x: jax.Array, rows: jax.Array, cfg: ModelConfig) -> jax.Array:
    """x [b, t, d] plus the gated memory read of rows [b, t, h, w] (any float dtype)."""
    b, t, h, w = rows.shape
    e = rows.reshape(b, t, h * w).astype(x.dtype)
    eps, zc = cfg.rms_norm_eps, cfg.zero_centered_norm
    k = rms_norm(matmul(e, p.key_proj), p.key_norm, eps, zc)
    q = rms_norm(x, p.query_norm, eps, zc)
    score = jnp.sum(k.astype(jnp.float32) * q.astype(jnp.float32), axis=-1) / math.sqrt(x.shape[-1])
    score = jnp.sign(score) * jnp.sqrt(jnp.maximum(jnp.abs(score), 1e-6))
    gate = jax.nn.sigmoid(score)[..., None]
    v = matmul(e, p.value_proj)
    return x + (gate * v.astype(jnp.float32)).astype(x.dtype)
