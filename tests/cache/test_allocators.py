"""Block and slot allocators: reference counts, exhaustion, and the reserved null block / scratch slot."""

from __future__ import annotations

import pytest

from infernix_jax.cache import (
    NULL_BLOCK,
    SCRATCH_SLOT,
    BlockAllocator,
    OutOfBlocks,
    OutOfSlots,
    SlotAllocator,
)


def test_blocks_are_distinct_and_never_the_null_block():
    alloc = BlockAllocator(10)
    assert alloc.num_total == 9 and alloc.num_free == 9
    blocks = alloc.allocate(4) + alloc.allocate(5)
    assert len(set(blocks)) == 9 and NULL_BLOCK not in blocks
    assert all(alloc.refcount(b) == 1 for b in blocks)
    assert alloc.num_free == 0


def test_out_of_blocks_allocates_nothing():
    alloc = BlockAllocator(5)
    held = alloc.allocate(3)
    with pytest.raises(OutOfBlocks):
        alloc.allocate(2)
    assert alloc.num_free == 1
    alloc.free(held)
    assert len(alloc.allocate(4)) == 4


def test_shared_block_returns_to_free_list_only_when_last_reference_drops():
    alloc = BlockAllocator(8)
    a = alloc.allocate(3)
    alloc.incref(a[:2])  # a prefix-cache entry shares the first two blocks
    assert [alloc.refcount(b) for b in a] == [2, 2, 1]
    alloc.free(a)
    assert [alloc.refcount(b) for b in a] == [1, 1, 0]
    assert alloc.num_free == 7 - 2
    alloc.free(a[:2])
    assert alloc.num_free == 7
    assert set(alloc.allocate(7)) == set(range(1, 8))


def test_double_free_and_foreign_blocks_are_rejected():
    alloc = BlockAllocator(4)
    (b,) = alloc.allocate(1)
    alloc.free([b])
    with pytest.raises(ValueError):
        alloc.free([b])
    with pytest.raises(ValueError):
        alloc.incref([b])
    with pytest.raises(ValueError):
        alloc.free([NULL_BLOCK])
    with pytest.raises(ValueError):
        alloc.refcount(4)
    assert alloc.num_free == 3


def test_slots_cycle_and_exhaust():
    slots = SlotAllocator(3)
    assert slots.num_total == 2
    a, b = slots.allocate(), slots.allocate()
    assert {a, b} == {1, 2} and SCRATCH_SLOT not in (a, b)
    with pytest.raises(OutOfSlots):
        slots.allocate()
    slots.free(a)
    assert slots.num_free == 1 and slots.allocate() == a
    with pytest.raises(ValueError):
        slots.free(SCRATCH_SLOT)
