"""Prefetching and the host cache never change the rows: random read delays, eviction, threads."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from infernix_jax.ngram.hashing import NgramHasher
from infernix_jax.ngram.memory import NgramTable
from infernix_jax.ngram.prefetch import RowPrefetcher
from infernix_jax.ngram.rows import ArrayRows, RowCache
from tests.ngram.conftest import VOCAB


class DelayedRows(ArrayRows):
    """A row source whose reads take a random time (0-5 ms), like a disk under load."""

    def __init__(self, table: np.ndarray, seed: int):
        super().__init__(table)
        self.rng = np.random.default_rng(seed)

    def read(self, ids):
        time.sleep(float(self.rng.uniform(0, 0.005)))
        return super().read(ids)


def test_prefetched_rows_equal_direct_lookups_under_random_delays(tiny_cfg, tiny_table):
    direct = NgramTable(tiny_cfg, ArrayRows(tiny_table), cache_bytes=0)
    delayed = NgramTable(tiny_cfg, DelayedRows(tiny_table, seed=1), cache_bytes=2 << 10)  # evicts constantly
    prefetcher = RowPrefetcher(delayed, workers=3)
    rng = np.random.default_rng(2)
    sequences = [rng.integers(0, VOCAB, int(rng.integers(1, 60))).tolist() for _ in range(12)]
    windows = []
    for s, tokens in enumerate(sequences):
        cut = sorted(rng.integers(0, len(tokens) + 1, 2).tolist())
        windows += [(s, 0, cut[0]), (s, cut[0], cut[1]), (s, cut[1], len(tokens))]
    windows = [w for w in windows if w[2] > w[1]]
    for key in rng.permutation(len(windows)):
        s, start, stop = windows[key]
        if key % 3:  # a third are never submitted: take looks them up on the spot
            prefetcher.submit(windows[key], sequences[s], start, stop)
        if key % 4 == 0:
            prefetcher.warm(sequences[s], start, stop)
    for key in rng.permutation(len(windows)):
        s, start, stop = windows[key]
        got = prefetcher.take(windows[key], sequences[s], start, stop)
        np.testing.assert_array_equal(got, direct.rows(sequences[s], start, stop))
    prefetcher.close()


def test_the_cache_returns_the_table_rows_while_evicting_from_many_threads(tiny_table):
    cache = RowCache(DelayedRows(tiny_table, seed=3), capacity_rows=50)
    rng = np.random.default_rng(4)
    hot = rng.integers(0, tiny_table.shape[0], 40)
    batches = [
        np.concatenate(
            [hot[rng.integers(0, 40, 20)], rng.integers(0, tiny_table.shape[0], int(rng.integers(1, 80)))]
        ).reshape(-1, 1)
        for _ in range(60)
    ]
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(cache.gather, batches))
    for ids, rows in zip(batches, results):
        np.testing.assert_array_equal(rows, tiny_table[ids])
    assert len(cache) <= 50
    assert cache.stats.hits > 0 and cache.stats.misses > 0


def test_ids_depend_only_on_the_last_n_tokens(tiny_cfg):
    """What makes chunk boundaries and decode exact: a window with its history gives the ids of the
    same positions computed over the whole sequence."""
    hasher = NgramHasher(tiny_cfg.ngram_memory, tiny_cfg.vocab_size)
    tokens = np.random.default_rng(6).integers(0, VOCAB, 50).tolist()
    whole = hasher.ids(hasher.context(tokens, 0, 50))
    for start, stop in ((0, 1), (1, 2), (2, 17), (17, 50), (49, 50)):
        np.testing.assert_array_equal(hasher.ids(hasher.context(tokens, start, stop)), whole[:, start:stop])
    # token 37 is read by the n-grams (orders <= 3) ending at 37, 38 and 39, and by none after
    changed = list(tokens)
    changed[37] = (changed[37] + 1) % VOCAB
    other = hasher.ids(hasher.context(changed, 0, 50))
    np.testing.assert_array_equal(other[:, 40:], whole[:, 40:])
    assert (other[:, 37:40] != whole[:, 37:40]).any()


def test_every_head_has_its_own_prime_slice(tiny_cfg):
    hasher = NgramHasher(tiny_cfg.ngram_memory, tiny_cfg.vocab_size)
    primes = hasher.primes.reshape(-1)
    assert len(set(primes.tolist())) == len(primes)
    assert (
        hasher.total_rows
        == primes.sum()
        <= tiny_cfg.ngram_memory.table_rows * len(tiny_cfg.ngram_memory.layers)
    )
    ids = hasher.ids(hasher.context(np.arange(200) % VOCAB, 0, 200))  # [L, T, heads]
    lo = hasher.offsets.reshape(len(tiny_cfg.ngram_memory.layers), -1)[:, None, :]
    assert ((ids >= lo) & (ids < lo + hasher.primes.reshape(lo.shape))).all()
