"""Asynchronous row prefetch: look rows up on worker threads before the forward needs them.

The ids depend only on the tokens, so as soon as the engine knows which positions it will feed
(a prefill chunk, the next decode token, the chunk after this one) it `submit`s them; the lookups
(hashing, the host cache, reads from disk) run on worker threads while the host prepares the
dispatch and the device runs earlier work. `take` returns the rows, waiting only for what is not
ready yet. Results never depend on timing: a lookup returns the same rows whenever it runs.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from infernix_jax.ngram.memory import NgramTable

MAX_PENDING = 256  # submitted lookups kept for a later `take` (the oldest are dropped first)


class RowPrefetcher:
    """Lookups of `NgramTable.rows` on a small thread pool, keyed so a later `take` finds them."""

    def __init__(self, table: NgramTable, workers: int = 2):
        self.table = table
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="ngram-prefetch")
        self._pending: OrderedDict[Hashable, Future] = OrderedDict()
        self._lock = threading.Lock()

    def submit(self, key: Hashable, tokens: Sequence[int], start: int, stop: int) -> Future:
        """Start looking up rows for positions [start, stop) of `tokens` (a snapshot is taken now)."""
        with self._lock:
            future = self._pending.get(key)
            if future is not None:
                return future
            window = list(tokens[max(0, start - self.table.hasher.history) : stop])
            offset = max(0, start - self.table.hasher.history)
            future = self._pool.submit(self._lookup, window, start - offset, stop - offset)
            self._pending[key] = future
            while len(self._pending) > MAX_PENDING:
                self._pending.popitem(last=False)
            return future

    def _lookup(self, window: list[int], start: int, stop: int) -> np.ndarray:
        # positions before `window` are only the sequence start when start < history (then offset is 0)
        return self.table.rows(window, start, stop)

    def warm(self, tokens: Sequence[int], start: int, stop: int) -> None:
        """Fire-and-forget: read rows into the host cache (a later lookup of them is a hit)."""
        if stop > start:
            offset = max(0, start - self.table.hasher.history)
            window = list(tokens[offset:stop])
            self._pool.submit(self._lookup, window, start - offset, stop - offset)

    def take(self, key: Hashable, tokens: Sequence[int], start: int, stop: int) -> np.ndarray:
        """The rows for [start, stop): those submitted under `key`, else looked up now."""
        with self._lock:
            future = self._pending.pop(key, None)
        if future is None:
            return self.table.rows(tokens, start, stop)
        return future.result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
