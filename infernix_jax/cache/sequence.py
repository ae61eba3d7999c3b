"""A per-sequence cache: contiguous KV for full-attention layers, GDN state for linear layers.

This is the simplest cache view the forward accepts (research scripts, perplexity, parity tests);
the engine's paged pool implements the same two methods (`write`, `attend`) over 64-token blocks.
Slot s of a sequence's contiguous KV holds the token at position s, so a query at position p sees
slots 0..p; padding tokens carry position -1 and are never written.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from infernix_jax.config import FULL_ATTENTION, ModelConfig


def _pytree(cls):
    return jax.tree_util.register_dataclass(dataclass(cls))


@_pytree
class ContiguousKV:
    """KV of one full-attention layer for B sequences of up to S tokens."""

    k: jax.Array  # [B, S, K, Dh]
    v: jax.Array  # [B, S, K, Dh]

    @property
    def capacity(self) -> int:
        return self.k.shape[1]

    def write(self, k: jax.Array, v: jax.Array, positions: jax.Array) -> ContiguousKV:
        """Store k, v [B, T, K, Dh] at their positions [B, T]; positions < 0 (padding) are dropped."""
        b, t = positions.shape
        slots = jnp.where(positions >= 0, positions, self.capacity)  # out of range -> dropped
        rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, t))
        new_k = self.k.at[rows, slots].set(k.astype(self.k.dtype), mode="drop")
        new_v = self.v.at[rows, slots].set(v.astype(self.v.dtype), mode="drop")
        return ContiguousKV(new_k, new_v)

    def attend(self, q: jax.Array, positions: jax.Array, scale: float) -> jax.Array:
        """Causal GQA attention of q [B, T, H, Dh] over the cached keys; returns [B, T, H, Dh]."""
        b, t, h, dh = q.shape
        kv_heads = self.k.shape[2]
        qg = q.reshape(b, t, kv_heads, h // kv_heads, dh)
        scores = (
            jnp.einsum("btkgd,bskd->bkgts", qg, self.k.astype(q.dtype), preferred_element_type=jnp.float32)
            * scale
        )
        slots = jnp.arange(self.capacity)
        visible = slots[None, None, :] <= positions[:, :, None]  # [B, T, S]
        scores = jnp.where(visible[:, None, None], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1)
        probs = jnp.where(jnp.isnan(probs), 0.0, probs)  # padding rows see nothing
        out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(q.dtype), self.v.astype(q.dtype))
        return out.reshape(b, t, h, dh)


@_pytree
class GDNState:
    """Recurrent state of one Gated DeltaNet layer for B sequences."""

    conv: jax.Array  # [B, conv_dim, kernel - 1]: the last raw (pre-conv) inputs
    recurrent: jax.Array  # [B, Hv, Dk, Dv] float32


@_pytree
class SequenceCache:
    """One entry per decoder layer (ContiguousKV or GDNState), plus the MTP layers' KV.

    `snapshots` is filled by a forward asked for recurrent-state snapshots: one GDNState per
    linear-attention layer with a snapshot axis after the batch axis (see model.forward).
    """

    layers: tuple[Any, ...]
    mtp: tuple[ContiguousKV, ...] = ()
    snapshots: tuple[GDNState, ...] = ()


def init_cache(
    cfg: ModelConfig, batch: int, max_len: int, dtype=jnp.float32, with_mtp: bool = False
) -> SequenceCache:
    """An empty cache for `batch` sequences of up to `max_len` tokens each."""

    def kv() -> ContiguousKV:
        shape = (batch, max_len, cfg.num_kv_heads, cfg.head_dim)
        return ContiguousKV(jnp.zeros(shape, dtype), jnp.zeros(shape, dtype))

    layers = []
    for kind in cfg.layer_types:
        if kind == FULL_ATTENTION:
            layers.append(kv())
        else:
            layers.append(
                GDNState(
                    conv=jnp.zeros((batch, cfg.linear_conv_dim, cfg.linear_conv_kernel - 1), dtype),
                    recurrent=jnp.zeros(
                        (batch, cfg.linear_num_v_heads, cfg.linear_k_head_dim, cfg.linear_v_head_dim),
                        jnp.float32,
                    ),
                )
            )
    mtp = tuple(kv() for _ in range(cfg.mtp_num_layers)) if with_mtp else ()
    return SequenceCache(layers=tuple(layers), mtp=mtp)
