"""PagedKV.attend's choice between the Pallas paged decode kernel and the XLA path."""

import jax.numpy as jnp
import numpy as np
import pytest

from infernix_jax.cache import BLOCK_SIZE
from infernix_jax.cache.decode_attention import decode_attention_mode, use_decode_kernel
from infernix_jax.cache.kv_formats import get_kv_format
from infernix_jax.cache.kv_pool import PagedKV


def _written_pool(fmt: str, rng, batch=3, kv_heads=2, head_dim=32, max_blocks=3):
    num_blocks = 1 + batch * max_blocks
    shape = (num_blocks, BLOCK_SIZE, kv_heads, head_dim)
    page_dtype = jnp.float32 if fmt == "bf16" else get_kv_format(fmt).storage_dtype
    scales = None if fmt == "bf16" else jnp.ones(shape[:3], jnp.float32)
    table = jnp.asarray(rng.permutation(np.arange(1, num_blocks)).reshape(batch, max_blocks), jnp.int32)
    kv = PagedKV(jnp.zeros(shape, page_dtype), jnp.zeros(shape, page_dtype), scales, scales, table, fmt)
    capacity = max_blocks * BLOCK_SIZE
    k = jnp.asarray(rng.standard_normal((batch, capacity, kv_heads, head_dim)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((batch, capacity, kv_heads, head_dim)), jnp.float32)
    positions = jnp.broadcast_to(jnp.arange(capacity, dtype=jnp.int32), (batch, capacity))
    return kv.write(k, v, positions)


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_decode_through_the_kernel_equals_the_xla_path(fmt):
    """The engine's decode attention gives the same output whichever implementation runs it,
    padding rows (position -1) included."""
    rng = np.random.default_rng(0)
    kv = _written_pool(fmt, rng)
    q = jnp.asarray(rng.standard_normal((3, 1, 6, 32)), jnp.float32)
    positions = jnp.asarray([[0], [130], [-1]], jnp.int32)
    with decode_attention_mode("xla"):
        want = np.asarray(kv.attend(q, positions, 32**-0.5))
    with decode_attention_mode("interpret"):
        got = np.asarray(kv.attend(q, positions, 32**-0.5))
    assert got.shape == want.shape == (3, 1, 6, 32)
    tol = 1e-5 if fmt == "bf16" else 2e-2  # quantized tiles meet q in bf16 inside the kernel's dots
    np.testing.assert_allclose(got[:2], want[:2], rtol=tol, atol=tol)
    assert np.isfinite(got[2]).all()


def test_multi_token_queries_and_cpu_auto_stay_on_xla():
    with decode_attention_mode("kernel"):
        assert use_decode_kernel(1) == (True, False)
        assert use_decode_kernel(4) == (False, False)  # prefill chunks and verify windows
    with decode_attention_mode("auto"):
        assert use_decode_kernel(1) == (False, False)  # this suite runs on the CPU backend


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="decode attention mode"), decode_attention_mode("triton"):
        pass
