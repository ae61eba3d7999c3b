"""Storage formats of the paged KV pool: how one token's K or V head vector is stored and read back.

A format is a small strategy object (`KVFormat`) chosen by name (`kv_dtype` on the command line):

- ``bf16``: the model's own dtype (bfloat16 in serving, float32 in CPU tests), no scales.
- ``int8``: symmetric, one float32 scale per token per KV head: scale = amax / 127,
  stored = round(x / scale) in [-127, 127].
- ``fp8``: float8 e4m3 (``float8_e4m3fn``, finite max 448), one float32 scale per token per KV head:
  scale = amax / 448, stored = x / scale rounded to the nearest e4m3 value.

Scales are kept per token (not per block) so that writing a token never rescales its neighbours:
decode appends one token at a time into a partly filled block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp


@dataclass(frozen=True)
class KVFormat:
    """One storage format: the stored dtype and, for quantized formats, the largest stored magnitude."""

    name: str
    storage_dtype: Any | None  # None: stored in the model dtype, unscaled
    max_stored: float = 0.0  # quantized formats: |stored| <= max_stored; scale = amax / max_stored

    @property
    def quantized(self) -> bool:
        return self.storage_dtype is not None

    def page_dtype(self, model_dtype: Any) -> jnp.dtype:
        """The dtype of the pages for a model computing in `model_dtype`."""
        return jnp.dtype(model_dtype if self.storage_dtype is None else self.storage_dtype)

    def page_itemsize(self, model_dtype: Any) -> int:
        return self.page_dtype(model_dtype).itemsize

    def scale_itemsize(self) -> int:
        """Bytes of scale per token per KV head (0 for unscaled formats)."""
        return jnp.dtype(SCALE_DTYPE).itemsize if self.quantized else 0

    def quantize(self, x: jax.Array, model_dtype: Any) -> tuple[jax.Array, jax.Array | None]:
        """x [..., Dh] -> (stored [..., Dh], scale [...] float32 or None)."""
        if not self.quantized:
            return x.astype(model_dtype), None
        x32 = x.astype(jnp.float32)
        amax = jnp.max(jnp.abs(x32), axis=-1)
        scale = jnp.where(amax > 0, amax / self.max_stored, 1.0).astype(SCALE_DTYPE)
        scaled = jnp.clip(x32 / scale[..., None], -self.max_stored, self.max_stored)
        if jnp.issubdtype(self.storage_dtype, jnp.integer):
            scaled = jnp.round(scaled)
        return scaled.astype(self.storage_dtype), scale

    def dequantize(self, stored: jax.Array, scale: jax.Array | None, dtype: Any) -> jax.Array:
        """(stored [..., Dh], scale [...]) -> values [..., Dh] in `dtype`."""
        if scale is None:
            return stored.astype(dtype)
        return (stored.astype(jnp.float32) * scale[..., None].astype(jnp.float32)).astype(dtype)


SCALE_DTYPE = jnp.float32

BF16 = KVFormat("bf16", None)
INT8 = KVFormat("int8", jnp.int8, 127.0)
FP8 = KVFormat("fp8", jnp.float8_e4m3fn, 448.0)

KV_FORMATS: dict[str, KVFormat] = {f.name: f for f in (BF16, INT8, FP8)}


def get_kv_format(name: str) -> KVFormat:
    """The format called `name` ("bf16", "int8" or "fp8")."""
    try:
        return KV_FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown kv_dtype {name!r}; supported: {', '.join(KV_FORMATS)}") from None
