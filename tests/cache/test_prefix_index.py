"""The prefix cache's host logic: keys, longest-hit lookup, LRU eviction to the host tier and back.

A fake device stands in for the engine's pools (numpy rows), so these tests need no model.
"""

from __future__ import annotations

import numpy as np

from infernix_jax.cache.allocators import BLOCK_SIZE, BlockAllocator
from infernix_jax.cache.prefix_cache import PrefixCache
from infernix_jax.cache.prefix_index import PrefixIndex, cache_salt


class FakeDevice:
    """KV blocks and state slots as numpy rows: a block's 'KV' is its id, so copies are visible."""

    def __init__(self, num_blocks: int, num_slots: int):
        self.kv = np.arange(num_blocks, dtype=np.float32)[:, None].repeat(4, 1)
        self.state = np.zeros((num_slots, 3), np.float32)

    def copy_blocks(self, src, dst):
        self.kv[list(dst)] = self.kv[list(src)]

    def read_blocks(self, ids):
        return [(self.kv[i].copy(),) for i in ids]

    def write_blocks(self, ids, data):
        for i, (row,) in zip(ids, data):
            self.kv[i] = row

    def copy_states(self, src, dst):
        self.state[list(dst)] = self.state[list(src)]

    def read_states(self, slots):
        return [(self.state[s].copy(),) for s in slots]

    def write_states(self, slots, data):
        for s, (row,) in zip(slots, data):
            self.state[s] = row

    def to_host(self, data):
        return tuple(np.array(a) for a in data)


def make(stateful=True, num_blocks=9, host_bytes=1 << 20):
    blocks = BlockAllocator(num_blocks)
    device = FakeDevice(num_blocks, 8)
    cache = PrefixCache(PrefixIndex(cache_salt("model"), stateful), blocks, device, range(4, 8), host_bytes)
    return cache, blocks, device


def tokens(n, seed=0):
    return np.random.default_rng(seed).integers(0, 1000, n).tolist()


def finish(cache, blocks, device, toks, slot=1, marker=1.0):
    """A request that computed `toks` in fresh blocks stops: it is cached, then releases its blocks."""
    owned = blocks.allocate(-(-len(toks) // BLOCK_SIZE))
    device.state[slot] = marker
    cache.snapshot_request(toks, len(toks), slot, owned)
    blocks.free(owned)
    return owned


def test_keys_depend_on_the_salt_and_on_every_earlier_block():
    a, b = PrefixIndex(cache_salt("m", "bf16"), True), PrefixIndex(cache_salt("m", "int8"), True)
    t = tokens(192)
    assert a.chain_keys(t, 3) != b.chain_keys(t, 3)
    changed = [t[0] + 1] + t[1:]
    assert a.chain_keys(t, 3)[2] != a.chain_keys(changed, 3)[2]


def test_a_hit_needs_a_snapshot_on_a_hybrid_model_and_leaves_one_token():
    cache, blocks, device = make()
    t = tokens(150)
    finish(cache, blocks, device, t, marker=7.0)
    assert cache.match(t).length == 0, "the whole prompt is cached, but one token must be fed"
    longer = cache.match(t + [5, 6])
    assert longer.length == 150 and len(longer.blocks) == 2
    assert cache.match(t[:149] + [999, 1]).length == 0, "no snapshot inside the diverging tail"
    slot = 2
    owned = cache.acquire(longer, slot)
    assert device.state[slot, 0] == 7.0, "the snapshot's state was restored into the request's slot"
    assert len(owned) == 3 and owned[:2] == [b.gpu for b in longer.blocks]
    assert device.kv[owned[2], 0] == device.kv[longer.snapshot.tail_gpu, 0], "the tail block is a private copy"
    assert owned[2] != longer.snapshot.tail_gpu


def test_a_dense_model_hits_on_any_cached_block_boundary():
    cache, blocks, device = make(stateful=False)
    t = tokens(200)
    finish(cache, blocks, device, t[:130])
    assert cache.match(t).length == 130  # the snapshot tail (2 tokens past the second block)
    assert cache.match(t[:129] + [1, 2, 3]).length == 128  # a block boundary needs no snapshot


def test_eviction_frees_least_recently_used_blocks_only_and_keeps_them_on_the_host():
    cache, blocks, device = make(num_blocks=9)
    old, new = tokens(128, 1), tokens(128, 2)
    finish(cache, blocks, device, old, marker=1.0)
    finish(cache, blocks, device, new, marker=2.0)
    in_use = cache.acquire(cache.match(new + [1]), 3)  # a request holds `new`'s blocks
    free_before = blocks.num_free
    assert cache.evictable_blocks() == 2  # old's two blocks; new's are in use
    assert cache.evict_blocks(8) == 2
    assert blocks.num_free == free_before + 2
    assert all(blocks.refcount(b) >= 1 for b in in_use), "blocks in use are never freed"
    hit = cache.match(old + [1])
    assert hit.length == 128 and all(e.gpu is None and e.host is not None for e in hit.blocks)
    restored = cache.acquire(hit, 4)
    assert [device.kv[b, 0] for b in restored] == [e.host[0][0] for e in hit.blocks], "uploaded back"
    assert cache.stats.hit_tokens_by_tier["host"] == 128


def test_without_host_room_evicted_entries_and_their_descendants_are_dropped():
    cache, blocks, device = make(host_bytes=1)
    t = tokens(200, 3)
    finish(cache, blocks, device, t)
    assert cache.evict_blocks(1) >= 1  # the last block goes first, and the snapshot after it with it
    assert cache.match(t + [1]).length == 0 and len(cache.index.blocks) == 2
    first = cache.index.blocks[cache.index.chain_keys(t, 1)[0]]
    cache._demote_block(first)  # dropping the first block drops everything chained after it
    assert not cache.index.blocks and not list(cache.index.all_snapshots())
    assert blocks.num_free == blocks.num_total


def test_a_lookup_reports_where_the_prompt_leaves_the_cached_prefixes():
    cache, blocks, device = make()
    system = tokens(100, 4)
    first = system + tokens(60, 5)
    finish(cache, blocks, device, first)
    other = system + tokens(70, 6)
    found = cache.match(other)
    assert found.length == 0, "no snapshot inside the shared system prompt yet"
    assert found.shared == 100, "one full block and 36 tokens of the next are the first prompt's"
    assert cache.match(first[:130] + [1, 2]).shared == 130  # past the indexed blocks, inside the tail
    assert cache.match(tokens(80, 7)).shared == 0
