"""`bench.moe_kernels` sweeps the word-decoded NVFP4 formulations beside the others, with tiles the
grouped kernel accepts at the Qwen3-Next-80B expert shapes (traced only, nothing runs)."""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from bench import moe_kernels
from pallas_kernels.moe_matmul import STREAMED_VARIANTS, WORD_VARIANTS, grouped_matmul


@pytest.mark.parametrize("quick", [False, True])
def test_only_nvfp4_sweeps_the_word_variants_and_every_format_the_streamed_gemv(quick):
    for fmt in ("nvfp4", "fp8", "fp8_block128"):
        variants = {c.variant for c in moe_kernels.configs(fmt, 8, 2048, quick)}
        assert variants >= {"gemv", "dot_t"}
        assert (variants >= set(WORD_VARIANTS)) if fmt == "nvfp4" else not variants & set(WORD_VARIANTS)
        assert variants >= set(STREAMED_VARIANTS)


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "fp8_block128"])
@pytest.mark.parametrize("proj", list(moe_kernels.QWEN3_NEXT_80B.projections))
@pytest.mark.parametrize("batch", [1, 8])
def test_every_configuration_is_accepted(fmt, proj, batch):
    shape = moe_kernels.QWEN3_NEXT_80B
    n, k = shape.projections[proj]
    e, m = shape.num_experts, batch * shape.top_k
    options = {"fmt": "fp8" if fmt.startswith("fp8") else fmt}
    if fmt == "nvfp4":
        weight = (
            jax.ShapeDtypeStruct((e, n, k // 2), jnp.uint8),
            jax.ShapeDtypeStruct((e, n, k // 16), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((e,), jnp.float32),
        )
    elif fmt == "fp8":
        weight = (jax.ShapeDtypeStruct((e, n, k), jnp.float8_e4m3fn), jax.ShapeDtypeStruct((e,), jnp.float32))
    else:
        scale = jax.ShapeDtypeStruct((e, -(-n // 128), -(-k // 128)), jnp.float32)
        weight, options["block_size"] = (jax.ShapeDtypeStruct((e, n, k), jnp.float8_e4m3fn), scale), 128
    x, sizes = jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((e,), jnp.int32)
    for cfg in moe_kernels.configs(fmt, batch, k, quick=False):
        out = jax.eval_shape(
            lambda x, w, s, cfg=cfg: grouped_matmul(x, w, s, **options, **dataclasses.asdict(cfg)),
            x,
            weight,
            sizes,
        )
        assert out.shape == (m, n), cfg
