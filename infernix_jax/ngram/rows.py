"""Where table rows come from, and the bounded host cache of hot rows in front of them.

A `RowSource` reads rows by id: `ArrayRows` from a table in RAM, `VolumeRows`
(infernix_jax/ngram/volume.py) from a TensorStore volume on disk. `RowCache` keeps a bounded set
of recently read rows in one preallocated host array, so that hot n-grams (their access is
Zipfian) are served from RAM and only misses reach the source. It is thread-safe: the
prefetcher's worker threads and the engine thread look rows up at the same time.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol

import numpy as np


class RowSource(Protocol):
    """A [num_rows, width] table read by row ids."""

    shape: tuple[int, int]
    dtype: np.dtype

    def read(self, ids: np.ndarray) -> np.ndarray:
        """Rows [len(ids), width] for sorted, unique int64 ids."""
        ...


class ArrayRows:
    """A table held in RAM (a numpy array or memmap)."""

    def __init__(self, table: np.ndarray):
        if table.ndim != 2:
            raise ValueError(f"a row table must be 2-D [rows, width], got shape {table.shape}")
        self.table = table
        self.shape = tuple(table.shape)
        self.dtype = table.dtype

    def read(self, ids: np.ndarray) -> np.ndarray:
        return np.asarray(self.table[ids])


@dataclass
class CacheStats:
    """Row lookups since start: served from the cache (hits) or read from the source (misses)."""

    hits: int = 0
    misses: int = 0

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 0.0


class RowCache:
    """A bounded host cache of rows in front of a `RowSource` (a FIFO ring of `capacity` rows).

    `gather(ids)` returns the rows of any int64 id array, shaped ids.shape + (width,). Misses are
    read from the source in one batched read (outside the lock, so other threads keep hitting the
    cache meanwhile) and then written into the ring, evicting its oldest rows. FIFO rather than LRU
    keeps every step vectorised; Zipfian hot rows that fall out come back on their next miss.
    """

    def __init__(self, source: RowSource, capacity_rows: int):
        self.source = source
        self.width = int(source.shape[1])
        self.capacity = max(0, int(capacity_rows))
        self.rows = np.zeros((self.capacity, self.width), source.dtype)
        self.slot_ids = np.full(self.capacity, -1, np.int64)  # which row each slot holds (-1: empty)
        self.where: dict[int, int] = {}  # row id -> slot
        self.hand = 0  # the next slot to fill (the oldest row)
        self.stats = CacheStats()
        self._lock = threading.Lock()

    @property
    def dtype(self) -> np.dtype:
        return self.source.dtype

    def gather(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, np.int64)
        unique, inverse = np.unique(ids.reshape(-1), return_inverse=True)
        if self.capacity == 0:  # no cache: one batched read
            self.stats.misses += len(unique)
            return np.asarray(self.source.read(unique))[inverse].reshape(ids.shape + (self.width,))
        out = np.empty((len(unique), self.width), self.source.dtype)
        with self._lock:
            get = self.where.get
            slots = np.fromiter((get(i, -1) for i in unique.tolist()), np.int64, len(unique))
            hit = slots >= 0
            out[hit] = self.rows[slots[hit]]
            self.stats.hits += int(hit.sum())
            self.stats.misses += int((~hit).sum())
        missing = unique[~hit]
        if len(missing):
            fetched = self.source.read(missing)
            out[~hit] = fetched
            self._insert(missing, fetched)
        return out[inverse].reshape(ids.shape + (self.width,))

    def _insert(self, ids: np.ndarray, rows: np.ndarray) -> None:
        if self.capacity == 0:
            return
        with self._lock:
            fresh = np.fromiter((i not in self.where for i in ids.tolist()), bool, len(ids))
            ids, rows = ids[fresh], rows[fresh]  # another thread may have inserted some meanwhile
            if len(ids) > self.capacity:  # more than fits: keep the last `capacity`
                ids, rows = ids[-self.capacity :], rows[-self.capacity :]
            n = len(ids)
            if n == 0:
                return
            slots = (self.hand + np.arange(n)) % self.capacity
            for old in self.slot_ids[slots].tolist():
                if old >= 0:
                    self.where.pop(old, None)
            self.slot_ids[slots] = ids
            self.rows[slots] = rows
            self.where.update(zip(ids.tolist(), slots.tolist()))
            self.hand = int((self.hand + n) % self.capacity)

    def __len__(self) -> int:
        return len(self.where)
