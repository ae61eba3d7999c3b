"""PagedKV gives the attention of ContiguousKV for the same tokens, whatever the blocks' placement."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infernix_jax.cache import BLOCK_SIZE, NULL_BLOCK, BlockAllocator, ContiguousKV, KVPages, create_kv_pool
from infernix_jax.config import ModelConfig

KV_HEADS, HEADS, HEAD_DIM = 2, 6, 16
SCALE = HEAD_DIM**-0.5


def _cfg() -> ModelConfig:
    from tests.conftest import HF_FIXTURES

    cfg = ModelConfig.from_hf_config(HF_FIXTURES / "qwen3_next")
    return cfg.replace(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM)


def _scattered_block_tables(lengths, max_blocks, num_blocks, seed):
    """Block tables whose blocks are shuffled across the pool; padding rows (length 0) all null."""
    rng = np.random.default_rng(seed)
    alloc = BlockAllocator(num_blocks)
    alloc.allocate(int(rng.integers(1, 5)))  # blocks held by someone else
    free = alloc.allocate(alloc.num_free)
    rng.shuffle(free)
    table = np.full((len(lengths), max_blocks), NULL_BLOCK, np.int32)
    for row, n in enumerate(lengths):
        need = -(-n // BLOCK_SIZE)
        table[row, :need], free = free[:need], free[need:]
    return jnp.asarray(table)


def _steps(lengths, chunk):
    """Position arrays [B, T] of a chunked prefill (ragged, padded with -1) then of single tokens."""
    start = [0] * len(lengths)
    while any(s < n for s, n in zip(start, lengths)):
        width = chunk if max(n - s for s, n in zip(start, lengths)) > 1 else 1
        pos = np.full((len(lengths), width), -1, np.int32)
        for row, n in enumerate(lengths):
            take = min(width, n - start[row])
            if take > 0:
                pos[row, :take] = np.arange(start[row], start[row] + take)
                start[row] += take
        yield pos
        chunk = max(1, chunk // 3)


@pytest.mark.parametrize(
    "lengths, chunk",
    [((70, 5, 130, 0), 48), ((1, 64, 65, 128), 80), ((200,), 200)],
)
def test_paged_equals_contiguous(lengths, chunk):
    cfg = _cfg()
    max_blocks = -(-max(lengths) // BLOCK_SIZE) + 1
    pages = create_kv_pool(cfg, num_blocks=3 * len(lengths) * max_blocks, dtype=jnp.float32).layers[0]
    paged = pages.view(_scattered_block_tables(lengths, max_blocks, pages.num_blocks, seed=len(lengths)))
    shape = (len(lengths), max_blocks * BLOCK_SIZE + 7, KV_HEADS, HEAD_DIM)  # a different capacity on purpose
    contiguous = ContiguousKV(jnp.zeros(shape), jnp.zeros(shape))
    write_attend = jax.jit(lambda kv, k, v, q, pos: (kv := kv.write(k, v, pos), kv.attend(q, pos, SCALE)))
    rng = np.random.default_rng(0)
    for pos in _steps(lengths, chunk):
        b, t = pos.shape
        k, v = (rng.standard_normal((b, t, KV_HEADS, HEAD_DIM), np.float32) for _ in range(2))
        q = rng.standard_normal((b, t, HEADS, HEAD_DIM), np.float32)
        paged, out_paged = write_attend(paged, k, v, q, jnp.asarray(pos))
        contiguous, out_ref = write_attend(contiguous, k, v, q, jnp.asarray(pos))
        valid = pos >= 0
        np.testing.assert_allclose(
            np.asarray(out_paged)[valid], np.asarray(out_ref)[valid], rtol=1e-5, atol=1e-5
        )
    assert not np.asarray(paged.k_pages[NULL_BLOCK]).any(), "padding must never write the null block"


def test_write_lands_at_block_and_offset():
    cfg = _cfg()
    pages = create_kv_pool(cfg, num_blocks=8, dtype=jnp.float32).layers[0]
    paged = pages.view(jnp.asarray([[5, 2, 7]], jnp.int32))
    k = jnp.arange(3 * KV_HEADS * HEAD_DIM, dtype=jnp.float32).reshape(1, 3, KV_HEADS, HEAD_DIM) + 1
    paged = paged.write(k, -k, jnp.asarray([[63, 64, 130]]))
    np.testing.assert_array_equal(paged.k_pages[5, 63], k[0, 0])
    np.testing.assert_array_equal(paged.k_pages[2, 0], k[0, 1])
    np.testing.assert_array_equal(paged.v_pages[7, 2], -k[0, 2])
    assert int(jnp.count_nonzero(paged.k_pages)) == 3 * KV_HEADS * HEAD_DIM
    assert isinstance(paged.pages(), KVPages)
