"""The prefix cache's index: content-addressed KV blocks and recurrent-state snapshots (host only).

Keys. A full 64-token block is named by a chained hash: key(i) = H(key(i - 1), tokens of block i),
with key(-1) the *salt* (the model and the KV format: see `cache_salt`), so equal keys mean equal
prefixes on the same model and KV layout. A *snapshot* is the recurrent state after the first p
tokens; it is filed under the key of the full blocks before p (`p // 64` of them) and the *tail*,
the p % 64 tokens after them, and holds a reference to the block that tail lives in.

A *hit* for a prompt is the longest p < len(prompt) whose full blocks are all indexed and which has
a snapshot at p (or, for a model without linear-attention layers, any block boundary or snapshot
tail). At least one prompt token is always left to feed, because the first sampled token needs
the logits of the last one.

Where the data is (GPU block / slot, host copy) is tracked on the entries but moved by
`prefix_cache.PrefixCache`; this module only names, finds and orders things.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

from infernix_jax.cache.allocators import BLOCK_SIZE

KEY_BYTES = 16


def block_key(parent: bytes, tokens: Sequence[int]) -> bytes:
    """The key of a full block holding `tokens` after the prefix named `parent`."""
    if len(tokens) != BLOCK_SIZE:
        raise ValueError(f"a full block has {BLOCK_SIZE} tokens, got {len(tokens)}")
    data = parent + np.asarray(tokens, dtype="<u4").tobytes()
    return hashlib.blake2b(data, digest_size=KEY_BYTES).digest()


def cache_salt(*parts: str | bytes) -> bytes:
    """The root key: a digest of whatever makes KV and state differ (model, weights, KV format, dtype)."""
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"ixj-prefix")
    for part in parts:
        h.update(part if isinstance(part, bytes) else part.encode())
        h.update(b"\0")
    return h.digest()


HostData = tuple  # one array per pool leaf (pinned-host jax array or numpy), the block / slot axis removed


@dataclass(eq=False)
class BlockEntry:
    """A cached full block: tokens [64 * depth, 64 * depth + 64) of every prefix with this key."""

    key: bytes
    parent: bytes
    depth: int  # block index within the prefix
    tokens: tuple[int, ...]
    gpu: int | None = None  # pool block id (the cache holds one reference) or None
    host: HostData | None = None  # a host copy, or None
    last_used: int = 0
    origin: str = "gpu"  # the tier the entry came from: "gpu" (computed here) or "file" (loaded)

    @property
    def resident(self) -> bool:
        return self.gpu is not None or self.host is not None


@dataclass(eq=False)
class SnapshotEntry:
    """The recurrent state after `position` tokens (and the block its tail tokens live in)."""

    node: bytes  # key of the full blocks before the tail (the salt when there are none)
    tail: tuple[int, ...]  # tokens [64 * (position // 64), position)
    position: int
    slot: int | None = None  # state pool slot on the GPU (snapshot slots), or None
    state: HostData | None = None  # host copy of the state, or None (models without state: ())
    tail_gpu: int | None = None  # GPU block holding the tail's KV (the cache holds one reference)
    tail_host: HostData | None = None
    last_used: int = 0
    origin: str = "gpu"

    @property
    def has_state(self) -> bool:
        return self.slot is not None or self.state is not None

    @property
    def has_tail(self) -> bool:
        return not self.tail or self.tail_gpu is not None or self.tail_host is not None


@dataclass
class Match:
    """The longest cached prefix of a prompt."""

    length: int = 0  # tokens served from the cache
    blocks: list[BlockEntry] = field(default_factory=list)  # full blocks of the prefix, in order
    snapshot: SnapshotEntry | None = None  # the state at `length` (None: fresh, or a stateless model)
    shared: int = 0  # tokens the prompt shares with indexed content (>= length): where it diverges


class PrefixIndex:
    """Entries by key, the chain structure (for dropping unreachable descendants) and an LRU clock."""

    def __init__(self, salt: bytes, stateful: bool):
        self.salt = salt
        self.stateful = stateful  # the model has linear-attention layers: a hit needs a snapshot
        self.blocks: dict[bytes, BlockEntry] = {}
        self.snapshots: dict[bytes, dict[tuple[int, ...], SnapshotEntry]] = {}
        self.children: dict[bytes, set[bytes]] = {}
        self.clock = 0

    def tick(self) -> int:
        self.clock += 1
        return self.clock

    # ---- lookup --------------------------------------------------------------------------------
    def chain_keys(self, tokens: Sequence[int], num_blocks: int) -> list[bytes]:
        """Keys of the first num_blocks full blocks of tokens."""
        keys, parent = [], self.salt
        for i in range(num_blocks):
            parent = block_key(parent, tokens[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE])
            keys.append(parent)
        return keys

    def match(self, tokens: Sequence[int], limit: int) -> Match:
        """The longest hit of at most `limit` tokens (callers pass len(prompt) - 1)."""
        best = Match()
        parent, chain = self.salt, []
        depth = 0
        while True:
            start = depth * BLOCK_SIZE
            if not self.stateful and start <= limit and start > best.length:
                best = Match(start, list(chain), None)
            for tail, snap in self.snapshots.get(parent, {}).items():
                end = start + len(tail)
                usable = end <= limit and end > best.length and snap.has_state and snap.has_tail
                if usable and tuple(tokens[start:end]) == tail:
                    best = Match(end, list(chain), snap)
            if start + BLOCK_SIZE > min(limit, len(tokens)):
                break
            key = block_key(parent, tokens[start : start + BLOCK_SIZE])
            entry = self.blocks.get(key)
            if entry is None or not entry.resident:
                break
            chain.append(entry)
            parent, depth = key, depth + 1
        best.shared = max(best.length, start + self._shared_after(parent, tokens[start:limit]))
        return best

    def _shared_after(self, node: bytes, rest: Sequence[int]) -> int:
        """How many leading tokens of `rest` (the prompt after the full blocks named `node`) an indexed
        block or snapshot tail after `node` also starts with. With the blocks before, that is where
        the prompt leaves the indexed prefixes: the recurrent state there is what a later prompt with
        the same divergence (another session on the same system prompt) needs."""
        longest = 0
        candidates = [self.blocks[k].tokens for k in self.children.get(node, ()) if k in self.blocks]
        candidates += list(self.snapshots.get(node, {}))
        for tokens in candidates:
            n = 0
            for a, b in zip(tokens, rest):
                if a != b:
                    break
                n += 1
            longest = max(longest, n)
        return longest

    def snapshot_at(self, tokens: Sequence[int], position: int) -> SnapshotEntry | None:
        """The snapshot of exactly tokens[:position], if indexed."""
        full = position // BLOCK_SIZE
        node = self.chain_keys(tokens, full)[-1] if full else self.salt
        return self.snapshots.get(node, {}).get(tuple(tokens[full * BLOCK_SIZE : position]))

    # ---- edits ---------------------------------------------------------------------------------
    def add_block(self, entry: BlockEntry) -> None:
        self.blocks[entry.key] = entry
        self.children.setdefault(entry.parent, set()).add(entry.key)

    def add_snapshot(self, entry: SnapshotEntry) -> None:
        self.snapshots.setdefault(entry.node, {})[entry.tail] = entry

    def remove_snapshot(self, entry: SnapshotEntry) -> None:
        group = self.snapshots.get(entry.node, {})
        if group.get(entry.tail) is entry:
            del group[entry.tail]
            if not group:
                del self.snapshots[entry.node]

    def subtree(self, key: bytes) -> tuple[list[BlockEntry], list[SnapshotEntry]]:
        """Every block and snapshot under `key` (the entry itself included): what becomes unreachable
        when it is dropped."""
        blocks, snaps, todo = [], [], [key]
        while todo:
            k = todo.pop()
            if k in self.blocks:
                blocks.append(self.blocks[k])
            snaps.extend(self.snapshots.get(k, {}).values())
            todo.extend(self.children.get(k, ()))
        return blocks, snaps

    def remove_block(self, entry: BlockEntry) -> None:
        if self.blocks.get(entry.key) is entry:
            del self.blocks[entry.key]
            kids = self.children.get(entry.parent)
            if kids is not None:
                kids.discard(entry.key)
                if not kids:
                    del self.children[entry.parent]

    def all_snapshots(self) -> Iterator[SnapshotEntry]:
        for group in self.snapshots.values():
            yield from group.values()
