"""Wiring the prefix cache into the engine: its salt, its device, and its file at start and shutdown."""

from __future__ import annotations

import hashlib
import logging
import os

import jax
import numpy as np

from infernix_jax.cache.allocators import BlockAllocator
from infernix_jax.cache.prefix_cache import PoolDevice, PrefixCache
from infernix_jax.cache.prefix_file import PrefixFileError, load_prefix_file, save_prefix_file
from infernix_jax.cache.prefix_index import PrefixIndex, cache_salt
from infernix_jax.config import ModelConfig
from infernix_jax.engine.config import EngineConfig
from infernix_jax.model.params import Params, is_routed_expert_leaf
from infernix_jax.weights.hf import path_str

log = logging.getLogger(__name__)

SAMPLE_VALUES = 4096  # values of each sampled tensor that go into the weights fingerprint


def weights_fingerprint(params: Params) -> str:
    """A digest of the model's weights from a sample of every tensor (cheap, and different for any
    two checkpoints in practice): the shape of each leaf and values of its first and last rows.

    Routed expert stacks count by shape only: wherever they live (device, host RAM, an artifact
    not read yet; see docs/experts.md) the outputs and so the cached KV are the same, and a
    restart with another expert budget still hits the cache file."""
    h = hashlib.blake2b(digest_size=16)
    for path, leaf in jax.tree_util.tree_leaves_with_path(params):
        h.update(str((leaf.shape, str(leaf.dtype))).encode())
        if is_routed_expert_leaf(path_str(path)):
            continue
        if leaf.ndim == 0:
            h.update(np.asarray(jax.device_get(leaf)).tobytes())
            continue
        lead = leaf.ndim - 1
        for row in (leaf[(0,) * lead], leaf[(-1,) * lead]):  # small slices: nothing large is copied
            h.update(np.asarray(jax.device_get(row[:SAMPLE_VALUES])).tobytes())
    return h.hexdigest()


def build_prefix_cache(
    cfg: ModelConfig,
    fingerprint: str,
    dtype,
    config: EngineConfig,
    blocks: BlockAllocator,
    device: PoolDevice,
) -> PrefixCache:
    """A cache salted with the model (config and `weights_fingerprint`), the KV format and the
    compute dtype."""
    salt = cache_salt(repr(cfg), fingerprint, config.kv_dtype, str(dtype))
    index = PrefixIndex(salt, stateful=bool(cfg.linear_attention_layers))
    slots = device.snapshot_slots if index.stateful else range(0)
    return PrefixCache(index, blocks, device, slots, config.prefix_cache_host_bytes)


def load_prefix_cache(cache: PrefixCache, path: str | os.PathLike) -> int:
    """Load a saved cache into the host tier. A missing file starts empty; an unusable one (another
    model, another version, truncated, corrupt) is ignored with a warning. Returns entries loaded."""
    if not os.path.exists(path):
        log.info("prefix cache file %s does not exist yet; starting empty", path)
        return 0
    try:
        entries = load_prefix_file(path, cache.index.salt)
    except (PrefixFileError, OSError) as exc:
        log.warning("ignoring prefix cache file %s: %s", path, exc)
        return 0
    added = cache.import_entries(entries)
    log.info("prefix cache: loaded %d of %d entries from %s", added, len(entries), path)
    return added


def save_prefix_cache(cache: PrefixCache, path: str | os.PathLike) -> int:
    """Write the whole cache (GPU entries read back) to `path` atomically. Returns entries written."""
    try:
        written = save_prefix_file(path, cache.index.salt, cache.export_entries())
    except OSError as exc:
        log.warning("could not save the prefix cache to %s: %s", path, exc)
        return 0
    log.info("prefix cache: saved %d entries to %s", written, path)
    return written
