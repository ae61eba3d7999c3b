"""Gated full attention: q/k RMSNorm per head, partial RoPE, GQA, optional sigmoid output gate."""

from __future__ import annotations

import jax

from infernix_jax.config import ModelConfig
from infernix_jax.model.norm import rms_norm
from infernix_jax.model.params import AttentionParams
from infernix_jax.model.rope import apply_rope, rope_cos_sin
from infernix_jax.weights.quant import matmul


def _linear(x: jax.Array, w, bias) -> jax.Array:
    y = matmul(x, w)
    return y if bias is None else y + bias.astype(y.dtype)


def attention(p: AttentionParams, x: jax.Array, positions: jax.Array, kv, cfg: ModelConfig):
    """x [B, T, D] at positions [B, T] (-1 = padding) -> (out [B, T, D], kv with this step's keys written).

    `kv` is any cache view with `write(k, v, positions)` and `attend(q, positions, scale)`.
    """
    b, t, _ = x.shape
    h, hk, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q = _linear(x, p.q_proj, p.q_bias)
    if cfg.attn_output_gate:
        q = q.reshape(b, t, h, 2 * dh)
        q, gate = q[..., :dh], q[..., dh:]
        gate = gate.reshape(b, t, h * dh)
    else:
        q = q.reshape(b, t, h, dh)
        gate = None
    k = _linear(x, p.k_proj, p.k_bias).reshape(b, t, hk, dh)
    v = _linear(x, p.v_proj, p.v_bias).reshape(b, t, hk, dh)
    q = rms_norm(q, p.q_norm, cfg.rms_norm_eps, cfg.zero_centered_norm)
    k = rms_norm(k, p.k_norm, cfg.rms_norm_eps, cfg.zero_centered_norm)
    cos, sin = rope_cos_sin(cfg.rope, positions)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    kv = kv.write(k, v, positions)
    out = kv.attend(q, positions, dh**-0.5).reshape(b, t, h * dh)
    if gate is not None:
        out = out * jax.nn.sigmoid(gate)
    return _linear(out, p.o_proj, p.o_bias), kv
