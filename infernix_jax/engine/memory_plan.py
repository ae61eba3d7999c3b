"""How the engine divides device memory at start: KV blocks for the pool and, when experts are
offloaded with `gpu_expert_budget="auto"`, the bytes of routed experts kept in device slots.

Weights other than routed experts come first (they are on the device already), then the state
slots (recurrent state per sequence and prefix-cache snapshot) and speculation's per-position
states. With an automatic expert budget, KV for `max_concurrency` sequences of `max_context`
tokens comes next and the experts get the rest; the KV pool then takes what the experts leave
(`kv_capacity="auto"`). On the CPU (no memory limit) nothing is offloaded by "auto".
"""

from __future__ import annotations

import logging

import jax

from infernix_jax.cache import kv_bytes_per_block, state_bytes_per_slot
from infernix_jax.config import ModelConfig
from infernix_jax.engine.config import EngineConfig
from infernix_jax.engine.speculative.rollback import verify_state_bytes
from infernix_jax.model.params import Params, is_routed_expert_leaf
from infernix_jax.weights.hf import path_str
from infernix_jax.weights.quant import leaf_nbytes

log = logging.getLogger("infernix_jax.engine")


def device_memory() -> tuple[int, int] | None:
    """(bytes the default device may use, bytes in use now), or None where the runtime reports no
    limit (the CPU)."""
    device = jax.devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if not stats or "bytes_limit" not in stats:
        return None
    return int(stats["bytes_limit"]), int(stats.get("bytes_in_use", 0))


def _reserved_bytes(cfg: ModelConfig, config: EngineConfig, dtype) -> int:
    """State slots (every sequence, the null slot, snapshots), speculation's verify states, and
    the check way's copies of a decode batch's state slots and penalty rows (core.py; two sets
    with asynchronous decode: the dispatch read back and the one enqueued after it)."""
    per_slot = state_bytes_per_slot(cfg, dtype)
    reserved = (config.max_concurrency + 1 + config.num_snapshot_slots) * per_slot
    checked = config.check_buckets
    if config.structured_output and checked:
        penalty_row = cfg.vocab_size * 5 + 4  # seen (bool) and output counts (i32) per token
        copies = 2 if config.async_decode else 1
        reserved += copies * max(checked) * (per_slot + penalty_row)
    if config.spec != "none":  # per-position GDN states of the largest verify dispatch
        reserved += verify_state_bytes(cfg, max(config.decode_buckets), config.spec_window, dtype)
    return reserved


def _block_bytes(cfg: ModelConfig, config: EngineConfig, dtype) -> int:
    return kv_bytes_per_block(cfg, config.kv_dtype, dtype, with_mtp=config.spec_uses_mtp)


def plan_blocks(cfg: ModelConfig, config: EngineConfig, dtype, params: Params) -> int:
    """KV blocks in the pool (the null block included), from kv_capacity or the memory budget."""
    per_sequence = config.max_blocks_per_sequence
    if config.kv_capacity != "auto":
        return int(config.kv_capacity) + 1
    wanted = config.max_concurrency * per_sequence + 1
    memory = device_memory()
    if memory is None:  # the CPU: room for every sequence at full length
        return wanted
    limit, in_use = memory
    weights = sum(leaf_nbytes(x) for x in jax.tree.leaves(params))
    # the weights are normally on the device already and so inside bytes_in_use: count them once
    budget = (
        limit * config.gpu_memory_utilization - max(weights, in_use) - _reserved_bytes(cfg, config, dtype)
    )
    affordable = int(budget // _block_bytes(cfg, config, dtype))
    if affordable < per_sequence + 1:
        raise ValueError(
            f"memory for {affordable} KV blocks, fewer than one sequence of {config.max_context} "
            f"tokens needs ({per_sequence}); lower max_context or free memory"
        )
    return min(wanted, affordable)


def auto_expert_budget(cfg: ModelConfig, config: EngineConfig, dtype, params: Params) -> int | str:
    """Device bytes for routed experts under `gpu_expert_budget="auto"`: what the device has left
    after the other weights, the state slots and KV for every sequence at full length; "all" when
    every expert fits or the device reports no limit. At least one slot per layer is kept anyway
    (`experts_in_budget`); the KV pool then shrinks to what remains."""
    memory = device_memory()
    if memory is None:
        return "all"
    limit, in_use = memory
    leaves = jax.tree_util.tree_leaves_with_path(params)
    routed = [is_routed_expert_leaf(path_str(path)) for path, _ in leaves]
    experts = [leaf for (_, leaf), r in zip(leaves, routed) if r]
    others = sum(leaf_nbytes(leaf) for (_, leaf), r in zip(leaves, routed) if not r)
    experts_on_device = sum(leaf_nbytes(leaf) for leaf in experts if isinstance(leaf, jax.Array))
    weights = max(others, in_use - experts_on_device)
    kv = (config.max_concurrency * config.max_blocks_per_sequence + 1) * _block_bytes(cfg, config, dtype)
    left = int(limit * config.gpu_memory_utilization - weights - _reserved_bytes(cfg, config, dtype) - kv)
    total = sum(leaf_nbytes(leaf) for leaf in experts)
    log.info(
        "gpu_expert_budget auto: %.2f GiB of %.2f GiB of routed experts (after %.2f GiB of other weights "
        "and %.2f GiB of KV for %d x %d tokens)",
        max(left, 0) / 2**30, total / 2**30, weights / 2**30, kv / 2**30, config.max_concurrency, config.max_context,
    )  # fmt: skip
    if left >= total:
        return "all"
    return max(left, 0)
