"""The bridge between the engine's pools and the forward: pure functions called inside a jitted step.

    cache = cache_view(kv_pool, state_pool, block_table, slots, cfg)
    logits, hidden, cache = forward(params, tokens, positions, cache, cfg)
    kv_pool, state_pool = commit_view(kv_pool, state_pool, cache, slots, cfg)

With the pools donated to the step, XLA updates pages and slots in place. Padding rows use a
block-table row of NULL_BLOCK and slot SCRATCH_SLOT: they read zeros and none of their writes land.
"""

from __future__ import annotations

import jax

from infernix_jax.cache.kv_pool import KVPool, PagedKV
from infernix_jax.cache.sequence import GDNState, SequenceCache
from infernix_jax.cache.state_pool import (
    SlottedGDNState,
    StatePool,
    gather_states,
    scatter_states,
    slotted_states,
)
from infernix_jax.config import FULL_ATTENTION, ModelConfig


def cache_view(
    kv_pool: KVPool,
    state_pool: StatePool,
    block_table: jax.Array,
    slots: jax.Array,
    cfg: ModelConfig,
    slotted: bool = False,
) -> SequenceCache:
    """The SequenceCache of B rows: PagedKV over `block_table` [B, M] int32 for attention layers
    (and MTP layers when the pool has them), GDNState gathered from `slots` [B] int32 for linear layers.

    slotted: linear layers get a SlottedGDNState instead (the pool seen through the slots), which
    the decode recurrence updates in place; for programs that commit the forward's final states
    (not those keeping a state per position, speculative verification)."""
    kv_layers, state_layers = iter(kv_pool.layers), iter(state_pool.layers)
    layers = []
    for kind in cfg.layer_types:
        if kind == FULL_ATTENTION:
            layers.append(next(kv_layers).view(block_table))
        else:
            layer = next(state_layers)
            layers.append(slotted_states(layer, slots) if slotted else gather_states(layer, slots))
    mtp = tuple(pages.view(block_table) for pages in kv_pool.mtp)
    return SequenceCache(layers=tuple(layers), mtp=mtp)


def commit_view(
    kv_pool: KVPool, state_pool: StatePool, cache: SequenceCache, slots: jax.Array, cfg: ModelConfig
) -> tuple[KVPool, StatePool]:
    """Take the pages back from the PagedKV entries and scatter the rows' states to their slots."""
    kv_layers, state_layers = [], []
    for kind, entry in zip(cfg.layer_types, cache.layers):
        if kind == FULL_ATTENTION:
            if not isinstance(entry, PagedKV):
                raise TypeError(f"attention layer entry is {type(entry).__name__}, expected PagedKV")
            kv_layers.append(entry.pages())
        else:
            if isinstance(entry, SlottedGDNState):
                state_layers.append(entry.pools())
                continue
            if not isinstance(entry, GDNState):
                raise TypeError(f"linear layer entry is {type(entry).__name__}, expected GDNState")
            state_layers.append(scatter_states(state_pool.layers[len(state_layers)], slots, entry))
    mtp = tuple(entry.pages() for entry in cache.mtp) if kv_pool.mtp else ()
    return KVPool(layers=tuple(kv_layers), mtp=mtp), StatePool(layers=tuple(state_layers))
