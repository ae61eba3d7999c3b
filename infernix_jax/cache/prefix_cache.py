"""The hybrid prefix cache: shared KV blocks and recurrent-state snapshots, on the GPU and in host RAM.

`PrefixCache` decides what is kept where; the data moves through a `PoolDevice` (the engine's
runner: block and slot copies, reads to and writes from the host). Host-side only, one thread.

GPU tier. Cached blocks live in the engine's KV pool, shared by reference count with the requests
that use them (BlockAllocator); the cache holds one reference per entry. A block is *evictable*
when only cache entries reference it. Snapshots occupy dedicated state-pool slots
(`snapshot_slots`), separate from the requests' slots.

Host tier. Evicted entries are copied to host memory within `host_bytes`: pinned host RAM where the
backend has it, else numpy (the device's choice: cache/prefix_host.py). The copy is not waited for.
A hit on them is uploaded into fresh blocks / the request's slot. Entries that fit nowhere are
dropped, with everything that hangs off them.

Taking a snapshot never copies KV: the entry references the block its tail lives in, which the
owning request only ever writes at later positions. Restoring one gives the new request a private
copy of that block (it will write after the tail) and shares the full blocks before it.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from infernix_jax.cache.allocators import BLOCK_SIZE, BlockAllocator
from infernix_jax.cache.prefix_file import FileEntry
from infernix_jax.cache.prefix_host import to_numpy
from infernix_jax.cache.prefix_index import (
    BlockEntry,
    HostData,
    Match,
    PrefixIndex,
    SnapshotEntry,
    block_key,
)

log = logging.getLogger(__name__)

TIERS = ("gpu", "host", "file")


class PoolDevice(Protocol):
    """What the cache needs from the device pools (implemented by the engine's runner)."""

    def copy_blocks(self, src: Sequence[int], dst: Sequence[int]) -> None: ...
    def read_blocks(self, ids: Sequence[int]) -> list[HostData]: ...
    def write_blocks(self, ids: Sequence[int], data: Sequence[HostData]) -> None: ...
    def copy_states(self, src: Sequence[int], dst: Sequence[int]) -> None: ...
    def read_states(self, slots: Sequence[int]) -> list[HostData]: ...
    def write_states(self, slots: Sequence[int], data: Sequence[HostData]) -> None: ...
    def to_host(self, data: HostData) -> HostData:
        """Host data from the file (numpy) in the host tier's own memory."""
        ...


@dataclass
class PrefixCacheStats:
    """Cumulative counters (for /metrics and benchmarks)."""

    queries: int = 0  # prompts looked up
    query_tokens: int = 0  # their tokens
    hits: int = 0  # prompts with a non-empty hit
    hit_tokens: int = 0  # tokens served from the cache
    hit_tokens_by_tier: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    snapshots_taken: int = 0
    evicted_to_host: int = 0  # entries moved from the GPU to the host tier
    dropped: int = 0  # entries dropped for lack of room

    @property
    def hit_rate(self) -> float:
        """Share of looked-up prompt tokens that were served from the cache."""
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0


def _nbytes(data: HostData | None) -> int:
    return sum(int(a.nbytes) for a in data) if data else 0


class PrefixCache:
    """Index + tiers. See the module docstring for the rules."""

    def __init__(
        self,
        index: PrefixIndex,
        blocks: BlockAllocator,
        device: PoolDevice,
        snapshot_slots: Sequence[int],
        host_bytes: int,
    ):
        self.index = index
        self.blocks = blocks
        self.device = device
        self.all_slots = frozenset(snapshot_slots)
        self.free_slots = sorted(snapshot_slots, reverse=True)
        self.num_snapshot_slots = len(snapshot_slots)
        self._protected: set[int] = set()  # ids of entries a restore in progress needs (never evicted)
        self.host_bytes = host_bytes
        self.host_used = 0
        self.cache_refs: Counter[int] = Counter()  # GPU block -> references held by cache entries
        self.stats = PrefixCacheStats()

    @property
    def stateful(self) -> bool:
        return self.index.stateful

    # ---- lookup and restore --------------------------------------------------------------------
    def match(self, tokens: Sequence[int]) -> Match:
        """The longest usable hit for a prompt (at least one token is left to feed)."""
        found = self.index.match(tokens, len(tokens) - 1)
        if self.stateful and found.snapshot is None:
            return Match(shared=found.shared)
        return found

    def blocks_needed(self, match: Match) -> int:
        """Fresh GPU blocks a restore of `match` takes (uploads of host-only blocks and the tail copy)."""
        uploads = sum(1 for e in match.blocks if e.gpu is None)
        tail = 1 if match.snapshot is not None and match.snapshot.tail else 0
        return uploads + tail

    def acquire(self, match: Match, slot: int | None) -> list[int] | None:
        """Give a request the blocks of `match` (shared full blocks, a private copy of the tail block)
        and put the snapshot's state into its `slot`. None when the GPU has no room for the restore."""
        if match.length == 0:
            return []
        snap = match.snapshot
        pinned = [e.gpu for e in match.blocks if e.gpu is not None]
        if snap is not None and snap.tail_gpu is not None:
            pinned.append(snap.tail_gpu)
        self.blocks.incref(pinned)  # while referenced here they cannot be evicted
        need = self.blocks_needed(match)
        if need > self.blocks.num_free:
            self._protected = {id(e) for e in match.blocks} | {id(snap)}
            try:
                self.evict_blocks(need - self.blocks.num_free)
            finally:
                self._protected = set()
        if need > self.blocks.num_free:
            self.blocks.free(pinned)
            return None
        if snap is not None and snap.tail_gpu is not None:
            self.blocks.free([snap.tail_gpu])  # the tail block is copied, not shared
        now = self.index.tick()
        tiers = Counter()
        uploads = [e for e in match.blocks if e.gpu is None]
        if uploads:
            ids = self.blocks.allocate(len(uploads))
            self.device.write_blocks(ids, [e.host for e in uploads])
            for entry, block in zip(uploads, ids):
                entry.gpu = block
                self.cache_refs[block] += 1
            self.blocks.incref(ids)
        owned = []
        for entry in match.blocks:
            tiers["file" if entry.origin == "file" else ("host" if entry in uploads else "gpu")] += BLOCK_SIZE
            entry.last_used, entry.origin = now, "gpu"
            owned.append(entry.gpu)
        if snap is not None:
            snap.last_used = now
            tier = "file" if snap.origin == "file" else ("gpu" if snap.slot is not None else "host")
            tiers[tier] += len(snap.tail)
            snap.origin = "gpu"
            if snap.tail:
                (block,) = self.blocks.allocate(1)
                if snap.tail_gpu is not None:
                    self.device.copy_blocks([snap.tail_gpu], [block])
                else:
                    self.device.write_blocks([block], [snap.tail_host])
                owned.append(block)
            if self.stateful and slot is not None:
                if snap.slot is not None:
                    self.device.copy_states([snap.slot], [slot])
                else:
                    self.device.write_states([slot], [snap.state])
        for tier, n in tiers.items():
            self.stats.hit_tokens_by_tier[tier] += n
        return owned

    def record_query(self, num_tokens: int, hit: int) -> None:
        self.stats.queries += 1
        self.stats.query_tokens += num_tokens
        self.stats.hit_tokens += hit
        self.stats.hits += hit > 0

    # ---- insertion -----------------------------------------------------------------------------
    def insert_blocks(self, tokens: Sequence[int], blocks: Sequence[int], num_tokens: int) -> None:
        """Index the full blocks among a request's first num_tokens tokens (its `blocks`, in order)."""
        parent = self.index.salt
        now = self.index.tick()
        for i in range(num_tokens // BLOCK_SIZE):
            chunk = tuple(tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
            key = block_key(parent, chunk)
            entry = self.index.blocks.get(key)
            if entry is None:
                entry = BlockEntry(key, parent, i, chunk)
                self.index.add_block(entry)
            if entry.gpu is None:
                self._hold(entry, "gpu", blocks[i])
                if entry.host is not None:  # the GPU copy is current again; the host copy is not needed
                    self.host_used -= _nbytes(entry.host)
                    entry.host = None
            entry.last_used = now
            parent = key

    def reserve_slot(self) -> int | None:
        """A GPU snapshot slot for a snapshot about to be taken (the least recently used one moves out)."""
        if not self.stateful:
            return None
        if not self.free_slots:
            victims = [s for s in self.index.all_snapshots() if s.slot is not None]
            if not victims:
                return None
            self._demote_snapshot(min(victims, key=lambda s: s.last_used))
        return self.free_slots.pop() if self.free_slots else None

    def release_slot(self, slot: int) -> None:
        """Give back a reserved slot whose snapshot was not taken (its dispatch failed)."""
        self.free_slots.append(slot)

    def add_snapshot(
        self, tokens: Sequence[int], position: int, slot: int | None, blocks: Sequence[int]
    ) -> None:
        """Index the state after tokens[:position], already written to snapshot `slot` (None for a
        model without state). `blocks` are the owning request's blocks (the tail block is shared)."""
        full = position // BLOCK_SIZE
        node = self.index.chain_keys(tokens, full)[-1] if full else self.index.salt
        tail = tuple(tokens[full * BLOCK_SIZE : position])
        old = self.index.snapshots.get(node, {}).get(tail)
        if old is not None:
            self._drop_snapshot(old)
        entry = SnapshotEntry(node, tail, position, slot=slot, state=None if self.stateful else ())
        if tail:
            self._hold(entry, "tail_gpu", blocks[full])
        entry.last_used = self.index.tick()
        self.index.add_snapshot(entry)
        self.stats.snapshots_taken += 1

    def snapshot_request(
        self, tokens: Sequence[int], position: int, slot: int | None, blocks: Sequence[int]
    ) -> None:
        """Cache a request that stops (finished or preempted): its full blocks, and the state of its
        `slot` after `position` tokens (copied to a snapshot slot)."""
        if position <= 0:
            return
        self.insert_blocks(tokens, blocks, position)
        if self.index.snapshot_at(tokens, position) is not None:
            self.index.snapshot_at(tokens, position).last_used = self.index.tick()
            return
        target = None
        if self.stateful:
            if slot is None:
                return
            target = self.reserve_slot()
            if target is None:
                return
            self.device.copy_states([slot], [target])
        self.add_snapshot(tokens, position, target, blocks)

    def wants_snapshot(self, tokens: Sequence[int], position: int) -> bool:
        return self.index.snapshot_at(tokens, position) is None

    # ---- eviction ------------------------------------------------------------------------------
    def evictable_blocks(self) -> int:
        """GPU blocks only cache entries reference (what eviction can free)."""
        return sum(1 for b, n in self.cache_refs.items() if n and self.blocks.refcount(b) == n)

    def evict_blocks(self, count: int) -> int:
        """Free at least `count` GPU blocks if possible, least recently used first (deeper blocks first
        among equals); evicted entries go to the host tier when it has room. Returns blocks freed."""
        holders = [(e.last_used, -e.depth, 0, e) for e in self.index.blocks.values() if e.gpu is not None]
        holders += [
            (s.last_used, -s.position // BLOCK_SIZE, 1, s)
            for s in self.index.all_snapshots()
            if s.tail_gpu is not None
        ]
        holders.sort(key=lambda h: h[:3])
        freed = 0
        for *_, entry in holders:
            if freed >= count:
                break
            block = entry.gpu if isinstance(entry, BlockEntry) else entry.tail_gpu
            if block is None or id(entry) in self._protected:
                continue
            if self.blocks.refcount(block) != self.cache_refs[block]:
                continue  # a running request uses it
            if isinstance(entry, BlockEntry):
                self._demote_block(entry)
            else:
                self._demote_tail(entry)
            freed += self.blocks.refcount(block) == 0
        return freed

    def on_pools_reset(self) -> None:
        """The device pools were rebuilt empty: forget every GPU copy (host copies stay valid)."""
        for entry in list(self.index.blocks.values()):
            entry.gpu = None
        for snap in list(self.index.all_snapshots()):
            snap.slot, snap.tail_gpu = None, None
        self.cache_refs.clear()
        self.free_slots = sorted(self.all_slots, reverse=True)
        for entry in list(self.index.blocks.values()):
            if not entry.resident:
                self._drop_block(entry)
        for snap in list(self.index.all_snapshots()):
            if not snap.has_state or not snap.has_tail:
                self._drop_snapshot(snap)

    # ---- moving entries ------------------------------------------------------------------------
    def _hold(self, entry, attr: str, block: int) -> None:
        self.blocks.incref([block])
        self.cache_refs[block] += 1
        setattr(entry, attr, block)

    def _unhold(self, entry, attr: str) -> None:
        block = getattr(entry, attr)
        if block is None:
            return
        setattr(entry, attr, None)
        self.cache_refs[block] -= 1
        if not self.cache_refs[block]:
            del self.cache_refs[block]
        self.blocks.free([block])

    def _make_room(self, nbytes: int, keep: object) -> bool:
        """Drop host-only entries (least recently used first) until nbytes more fit in the host budget."""
        if nbytes > self.host_bytes:
            return False
        if self.host_used + nbytes <= self.host_bytes:
            return True
        spare = lambda e: e is not keep and id(e) not in self._protected
        host_only = [
            e for e in self.index.blocks.values() if e.gpu is None and e.host is not None and spare(e)
        ]
        host_only += [s for s in self.index.all_snapshots() if s.slot is None and s.state and spare(s)]
        for entry in sorted(host_only, key=lambda e: e.last_used):
            if self.host_used + nbytes <= self.host_bytes:
                break
            if isinstance(entry, BlockEntry):
                if entry.key in self.index.blocks:
                    self._drop_block(entry)
            else:
                self._drop_snapshot(entry)
        return self.host_used + nbytes <= self.host_bytes

    def _block_to_host(self, entry, gpu_attr: str, host_attr: str) -> bool:
        """Copy the GPU block `entry.<gpu_attr>` to `entry.<host_attr>` (if the host has room), then
        release the GPU block. True when the entry still has the block's data."""
        if getattr(entry, host_attr) is None:
            (data,) = self.device.read_blocks([getattr(entry, gpu_attr)])
            if self._make_room(_nbytes(data), entry):
                setattr(entry, host_attr, data)
                self.host_used += _nbytes(data)
        self._unhold(entry, gpu_attr)
        return getattr(entry, host_attr) is not None

    def _demote_block(self, entry: BlockEntry) -> None:
        if self._block_to_host(entry, "gpu", "host"):
            self.stats.evicted_to_host += 1
        else:
            self._drop_block(entry)

    def _demote_tail(self, snap: SnapshotEntry) -> None:
        if not self._block_to_host(snap, "tail_gpu", "tail_host"):
            self._drop_snapshot(snap)

    def _demote_snapshot(self, snap: SnapshotEntry) -> None:
        """Move a snapshot's state (and tail block) off the GPU, or drop it."""
        if snap.state is None and snap.slot is not None:
            (data,) = self.device.read_states([snap.slot])
            if self._make_room(_nbytes(data), snap):
                snap.state = data
                self.host_used += _nbytes(data)
        if snap.slot is not None:
            self.free_slots.append(snap.slot)
            snap.slot = None
        if snap.state is None:
            self._drop_snapshot(snap)
        else:
            self.stats.evicted_to_host += 1

    def _drop_block(self, entry: BlockEntry) -> None:
        """Remove a block and everything after it (unreachable without it)."""
        blocks, snaps = self.index.subtree(entry.key)
        for snap in snaps:
            self._drop_snapshot(snap)
        for block in blocks:
            self._unhold(block, "gpu")
            self.host_used -= _nbytes(block.host)
            block.host = None
            self.index.remove_block(block)
            self.stats.dropped += 1

    def _drop_snapshot(self, snap: SnapshotEntry) -> None:
        self._unhold(snap, "tail_gpu")
        if snap.slot is not None:
            self.free_slots.append(snap.slot)
            snap.slot = None
        self.host_used -= _nbytes(snap.state) + _nbytes(snap.tail_host)
        snap.state = None if self.stateful else ()
        snap.tail_host = None
        self.index.remove_snapshot(snap)
        self.stats.dropped += 1

    def clear(self) -> None:
        """Drop every entry on every tier (requests keep the blocks they hold)."""
        for snap in list(self.index.all_snapshots()):
            self._drop_snapshot(snap)
        for entry in list(self.index.blocks.values()):
            if entry.key in self.index.blocks:
                self._drop_block(entry)

    # ---- the file tier -------------------------------------------------------------------------
    def export_entries(self) -> list[FileEntry]:
        """Every entry with its data in numpy (GPU copies are read back), for `save_prefix_file`."""
        blocks = list(self.index.blocks.values())
        on_gpu = [e for e in blocks if e.host is None]
        read = dict(zip(map(id, on_gpu), self._read_blocks([e.gpu for e in on_gpu])))
        out = []
        for e in blocks:
            meta = {"key": e.key.hex(), "parent": e.parent.hex(), "depth": e.depth, "tokens": list(e.tokens)}
            out.append(FileEntry("block", meta, {"host": to_numpy(e.host or read[id(e)])}, e.last_used))
        for s in self.index.all_snapshots():
            state = s.state if s.state is not None else self.device.read_states([s.slot])[0]
            arrays = {"state": to_numpy(state)}
            if s.tail:
                arrays["tail_host"] = to_numpy(s.tail_host or self.device.read_blocks([s.tail_gpu])[0])
            meta = {"node": s.node.hex(), "tail": list(s.tail), "position": s.position}
            out.append(FileEntry("snapshot", meta, arrays, s.last_used))
        return out

    def _read_blocks(self, ids: list[int], batch: int = 64) -> list[HostData]:
        out = []
        for i in range(0, len(ids), batch):
            out.extend(self.device.read_blocks(ids[i : i + batch]))
        return out

    def import_entries(self, entries: Sequence[FileEntry]) -> int:
        """Add entries loaded from a file to the host tier (in its memory: `PoolDevice.to_host`), most
        recently used first, while the host budget lasts. Returns the number added."""
        added = 0
        for f in sorted(entries, key=lambda e: -e.last_used):
            arrays = f.arrays
            nbytes = sum(_nbytes(a) for a in arrays.values())
            if self.host_used + nbytes > self.host_bytes:
                continue
            if f.kind == "block":
                key = bytes.fromhex(f.meta["key"])
                if key in self.index.blocks:
                    continue
                entry = BlockEntry(
                    key,
                    bytes.fromhex(f.meta["parent"]),
                    f.meta["depth"],
                    tuple(f.meta["tokens"]),
                    origin="file",
                )
                entry.host = self.device.to_host(arrays["host"])
                self.index.add_block(entry)
            else:
                tail = tuple(f.meta["tail"])
                node = bytes.fromhex(f.meta["node"])
                if tail in self.index.snapshots.get(node, {}):
                    continue
                entry = SnapshotEntry(node, tail, f.meta["position"], origin="file")
                entry.state = self.device.to_host(arrays["state"]) if self.stateful else ()
                if tail and "tail_host" in arrays:
                    entry.tail_host = self.device.to_host(arrays["tail_host"])
                self.index.add_snapshot(entry)
            self.host_used += nbytes
            added += 1
        return added
