"""PagedKV.attend's choice between the Pallas paged attention kernels and the XLA path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infernix_jax.cache import BLOCK_SIZE
from infernix_jax.cache.attention_choice import (
    PREFILL_KERNEL_MIN_TOKENS,
    decode_attention_mode,
    prefill_attention_mode,
    recurrent_update_mode,
    use_decode_kernel,
    use_prefill_kernel,
    use_recurrent_kernel,
)
from infernix_jax.cache.kv_formats import get_kv_format
from infernix_jax.cache.kv_pool import PagedKV
from pallas_kernels.compat import on_gpu

# float32 pages: the interpreter and XLA agree to rounding on the CPU; a GPU's XLA dots run float32
# through TF32-class precision by default (differences of ~1e-4 measured on the H200).
F32_TOL = 2e-3 if on_gpu() else 1e-5


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
    tol = F32_TOL if fmt == "bf16" else 2e-2  # quantized tiles meet q in bf16 inside the kernel's dots
    np.testing.assert_allclose(got[:2], want[:2], rtol=tol, atol=tol)
    assert np.isfinite(got[2]).all()


def test_multi_token_queries_stay_on_xla_and_auto_compiles_on_gpus_only():
    with decode_attention_mode("kernel"):
        assert use_decode_kernel(1) == (True, False)
        assert use_decode_kernel(4) == (False, False)  # prefill chunks and verify windows
    with decode_attention_mode("auto"):
        assert use_decode_kernel(1) == (on_gpu(), False)  # compiled on a GPU, XLA elsewhere


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="decode attention mode"), decode_attention_mode("triton"):
        pass


@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_prefill_chunks_through_the_kernel_equal_the_xla_path(fmt):
    """A chunk continuing each row's cached prefix (row 0 from position 0, row 1 mid-sequence,
    row 2 with a padded tail) attends the same whichever implementation runs it."""
    rng = np.random.default_rng(1)
    kv = _written_pool(fmt, rng)
    t = PREFILL_KERNEL_MIN_TOKENS
    q = jnp.asarray(rng.standard_normal((3, t, 6, 32)), jnp.float32)
    positions = np.stack(
        [np.arange(t), 100 + np.arange(t), np.where(np.arange(t) < 40, 20 + np.arange(t), -1)]
    )
    positions = jnp.asarray(positions, jnp.int32)
    with prefill_attention_mode("xla"):
        want = np.asarray(kv.attend(q, positions, 32**-0.5))
    with prefill_attention_mode("interpret"):
        got = np.asarray(kv.attend(q, positions, 32**-0.5))
    assert got.shape == want.shape == (3, t, 6, 32)
    tol = F32_TOL if fmt == "bf16" else 2e-2
    np.testing.assert_allclose(got[:2], want[:2], rtol=tol, atol=tol)
    np.testing.assert_allclose(got[2, :40], want[2, :40], rtol=tol, atol=tol)


def test_prefill_kernel_takes_long_chunks_with_power_of_two_heads_only():
    with prefill_attention_mode("kernel"):
        assert use_prefill_kernel(PREFILL_KERNEL_MIN_TOKENS, 256) == (True, False)
        assert use_prefill_kernel(PREFILL_KERNEL_MIN_TOKENS - 1, 256) == (False, False)  # verify windows
        assert use_prefill_kernel(4096, 96) == (False, False)  # the kernel's tiles need 2**n
    with prefill_attention_mode("auto"):
        assert use_prefill_kernel(4096, 256) == (on_gpu(), False)
    with pytest.raises(ValueError, match="prefill attention mode"), prefill_attention_mode("gpu"):
        pass


@pytest.mark.skipif(jax.default_backend() not in ("gpu", "cuda"), reason="compiled kernels need a GPU")
@pytest.mark.parametrize("fmt", ["bf16", "int8"])
def test_compiled_kernels_equal_the_xla_path_on_a_gpu(fmt):
    """On a GPU the compiled decode and prefill kernels (not the interpreter) give XLA's result."""
    rng = np.random.default_rng(2)
    kv = _written_pool(fmt, rng, head_dim=64)
    t = 2 * PREFILL_KERNEL_MIN_TOKENS
    q = jnp.asarray(rng.standard_normal((3, t, 6, 64)), jnp.bfloat16)
    positions = jnp.asarray(np.stack([np.arange(t), 50 + np.arange(t), np.full(t, -1)]), jnp.int32)
    for mode, chunk in ((prefill_attention_mode, t), (decode_attention_mode, 1)):
        with mode("xla"):
            want = np.asarray(kv.attend(q[:, :chunk], positions[:, :chunk], 64**-0.5), np.float32)
        with mode("kernel"):
            got = np.asarray(kv.attend(q[:, :chunk], positions[:, :chunk], 64**-0.5), np.float32)
        np.testing.assert_allclose(got[:2], want[:2], rtol=3e-2, atol=3e-2)


def test_recurrence_kernel_takes_short_windows_of_power_of_two_heads():
    with recurrent_update_mode("kernel"):
        assert use_recurrent_kernel(1, 128, 128) == (True, False)
        assert use_recurrent_kernel(16, 128, 128) == (True, False)  # the per-token path's longest window
        assert use_recurrent_kernel(17, 128, 128) == (False, False)  # the chunked form
        assert use_recurrent_kernel(1, 96, 128) == (False, False)
    with recurrent_update_mode("interpret"):
        assert use_recurrent_kernel(1, 16, 16) == (True, True)
    with pytest.raises(ValueError, match="recurrent attention mode"), recurrent_update_mode("fast"):
        pass
