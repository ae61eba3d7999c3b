"""The decode sweep of bench.kernels offers the streamed formulation with its own grid sizes, and
its configurations run (interpret mode) and equal the XLA reference."""

import jax
import numpy as np

from bench import kernels
from pallas_kernels import _quant_common as qc


def test_streamed_configs_take_programs_instead_of_split_k():
    configs = kernels.sweep_configs("nvfp4", 34816, 5120, 1, ("gemv_ws", "gemv_w"))
    assert {c.variant for c in configs} == {"gemv_ws", "gemv_w"}
    streamed = [c for c in configs if c.variant == "gemv_ws"]
    assert all(c.split_k == 1 and c.programs in kernels.STREAMED_PROGRAMS for c in streamed)
    assert {c.programs for c in streamed} == set(kernels.STREAMED_PROGRAMS)
    assert configs[0].variant == "gemv_ws" and configs[1].variant == "gemv_w"  # round-robin order
    # block-scaled FP8 keeps tiles inside its 128 x 128 scale blocks
    assert all(c.block_k <= 128 for c in kernels.sweep_configs("fp8_block128", 1024, 1024, 1, ("gemv_ws",)))
    assert kernels.sweep_configs("nvfp4", 1024, 1024, 16, ("gemv_ws",)) == []  # gemv serves M <= 8
    assert {c.variant for c in kernels.sweep_configs("nvfp4", 1024, 1024, 16, ("gemv_ws", "dot_ws"))} == {"dot_ws"}


def test_word_gemv_configs_come_with_each_scale_spread_side_by_side_and_tiles_filter():
    configs = kernels.sweep_configs(
        "nvfp4", 34816, 5120, 1, ("gemv_ws", "dot_w"), scale_spreads=("reshape", "gather"), tiles=((32, 512),)
    )
    assert {(c.block_n, c.block_k) for c in configs} == {(32, 512)}
    streamed = [c for c in configs if c.variant == "gemv_ws"]
    assert [c.scale_spread for c in streamed[:2]] == ["reshape", "gather"] and configs[0] == streamed[0]
    assert len(streamed) == 2 * len(kernels.STREAMED_PROGRAMS)
    dots = [c for c in configs if c.variant == "dot_w"]  # the dots take block bytes: one config each
    assert dots and len({(c.split_k, c.scale_spread) for c in dots}) == len(dots)


def test_a_streamed_sweep_configuration_equals_the_xla_path():
    for fmt in ("nvfp4", "fp8"):
        weight, static, _ = kernels._random_weight(fmt, 96, 320, jax.random.key(0))
        x = jax.random.normal(jax.random.key(1), (2, 320), jax.numpy.bfloat16)
        cfg = qc.MatmulConfig("gemv_ws", 32, 128, 1, 4, 3, programs=5)
        got = kernels._sweep_fn(fmt, cfg, static, interpret=True)((x,), (weight,))[0]
        want = kernels._sweep_fn(fmt, None, static)((x,), (weight,))[0]
        assert kernels.relative_error(got, want) < 1e-2, fmt
        assert np.isfinite(np.asarray(got, np.float32)).all()
