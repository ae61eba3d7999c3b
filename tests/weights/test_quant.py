"""Quantized weight types: published quantization formulas, byte layouts, dispatching matmuls."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from infernix_jax.weights import quant
from infernix_jax.weights.quant import (
    FP8Weight,
    NVFP4Weight,
    expert_matmul,
    kernel_mode,
    matmul,
    quantize_fp8,
    quantize_int8,
    quantize_nvfp4,
    quantize_q4,
    quantize_q8,
)
from pallas_kernels import compat

QUANTIZERS = {
    "nvfp4": quantize_nvfp4,
    "fp8": quantize_fp8,
    "fp8_block32": lambda w: quantize_fp8(w, block_size=32),
    "int8": quantize_int8,
    "q8_g32": quantize_q8,
    "q8_g64": lambda w: quantize_q8(w, group_size=64),
    "q4_g32": quantize_q4,
    "q4_g128": lambda w: quantize_q4(w, group_size=128),
}


def _weight(rng, *shape, scale=0.05):
    return jnp.asarray(rng.standard_normal(shape) * scale, jnp.bfloat16)


def _modelopt_nvfp4_numpy(w):
    """ModelOpt's NVFP4 export (NVFP4QTensor.quantize), transcribed to numpy for a 2-D weight."""
    w = np.asarray(w, np.float32)
    ws2 = np.float32(np.abs(w).max()) / np.float32(6.0 * 448.0)
    blocks = w.reshape(w.shape[0], -1, 16)
    per_block = np.abs(blocks).max(-1) / (np.float32(6.0) * ws2)
    per_block[per_block == 0] = 1.0
    scale = np.maximum(per_block, np.float32(2.0**-9)).astype(ml_dtypes.float8_e4m3fn)
    scaled = (blocks / (scale.astype(np.float32) * ws2)[..., None]).reshape(w.shape)
    mag = np.abs(scaled)
    code = np.searchsorted(np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], np.float32), mag, side="left")
    code = code + np.isin(mag, np.array([0.75, 1.75, 3.5], np.float32)) + 8 * (scaled < 0)
    code = code.astype(np.uint8)
    return (code[:, 1::2] << 4) | code[:, 0::2], scale, ws2


def test_nvfp4_quantize_reproduces_modelopt_bit_for_bit():
    rng = np.random.default_rng(0)
    w = np.array(_weight(rng, 40, 96))
    w[3, :16] = 0  # an all-zero block takes block scale 1.0
    w[5, 16:32] *= 1e-4  # a tiny block clamps at the smallest e4m3 scale
    packed, scale, ws2 = _modelopt_nvfp4_numpy(w)
    q = quantize_nvfp4(jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(q.packed), packed)
    np.testing.assert_array_equal(np.asarray(q.block_scale).view(np.uint8), scale.view(np.uint8))
    assert np.float32(q.tensor_scale) == ws2


def test_nvfp4_low_nibble_is_the_even_element():
    # byte 0x21: element 0 has code 1 (0.5), element 1 has code 2 (1.0); 0xF8: -0.0 then -6.
    packed = jnp.asarray([[0x21, 0xF8, 0x7A, 0, 0, 0, 0, 0]], jnp.uint8)
    w = NVFP4Weight(
        packed=packed, block_scale=jnp.asarray([[2.0]], jnp.float8_e4m3fn), tensor_scale=jnp.float32(0.5)
    )
    np.testing.assert_array_equal(
        np.asarray(w.dequantize(jnp.float32))[0, :6], [0.5, 1.0, -0.0, -6.0, -1.0, 6.0]
    )


@pytest.mark.parametrize("name", sorted(QUANTIZERS))
def test_quantization_error_is_within_the_format_step(name):
    w = _weight(np.random.default_rng(1), 48, 256)
    q = QUANTIZERS[name](w)
    err = np.abs(np.asarray(q.dequantize(jnp.float32)) - np.asarray(w, np.float32))
    wf = np.abs(np.asarray(w, np.float32))
    if isinstance(q, NVFP4Weight):  # the widest E2M1 gap (4 -> 6) is 2 units of the block scale
        unit = np.repeat(np.asarray(q.block_scale, np.float32), 16, -1) * np.float32(q.tensor_scale)
        bound = unit * 1.0
    elif isinstance(q, FP8Weight):  # 3 mantissa bits: half an ulp is 1/16 of the value
        bound = wf / 16 + 1e-6
    elif name == "int8":
        bound = np.asarray(q.scale)[:, None] / 2
    else:
        g = q.group_size
        bound = np.repeat(np.asarray(q.scale, np.float32), g, -1) / 2 + 1e-3 * wf.max()
    assert np.all(err <= bound * (1 + 1e-5)), float((err - bound).max())


@pytest.mark.parametrize("name", sorted(QUANTIZERS))
def test_matmul_equals_x_times_dequantized_weight(name):
    rng = np.random.default_rng(2)
    q = QUANTIZERS[name](_weight(rng, 48, 256))
    x = jnp.asarray(rng.standard_normal((2, 3, 256)), jnp.float32)
    want = np.einsum("btk,nk->btn", np.asarray(x), np.asarray(q.dequantize(jnp.float32)))
    got = jax.jit(matmul)(x, q)
    assert got.shape == (2, 3, 48) and got.dtype == x.dtype
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", ["nvfp4", "fp8", "fp8_block32"])
def test_kernel_dispatch_matches_the_reference_path(name):
    rng = np.random.default_rng(3)
    q = QUANTIZERS[name](_weight(rng, 96, 320))
    x = jnp.asarray(rng.standard_normal((5, 320)), jnp.bfloat16)
    # The mode is read at trace time: each mode gets its own jitted function.
    with kernel_mode("reference"):
        want = jax.jit(lambda x, w: matmul(x, w))(x, q)
    with kernel_mode("interpret"):
        kernel_fn = jax.jit(lambda x, w: matmul(x, w))
        assert "while" in kernel_fn.lower(x, q).as_text()  # the kernel's K loop: the Pallas path was taken
        got = kernel_fn(x, q)
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2
    )


def test_plain_arrays_keep_the_bf16_path():
    rng = np.random.default_rng(4)
    w, x = _weight(rng, 8, 32), jnp.asarray(rng.standard_normal((2, 32)), jnp.bfloat16)
    want = np.asarray(x, np.float32) @ np.asarray(w, np.float32).T
    np.testing.assert_allclose(np.asarray(matmul(x, w), np.float32), want, rtol=1e-2, atol=1e-2)


def test_nbytes_counts_packed_bytes():
    n, k = 64, 256
    w = _weight(np.random.default_rng(5), n, k)
    assert quantize_nvfp4(w).nbytes == n * k // 2 + n * k // 16 + 4
    assert quantize_fp8(w).nbytes == n * k + 4
    assert quantize_fp8(w, block_size=128).nbytes == n * k + 1 * 2 * 4
    assert quantize_int8(w).nbytes == n * k + 4 * n
    assert quantize_q8(w, group_size=32).nbytes == n * k + 2 * n * k // 32
    assert quantize_q4(w, group_size=64).nbytes == n * k // 2 + 2 * 2 * n * k // 64


def test_quantized_weights_are_pytrees_that_eval_shape_sizes_without_data():
    spec = jax.ShapeDtypeStruct((512, 4096), jnp.bfloat16)
    q = jax.eval_shape(quantize_nvfp4, spec)
    assert isinstance(q, NVFP4Weight) and q.shape == (512, 4096)
    assert q.nbytes == 512 * 2048 + 512 * 256 + 4
    q8 = jax.eval_shape(lambda w: quantize_q8(w, group_size=128), spec)
    assert q8.group_size == 128 and len(jax.tree.leaves(q8)) == 2


def test_stacked_experts_use_per_expert_scales():
    w = _weight(np.random.default_rng(6), 3, 32, 64)
    w = w.at[1].multiply(100.0)
    stacked = quantize_nvfp4(w)
    assert stacked.tensor_scale.shape == (3,)
    for e in range(3):
        alone = quantize_nvfp4(w[e])
        np.testing.assert_array_equal(np.asarray(stacked.packed[e]), np.asarray(alone.packed))
        assert float(stacked.tensor_scale[e]) == float(alone.tensor_scale)


@pytest.mark.parametrize("name", ["plain", "nvfp4", "fp8_block32", "q4_g32"])
def test_expert_matmul_per_token_and_per_group(name):
    rng = np.random.default_rng(7)
    w = _weight(rng, 4, 24, 64)
    w = w if name == "plain" else QUANTIZERS[name](w)
    wf = np.asarray(quant.dequantize(w, jnp.float32))
    x = jnp.asarray(rng.standard_normal((6, 64)), jnp.float32)
    ids = jnp.asarray([2, 0, 3, 3, 1, 2], jnp.int32)
    got = jax.jit(lambda x, w, i: expert_matmul(x, w, expert_ids=i))(x, w, ids)
    want = np.stack([np.asarray(x[t]) @ wf[int(ids[t])].T for t in range(6)])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)

    sizes = jnp.asarray([2, 0, 3, 1], jnp.int32)  # rows 0-1 expert 0, rows 2-4 expert 2, row 5 expert 3
    got = expert_matmul(x, w, group_sizes=sizes)
    experts = [0, 0, 2, 2, 2, 3]
    want = np.stack([np.asarray(x[t]) @ wf[experts[t]].T for t in range(6)])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


def test_bad_calls_are_rejected():
    w = quantize_nvfp4(_weight(np.random.default_rng(8), 2, 16, 32))
    x = jnp.ones((3, 32), jnp.float32)
    with pytest.raises(ValueError, match="exactly one"):
        expert_matmul(x, w)
    with pytest.raises(ValueError, match="expert_ids shape"):
        expert_matmul(x, w, expert_ids=jnp.zeros((2,), jnp.int32))
    with pytest.raises(ValueError, match="K=16"):
        matmul(jnp.ones((1, 16)), quantize_int8(jnp.ones((4, 32))))
    with pytest.raises(ValueError, match="K % 16"):
        quantize_nvfp4(jnp.ones((4, 40)))
    with pytest.raises(ValueError, match="group_size=48 must divide K=64"):
        quantize_q8(jnp.ones((4, 64)), group_size=48)
    with pytest.raises(ValueError, match="kernel mode"), kernel_mode("fast"):
        pass


def test_nvfp4_decode_tiles_follow_rows_dtype_and_layer_size():
    """One bf16 row on a large layer takes the streamed CUDA-core word kernel, mid-sized ones the
    per-tile one; more rows, float32 rows and small layers take the dot formulations (float32
    would be rounded by float16)."""
    from infernix_jax.weights.quant import nvfp4_tiles

    gate_up = nvfp4_tiles(1, 5120, 34816, jnp.bfloat16)
    assert (gate_up["variant"], gate_up["block_n"], gate_up["split_k"]) == ("gemv_h2w_ws", 32, 1)
    assert nvfp4_tiles(1, 17408, 5120, jnp.bfloat16)["variant"] == "gemv_h2w_ws"  # 2**26 weights and up
    o_proj = nvfp4_tiles(1, 6144, 5120, jnp.bfloat16)
    assert (o_proj["variant"], o_proj["split_k"]) == ("gemv_w", 2)  # 160 row tiles: split K
    assert nvfp4_tiles(1, 2048, 8192, jnp.float16)["block_n"] == 64
    assert nvfp4_tiles(1, 4096, 2048, jnp.bfloat16)["variant"] == "gemv_ws"  # the 80B o_proj
    assert nvfp4_tiles(8, 4096, 2048, jnp.bfloat16)["variant"] == "gemv_ws"
    assert nvfp4_tiles(2, 5120, 34816, jnp.bfloat16)["variant"] == "dot_w"
    assert nvfp4_tiles(1, 5120, 34816, jnp.float32)["variant"] == "dot"
    assert nvfp4_tiles(1, 512, 2048, jnp.bfloat16)["variant"] == "dot"  # one row, a small layer
    assert nvfp4_tiles(2, 512, 2048, jnp.bfloat16)["variant"] == "dot_w"
    q_gated = nvfp4_tiles(1, 5120, 12288, jnp.bfloat16)  # the half2 gemv's own tiles: 3 programs an SM
    assert (q_gated["block_k"], q_gated["programs"]) == (512, 3 * compat.sm_count())
    with quant.nvfp4_streamed_gemv("gemv_ws"):
        assert nvfp4_tiles(1, 5120, 12288, jnp.bfloat16)["block_k"] == 1024
    assert nvfp4_tiles(1, 2048, 12288, jnp.bfloat16)["split_k"] == 4  # gemv_w below K = 4096


def test_fp8_decode_tiles_split_k_until_the_grid_fills_the_gpu():
    """Per-tensor FP8: the widest layer's single row takes the CUDA-core kernel, the other large
    layers' rows the dot with K split until ~4 programs per SM; where the sweep found nothing
    better (the 80B layers, prefill) the kernel's own table decides."""
    from infernix_jax.weights.quant import fp8_tiles

    assert fp8_tiles(1, 5120, 34816)["variant"] == "gemv"
    down = fp8_tiles(1, 17408, 5120)
    assert (down["variant"], down["split_k"]) == ("dot", 8)  # 80 row tiles of 64
    assert fp8_tiles(1, 5120, 12288)["split_k"] == 4
    assert fp8_tiles(8, 17408, 5120)["split_k"] == 8
    assert fp8_tiles(1, 2048, 8192) == fp8_tiles(8, 5120, 12288) == fp8_tiles(4096, 5120, 5120) == {}


def test_fp8_decode_takes_xlas_dot_where_the_h200_measured_it_faster():
    """Per-tensor FP8 on a GPU: XLA's convert-fused dot for 2+ rows and for one row on the large
    27B layers below the widest; the kernel for one row elsewhere; the mode overrides both."""
    from infernix_jax.weights.quant import fp8_decode_mode, fp8_decode_way

    assert fp8_decode_way(8, 5120, 34816) == fp8_decode_way(2, 2048, 1024) == "xla"
    assert fp8_decode_way(1, 5120, 12288) == fp8_decode_way(1, 17408, 5120) == "xla"  # q_gated, down
    assert fp8_decode_way(1, 5120, 34816) == "kernel"  # gate_up: a tie, the tuned gemv stays
    assert fp8_decode_way(1, 6144, 5120) == fp8_decode_way(1, 2048, 12288) == "kernel"
    with fp8_decode_mode("kernel"):
        assert fp8_decode_way(8, 5120, 34816) == "kernel"
    with fp8_decode_mode("xla"):
        assert fp8_decode_way(1, 5120, 34816) == "xla"
    with pytest.raises(ValueError, match="auto, kernel, xla"), fp8_decode_mode("cublas"):
        pass


def test_int8_decode_takes_the_float32_reduction_at_one_row_where_the_h200_measured_it_faster():
    """INT8 on a GPU: XLA's dot for 2+ rows and for one row on the 27B down (K = 17408); the
    float32 reference's reduction for one row on the narrower layers."""
    from infernix_jax.weights.quant import int8_decode_way

    assert int8_decode_way(8, 5120) == int8_decode_way(4096, 2048) == int8_decode_way(1, 17408) == "xla"
    assert int8_decode_way(1, 5120) == int8_decode_way(1, 6144) == int8_decode_way(1, 2048) == "reference"


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.float32])
@pytest.mark.parametrize("fmt", ["fp8", "int8"])
def test_fp8_and_int8_xla_matmuls_equal_the_reference(fmt, dtype):
    from infernix_jax.weights.quant import fp8_xla_matmul, int8_xla_matmul, quantize_int8

    rng = np.random.default_rng(11)
    w = _weight(rng, 40, 96)
    q, fn = (quantize_fp8(w), fp8_xla_matmul) if fmt == "fp8" else (quantize_int8(w), int8_xla_matmul)
    x = jnp.asarray(rng.standard_normal((3, 96)), dtype)
    got = jax.jit(fn)(x, q.data, q.scale)
    assert got.dtype == dtype
    want = np.asarray(x, np.float32) @ np.asarray(q.dequantize(jnp.float32)).T
    tol = {jnp.float32: 1e-5, jnp.float16: 2e-3}.get(dtype, 2e-2)
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=tol, atol=tol * np.abs(want).max())


def test_block_scaled_fp8_prefill_rows_on_a_gpu_take_the_tiled_kernel(monkeypatch):
    """Block scales vary along K, so no single dot can take them out: past the decode rows a GPU
    runs the tiled kernel with the tiles the H200 sweep picked (FP8_BLOCK_PREFILL_TILES), not a
    float32 dot on CUDA cores; and those tiles give the reference's result (interpret mode)."""
    from pallas_kernels import compat
    from pallas_kernels.fp8_matmul import fp8_matmul, reference_fp8_matmul

    rng = np.random.default_rng(15)
    q = quantize_fp8(_weight(rng, 200, 256), block_size=128)
    x = jnp.asarray(rng.standard_normal((quant.SMALL_M_MAX + 66, 256)), jnp.bfloat16)
    calls = []
    monkeypatch.setattr(compat, "on_gpu", lambda: True)
    monkeypatch.setattr(
        quant, "fp8_matmul", lambda *a, **kw: calls.append(kw) or jnp.zeros((x.shape[0], 200), x.dtype)
    )
    with kernel_mode("auto"):
        matmul(x, q)
    assert calls == [{"block_size": 128, **quant.FP8_BLOCK_PREFILL_TILES}]
    monkeypatch.undo()
    got = fp8_matmul(x, q.data, q.scale, block_size=128, interpret=True, **quant.FP8_BLOCK_PREFILL_TILES)
    want = reference_fp8_matmul(x, q.data, q.scale, block_size=128)
    np.testing.assert_allclose(
        np.asarray(got, np.float32), np.asarray(want), rtol=2e-2, atol=2e-2 * np.abs(want).max()
    )


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_nvfp4_xla_matmul_equals_the_reference(dtype):
    """The prefill form: exact block values in the activation dtype, float32 accumulation."""
    from infernix_jax.weights.quant import nvfp4_block_values, nvfp4_xla_matmul

    rng = np.random.default_rng(12)
    q = quantize_nvfp4(_weight(rng, 40, 96))
    values = nvfp4_block_values(q.packed, q.block_scale, jnp.float32) * q.tensor_scale
    np.testing.assert_array_equal(np.asarray(values), np.asarray(q.dequantize(jnp.float32)))  # same values
    x = jnp.asarray(rng.standard_normal((70, 96)), dtype)
    got = jax.jit(nvfp4_xla_matmul)(x, q.packed, q.block_scale, q.tensor_scale)
    assert got.dtype == dtype
    want = np.asarray(x, np.float32) @ np.asarray(q.dequantize(jnp.float32)).T
    np.testing.assert_allclose(np.asarray(got, np.float32), want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


def test_prefill_rows_on_a_gpu_take_the_xla_dot_instead_of_a_float32_matmul(monkeypatch):
    """Past the kernels' rows a GPU runs NVFP4, per-tensor FP8 and INT8 as one dot in the
    activation dtype (a full-precision float32 dot would run on CUDA cores); float32 activations
    keep the float32 reference. INT8, which has no kernel, takes its dot at decode rows too, but
    for one row on layers with K < 16384, where the float32 reduction was faster on the H200
    (`int8_decode_way`). Traced only: the CPU cannot run the GPU path."""
    from pallas_kernels import compat

    monkeypatch.setattr(compat, "on_gpu", lambda: True)
    rng = np.random.default_rng(13)
    w = _weight(rng, 32, 128)

    def lowered(q, dtype, rows=quant.SMALL_M_MAX + 16):
        x = jax.ShapeDtypeStruct((rows, 128), dtype)
        with kernel_mode("auto"):
            return jax.jit(lambda x, q: matmul(x, q)).lower(x, q).as_text()

    nvfp4 = lowered(quantize_nvfp4(w), jnp.bfloat16)
    assert "f4E2M1FN" in nvfp4 and "HIGHEST" not in nvfp4
    fp8 = lowered(quantize_fp8(w), jnp.bfloat16)
    assert "(tensor<32x128xf8E4M3FN>) -> tensor<32x128xbf16>" in fp8 and "HIGHEST" not in fp8
    assert "HIGHEST" in lowered(quantize_nvfp4(w), jnp.float32)
    int8 = lowered(quant.quantize_int8(w), jnp.bfloat16)
    assert "(tensor<32x128xi8>) -> tensor<32x128xbf16>" in int8 and "HIGHEST" not in int8
    # INT8 decode rows: no kernel, the same dot; one row of a narrow layer: the float32 reduction
    assert "HIGHEST" not in lowered(quant.quantize_int8(w), jnp.bfloat16, rows=2)
    assert "HIGHEST" in lowered(quant.quantize_int8(w), jnp.bfloat16, rows=1)


def _count_fused_launches(monkeypatch):
    launches = []
    real = quant.nvfp4_matmuls
    monkeypatch.setattr(
        quant, "nvfp4_matmuls", lambda x, ws, **kw: launches.append(len(ws)) or real(x, ws, **kw)
    )
    return launches


def test_matmuls_run_the_nvfp4_weights_of_one_row_in_one_launch_and_the_rest_apart(monkeypatch):
    """A decode row through q / k / v-like weights: the NVFP4 ones share one launch, a bf16 one
    among them runs alone, and every result equals its own matmul (the reference path)."""
    rng = np.random.default_rng(21)
    ws = (quantize_nvfp4(_weight(rng, 96, 512)), _weight(rng, 24, 512), quantize_nvfp4(_weight(rng, 40, 512)))
    x = jnp.asarray(rng.standard_normal((1, 1, 512)), jnp.bfloat16)
    launches = _count_fused_launches(monkeypatch)
    with kernel_mode("interpret"):
        got = jax.jit(quant.matmuls)(x, ws)
    assert launches == [2]
    with kernel_mode("reference"):
        want = [matmul(x, w) for w in ws]
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == x.dtype
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=2e-2, atol=2e-2)


def test_the_block_sum_gemv_serves_a_fused_decode_row_when_switched_on(monkeypatch):
    rng = np.random.default_rng(22)
    ws = (quantize_nvfp4(_weight(rng, 96, 512)), quantize_nvfp4(_weight(rng, 40, 512)))
    x = jnp.asarray(rng.standard_normal((1, 1, 512)), jnp.bfloat16)
    variants, real = [], quant.nvfp4_matmuls
    monkeypatch.setattr(
        quant, "nvfp4_matmuls", lambda x, ws, **kw: variants.append(kw["variant"]) or real(x, ws, **kw)
    )
    with kernel_mode("interpret"), quant.nvfp4_streamed_gemv("gemv_bs_ws"):
        got = jax.jit(quant.matmuls)(x, ws)
    assert variants == ["gemv_bs_ws"]
    with kernel_mode("reference"):
        want = [matmul(x, w) for w in ws]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=2e-2, atol=2e-2)


def test_the_word_dot_switch_gives_rows_past_one_the_joined_dot():
    """`nvfp4_word_dot("dot_jw")`: four 16-bit rows through an NVFP4 weight launch the joined word
    dot (x in natural order) and give the reference's output; one row keeps its own formulation."""
    rng = np.random.default_rng(23)
    w = quantize_nvfp4(_weight(rng, 96, 512))
    x = jnp.asarray(rng.standard_normal((4, 512)), jnp.bfloat16)
    assert quant.nvfp4_tiles(4, 512, 96)["variant"] == "dot_w"
    with kernel_mode("interpret"), quant.nvfp4_word_dot("dot_jw"):
        assert quant.nvfp4_tiles(4, 512, 96)["variant"] == "dot_jw"
        assert quant.nvfp4_tiles(1, 5120, 17408)["variant"] == "gemv_h2w_ws"
        assert "nvfp4_matmul_dot_jw" in str(jax.make_jaxpr(matmul)(x, w))
        got = jax.jit(matmul)(x, w)
    with kernel_mode("reference"):
        want = matmul(x, w)
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="NVFP4 word dot"), quant.nvfp4_word_dot("dot_t_w"):
        pass


def test_matmuls_keep_weights_apart_for_several_rows_switched_off_or_on_the_reference_path(monkeypatch):
    """Rows past one on shapes whose table entry is a tensor-core dot (the default "on" mode),
    `fused_projections(False)` and the reference path (no kernel) all run one matmul per weight."""
    rng = np.random.default_rng(22)
    ws = (quantize_nvfp4(_weight(rng, 64, 256)), quantize_nvfp4(_weight(rng, 32, 256)))
    launches = _count_fused_launches(monkeypatch)
    with kernel_mode("interpret"), quant.fused_projections(True):
        quant.matmuls(jnp.ones((4, 256), jnp.bfloat16), ws)
        with quant.fused_projections(False):
            quant.matmuls(jnp.ones((1, 256), jnp.bfloat16), ws)
        quant.matmuls(jnp.ones((1, 256), jnp.float32), ws)  # float32 rows would round to float16
    with kernel_mode("reference"):
        quant.matmuls(jnp.ones((1, 256), jnp.bfloat16), ws)
    assert launches == []


def test_matmuls_fuse_several_rows_through_the_streamed_dots_when_asked(monkeypatch):
    """`fused_projections("rows")`: 2-16 decode rows of a group run in one "dot_ws" launch that
    equals each weight's own matmul; past 16 rows they stay apart; an unknown mode is refused."""
    rng = np.random.default_rng(24)
    ws = (quantize_nvfp4(_weight(rng, 64, 256)), quantize_nvfp4(_weight(rng, 40, 256)))
    x = jnp.asarray(rng.standard_normal((4, 256)), jnp.bfloat16)
    variants = []
    real = quant.nvfp4_matmuls
    monkeypatch.setattr(quant, "nvfp4_matmuls", lambda x, w, **kw: variants.append(kw["variant"]) or real(x, w, **kw))
    with kernel_mode("interpret"), quant.fused_projections("rows"):
        got = quant.matmuls(x, ws)
        quant.matmuls(jnp.ones((17, 256), jnp.bfloat16), ws)
    assert variants == ["dot_ws"]
    with kernel_mode("reference"):
        want = [matmul(x, w) for w in ws]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=2e-2, atol=2e-2)
    with pytest.raises(ValueError, match="on, off, rows"), quant.fused_projections("all"):
        pass


def test_fused_projections_lower_to_one_triton_call_for_cuda():
    rng = np.random.default_rng(23)
    ws = tuple(quantize_nvfp4(_weight(rng, n, 5120)) for n in (6144, 1024, 1024))
    with kernel_mode("kernel"):
        text = compat.lower_for_cuda(
            jax.jit(quant.matmuls), jax.ShapeDtypeStruct((1, 5120), jnp.bfloat16), ws
        )
    assert text.count("xla.gpu.triton") == 1 and "nvfp4_matmul_gemv_h2w_ws" in text  # K >= 4096, wide


def test_matmuls_keep_two_large_weights_apart(monkeypatch):
    """The 27B's gate / up (17408 x 5120 each) ran 4% slower fused: groups of only large weights
    keep a launch each (shapes only: nothing is computed)."""
    big = quant.FUSE_BELOW_WEIGHTS // 5120 + 16
    ws = tuple(
        NVFP4Weight(
            jax.ShapeDtypeStruct((n, 2560), jnp.uint8),
            jax.ShapeDtypeStruct((n, 320), jnp.float8_e4m3fn),
            jax.ShapeDtypeStruct((), jnp.float32),
        )
        for n in (big, big)
    )
    launches = _count_fused_launches(monkeypatch)
    with kernel_mode("kernel"):
        jax.eval_shape(quant.matmuls, jax.ShapeDtypeStruct((1, 5120), jnp.bfloat16), ws)
    assert launches == []


def test_the_word_rows_switch_lets_the_dense_word_kernels_make_their_rows(monkeypatch):
    """`nvfp4_word_rows("kernel")`: the decode tiles of the gemvs (single weights) carry
    x_rows="kernel", formulations that cannot make their own rows (dot_w, dot) keep XLA's, and a
    decode row through fused projections (gemv_ws) hands x to the kernel as given and gives the
    reference's output."""
    rng = np.random.default_rng(31)
    ws = (quantize_nvfp4(_weight(rng, 96, 512)), quantize_nvfp4(_weight(rng, 40, 512)))
    x = jnp.asarray(rng.standard_normal((1, 1, 512)) * 50.0, jnp.bfloat16)
    assert "x_rows" not in quant.nvfp4_tiles(1, 4096, 2048)
    seen, real = [], quant.nvfp4_matmuls
    monkeypatch.setattr(quant, "nvfp4_matmuls", lambda x, ws, **kw: seen.append(kw.get("x_rows")) or real(x, ws, **kw))
    with quant.nvfp4_word_rows("kernel"):
        assert quant.nvfp4_tiles(1, 4096, 2048)["x_rows"] == "kernel"  # gemv_ws (the 80B o_proj)
        assert "x_rows" not in quant.nvfp4_tiles(1, 17408, 5120)  # gemv_h2w_ws reads x in pairs
        assert quant.nvfp4_tiles(1, 6144, 5120)["x_rows"] == "kernel"  # gemv_w
        assert "x_rows" not in quant.nvfp4_tiles(4, 5120, 34816)  # dot_w
        assert "x_rows" not in quant.nvfp4_tiles(1, 512, 96)  # the bf16-decode dot
        with kernel_mode("interpret"):
            got = jax.jit(lambda x, ws: quant.matmuls(x, ws))(x, ws)  # a new function: traced here, not cached
    assert seen == ["kernel"]
    with kernel_mode("reference"):
        want = [matmul(x, w) for w in ws]
    for g, w in zip(got, want, strict=True):
        scale = float(jnp.abs(w.astype(jnp.float32)).max())
        np.testing.assert_allclose(np.asarray(g, np.float32), np.asarray(w, np.float32), rtol=2e-2, atol=2e-2 * scale)
    with pytest.raises(ValueError, match="NVFP4 word rows"), quant.nvfp4_word_rows("gpu"):
        pass
