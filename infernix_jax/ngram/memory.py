"""`NgramTable`: token windows in, the gathered memory rows out (hashing + the host row cache).

`rows(tokens, start, stop)` returns what the model's memory layers read for positions
[start, stop) of a sequence: [L, stop - start, heads, width] in the table's dtype, L = memory
layers. It needs the whole token list only for the `max_order - 1` tokens before `start`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from infernix_jax.config import ModelConfig
from infernix_jax.ngram.hashing import NgramHasher
from infernix_jax.ngram.rows import ArrayRows, RowCache, RowSource
from infernix_jax.ngram.volume import NgramVolumeError, expected_shape, open_volume, table_dtype

DEFAULT_CACHE_BYTES = 1 << 30  # host cache of hot rows when none is given


class NgramTable:
    """The n-gram memory's rows for one model: hashing, a bounded host cache and a row source."""

    def __init__(self, cfg: ModelConfig, source: RowSource, cache_bytes: int = DEFAULT_CACHE_BYTES):
        if cfg.ngram_memory is None:
            raise NgramVolumeError("the model config has no ngram_memory")
        self.spec = cfg.ngram_memory
        self.hasher = NgramHasher(self.spec, cfg.vocab_size)
        want = (self.hasher.total_rows, self.spec.row_width)
        if tuple(source.shape) != want:
            raise NgramVolumeError(
                f"the n-gram table is {list(source.shape)} but this model addresses {list(want)}"
            )
        row_bytes = self.spec.row_width * np.dtype(source.dtype).itemsize
        self.cache = RowCache(source, cache_bytes // row_bytes)
        self.dtype = source.dtype

    @property
    def num_layers(self) -> int:
        return len(self.spec.layers)

    def rows(self, tokens: Sequence[int], start: int, stop: int) -> np.ndarray:
        """[L, stop - start, heads, width] rows for positions [start, stop) of `tokens`."""
        ids = self.hasher.ids(self.hasher.context(tokens, start, stop))
        return self.cache.gather(ids)

    def empty(self, *shape: int) -> np.ndarray:
        """Zero rows [L, *shape, heads, width] (padding rows and positions)."""
        return np.zeros((self.num_layers, *shape, self.spec.num_heads, self.spec.row_width), self.dtype)


def table_in_memory(
    cfg: ModelConfig, table: np.ndarray, cache_bytes: int = DEFAULT_CACHE_BYTES
) -> NgramTable:
    """An NgramTable over a table held in RAM (tests, benchmarks, small models)."""
    return NgramTable(
        cfg, ArrayRows(np.asarray(table).astype(table_dtype(cfg.ngram_memory.table_dtype))), cache_bytes
    )


def table_from_volume(
    cfg: ModelConfig, path: str | os.PathLike, cache_bytes: int = DEFAULT_CACHE_BYTES, verify: bool = False
) -> NgramTable:
    """An NgramTable over a volume on disk (checked against the model; NgramVolumeError if it differs)."""
    return NgramTable(cfg, open_volume(path, cfg, verify=verify), cache_bytes)


def random_table(cfg: ModelConfig, seed: int = 0, scale: float = 1.0) -> np.ndarray:
    """A random table in the shape `cfg`'s memory addresses (tests and benchmarks)."""
    rows, width = expected_shape(cfg)
    values = np.random.default_rng(seed).standard_normal((rows, width), np.float32) * scale
    return values.astype(table_dtype(cfg.ngram_memory.table_dtype))
