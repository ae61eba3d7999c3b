"""The memory of the prefix cache's host tier: pinned host RAM beside the device, or numpy.

An evicted block or snapshot is a `HostData`: one array per pool leaf, the block / slot axis
removed. Where the backend offers the `pinned_host` memory kind (the GPU backends do, and so does
jaxlib's CPU backend: `device.addressable_memories()` lists `device`, `pinned_host` and
`unpinned_host` there), those arrays are jax arrays placed in it: the copy off the device is a
`jax.device_put` that returns at once (the cache never waits for it), and the upload is a DMA from
page-locked memory with no staging copy. Elsewhere they are numpy arrays (one log line says so), and
a read waits for its copy.

Moving data never compiles anything here: `jax.device_put` between memory kinds of one device is a
transfer, and the programs that gather rows off the pools and scatter them back are the runner's,
compiled by its warm-up (infernix_jax/engine/runner.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np

from infernix_jax.cache.prefix_index import HostData

log = logging.getLogger(__name__)

PINNED_HOST = "pinned_host"


def memory_kinds(device: jax.Device) -> frozenset[str]:
    """The memory kinds a device can address ('device', 'pinned_host', ...); empty where the
    backend does not say."""
    try:
        return frozenset(m.kind for m in device.addressable_memories())
    except Exception:  # noqa: BLE001 - backends without the memories API
        return frozenset()


@dataclass(frozen=True)
class HostMemory:
    """Copies pool rows between the device and the host tier's memory (see the module docstring)."""

    device: jax.Device
    pinned: bool  # host arrays are jax arrays in pinned_host memory (else numpy)

    @classmethod
    def for_device(cls, device: jax.Device) -> HostMemory:
        """Pinned host memory when `device` offers it, else numpy; says which in the log."""
        pinned = PINNED_HOST in memory_kinds(device)
        if pinned:
            log.info("prefix cache host tier: %s memory of %s", PINNED_HOST, device)
        else:
            log.info(
                "prefix cache host tier: %s offers no %s memory; using numpy arrays", device, PINNED_HOST
            )
        return cls(device, pinned)

    @property
    def _on_host(self) -> jax.sharding.Sharding:
        return jax.sharding.SingleDeviceSharding(self.device, memory_kind=PINNED_HOST)

    @property
    def _on_device(self) -> jax.sharding.Sharding:
        return jax.sharding.SingleDeviceSharding(self.device)

    def store(self, rows: Sequence) -> list[HostData]:
        """Host copies of device rows (each a pytree of arrays): asynchronous when pinned."""
        if self.pinned:
            placed = jax.device_put(list(rows), self._on_host)
        else:
            placed = jax.device_get(list(rows))
        return [tuple(jax.tree.leaves(row)) for row in placed]

    def adopt(self, data: HostData) -> HostData:
        """Host data from elsewhere (numpy from the cache file) in this tier's memory."""
        if not self.pinned:
            return tuple(np.asarray(a) for a in data)
        return tuple(jax.device_put(list(data), self._on_host))

    def load(self, data: Sequence[HostData]) -> list[tuple[jax.Array, ...]]:
        """Device copies of host data of either kind (pinned jax arrays or numpy): asynchronous."""
        return [tuple(row) for row in jax.device_put([list(d) for d in data], self._on_device)]


def to_numpy(data: HostData) -> tuple[np.ndarray, ...]:
    """Host data as numpy arrays (what the file tier writes); waits for a copy still in flight."""
    return tuple(np.asarray(a) for a in data)
