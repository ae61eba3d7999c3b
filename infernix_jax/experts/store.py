"""The host-side homes of experts without a device slot: host RAM and the artifact on disk.

- Host tier: an expert's packed leaves as numpy arrays in RAM, with a CRC32 taken when they were
  stored; every read checks it, so corrupted memory fails the read instead of the output.
- Disk tier: the expert stays in the artifact (TensorStore zarr3, one chunk per expert) and is
  read on demand. Reads run on a small thread pool; `read_ahead` starts reads that a coming
  layer is likely to need (the experts it missed last step) and keeps them in a bounded cache.
  An I/O error (a missing or damaged chunk) is an `ExpertReadError`.

Failures are injectable (`inject_fault`) so that tests exercise the same error path as a real
disk or memory fault: the error propagates out of the step that needed the expert.
"""

from __future__ import annotations

import threading
import zlib
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from infernix_jax.experts.layout import ExpertLayout, Leaves
from infernix_jax.weights.artifact import Artifact

HOST, DISK = "host", "disk"
FAULT_KINDS = ("io", "checksum")


class ExpertReadError(RuntimeError):
    """An expert could not be read (I/O error, checksum mismatch); fails the step that needed it."""


def checksum(leaves: Leaves) -> int:
    crc = 0
    for a in leaves:
        crc = zlib.crc32(np.asarray(a, order="C").reshape(-1).view(np.uint8), crc)
    return crc


def _as_float(a: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """`a` cast to `dtype` when both are floating point (bf16 / f32 / f16 / float8), else as is."""
    if a.dtype == dtype or not (
        jnp.issubdtype(a.dtype, jnp.floating) and jnp.issubdtype(dtype, jnp.floating)
    ):
        return a
    return a.astype(dtype)


class ExpertStore:
    """Experts in host RAM (`host`) and in the artifact (`disk`); layer indices are MoE-layer ranks."""

    def __init__(
        self,
        layout: ExpertLayout,
        artifact: Artifact | None = None,
        artifact_paths: dict[int, tuple[str, str, str]] | None = None,
        read_threads: int = 4,
        read_cache_experts: int = 64,
        verify_host_reads: bool = False,
    ):
        """artifact_paths: MoE-layer rank -> the artifact leaf paths of its (gate, up, down) stacks."""
        self.layout = layout
        self.artifact = artifact
        self.artifact_paths = artifact_paths or {}
        self._host: dict[tuple[int, int], tuple[Leaves, int]] = {}
        self._host_counts: dict[int, int] = {}
        self._pool = ThreadPoolExecutor(max_workers=read_threads, thread_name_prefix="expert-read")
        self._ahead: OrderedDict[tuple[int, int], Future] = OrderedDict()
        self._ahead_limit = read_cache_experts
        self._faults: dict[tuple[int, int], str] = {}
        self._lock = threading.Lock()
        self.verify_host_reads = (
            verify_host_reads  # CRC32 every host read (~4 GB/s of CPU time; off: see docs)
        )

    # ---- tiers ---------------------------------------------------------------------------------
    @property
    def has_disk(self) -> bool:
        return self.artifact is not None

    def put_host(self, layer: int, expert: int, leaves: Leaves) -> None:
        leaves = [np.asarray(a, order="C") for a in leaves]  # (ascontiguousarray would make 0-d arrays 1-d)
        if (layer, expert) not in self._host:
            self._host_counts[layer] = self._host_counts.get(layer, 0) + 1
        self._host[(layer, expert)] = (leaves, checksum(leaves))

    def drop_host(self, layer: int, expert: int) -> None:
        if self._host.pop((layer, expert), None) is not None:
            self._host_counts[layer] -= 1

    def in_host(self, layer: int, expert: int) -> bool:
        return (layer, expert) in self._host

    def host_count(self, layer: int) -> int:
        return self._host_counts.get(layer, 0)

    @property
    def host_experts(self) -> int:
        """Experts held in host RAM, all layers."""
        return len(self._host)

    @property
    def host_bytes(self) -> int:
        return len(self._host) * self.layout.expert_bytes

    def tier_of(self, layer: int, expert: int) -> str:
        return HOST if (layer, expert) in self._host else DISK

    # ---- faults (tests) ------------------------------------------------------------------------
    def inject_fault(self, layer: int, expert: int, kind: str = "io") -> None:
        """Make the next read of (layer, expert) fail: "io" raises as a failed disk read would,
        "checksum" corrupts the bytes so that the checksum test catches them."""
        if kind not in FAULT_KINDS:
            raise ValueError(f"fault kind must be one of {FAULT_KINDS}, got {kind!r}")
        self._faults[(layer, expert)] = kind

    def clear_faults(self) -> None:
        with self._lock:
            self._faults.clear()

    def _take_fault(self, layer: int, expert: int) -> str | None:
        with self._lock:
            return self._faults.pop((layer, expert), None)

    # ---- reads ---------------------------------------------------------------------------------
    def read(self, layer: int, expert: int) -> Leaves:
        """One expert's leaves from its home tier (host, else disk). Raises ExpertReadError."""
        if (layer, expert) in self._host:
            return self._read_host(layer, expert)
        return self._wait(layer, expert, self._disk_future(layer, expert))

    def read_many(self, layer: int, experts: list[int]) -> list[Leaves]:
        """Several experts of one layer; disk reads run in parallel."""
        futures = {e: self._disk_future(layer, e) for e in experts if (layer, e) not in self._host}
        return [
            self._read_host(layer, e) if e not in futures else self._wait(layer, e, futures[e])
            for e in experts
        ]

    def read_ahead(self, layer: int, experts: list[int]) -> None:
        """Start disk reads of experts a coming step will likely need (no-op for host experts)."""
        for e in experts:
            if (layer, e) not in self._host and self.has_disk:
                self._disk_future(layer, e, keep=True)

    def _read_host(self, layer: int, expert: int) -> Leaves:
        leaves, crc = self._host[(layer, expert)]
        fault = self._take_fault(layer, expert)
        if fault == "io":
            raise ExpertReadError(
                f"expert {expert} of MoE layer {layer}: host read failed (injected I/O error)"
            )
        if fault == "checksum":
            leaves = [a.copy() for a in leaves]
            leaves[0].view(np.uint8).reshape(-1)[0] ^= 0xFF
        if (self.verify_host_reads or fault) and checksum(leaves) != crc:
            raise ExpertReadError(f"expert {expert} of MoE layer {layer}: checksum mismatch in host memory")
        return leaves

    def _disk_future(self, layer: int, expert: int, keep: bool = False) -> tuple[Future, bool]:
        """(a read of the expert, whether it was started earlier by read_ahead)."""
        with self._lock:
            future = self._ahead.pop((layer, expert), None)
            early = future is not None
            if future is None:
                future = self._pool.submit(self._read_disk, layer, expert)
            if keep:
                self._ahead[(layer, expert)] = future
                while len(self._ahead) > self._ahead_limit:
                    self._ahead.popitem(last=False)
            return future, early

    def _wait(self, layer: int, expert: int, read: tuple[Future, bool]) -> Leaves:
        future, early = read
        try:
            return future.result()
        except Exception as e:
            if early:  # a read-ahead that failed is read again: its failure must not outlive its step
                return self._wait(layer, expert, (self._pool.submit(self._read_disk, layer, expert), False))
            if isinstance(e, ExpertReadError):
                raise
            raise ExpertReadError(f"expert {expert} of MoE layer {layer}: disk read failed: {e}") from e

    def _read_disk(self, layer: int, expert: int) -> Leaves:
        if self.artifact is None:
            raise ExpertReadError(
                f"expert {expert} of MoE layer {layer} has no home: no host copy and no artifact"
            )
        fault = self._take_fault(layer, expert)
        if fault == "io":
            raise ExpertReadError(
                f"expert {expert} of MoE layer {layer}: disk read failed (injected I/O error)"
            )
        values = tuple(self.artifact.read_expert(path, expert) for path in self.artifact_paths[layer])
        leaves = [np.asarray(a) for a in jax.tree.leaves(values)]
        if fault == "checksum":
            raise ExpertReadError(
                f"expert {expert} of MoE layer {layer}: checksum mismatch on disk (injected)"
            )
        want = list(zip(self.layout.leaf_shapes, self.layout.leaf_dtypes))
        if len(leaves) == len(want):  # plain float experts take the model's dtype, as loading casts them
            leaves = [_as_float(a, np.dtype(d)) for a, (_s, d) in zip(leaves, want)]
        if [(a.shape, a.dtype) for a in leaves] != [(tuple(s), np.dtype(d)) for s, d in want]:
            raise ExpertReadError(
                f"expert {expert} of MoE layer {layer}: the artifact holds {[(a.shape, a.dtype.name) for a in leaves]}, "
                f"not the layout the model was built with"
            )
        return leaves

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
