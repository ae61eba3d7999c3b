"""The paged KV pool of the full-attention layers: 64-token blocks shared through block tables.

Layout (letters as elsewhere: N blocks, P = BLOCK_SIZE tokens a block, K kv heads, Dh head dim,
B batch rows, M blocks a row may span):

- `KVPages`: one layer's storage, k_pages / v_pages [N, P, K, Dh] in the format's dtype and, for
  quantized formats, k_scales / v_scales [N, P, K] float32 (one scale per token per head).
- `PagedKV`: the per-layer view the forward receives: those pages plus block_table [B, M] int32.
  Token position p of row b lives at (block_table[b, p // P], p % P).
- `KVPool`: the pages of every full-attention layer (and of the MTP layers when asked for).

Block 0 is the null block (see allocators.py): padding rows point at it and writes to it are dropped.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp

from infernix_jax.cache.allocators import BLOCK_SIZE, NULL_BLOCK
from infernix_jax.cache.attention_choice import use_decode_kernel, use_prefill_kernel
from infernix_jax.cache.kv_formats import SCALE_DTYPE, get_kv_format
from infernix_jax.cache.sequence import ContiguousKV
from infernix_jax.config import ModelConfig


def _pytree(cls):
    """A dataclass registered as a pytree; fields marked static=True are metadata (part of the treedef)."""
    cls = dataclass(cls)
    fields = dataclasses.fields(cls)
    meta = [f.name for f in fields if f.metadata.get("static")]
    data = [f.name for f in fields if not f.metadata.get("static")]
    return jax.tree_util.register_dataclass(cls, data_fields=data, meta_fields=meta)


def _static(default=dataclasses.MISSING):
    return field(default=default, metadata={"static": True})


@_pytree
class KVPages:
    """KV storage of one attention layer."""

    k_pages: jax.Array  # [N, P, K, Dh] storage dtype
    v_pages: jax.Array  # [N, P, K, Dh]
    k_scales: jax.Array | None  # [N, P, K] float32 (quantized formats), else None
    v_scales: jax.Array | None
    kv_format: str = _static("bf16")  # "bf16" | "int8" | "fp8"

    @property
    def num_blocks(self) -> int:
        return self.k_pages.shape[0]

    def view(self, block_table: jax.Array) -> PagedKV:
        """The forward's view of these pages for the rows of `block_table` [B, M]."""
        return PagedKV(self.k_pages, self.v_pages, self.k_scales, self.v_scales, block_table, self.kv_format)


@_pytree
class PagedKV:
    """One attention layer's KV for B rows, read and written through their block tables."""

    k_pages: jax.Array  # [N, P, K, Dh]
    v_pages: jax.Array  # [N, P, K, Dh]
    k_scales: jax.Array | None  # [N, P, K] float32 or None
    v_scales: jax.Array | None
    block_table: jax.Array  # [B, M] int32; padding rows and unused entries hold NULL_BLOCK
    kv_format: str = _static("bf16")

    @property
    def capacity(self) -> int:
        """Tokens one row can address: M * BLOCK_SIZE."""
        return self.block_table.shape[1] * BLOCK_SIZE

    def pages(self) -> KVPages:
        """The storage without the block table (what goes back into the pool)."""
        return KVPages(self.k_pages, self.v_pages, self.k_scales, self.v_scales, self.kv_format)

    def write(self, k: jax.Array, v: jax.Array, positions: jax.Array) -> PagedKV:
        """Store k, v [B, T, K, Dh] at positions [B, T].

        Positions < 0 (padding), positions past the row's block table, and tokens whose block is
        the null block are dropped.
        """
        fmt = get_kv_format(self.kv_format)
        num_blocks = self.k_pages.shape[0]
        valid = (positions >= 0) & (positions < self.capacity)
        index = jnp.where(valid, positions // BLOCK_SIZE, 0)
        block = jnp.take_along_axis(self.block_table, index, axis=1)  # [B, T]
        block = jnp.where(valid & (block != NULL_BLOCK), block, num_blocks)  # out of range -> dropped
        offset = jnp.where(valid, positions % BLOCK_SIZE, 0)
        model_dtype = self.k_pages.dtype if not fmt.quantized else k.dtype

        def put(pages, scales, x):
            stored, scale = fmt.quantize(x, model_dtype)
            pages = pages.at[block, offset].set(stored.astype(pages.dtype), mode="drop")
            if scales is not None:
                scales = scales.at[block, offset].set(scale, mode="drop")
            return pages, scales

        k_pages, k_scales = put(self.k_pages, self.k_scales, k)
        v_pages, v_scales = put(self.v_pages, self.v_scales, v)
        return PagedKV(k_pages, v_pages, k_scales, v_scales, self.block_table, self.kv_format)

    def gather(self, dtype: Any) -> tuple[jax.Array, jax.Array]:
        """Each row's keys and values laid out by position: ([B, M*P, K, Dh], same) in `dtype`."""
        fmt = get_kv_format(self.kv_format)

        def contiguous(pages, scales):
            x = pages[self.block_table]  # [B, M, P, K, Dh]
            s = None if scales is None else scales[self.block_table]  # [B, M, P, K]
            x = fmt.dequantize(x, s, dtype)
            b, m, p, kh, dh = x.shape
            return x.reshape(b, m * p, kh, dh)

        return contiguous(self.k_pages, self.k_scales), contiguous(self.v_pages, self.v_scales)

    def attend(self, q: jax.Array, positions: jax.Array, scale: float) -> jax.Array:
        """Causal GQA attention of q [B, T, H, Dh] at positions [B, T] over each row's pages -> [B, T, H, Dh].

        On a GPU, one-token queries run the Pallas paged decode kernel and chunks of 64 tokens or
        more the paged prefill flash kernel (attention_choice.py); the rest is plain XLA: gathers
        the row's blocks into a contiguous view and runs the same masked float32-softmax attention
        as `ContiguousKV.attend` (a query at position p sees positions 0..p).
        """
        kernel, interpret = use_decode_kernel(q.shape[1])
        if kernel:
            from pallas_kernels.paged_attention import paged_decode_attention

            lengths = jnp.maximum(positions[:, 0] + 1, 0).astype(jnp.int32)  # padding rows (-1): length 0
            out = paged_decode_attention(
                q[:, 0], self.k_pages, self.v_pages, self.block_table, lengths,
                self.k_scales, self.v_scales, scale=scale, interpret=interpret,
            )  # fmt: skip
            return out[:, None].astype(q.dtype)
        kernel, interpret = use_prefill_kernel(q.shape[1], q.shape[-1])
        if kernel:
            from pallas_kernels.flash_prefill import paged_prefill_attention

            out = paged_prefill_attention(
                q, self.k_pages, self.v_pages, self.block_table, positions.astype(jnp.int32),
                self.k_scales, self.v_scales, scale=scale, interpret=interpret,
            )  # fmt: skip
            return out.astype(q.dtype)
        k, v = self.gather(q.dtype)
        return ContiguousKV(k, v).attend(q, positions, scale)


@_pytree
class KVPool:
    """Pages of every full-attention layer (in `cfg.full_attention_layers` order) and of the MTP layers."""

    layers: tuple[KVPages, ...]
    mtp: tuple[KVPages, ...] = ()

    @property
    def num_blocks(self) -> int:
        return self.layers[0].num_blocks if self.layers else (self.mtp[0].num_blocks if self.mtp else 0)


def _num_kv_layers(cfg: ModelConfig, with_mtp: bool) -> int:
    return len(cfg.full_attention_layers) + (cfg.mtp_num_layers if with_mtp else 0)


def create_kv_pool(
    cfg: ModelConfig,
    num_blocks: int,
    kv_dtype: str = "bf16",
    dtype: Any = jnp.bfloat16,
    with_mtp: bool = False,
) -> KVPool:
    """An all-zero pool of `num_blocks` blocks (block 0 included) per attention layer.

    `dtype` is the model's compute dtype: the page dtype of the "bf16" format (so float32 tests
    store float32) and the dtype quantized pages are read back in.
    """
    fmt = get_kv_format(kv_dtype)
    page_shape = (num_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
    page_dtype = fmt.page_dtype(dtype)

    def layer() -> KVPages:
        scales = (lambda: jnp.ones(page_shape[:-1], SCALE_DTYPE)) if fmt.quantized else (lambda: None)
        return KVPages(
            jnp.zeros(page_shape, page_dtype), jnp.zeros(page_shape, page_dtype), scales(), scales(), fmt.name
        )

    layers = tuple(layer() for _ in cfg.full_attention_layers)
    mtp = tuple(layer() for _ in range(cfg.mtp_num_layers)) if with_mtp else ()
    return KVPool(layers=layers, mtp=mtp)


def kv_bytes_per_block(
    cfg: ModelConfig, kv_dtype: str = "bf16", dtype: Any = jnp.bfloat16, with_mtp: bool = False
) -> int:
    """Device bytes one block costs across all attention layers (K and V, pages and scales)."""
    fmt = get_kv_format(kv_dtype)
    per_token_head = cfg.head_dim * fmt.page_itemsize(dtype) + fmt.scale_itemsize()
    return _num_kv_layers(cfg, with_mtp) * 2 * BLOCK_SIZE * cfg.num_kv_heads * per_token_head
