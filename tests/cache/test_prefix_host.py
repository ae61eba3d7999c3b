"""The prefix cache's host tier memory: pinned host arrays where the backend has them, else numpy.

Entries evicted to either kind come back unchanged, through an upload and through the cache file.
The fake device of test_prefix_index keeps its rows in numpy; here its copies to and from the host
go through `HostMemory`, as the engine's runner's do.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infernix_jax.cache.allocators import BlockAllocator
from infernix_jax.cache.prefix_cache import PrefixCache
from infernix_jax.cache.prefix_file import load_prefix_file, save_prefix_file
from infernix_jax.cache.prefix_host import PINNED_HOST, HostMemory, memory_kinds
from infernix_jax.cache.prefix_index import PrefixIndex, cache_salt
from tests.cache.test_prefix_index import FakeDevice, finish, tokens

DEVICE = jax.devices()[0]
KINDS = [PINNED_HOST, "numpy"] if PINNED_HOST in memory_kinds(DEVICE) else ["numpy"]


def assert_in(memory: HostMemory, data) -> None:
    for a in data:
        if memory.pinned:
            assert isinstance(a, jax.Array) and a.sharding.memory_kind == PINNED_HOST
        else:
            assert isinstance(a, np.ndarray)


class HostTierDevice(FakeDevice):
    """The fake device, its host copies made by `memory` (pinned jax arrays or numpy)."""

    def __init__(self, num_blocks: int, num_slots: int, memory: HostMemory):
        super().__init__(num_blocks, num_slots)
        self.memory = memory

    def read_blocks(self, ids):
        return self.memory.store([(jnp.asarray(self.kv[i]),) for i in ids])

    def write_blocks(self, ids, data):
        for i, (row,) in zip(ids, self.memory.load(data)):
            self.kv[i] = np.asarray(row)

    def read_states(self, slots):
        return self.memory.store([(jnp.asarray(self.state[s]),) for s in slots])

    def write_states(self, slots, data):
        for s, (row,) in zip(slots, self.memory.load(data)):
            self.state[s] = np.asarray(row)

    def to_host(self, data):
        return self.memory.adopt(data)


def make(memory: HostMemory, num_blocks: int = 9):
    blocks = BlockAllocator(num_blocks)
    device = HostTierDevice(num_blocks, 8, memory)
    cache = PrefixCache(PrefixIndex(cache_salt("model"), True), blocks, device, range(4, 8), 1 << 20)
    return cache, blocks, device


def test_the_cpu_backend_is_asked_for_its_memory_kinds_and_pinned_host_is_used_when_offered():
    memory = HostMemory.for_device(DEVICE)
    assert memory.pinned == (PINNED_HOST in memory_kinds(DEVICE))
    assert "device" in memory_kinds(DEVICE) or not memory_kinds(DEVICE)


@pytest.mark.parametrize("kind", KINDS)
def test_rows_copied_to_the_host_and_back_are_unchanged(kind):
    memory = HostMemory(DEVICE, kind == PINNED_HOST)
    rng = np.random.default_rng(0)
    rows = [
        {
            "k": jnp.asarray(rng.normal(size=(4, 3)), jnp.bfloat16),
            "s": jnp.asarray(rng.normal(size=5), jnp.float32),
        }
        for _ in range(3)
    ]
    stored = memory.store(rows)
    for data in stored:
        assert_in(memory, data)
    loaded = memory.load(stored[:2] + [memory.adopt(tuple(np.asarray(a) for a in stored[2]))])
    for row, back in zip(rows, loaded):
        for want, got in zip(jax.tree.leaves(row), back):
            assert got.sharding.memory_kind == DEVICE.default_memory().kind
            assert got.dtype == want.dtype
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("kind", KINDS)
def test_host_entries_of_either_kind_come_back_through_an_upload_and_through_the_file(kind, tmp_path):
    memory = HostMemory(DEVICE, kind == PINNED_HOST)
    cache, blocks, device = make(memory)
    device.kv += 100.0  # distinct from a fresh device's rows
    t = tokens(150, 1)
    owned = finish(cache, blocks, device, t, marker=3.5)
    want = [device.kv[b].copy() for b in owned]
    assert cache.evict_blocks(8) == len(owned)
    for snap in list(cache.index.all_snapshots()):
        cache._demote_snapshot(snap)
    entries = list(cache.index.blocks.values())
    snap = cache.index.snapshot_at(t, 150)
    for data in [e.host for e in entries] + [snap.state, snap.tail_host]:
        assert_in(memory, data)

    path = tmp_path / "prefix.cache"
    assert save_prefix_file(path, cache.index.salt, cache.export_entries()) == 3
    fresh, _, fresh_device = make(memory)
    assert fresh.import_entries(load_prefix_file(path, fresh.index.salt)) == 3
    for e in fresh.index.blocks.values():
        assert_in(memory, e.host)
    for restore, dev in ((cache, device), (fresh, fresh_device)):
        hit = restore.match(t + [1])
        assert hit.length == 150
        restored = restore.acquire(hit, 3)
        np.testing.assert_array_equal(dev.kv[restored], np.stack(want))
        assert (dev.state[3] == 3.5).all()
