"""How many KV blocks and state slots to allocate, from the device's memory and the weights' size.

Three ways to size the KV pool (state slots are always `max_concurrency` + the scratch slot):

- ``kv_capacity="auto"`` (default, no `max_context`): fill what the weights leave.
  budget = device_bytes * gpu_memory_utilization - weights_bytes - safety_margin_bytes;
  the state slots are taken first and the rest becomes KV blocks.
- an explicit ``max_context``: exactly max_concurrency * ceil(max_context / 64) blocks (+ the
  null block), so every admitted sequence can reach max_context; an error if that does not fit.
- ``kv_capacity`` explicit: an int (or a string of digits) is a number of usable blocks, as
  `EngineConfig.kv_capacity` means it; a string with a unit ("24GiB", "500MB") is a byte budget
  for the KV blocks. Either is checked against the memory budget.

The safety margin covers what is not weights, KV or state: XLA's workspace, the activations of
the largest bucket (a 4096-token prefill chunk, the MoE dispatch buffers), logits and fragmentation.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp

from infernix_jax.cache.allocators import BLOCK_SIZE
from infernix_jax.cache.kv_formats import get_kv_format
from infernix_jax.cache.kv_pool import kv_bytes_per_block
from infernix_jax.cache.state_pool import state_bytes_per_slot
from infernix_jax.config import ModelConfig

GiB = 1 << 30
MiB = 1 << 20
DEFAULT_SAFETY_MARGIN_BYTES = 2 * GiB
RESERVED_BLOCKS = 1  # the null block
RESERVED_SLOTS = 1  # the scratch slot


class CapacityError(ValueError):
    """The requested KV capacity does not fit in the device memory left by the weights."""


@dataclass(frozen=True)
class CapacityPlan:
    """What the engine allocates at start, and the arithmetic behind it."""

    kv_dtype: str  # storage format of the KV pool
    num_blocks: int  # KV blocks in the pool, the null block included
    num_slots: int  # state slots, the scratch slot included
    bytes_per_block: int  # one block across all attention (and MTP) layers
    bytes_per_slot: int  # one slot across all linear-attention layers
    bytes_kv: int  # num_blocks * bytes_per_block
    bytes_state: int  # num_slots * bytes_per_slot
    max_concurrency: int  # sequences running at once
    max_context: int  # tokens one sequence may reach (prompt + output)
    mode: str  # "auto", "max_context", "blocks" or "bytes": how num_blocks was chosen
    weights_bytes: int
    device_bytes: int
    gpu_memory_utilization: float
    safety_margin_bytes: int

    @property
    def usable_blocks(self) -> int:
        return self.num_blocks - RESERVED_BLOCKS

    @property
    def token_capacity(self) -> int:
        """Tokens of KV the pool holds across all sequences."""
        return self.usable_blocks * BLOCK_SIZE

    @property
    def budget_bytes(self) -> int:
        """What KV and state may use: device * utilization - weights - margin."""
        return _budget(
            self.device_bytes, self.gpu_memory_utilization, self.weights_bytes, self.safety_margin_bytes
        )

    def describe(self) -> str:
        """The plan in words, for the start-up log."""
        how = {
            "auto": "filling the memory the weights leave",
            "max_context": f"sized for {self.max_concurrency} sequences of {self.max_context:,} tokens",
            "blocks": "sized by the kv_capacity block count",
            "bytes": "sized by the kv_capacity byte budget",
        }[self.mode]
        per_seq = self.token_capacity // max(self.max_concurrency, 1)
        lines = [
            (
                f"KV cache ({self.kv_dtype}, {how}): {self.usable_blocks:,} blocks of {BLOCK_SIZE} tokens "
                f"= {self.token_capacity:,} tokens, {_size(self.bytes_per_block)} per block, {_size(self.bytes_kv)} "
                f"in all (+1 null block); {per_seq:,} tokens per sequence when {self.max_concurrency} run at once, "
                f"max context {self.max_context:,}."
            ),
            (
                f"State slots: {self.num_slots - RESERVED_SLOTS} (+1 scratch) of {_size(self.bytes_per_slot)} "
                f"= {_size(self.bytes_state)}."
            ),
            (
                f"Device memory {_size(self.device_bytes)} x {self.gpu_memory_utilization:.2f} utilization: "
                f"weights {_size(self.weights_bytes)}, KV {_size(self.bytes_kv)}, state {_size(self.bytes_state)}, "
                f"safety margin {_size(self.safety_margin_bytes)}, unplanned "
                f"{_size(max(self.budget_bytes - self.bytes_kv - self.bytes_state, 0))}."
            ),
        ]
        return "\n".join(lines)


def plan_capacity(
    cfg: ModelConfig,
    weights_bytes: int,
    device_bytes: int,
    kv_dtype: str = "bf16",
    max_concurrency: int = 8,
    max_context: int | None = None,
    kv_capacity: str | int = "auto",
    gpu_memory_utilization: float = 0.9,
    safety_margin_bytes: int = DEFAULT_SAFETY_MARGIN_BYTES,
    dtype: Any = jnp.bfloat16,
    with_mtp: bool = False,
) -> CapacityPlan:
    """Choose the pool sizes (see the module docstring); raises CapacityError when they cannot fit.

    `dtype` is the model's compute dtype (pages of the "bf16" format, conv states); `with_mtp`
    counts the MTP layers' KV in each block.
    """
    get_kv_format(kv_dtype)  # validates the name
    if max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    if max_context is not None and max_context < 1:
        raise ValueError(f"max_context must be >= 1, got {max_context}")
    per_block = kv_bytes_per_block(cfg, kv_dtype, dtype, with_mtp)
    per_slot = state_bytes_per_slot(cfg, dtype)
    num_slots = max_concurrency + RESERVED_SLOTS
    bytes_state = num_slots * per_slot
    budget = _budget(device_bytes, gpu_memory_utilization, weights_bytes, safety_margin_bytes)
    explicit_blocks, explicit_bytes = _explicit_capacity(kv_capacity)

    if explicit_blocks is not None:
        mode = "blocks"
        num_blocks = explicit_blocks + RESERVED_BLOCKS
    elif explicit_bytes is not None:
        mode = "bytes"
        num_blocks = explicit_bytes // per_block if per_block else RESERVED_BLOCKS + max_concurrency
    elif max_context is not None:
        mode = "max_context"
        num_blocks = max_concurrency * math.ceil(max_context / BLOCK_SIZE) + RESERVED_BLOCKS
    else:
        mode = "auto"
        left = budget - bytes_state
        num_blocks = left // per_block if per_block else RESERVED_BLOCKS + max_concurrency
    num_blocks = int(num_blocks)
    bytes_kv = num_blocks * per_block

    shortfall = bytes_kv + bytes_state - budget
    if num_blocks < RESERVED_BLOCKS + max_concurrency or shortfall > 0:
        raise CapacityError(
            f"KV cache ({kv_dtype}, {mode}) needs {max(num_blocks, RESERVED_BLOCKS + max_concurrency):,} blocks "
            f"of {_size(per_block)} plus {_size(bytes_state)} of state slots, but only {_size(max(budget, 0))} is "
            f"left (device {_size(device_bytes)} x {gpu_memory_utilization:.2f} - weights {_size(weights_bytes)} "
            f"- margin {_size(safety_margin_bytes)}); lower max_concurrency or max_context, or use kv_dtype "
            "int8/fp8"
        )
    if max_context is None:
        max_context = min(cfg.max_position_embeddings, (num_blocks - RESERVED_BLOCKS) * BLOCK_SIZE)
    return CapacityPlan(
        kv_dtype=kv_dtype,
        num_blocks=num_blocks,
        num_slots=num_slots,
        bytes_per_block=per_block,
        bytes_per_slot=per_slot,
        bytes_kv=bytes_kv,
        bytes_state=bytes_state,
        max_concurrency=max_concurrency,
        max_context=int(max_context),
        mode=mode,
        weights_bytes=int(weights_bytes),
        device_bytes=int(device_bytes),
        gpu_memory_utilization=float(gpu_memory_utilization),
        safety_margin_bytes=int(safety_margin_bytes),
    )


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}  # fmt: skip


def parse_bytes(value: str | int) -> int:
    """A byte count from an int or a string such as "24GiB", "500 MB", "1.5gib"."""
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"byte size must be positive, got {value}")
        return value
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not match or match.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {value!r} as a byte size (e.g. 24GiB, 500MB, or 'auto')")
    size = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if size <= 0:
        raise ValueError(f"byte size must be positive, got {value!r}")
    return size


def _explicit_capacity(kv_capacity: str | int) -> tuple[int | None, int | None]:
    """("auto" -> (None, None)), a block count -> (blocks, None), a byte size with a unit -> (None, bytes)."""
    if kv_capacity == "auto":
        return None, None
    if isinstance(kv_capacity, int) or str(kv_capacity).strip().isdigit():
        blocks = int(kv_capacity)
        if blocks < 1:
            raise ValueError(
                f"kv_capacity must be 'auto', a positive block count or a byte size, got {kv_capacity!r}"
            )
        return blocks, None
    return None, parse_bytes(kv_capacity)


def _budget(device_bytes: int, utilization: float, weights_bytes: int, margin: int) -> int:
    return int(device_bytes * utilization) - int(weights_bytes) - int(margin)


def _size(n: int) -> str:
    if n >= GiB:
        return f"{n / GiB:.2f} GiB"
    if n >= MiB:
        return f"{n / MiB:.2f} MiB"
    return f"{n / 1024:.1f} KiB"
