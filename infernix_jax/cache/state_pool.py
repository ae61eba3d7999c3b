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
    """Write a batch of states back to `slots` [B]; rows aimed at the scratch slot write zeros
    there, so it still reads zeros (dropping them instead, as an out-of-range index, costs a GPU
    launch of its own a layer: the index's check before the update). A part of `states` that is
    None (conv or recurrent) leaves that pool as it is."""
    scratch = slots == SCRATCH_SLOT

    def put(pool, x):
        if x is None:
            return pool
        x = jnp.where(scratch.reshape((-1,) + (1,) * (x.ndim - 1)), 0, x).astype(pool.dtype)
        if x.shape[0] == 1:
            return jax.lax.dynamic_update_slice(pool, x, (slots[0],) + (0,) * (x.ndim - 1))
        return pool.at[slots].set(x, mode="promise_in_bounds")

    return GDNState(conv=put(layer.conv, states.conv), recurrent=put(layer.recurrent, states.recurrent))


@_pytree
class SlottedGDNState:
    """One linear-attention layer's state for B rows, read and written through their slots (what
    PagedKV is to the KV pool): the pool arrays themselves and the rows' slots, so that the decode
    recurrence can update the rows' states in place (`recurrent_update`) instead of gathering them
    out and scattering them back. Other paths take `gather()` and hand the result to `commit`."""

    conv_pool: jax.Array  # [S, C, K-1]
    recurrent_pool: jax.Array  # [S, Hv, Dk, Dv] float32
    slots: jax.Array  # [B] int32; padding rows hold SCRATCH_SLOT

    def gather(self) -> GDNState:
        """The rows' states as a batch (conv [B, C, K-1], recurrent [B, Hv, Dk, Dv])."""
        return gather_states(self.pools(), self.slots)

    def commit(self, states: GDNState) -> SlottedGDNState:
        """The rows' new states (a batch) written to their slots; scratch-slot rows dropped."""
        pools = scatter_states(self.pools(), self.slots, states)
        return SlottedGDNState(pools.conv, pools.recurrent, self.slots)

    def pools(self) -> GDNState:
        """The storage without the slots (what goes back into the StatePool)."""
        return GDNState(conv=self.conv_pool, recurrent=self.recurrent_pool)

    def recurrent_update(
        self,
        raw: jax.Array,
        b_in: jax.Array,
        a_in: jax.Array,
        params: tuple[jax.Array, jax.Array, jax.Array],
        fresh: jax.Array,
        n_valid: jax.Array,
        *,
        key_heads: int,
        interpret: bool = False,
        columns: tuple[int, int, int] | None = None,
    ) -> tuple[jax.Array, SlottedGDNState]:
        """The layer's causal conv, gates and gated delta recurrence over a window in one kernel
        (pallas_kernels/gated_delta.py): (out [B, T, Hv, Dv] in raw's dtype, the updated view).
        The rows' recurrent states are read from and written back to their slots in place; their
        conv states are read from their slots and scattered back after the kernel (in place they
        would race, see the kernel). raw [B, T, C] is the input projection's q | k | v before the conv, b_in / a_in [B, T, Hv] the
        b / a projections, params (conv_weight [C, W], A_log [Hv], dt_bias [Hv]), fresh [B] bool
        (start from zeros), n_valid [B] (the row's real tokens; the rest are padding). columns: raw,
        b_in and a_in are one array holding the three from these columns (`matmuls_joined`)."""
        from pallas_kernels import gated_delta  # the cache package imports Pallas only when asked

        conv_weight, a_log, dt_bias = params
        out, new_conv, recurrent = gated_delta.gated_delta_conv_decode_call(
            raw, b_in, a_in, conv_weight, a_log, dt_bias, self.conv_pool, self.recurrent_pool, self.slots, fresh,
            n_valid, key_heads=key_heads, drop_slot=SCRATCH_SLOT, interpret=interpret, columns=columns,
        )  # fmt: skip
        conv = scatter_states(self.pools(), self.slots, GDNState(new_conv, None)).conv
        return out, SlottedGDNState(conv, recurrent, self.slots)


def slotted_states(layer: GDNState, slots: jax.Array) -> SlottedGDNState:
    """A pool layer seen through the rows' `slots` [B]."""
    return SlottedGDNState(conv_pool=layer.conv, recurrent_pool=layer.recurrent, slots=slots)


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
