"""Device memory of the engine: the paged KV pool, GDN state slots, their allocators and capacity plan.

The forward only sees a `SequenceCache`; `cache_view` builds one over the pools for a batch
(block tables + slots) and `commit_view` puts the updated pages and states back. Details and
formats: docs/kv_cache.md.
"""

from infernix_jax.cache.allocators import (
    BLOCK_SIZE,
    NULL_BLOCK,
    SCRATCH_SLOT,
    BlockAllocator,
    OutOfBlocks,
    OutOfSlots,
    SlotAllocator,
)
from infernix_jax.cache.capacity import CapacityError, CapacityPlan, parse_bytes, plan_capacity
from infernix_jax.cache.kv_formats import KV_FORMATS, KVFormat, get_kv_format
from infernix_jax.cache.kv_pool import KVPages, KVPool, PagedKV, create_kv_pool, kv_bytes_per_block
from infernix_jax.cache.sequence import ContiguousKV, GDNState, SequenceCache, init_cache
from infernix_jax.cache.state_pool import (
    SlottedGDNState,
    StatePool,
    create_state_pool,
    scatter_snapshots,
    state_bytes_per_slot,
)
from infernix_jax.cache.view import cache_view, commit_view

__all__ = [
    "BLOCK_SIZE",
    "KV_FORMATS",
    "NULL_BLOCK",
    "SCRATCH_SLOT",
    "BlockAllocator",
    "CapacityError",
    "CapacityPlan",
    "ContiguousKV",
    "GDNState",
    "KVFormat",
    "KVPages",
    "KVPool",
    "OutOfBlocks",
    "OutOfSlots",
    "PagedKV",
    "SequenceCache",
    "SlotAllocator",
    "SlottedGDNState",
    "StatePool",
    "cache_view",
    "commit_view",
    "create_kv_pool",
    "create_state_pool",
    "get_kv_format",
    "init_cache",
    "kv_bytes_per_block",
    "parse_bytes",
    "plan_capacity",
    "scatter_snapshots",
    "state_bytes_per_slot",
]
