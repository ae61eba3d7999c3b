"""Gated full attention: q/k RMSNorm per head, partial RoPE, GQA, optional sigmoid output gate.

Tree-shaped verify windows (speculative decoding, `tree_parents`): node i of a row's window sits
at RoPE position start + depth(i) but its key/value is stored at slot start + i (siblings share a
depth, so positions cannot address them), and it attends to every slot before the window and to
its own ancestors (itself included) only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from infernix_jax.config import ModelConfig
from infernix_jax.model.norm import rms_norm
from infernix_jax.model.params import AttentionParams
from infernix_jax.model.rope import apply_rope, rope_cos_sin
from infernix_jax.weights.quant import NormSource, matmul, matmuls


def _linear(x: jax.Array, w, bias) -> jax.Array:
    y = matmul(x, w)
    return y if bias is None else y + bias.astype(y.dtype)


def tree_ancestors(parents: jax.Array) -> jax.Array:
    """bool [B, T, T]: entry [b, i, j] says window node j is node i or one of its ancestors.

    parents i32 [B, T]: each node's parent index within the window (< its own index; -1 for the root).
    """
    b, t = parents.shape
    rows = jnp.arange(b)[:, None]
    node = jnp.broadcast_to(jnp.arange(t)[None, :], (b, t))
    seen = jnp.zeros((b, t, t), bool)
    for _ in range(t):  # a path is at most t nodes long
        seen = seen | (jax.nn.one_hot(node, t, dtype=jnp.int32) > 0)  # node -1 hits nothing
        node = jnp.where(node >= 0, parents[rows, jnp.maximum(node, 0)], -1)
    return seen


def tree_slots(positions: jax.Array) -> jax.Array:
    """i32 [B, T]: the KV slot of each window node, start + node index (-1 on padding)."""
    start = positions[:, :1]
    return jnp.where(positions >= 0, start + jnp.arange(positions.shape[1])[None, :], -1)


def _cached_kv(kv, dtype) -> tuple[jax.Array, jax.Array]:
    """A cache view's keys and values laid out by slot: ([B, S, K, Dh], same)."""
    if hasattr(kv, "gather"):  # paged
        return kv.gather(dtype)
    return kv.k.astype(dtype), kv.v.astype(dtype)


def tree_attend(kv, q: jax.Array, positions: jax.Array, parents: jax.Array, scale: float) -> jax.Array:
    """GQA attention of window nodes q [B, T, H, Dh] over the slots before the window and their own
    ancestors' slots (see tree_slots) -> [B, T, H, Dh]. Same float32 softmax as the causal attend."""
    b, t, h, dh = q.shape
    keys, values = _cached_kv(kv, q.dtype)
    kv_heads = keys.shape[2]
    qg = q.reshape(b, t, kv_heads, h // kv_heads, dh)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, keys, preferred_element_type=jnp.float32) * scale
    start = positions[:, :1, None]  # [B, 1, 1]
    slot = jnp.arange(keys.shape[1])[None, None, :]
    index = slot - start  # window node index of each slot
    in_window = (index >= 0) & (index < t)
    ancestor = jnp.take_along_axis(
        tree_ancestors(parents), jnp.clip(index, 0, t - 1).astype(jnp.int32).repeat(t, axis=1), axis=2
    )  # [B, T, S]
    visible = ((slot < start) | (in_window & ancestor)) & (positions[:, :, None] >= 0)
    scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    probs = jnp.where(jnp.isnan(probs), 0.0, probs)  # padding rows see nothing
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(q.dtype), values)
    return out.reshape(b, t, h, dh)


def attention(
    p: AttentionParams,
    x: jax.Array,
    positions: jax.Array,
    kv,
    cfg: ModelConfig,
    tree_parents: jax.Array | None = None,
    norm: NormSource | None = None,
):
    """x [B, T, D] at positions [B, T] (-1 = padding) -> (out [B, T, D], kv with this step's keys written).

    `kv` is any cache view with `write(k, v, positions)` and `attend(q, positions, scale)`.
    tree_parents i32 [B, T] (a tree-shaped verify window, see the module docstring): positions are
    start + depth, keys go to slots start + node index, and each node sees only its ancestors.
    norm: x is that RMSNorm's output (the layer's input norm; `weights.quant.NormSource`).
    """
    b, t, _ = x.shape
    h, hk, dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    q, k, v = (  # one launch where the weights allow it (`matmuls`)
        y if bias is None else y + bias.astype(y.dtype)
        for y, bias in zip(
            matmuls(x, (p.q_proj, p.k_proj, p.v_proj), norm), (p.q_bias, p.k_bias, p.v_bias), strict=True
        )
    )
    if cfg.attn_output_gate:
        q = q.reshape(b, t, h, 2 * dh)
        q, gate = q[..., :dh], q[..., dh:]
        gate = gate.reshape(b, t, h * dh)
    else:
        q = q.reshape(b, t, h, dh)
        gate = None
    k = k.reshape(b, t, hk, dh)
    v = v.reshape(b, t, hk, dh)
    q = rms_norm(q, p.q_norm, cfg.rms_norm_eps, cfg.zero_centered_norm)
    k = rms_norm(k, p.k_norm, cfg.rms_norm_eps, cfg.zero_centered_norm)
    cos, sin = rope_cos_sin(cfg.rope, positions)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if tree_parents is None:
        kv = kv.write(k, v, positions)
        out = kv.attend(q, positions, dh**-0.5).reshape(b, t, h * dh)
    else:
        kv = kv.write(k, v, tree_slots(positions))
        out = tree_attend(kv, q, positions, tree_parents, dh**-0.5).reshape(b, t, h * dh)
    if gate is not None:
        out = out * jax.nn.sigmoid(gate)
    return _linear(out, p.o_proj, p.o_bias), kv
