"""SwiGLU MLP and the mixture-of-experts block (softmax router, top-k, optional shared expert)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from infernix_jax.config import ModelConfig
from infernix_jax.model.params import MLPParams, MoEParams
from infernix_jax.weights.quant import dequantize, matmul, take

# With few (token, expert) pairs, gather each pair's expert weights: it reads only the chosen experts
# (the decode case). Once the pairs would read more than half of all experts, sort the pairs by
# expert and run a grouped matmul, which reads every expert once.
GATHER_MIN_PAIRS = 64


def mlp(p: MLPParams, x: jax.Array) -> jax.Array:
    return matmul(jax.nn.silu(matmul(x, p.gate_proj)) * matmul(x, p.up_proj), p.down_proj)


def route(router: jax.Array, x: jax.Array, top_k: int, renormalize: bool) -> tuple[jax.Array, jax.Array]:
    """Softmax router in fp32 -> (weights [N, k] in x's dtype, expert ids [N, k])."""
    logits = matmul(x, router).astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, ids = jax.lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights.astype(x.dtype), ids


def _experts_gathered(p: MoEParams, x: jax.Array, ids: jax.Array) -> jax.Array:
    """x [N, D], ids [N, k] -> per-pair expert outputs [N, k, D], reading only chosen experts
    (quantized experts: only their packed bytes, unpacked after the gather)."""
    gate = dequantize(take(p.gate_proj, ids), x.dtype)  # [N, k, I, D]
    up = dequantize(take(p.up_proj, ids), x.dtype)
    down = dequantize(take(p.down_proj, ids), x.dtype)  # [N, k, D, I]
    h = jax.nn.silu(jnp.einsum("nd,nkid->nki", x, gate)) * jnp.einsum("nd,nkid->nki", x, up)
    return jnp.einsum("nki,nkdi->nkd", h, down)


def _experts_grouped(p: MoEParams, x: jax.Array, ids: jax.Array, num_experts: int) -> jax.Array:
    """Sort (token, expert) pairs by expert and run one grouped matmul per projection."""
    n, k = ids.shape
    flat_ids = ids.reshape(-1)
    order = jnp.argsort(flat_ids, stable=True)
    token_of_pair = order // k
    xs = jnp.take(x, token_of_pair, axis=0)  # [N*k, D] grouped by expert
    group_sizes = jnp.bincount(flat_ids, length=num_experts).astype(jnp.int32)
    # every expert is read once here (prefill): quantized stacks are unpacked to x's dtype first
    gate_t = jnp.swapaxes(dequantize(p.gate_proj, x.dtype), 1, 2)  # [E, D, I]
    up_t = jnp.swapaxes(dequantize(p.up_proj, x.dtype), 1, 2)
    down_t = jnp.swapaxes(dequantize(p.down_proj, x.dtype), 1, 2)  # [E, I, D]
    h = jax.nn.silu(jax.lax.ragged_dot(xs, gate_t, group_sizes)) * jax.lax.ragged_dot(xs, up_t, group_sizes)
    ys = jax.lax.ragged_dot(h, down_t, group_sizes)  # [N*k, D] in sorted order
    out = jnp.zeros_like(ys).at[order].set(ys)  # back to (token, slot) order
    return out.reshape(n, k, -1)


def moe(p: MoEParams, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """x [..., D] -> [..., D]: sum_k w_k E_k(x) + sigmoid(shared_gate(x)) * shared(x)."""
    shape = x.shape
    xf = x.reshape(-1, shape[-1])
    weights, ids = route(p.router, xf, cfg.num_experts_per_tok, cfg.norm_topk_prob)
    if ids.size <= max(GATHER_MIN_PAIRS, cfg.num_experts // 2):
        per_pair = _experts_gathered(p, xf, ids)
    else:
        per_pair = _experts_grouped(p, xf, ids, cfg.num_experts)
    out = jnp.einsum("nk,nkd->nd", weights, per_pair)
    if p.shared is not None:
        gate = jax.nn.sigmoid(matmul(xf, p.shared_gate))
        out = out + gate * mlp(p.shared, xf)
    return out.reshape(shape)
