"""Recurrent-state rollback without recompute, and what it costs in memory.

The verify forward runs with `keep_states=True`: every Gated DeltaNet layer returns its conv and
recurrent state after each window position (conv [b, w, C, K-1], recurrent [b, w, Hv, Dk, Dv]).
Once the acceptance is known, `keep_accepted_states` takes, per row, the state after the last
committed window position (index = accepted drafts: the pending token plus the accepted drafts are
committed) and that is what is scattered back to the row's state slot. A rejected draft therefore
leaves no trace in the recurrent state, and nothing is recomputed.

Attention KV needs no rollback: the window wrote keys/values at positions P .. P+n, the committed
length becomes P + accepted + 1, and a later token at position p writes slot p before any query
at p or beyond reads it (queries see positions <= their own). Stale entries past the committed
length are simply overwritten.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from infernix_jax.cache.sequence import GDNState, SequenceCache
from infernix_jax.config import ModelConfig


def keep_accepted_states(cache: SequenceCache, index: jax.Array) -> SequenceCache:
    """Per-position GDN states -> the state at `index` [b] (window position) of each row."""

    def pick(entry):
        if not isinstance(entry, GDNState):
            return entry
        take = lambda x: jnp.take_along_axis(x, index.reshape((-1,) + (1,) * (x.ndim - 1)), axis=1)[:, 0]
        return GDNState(conv=take(entry.conv), recurrent=take(entry.recurrent))

    return SequenceCache(layers=tuple(pick(e) for e in cache.layers), mtp=cache.mtp)


def verify_state_bytes(cfg: ModelConfig, batch: int, window: int, dtype: Any = jnp.bfloat16) -> int:
    """Transient device bytes of the per-position states one verify program holds: for every
    linear-attention layer, batch x window copies of the conv state (model dtype) and of the
    float32 recurrent state. (Qwen3.5-27B shape, 48 GDN layers: 147 MiB per row and position.)"""
    conv = cfg.linear_conv_dim * (cfg.linear_conv_kernel - 1) * jnp.dtype(dtype).itemsize
    recurrent = cfg.linear_num_v_heads * cfg.linear_k_head_dim * cfg.linear_v_head_dim * 4
    return len(cfg.linear_attention_layers) * batch * window * (conv + recurrent)
