"""ModelOpt checkpoints: config forms, exclusions, and bit-exact Linear tensors."""

import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from infernix_jax.weights.modelopt import QuantConfig, build_linear, read_quant_config
from infernix_jax.weights.quant import FP8Weight, NVFP4Weight, matmul, quantize_fp8, quantize_nvfp4

QUANTIZED = ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.experts.1.down_proj")
EXCLUDED = ("lm_head", "model.layers.0.mlp.gate")


def _write(path, name, data):
    path.joinpath(name).write_text(json.dumps(data))


def _modelopt_nvfp4_tensors(rng):
    """A tiny checkpoint's tensors in ModelOpt's NVFP4 export layout (names, dtypes, shapes)."""
    tensors, source = {}, {}
    for prefix, (n, k) in zip(QUANTIZED + EXCLUDED, [(48, 64), (32, 96), (40, 64), (8, 64)]):
        w = jnp.asarray(rng.standard_normal((n, k)) * 0.05, jnp.bfloat16)
        source[prefix] = w
        if prefix in EXCLUDED:
            tensors[f"{prefix}.weight"] = np.asarray(w)
            continue
        q = quantize_nvfp4(w)
        tensors[f"{prefix}.weight"] = np.asarray(q.packed)
        tensors[f"{prefix}.weight_scale"] = np.asarray(q.block_scale)
        tensors[f"{prefix}.weight_scale_2"] = np.asarray(q.tensor_scale, np.float32)
        tensors[f"{prefix}.input_scale"] = np.asarray(0.02, np.float32)
    return tensors, source


def test_reads_hf_quant_config_json(tmp_path):
    _write(tmp_path, "config.json", {"model_type": "qwen3_next"})
    _write(
        tmp_path,
        "hf_quant_config.json",
        {
            "producer": {"name": "modelopt", "version": "0.31.0"},
            "quantization": {
                "quant_algo": "NVFP4",
                "kv_cache_quant_algo": None,
                "group_size": 16,
                "exclude_modules": ["lm_head", "model.layers.*.mlp.gate", "*linear_attn*"],
            },
        },
    )
    q = read_quant_config(tmp_path)
    assert (q.quant_algo, q.group_size, q.producer, q.source) == (
        "NVFP4",
        16,
        "modelopt 0.31.0",
        "hf_quant_config.json",
    )
    assert q.is_excluded("lm_head") and q.is_excluded("model.layers.7.mlp.gate")
    assert q.is_excluded("model.layers.2.linear_attn.in_proj_qkvz")
    assert not q.is_excluded("model.layers.7.mlp.gate_proj")
    assert not q.is_excluded("model.layers.3.self_attn.q_proj")


def test_reads_the_config_json_form_and_infers_the_algo_from_config_groups(tmp_path):
    _write(
        tmp_path,
        "config.json",
        {
            "quantization_config": {
                "quant_method": "modelopt",
                "producer": {"name": "modelopt", "version": "0.35"},
                "ignore": ["lm_head", "model.layers.*.mlp.shared_expert_gate*"],
                "config_groups": {
                    "group_0": {
                        "weights": {"type": "float", "num_bits": 4, "group_size": 16},
                        "input_activations": {"type": "float", "num_bits": 4},
                        "targets": ["Linear"],
                    }
                },
                "kv_cache_scheme": {"type": "float", "num_bits": 8},
            }
        },
    )
    q = read_quant_config(tmp_path)
    assert (q.quant_algo, q.group_size, q.source) == ("NVFP4", 16, "config.json")
    assert q.is_excluded("model.layers.4.mlp.shared_expert_gate")
    assert not q.is_excluded("model.layers.4.mlp.shared_expert.up_proj")


def test_reads_block_fp8_config(tmp_path):
    _write(
        tmp_path,
        "config.json",
        {
            "quantization_config": {
                "quant_method": "fp8",
                "fmt": "e4m3",
                "activation_scheme": "dynamic",
                "weight_block_size": [128, 128],
                "modules_to_not_convert": ["lm_head", "mlp.gate"],
            }
        },
    )
    q = read_quant_config(tmp_path)
    assert (q.quant_algo, q.weight_block_size) == ("FP8_BLOCK", (128, 128))
    assert q.is_excluded("model.layers.1.mlp.gate") and not q.is_excluded("model.layers.1.mlp.gate_proj")


def test_unquantized_checkpoint_has_no_quant_config(tmp_path):
    _write(tmp_path, "config.json", {"model_type": "qwen3_next"})
    assert read_quant_config(tmp_path) is None


@pytest.mark.parametrize("algo", ["W4A8_AWQ", "INT4_AWQ"])
def test_unsupported_algorithms_are_named(tmp_path, algo):
    _write(tmp_path, "hf_quant_config.json", {"quantization": {"quant_algo": algo}})
    with pytest.raises(ValueError, match=algo):
        read_quant_config(tmp_path)


def test_nvfp4_linears_load_bit_exact_and_multiply_like_the_dequantized_weight():
    rng = np.random.default_rng(0)
    tensors, source = _modelopt_nvfp4_tensors(rng)
    qcfg = QuantConfig(quant_algo="NVFP4", group_size=16, exclude_modules=("lm_head", "*.mlp.gate"))
    for prefix in QUANTIZED:
        w = build_linear(tensors.__getitem__, prefix, qcfg)
        assert isinstance(w, NVFP4Weight)
        np.testing.assert_array_equal(np.asarray(w.packed), tensors[f"{prefix}.weight"])
        np.testing.assert_array_equal(
            np.asarray(w.block_scale).view(np.uint8), tensors[f"{prefix}.weight_scale"].view(np.uint8)
        )
        assert np.float32(w.tensor_scale) == tensors[f"{prefix}.weight_scale_2"]
        assert float(w.input_scale) == pytest.approx(0.02)
        # Re-quantizing the source with the published formula gives the same bytes back.
        np.testing.assert_array_equal(np.asarray(quantize_nvfp4(source[prefix]).packed), np.asarray(w.packed))
        x = jnp.asarray(rng.standard_normal((3, w.shape[1])), jnp.float32)
        want = np.asarray(x) @ np.asarray(w.dequantize(jnp.float32)).T
        np.testing.assert_allclose(np.asarray(matmul(x, w)), want, rtol=1e-5, atol=1e-5)
        # and the dequantized weight is close to the bf16 source (NVFP4 error is at most one scale unit)
        assert float(jnp.abs(w.dequantize(jnp.float32) - source[prefix].astype(jnp.float32)).max()) < 0.05
    for prefix in EXCLUDED:
        w = build_linear(tensors.__getitem__, prefix, qcfg)
        assert not isinstance(w, NVFP4Weight) and w.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(w), np.asarray(source[prefix]))


def test_e4m3_tensors_may_arrive_as_their_uint8_bytes():
    tensors, _ = _modelopt_nvfp4_tensors(np.random.default_rng(1))
    prefix = QUANTIZED[0]
    raw = dict(tensors)
    raw[f"{prefix}.weight_scale"] = tensors[f"{prefix}.weight_scale"].view(np.uint8)
    w = build_linear(raw.__getitem__, prefix, QuantConfig(quant_algo="NVFP4", group_size=16))
    assert w.block_scale.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(np.asarray(w.block_scale).view(np.uint8), raw[f"{prefix}.weight_scale"])


@pytest.mark.parametrize("block", [None, 128])
def test_fp8_linears_load_bit_exact(block):
    rng = np.random.default_rng(2)
    w_src = jnp.asarray(rng.standard_normal((200, 160)) * 0.05, jnp.bfloat16)
    q = quantize_fp8(w_src, block_size=block)
    tensors = {"m.o_proj.weight": np.asarray(q.data)}
    if block is None:
        tensors["m.o_proj.weight_scale"] = np.asarray(q.scale, np.float32)
        qcfg = QuantConfig(quant_algo="FP8")
    else:
        tensors["m.o_proj.weight_scale_inv"] = np.asarray(q.scale, np.float32)
        qcfg = QuantConfig(quant_algo="FP8_BLOCK", weight_block_size=(128, 128))
    w = build_linear(tensors.__getitem__, "m.o_proj", qcfg)
    assert isinstance(w, FP8Weight) and w.block_size == block
    np.testing.assert_array_equal(
        np.asarray(w.data).view(np.uint8), tensors["m.o_proj.weight"].view(np.uint8)
    )
    np.testing.assert_array_equal(np.asarray(w.scale), np.asarray(q.scale))
    x = jnp.asarray(rng.standard_normal((2, 160)), jnp.float32)
    np.testing.assert_allclose(
        np.asarray(matmul(x, w)),
        np.asarray(x) @ np.asarray(w.dequantize(jnp.float32)).T,
        rtol=1e-5,
        atol=1e-5,
    )


def test_mismatched_scale_shapes_name_the_tensor():
    tensors, _ = _modelopt_nvfp4_tensors(np.random.default_rng(3))
    prefix = QUANTIZED[0]
    tensors[f"{prefix}.weight_scale"] = tensors[f"{prefix}.weight_scale"][:, :2]
    with pytest.raises(ValueError, match=f"{prefix}.weight_scale has shape"):
        build_linear(tensors.__getitem__, prefix, QuantConfig(quant_algo="NVFP4", group_size=16))
    fp8 = {"a.weight": np.zeros((4, 4), ml_dtypes.float8_e4m3fn)}
    with pytest.raises(ValueError, match="neither weight_scale nor weight_scale_inv"):
        build_linear(fp8.__getitem__, "a", QuantConfig(quant_algo="FP8"))
