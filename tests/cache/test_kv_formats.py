"""int8 / fp8 KV storage: per-token-per-head scales, and attention within a stated error of unquantized KV.

Stated tolerances (random normal q, k, v; 2 rows x 256 tokens, 8 query heads over 2 KV heads,
head_dim 128): relative Frobenius error of the attention output against unquantized KV
<= 2e-2 for int8 (measured 1.1e-2) and <= 7e-2 for fp8 e4m3 (measured 4.5e-2).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infernix_jax.cache import create_kv_pool, get_kv_format, kv_bytes_per_block
from infernix_jax.config import ModelConfig
from tests.conftest import HF_FIXTURES

TOLERANCE = {"int8": 2e-2, "fp8": 7e-2}


def _cfg(kv_heads=2, heads=8, head_dim=128) -> ModelConfig:
    cfg = ModelConfig.from_hf_config(HF_FIXTURES / "qwen3_next")
    return cfg.replace(num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim)


@pytest.mark.parametrize("name, qmax", [("int8", 127), ("fp8", 448)])
def test_scale_is_amax_over_format_max_per_token_per_head(name, qmax):
    fmt = get_kv_format(name)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 5, 2, 64)).astype(np.float32) * rng.uniform(0.01, 100, (3, 5, 2, 1))
    x[0, 0, 0] = 0.0  # an all-zero head vector must not divide by zero
    stored, scale = fmt.quantize(jnp.asarray(x), jnp.float32)
    assert stored.dtype == fmt.storage_dtype and scale.shape == (3, 5, 2)
    amax = np.abs(x).max(-1)
    np.testing.assert_allclose(np.asarray(scale)[amax > 0], amax[amax > 0] / qmax, rtol=1e-6)
    back = np.asarray(fmt.dequantize(stored, scale, jnp.float32))
    assert np.isfinite(back).all() and not back[0, 0, 0].any()
    # worst-case per-element error: half a step for int8, 2^-4 relative (3 mantissa bits) for e4m3
    bound = (
        amax[..., None] / 254 if name == "int8" else np.maximum(np.abs(x) / 16, amax[..., None] / 448 / 2**9)
    )
    assert (np.abs(back - x) <= bound * 1.0001).all()


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_quantized_attention_within_tolerance(name):
    cfg = _cfg()
    rng = np.random.default_rng(0)
    b, t = 2, 256
    k, v = (rng.standard_normal((b, t, 2, 128), np.float32) for _ in range(2))
    q = rng.standard_normal((b, t, 8, 128), np.float32) * 2
    positions = np.tile(np.arange(t), (b, 1))
    table = jnp.asarray([[1, 7, 3, 5], [2, 8, 4, 6]], jnp.int32)

    def attention(kv_dtype):
        paged = create_kv_pool(cfg, 9, kv_dtype, jnp.float32).layers[0].view(table)
        paged = paged.write(k, v, positions)
        return np.asarray(paged.attend(q, positions, 128**-0.5)), paged

    reference, _ = attention("bf16")
    out, paged = attention(name)
    assert paged.k_pages.dtype == get_kv_format(name).storage_dtype
    assert paged.k_scales.shape == (9, 64, 2)
    rel = np.linalg.norm(out - reference) / np.linalg.norm(reference)
    assert rel <= TOLERANCE[name], f"{name}: relative attention error {rel:.3e}"
    assert rel > 0  # the format really quantizes


def test_bytes_per_block_match_the_pool():
    cfg = _cfg()
    for name in ("bf16", "int8", "fp8"):
        pool = create_kv_pool(cfg, 3, name, jnp.bfloat16, with_mtp=True)
        total = sum(a.nbytes for a in jax.tree.leaves(pool))
        assert kv_bytes_per_block(cfg, name, jnp.bfloat16, with_mtp=True) * 3 == total
    per_layer_bf16 = 2 * 64 * 2 * 128 * 2
    assert kv_bytes_per_block(cfg, "bf16") == len(cfg.full_attention_layers) * per_layer_bf16
    assert kv_bytes_per_block(cfg, "int8") == len(cfg.full_attention_layers) * (
        per_layer_bf16 // 2 + 2 * 64 * 2 * 4
    )


def test_unknown_format_is_rejected():
    with pytest.raises(ValueError, match="int8"):
        get_kv_format("int4")
