"""Host-side allocators of the engine's device memory: KV blocks (reference counted) and state slots.

Both reserve index 0: block 0 is the *null block* and slot 0 the *scratch slot*. Padding rows of a
batch point at them (a block-table row of zeros, slot 0); `PagedKV.write` and `commit_view` drop
every write aimed at them, so they stay zero and a padding row can never clobber a real sequence.
Neither is ever handed out, so `num_total` counts the allocatable ones (`num_blocks - 1`).
"""

from __future__ import annotations

NULL_BLOCK = 0
SCRATCH_SLOT = 0
BLOCK_SIZE = 64  # tokens per KV block


class OutOfBlocks(RuntimeError):
    """Fewer free KV blocks than asked for (the scheduler preempts or waits)."""


class OutOfSlots(RuntimeError):
    """No free state slot (more concurrent sequences than the pool was planned for)."""


class BlockAllocator:
    """Free list of KV blocks 1..num_blocks-1 with a reference count per block.

    A block is owned by every sequence (or prefix-cache entry) that holds a reference; `free`
    drops one reference per block and the block returns to the free list when none is left.
    """

    def __init__(self, num_blocks: int):
        if num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block {NULL_BLOCK} is reserved), got {num_blocks}")
        self._num_blocks = num_blocks
        self._refcount = [0] * num_blocks
        # a stack, lowest block on top: allocation order is deterministic and compact
        self._free = list(range(num_blocks - 1, NULL_BLOCK, -1))

    @property
    def num_total(self) -> int:
        """Allocatable blocks (the null block excluded)."""
        return self._num_blocks - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refcount(self, block: int) -> int:
        self._check(block)
        return self._refcount[block]

    def allocate(self, n: int) -> list[int]:
        """n fresh blocks with one reference each; raises OutOfBlocks (allocating nothing) when short."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > len(self._free):
            raise OutOfBlocks(f"asked for {n} KV blocks, {len(self._free)} free of {self.num_total}")
        blocks = [self._free.pop() for _ in range(n)]
        for b in blocks:
            self._refcount[b] = 1
        return blocks

    def incref(self, blocks: list[int]) -> None:
        """Add a reference to each (allocated) block: another owner now shares it."""
        for b in blocks:
            self._check_live(b)
        for b in blocks:
            self._refcount[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one reference per block; blocks left with none return to the free list."""
        for b in blocks:
            self._check_live(b)
        for b in blocks:
            self._refcount[b] -= 1
            if self._refcount[b] == 0:
                self._free.append(b)

    def _check(self, block: int) -> None:
        if not 0 <= block < self._num_blocks:
            raise ValueError(f"block {block} out of range [0, {self._num_blocks})")

    def _check_live(self, block: int) -> None:
        self._check(block)
        if block == NULL_BLOCK:
            raise ValueError(f"block {NULL_BLOCK} is the reserved null block")
        if self._refcount[block] <= 0:
            raise ValueError(f"block {block} is not allocated")


class SlotAllocator:
    """Free list of state slots 1..num_slots-1 (slot 0 is the scratch slot of padding rows)."""

    def __init__(self, num_slots: int):
        if num_slots < 2:
            raise ValueError(f"num_slots must be >= 2 (slot {SCRATCH_SLOT} is reserved), got {num_slots}")
        self._num_slots = num_slots
        self._free = list(range(num_slots - 1, SCRATCH_SLOT, -1))
        self._used: set[int] = set()

    @property
    def num_total(self) -> int:
        """Allocatable slots (the scratch slot excluded)."""
        return self._num_slots - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise OutOfSlots(f"all {self.num_total} state slots are in use")
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"state slot {slot} is not allocated")
        self._used.remove(slot)
        self._free.append(slot)
