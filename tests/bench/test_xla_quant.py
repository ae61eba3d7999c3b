"""bench.xla_quant: XLA's own fusions of the quantized decode matmuls compute the same function as
the float32 references (ModelOpt's nibble order through the native E2M1 type), and the profile
summary reads a trace."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import xla_quant
from bench.profile_summary import _union_ns, format_summary, profile_device
from infernix_jax.weights.quant import e2m1_codes
from pallas_kernels.fp8_matmul import reference_fp8_matmul
from pallas_kernels.nvfp4_matmul import reference_nvfp4_matmul


def _nvfp4(rng, n, k):
    packed = jnp.asarray(rng.integers(0, 256, (n, k // 2)), jnp.uint8)
    scale = jnp.asarray(rng.uniform(0.01, 4.0, (n, k // 16)), jnp.float32).astype(jnp.float8_e4m3fn)
    return packed, scale, jnp.float32(0.02)


def test_native_e2m1_codes_follow_modelopts_nibble_order():
    codes = e2m1_codes(jnp.asarray([[0x21, 0xF4]], jnp.uint8)).astype(jnp.float32)
    np.testing.assert_array_equal(np.asarray(codes), [[0.5, 1.0, 2.0, -6.0]])  # low nibble first


@pytest.mark.parametrize("form", ["xla_dot", "xla_dot_blocks", "xla_reduce"])
@pytest.mark.parametrize("m", [1, 5])
def test_nvfp4_xla_forms_equal_the_reference(form, m):
    rng = np.random.default_rng(m)
    w = _nvfp4(rng, 48, 96)
    x = jnp.asarray(rng.standard_normal((m, 96)), jnp.bfloat16)
    got = jax.jit(xla_quant.FORMS["nvfp4"][form])(x, *w).astype(jnp.float32)
    want = reference_nvfp4_matmul(x, *w)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-2, atol=1e-2 * float(jnp.abs(want).max()))


@pytest.mark.parametrize("form", ["xla_dot", "xla_reduce", "auto"])
def test_fp8_xla_forms_equal_the_reference(form):
    rng = np.random.default_rng(7)
    data = jnp.asarray(rng.standard_normal((40, 64)) * 8, jnp.float32).astype(jnp.float8_e4m3fn)
    x = jnp.asarray(rng.standard_normal((3, 64)), jnp.bfloat16)
    got = jax.jit(xla_quant.FORMS["fp8"][form])(x, data, jnp.float32(0.01)).astype(jnp.float32)
    want = reference_fp8_matmul(x, data, jnp.float32(0.01))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-2, atol=1e-2 * float(jnp.abs(want).max()))


def test_expert_pairs_gather_the_routed_experts():
    rng = np.random.default_rng(3)
    packed = jnp.asarray(rng.integers(0, 256, (6, 32, 32)), jnp.uint8)
    scale = jnp.asarray(rng.uniform(0.01, 4.0, (6, 32, 4)), jnp.float32).astype(jnp.float8_e4m3fn)
    ts = jnp.asarray(rng.uniform(0.005, 0.02, 6), jnp.float32)
    x = jnp.asarray(rng.standard_normal((2, 64)), jnp.bfloat16)
    ids = jnp.asarray([[5, 0], [2, 5]], jnp.int32)
    got = jax.jit(xla_quant.expert_pairs_f4)(x, ids, packed, scale, ts).astype(jnp.float32)
    want = xla_quant.expert_pairs_reference(x, ids, packed, scale, ts)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-2, atol=1e-2 * float(jnp.abs(want).max()))


def test_union_of_intervals_counts_overlaps_once():
    assert _union_ns([(0, 10), (5, 15), (20, 30)]) == 25
    assert _union_ns([]) == 0


def test_profile_summary_of_a_cpu_run_says_there_is_no_device_plane(tmp_path):
    f = jax.jit(lambda a: jnp.sin(a) @ a)
    a = jnp.ones((64, 64))
    f(a).block_until_ready()
    summary = profile_device(lambda: f(a), repeats=2, log_dir=str(tmp_path))
    assert summary["repeats"] == 2 and summary["devices"] == []  # the CPU backend has no device plane
    assert summary["host_top"] and "no device plane" in format_summary(summary)


def test_union_of_nested_intervals_counts_the_outer_one():
    assert _union_ns([(0, 100), (10, 20), (30, 40), (90, 120)]) == 120
