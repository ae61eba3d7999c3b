"""A table volume: the n-gram memory's rows on local disk as a TensorStore zarr3 array, plus a manifest.

Layout of a volume directory:

    manifest.json   {"format": "infernix-ngram-volume", "version": 1, "shape": [rows, width],
                     "dtype", "chunk_rows", "shard_rows", "hash": {...}, "sha256"}
    table/          zarr3 array [rows, width], sharded: files of `shard_rows` rows, read by inner
                    chunks of `chunk_rows` rows (one small read per row looked up)

The "hash" record holds every parameter that decides which row a token window reads (orders, heads,
row budget, layers, seed, pad id and a fingerprint of the primes and multipliers); "sha256" is the
digest of the table's bytes in row order. `open_volume` checks all of it against the model and
names each mismatch; `verify_volume` re-reads the data and checks the digest (slow: reads it all).
The volume is never loaded whole: `VolumeRows.read` reads the chunks that hold the asked rows.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import tensorstore as ts

from infernix_jax.config import ModelConfig
from infernix_jax.ngram.hashing import NgramHasher

FORMAT = "infernix-ngram-volume"
VERSION = 1
MANIFEST = "manifest.json"
TABLE_DIR = "table"
CHUNK_BYTES = 8 << 10  # an inner chunk (the unit one row read fetches) holds about this many bytes
SHARD_BYTES = 64 << 20  # a shard file holds about this many bytes


class NgramVolumeError(ValueError):
    """The volume is missing, damaged, or does not belong to this model."""


def table_dtype(name: str) -> np.dtype:
    """numpy dtype of a config's table_dtype name (bfloat16 through ml_dtypes, as JAX uses)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def hash_record(cfg: ModelConfig) -> dict[str, Any]:
    """What the manifest's "hash" must equal for `cfg`'s memory."""
    spec = cfg.ngram_memory
    hasher = NgramHasher(spec, cfg.vocab_size)
    return {
        "orders": list(spec.orders),
        "heads_per_order": spec.heads_per_order,
        "table_rows": spec.table_rows,
        "row_width": spec.row_width,
        "layers": list(spec.layers),
        "seed": spec.seed,
        "pad_id": hasher.pad,
        "fingerprint": hasher.fingerprint,
    }


def expected_shape(cfg: ModelConfig) -> tuple[int, int]:
    spec = cfg.ngram_memory
    return NgramHasher(spec, cfg.vocab_size).total_rows, spec.row_width


def _store_spec(path: Path) -> dict[str, Any]:
    return {
        "driver": "zarr3",
        "kvstore": {"driver": "file", "path": str(path)},
        # shard indexes stay cached; data rows are cached by RowCache, not here
        "context": {"cache_pool": {"total_bytes_limit": 256 << 20}},
    }


def _geometry(rows: int, width: int, itemsize: int) -> tuple[int, int]:
    row_bytes = width * itemsize
    chunk_rows = max(1, CHUNK_BYTES // row_bytes)
    shard_rows = max(chunk_rows, (SHARD_BYTES // row_bytes) // chunk_rows * chunk_rows)
    return chunk_rows, min(shard_rows, -(-rows // chunk_rows) * chunk_rows)


def write_volume(
    path: str | os.PathLike,
    cfg: ModelConfig,
    table: Any,
    progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Write `table` ([rows, width]: a numpy array, memmap, safetensors slice or anything sliceable by
    row ranges with .shape) as a volume for `cfg`'s memory, one shard at a time. Returns the manifest.

    Raises NgramVolumeError when the table's shape is not the one the model's hashing addresses.
    """
    if cfg.ngram_memory is None:
        raise NgramVolumeError("the model config has no ngram_memory")
    shape = tuple(int(d) for d in table.shape)
    want = expected_shape(cfg)
    if shape != want:
        raise NgramVolumeError(
            f"the table is {list(shape)} but this model's n-gram memory addresses {list(want)} "
            "(rows = sum of the heads' primes, see docs/ngram_memory.md)"
        )
    dtype = table_dtype(cfg.ngram_memory.table_dtype)
    rows, width = shape
    chunk_rows, shard_rows = _geometry(rows, width, dtype.itemsize)
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    (root / MANIFEST).unlink(missing_ok=True)  # a half-written volume has no manifest
    store = ts.open(
        {
            **_store_spec(root / TABLE_DIR),
            "metadata": {
                "shape": [rows, width],
                "data_type": dtype.name,
                "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [shard_rows, width]}},
                "codecs": [
                    {
                        "name": "sharding_indexed",
                        "configuration": {"chunk_shape": [chunk_rows, width], "codecs": [{"name": "bytes"}]},
                    }
                ],
            },
        },
        create=True,
        delete_existing=True,
    ).result()
    digest = hashlib.sha256()
    pending = None  # the previous shard's write runs while the next shard is read and hashed
    for start in range(0, rows, shard_rows):
        stop = min(rows, start + shard_rows)
        block = np.ascontiguousarray(np.asarray(table[start:stop]).astype(dtype, copy=False))
        digest.update(memoryview(block.view(np.uint8)))
        if pending is not None:
            pending.result()
        pending = store[start:stop].write(block)
        if progress is not None:
            progress(stop, rows)
    if pending is not None:
        pending.result()
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "shape": [rows, width],
        "dtype": dtype.name,
        "chunk_rows": chunk_rows,
        "shard_rows": shard_rows,
        "hash": hash_record(cfg),
        "sha256": digest.hexdigest(),
    }
    tmp = root / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, root / MANIFEST)
    return manifest


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    file = Path(path) / MANIFEST
    if not file.exists():
        raise NgramVolumeError(
            f"{path} is not an n-gram table volume (no {MANIFEST}; was it written completely?)"
        )
    manifest = json.loads(file.read_text())
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise NgramVolumeError(
            f"{path}: unknown volume format {manifest.get('format')!r} version {manifest.get('version')!r}"
        )
    return manifest


def check_manifest(manifest: dict[str, Any], cfg: ModelConfig, where: str = "the volume") -> None:
    """Raise NgramVolumeError naming every way the manifest disagrees with the model's memory."""
    spec = cfg.ngram_memory
    if spec is None:
        raise NgramVolumeError("an n-gram volume was given but the model config has no ngram_memory")
    problems = []
    shape = list(expected_shape(cfg))
    if manifest["shape"] != shape:
        problems.append(f"shape {manifest['shape']} but the model addresses {shape}")
    dtype = table_dtype(spec.table_dtype).name
    if manifest["dtype"] != dtype:
        problems.append(f"dtype {manifest['dtype']} but the model's table_dtype is {dtype}")
    want = hash_record(cfg)
    for key, value in want.items():
        if manifest["hash"].get(key) != value:
            problems.append(f"hash {key} {manifest['hash'].get(key)!r} but the model has {value!r}")
    if spec.table_sha256 and manifest.get("sha256") != spec.table_sha256:
        problems.append(
            f"sha256 {manifest.get('sha256')} but the model's table_sha256 is {spec.table_sha256}"
        )
    if problems:
        raise NgramVolumeError(f"{where} does not match this model's n-gram memory: " + "; ".join(problems))


class VolumeRows:
    """A volume's table as a `RowSource`: each read fetches only the chunks holding the asked rows."""

    def __init__(self, path: str | os.PathLike, manifest: dict[str, Any]):
        self.path = Path(path)
        self.manifest = manifest
        self.store = ts.open(
            {**_store_spec(self.path / TABLE_DIR), "fill_missing_data_reads": False}, open=True
        ).result()
        self.shape = tuple(int(d) for d in self.store.shape)
        self.dtype = table_dtype(manifest["dtype"])
        if list(self.shape) != manifest["shape"]:
            raise NgramVolumeError(
                f"{path}: the table is {list(self.shape)}, its manifest says {manifest['shape']}"
            )

    def read(self, ids: np.ndarray) -> np.ndarray:
        if len(ids) == 0:
            return np.zeros((0, self.shape[1]), self.dtype)
        return np.asarray(self.store[np.asarray(ids, np.int64)].read().result())

    def read_range(self, start: int, stop: int) -> np.ndarray:
        return np.asarray(self.store[start:stop].read().result())


def open_volume(path: str | os.PathLike, cfg: ModelConfig, verify: bool = False) -> VolumeRows:
    """Open a volume for `cfg`'s memory; raises NgramVolumeError when it does not match the model.
    verify: also re-read the whole table and compare its sha256 with the manifest's."""
    manifest = read_manifest(path)
    check_manifest(manifest, cfg, where=f"the n-gram volume {path}")
    rows = VolumeRows(path, manifest)
    if verify:
        verify_volume(rows)
    return rows


def verify_volume(rows: VolumeRows) -> None:
    """Re-hash the table's bytes (shard by shard) and compare with the manifest's sha256."""
    digest = hashlib.sha256()
    step = int(rows.manifest["shard_rows"])
    for start in range(0, rows.shape[0], step):
        block = np.ascontiguousarray(rows.read_range(start, min(rows.shape[0], start + step)))
        digest.update(memoryview(block.view(np.uint8)))
    if digest.hexdigest() != rows.manifest["sha256"]:
        raise NgramVolumeError(
            f"the n-gram volume {rows.path} is damaged: its data hashes to {digest.hexdigest()}, "
            f"its manifest says {rows.manifest['sha256']}"
        )
