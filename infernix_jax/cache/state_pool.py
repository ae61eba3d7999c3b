"""State slots of the linear-attention (Gated DeltaNet) layers: one slot per running sequence.

A slot holds, for every linear-attention layer, the conv state [C, K-1] (the last raw inputs of
the causal conv, model dtype) and the recurrent delta-rule state [Hv, Dk, Dv] (float32). Unlike
KV it is not append-only: each step overwrites the whole slot. Slot 0 is the scratch slot of
padding rows (see allocators.py): it reads as zeros and writes to it are dropped.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from infernix_jax.cache.allocators import SCRATCH_SLOT
from infernix_jax.cache.kv_pool import _pytree
from infernix_jax.cache.sequence import GDNState
from infernix_jax.config import ModelConfig


@_pytree
class StatePool:
    """GDNState per linear-attention layer (in `cfg.linear_attention_layers` order), slots leading."""

    layers: tuple[GDNState, ...]  # conv [S, C, K-1], recurrent [S, Hv, Dk, Dv] float32

    @property
    def num_slots(self) -> int:
        return self.layers[0].conv.shape[0] if self.layers else 0


def create_state_pool(cfg: ModelConfig, num_slots: int, dtype: Any = jnp.bfloat16) -> StatePool:
    """An all-zero pool of `num_slots` slots (the scratch slot included); conv states in `dtype`."""
    conv_shape = (num_slots, cfg.linear_conv_dim, cfg.linear_conv_kernel - 1)
    rec_shape = (num_slots, cfg.linear_num_v_heads, cfg.linear_k_head_dim, cfg.linear_v_head_dim)
    return StatePool(
        layers=tuple(
            GDNState(conv=jnp.zeros(conv_shape, dtype), recurrent=jnp.zeros(rec_shape, jnp.float32))
            for _ in cfg.linear_attention_layers
        )
    )


def state_bytes_per_slot(cfg: ModelConfig, dtype: Any = jnp.bfloat16) -> int:
    """Device bytes of one slot across all linear-attention layers."""
    conv = cfg.linear_conv_dim * (cfg.linear_conv_kernel - 1) * jnp.dtype(dtype).itemsize
    recurrent = cfg.linear_num_v_heads * cfg.linear_k_head_dim * cfg.linear_v_head_dim * 4
    return len(cfg.linear_attention_layers) * (conv + recurrent)


def gather_states(layer: GDNState, slots: jax.Array) -> GDNState:
    """The states of `slots` [B] as a batch: conv [B, C, K-1], recurrent [B, Hv, Dk, Dv]."""
    return GDNState(conv=layer.conv[slots], recurrent=layer.recurrent[slots])


def scatter_states(layer: GDNState, slots: jax.Array, states: GDNState) -> GDNState:
    """Write a batch of states back to `slots` [B]; rows aimed at the scratch slot are dropped."""
    num_slots = layer.conv.shape[0]
    target = jnp.where(slots == SCRATCH_SLOT, num_slots, slots)  # out of range -> dropped
    return GDNState(
        conv=layer.conv.at[target].set(states.conv.astype(layer.conv.dtype), mode="drop"),
        recurrent=layer.recurrent.at[target].set(states.recurrent.astype(layer.recurrent.dtype), mode="drop"),
    )


def scatter_snapshots(pool: StatePool, snapshots: tuple[GDNState, ...], slots: jax.Array) -> StatePool:
    """Write snapshots (per layer: conv [B, S, ...], recurrent [B, S, ...]) to `slots` [B, S];
    entries aimed at the scratch slot are dropped."""
    layers = []
    for layer, snap in zip(pool.layers, snapshots):
        for j in range(slots.shape[1]):
            layer = scatter_states(
                layer, slots[:, j], GDNState(conv=snap.conv[:, j], recurrent=snap.recurrent[:, j])
            )
        layers.append(layer)
    return StatePool(layers=tuple(layers))
