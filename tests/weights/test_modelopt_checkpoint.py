"""ModelOpt NVFP4 / FP8 checkpoints load through `infernix_jax.load`, bit-exact, and run like their
dequantized float weights."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

import infernix_jax
from infernix_jax.config import ModelConfig
from infernix_jax.weights.hf import load_params
from infernix_jax.weights.quant import FP8Weight, NVFP4Weight, QuantizedWeight, quantize_fp8, quantize_nvfp4
from infernix_jax.weights.safetensors_io import CheckpointError, SafetensorsCheckpoint, save_safetensors
from tests.conftest import HF_FIXTURES
from tests.fixtures import modelopt_checkpoint as mo

TOKENS = [3, 17, 250, 9, 41, 77, 12, 300, 5, 199, 64, 2]


def _write(tmp_path, variant, **kwargs):
    src, dst, ref = HF_FIXTURES / variant, tmp_path / "modelopt", tmp_path / "dequantized"
    names = mo.write_modelopt_checkpoint(src, dst, ref, **kwargs)
    return dst, ref, names


def test_numpy_quantizer_matches_the_library_quantizer_byte_for_byte():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((24, 64)) * rng.uniform(0.01, 3, (24, 1))).astype(np.float32)
    w[3, :16] = 0.0  # an all-zero block: scale 1
    w[5, :16] = np.array([6, 0.75, 1.75, 3.5, 0.25, 2.5, 5, 1.25] * 2, np.float32)  # ties between codes
    ours, lib = mo.quantize_nvfp4(w), quantize_nvfp4(jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(lib.packed), ours["weight"])
    np.testing.assert_array_equal(np.asarray(lib.block_scale).view(np.uint8), ours["weight_scale"].view(np.uint8))
    assert np.float32(lib.tensor_scale) == ours["weight_scale_2"]
    fp8, lib8 = mo.quantize_fp8(w), quantize_fp8(jnp.asarray(w))
    np.testing.assert_array_equal(np.asarray(lib8.data).view(np.uint8), fp8["weight"].view(np.uint8))


@pytest.mark.parametrize(
    "variant, algo, form, exclude",
    [
        ("qwen3_next", "NVFP4", "hf_quant_config", mo.DEFAULT_EXCLUDE),  # per-expert, shared expert, MTP
        ("qwen3_next", "NVFP4", "quantization_config", ("lm_head",)),  # fused GDN projections quantized too
        ("qwen3_5_moe", "NVFP4", "quantization_config", mo.DEFAULT_EXCLUDE),  # fused experts
        ("qwen3_dense", "FP8", "hf_quant_config", ("lm_head",)),  # attention biases, tied embeddings
    ],
)
def test_modelopt_checkpoint_runs_like_its_dequantized_weights(tmp_path, variant, algo, form, exclude):
    path, reference, quantized = _write(tmp_path, variant, algo=algo, form=form, exclude=exclude)
    model = infernix_jax.load(path, dtype=jnp.float32, max_context=64)
    want = infernix_jax.load(reference, dtype=jnp.float32, max_context=64).logits(TOKENS)
    kinds = {type(w) for w in _quantized_leaves(model.params)}
    assert kinds == {NVFP4Weight if algo == "NVFP4" else FP8Weight}
    assert len(quantized) > 0
    np.testing.assert_allclose(model.logits(TOKENS), want, rtol=2e-4, atol=2e-4)


def _quantized_leaves(params):
    import jax

    return [w for w in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, QuantizedWeight))
            if isinstance(w, QuantizedWeight)]


def test_loaded_bytes_are_the_files_bytes(tmp_path):
    path, _, _ = _write(tmp_path, "qwen3_next", algo="NVFP4", form="hf_quant_config", exclude=("lm_head",))
    cfg = ModelConfig.from_hf_config(path)
    params = load_params(path, cfg, progress=False)
    ckpt = SafetensorsCheckpoint(path)
    layer = params.layers[3]  # full attention + MoE
    q = layer.attn.q_proj
    assert isinstance(q, NVFP4Weight)
    np.testing.assert_array_equal(np.asarray(q.packed), ckpt.get("model.layers.3.self_attn.q_proj.weight"))
    np.testing.assert_array_equal(
        np.asarray(q.block_scale).view(np.uint8), ckpt.get("model.layers.3.self_attn.q_proj.weight_scale").view(np.uint8)
    )
    assert float(q.input_scale) == pytest.approx(0.0125)
    experts = layer.moe.down_proj
    assert experts.packed.shape == (cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size // 2)
    for e in range(cfg.num_experts):
        name = f"model.layers.3.mlp.experts.{e}.down_proj"
        np.testing.assert_array_equal(np.asarray(experts.packed[e]), ckpt.get(name + ".weight"))
        np.testing.assert_array_equal(np.asarray(experts.block_scale[e]).view(np.uint8),
                                      ckpt.get(name + ".weight_scale").view(np.uint8))
        assert np.float32(experts.tensor_scale[e]) == ckpt.get(name + ".weight_scale_2")
    # Qwen3-Next's fused in_proj_qkvz is split into qkv and z rows: the bytes are the file's rows
    qkvz = ckpt.get("model.layers.0.linear_attn.in_proj_qkvz.weight")
    from infernix_jax.weights.hf import qkv_from_fused

    np.testing.assert_array_equal(np.asarray(params.layers[0].gdn.in_proj_qkv.packed), qkv_from_fused(cfg, qkvz))
    # excluded modules keep the model dtype
    assert params.lm_head.dtype == jnp.float32 and params.embed.dtype == jnp.float32


def test_fused_experts_keep_per_expert_scales(tmp_path):
    path, _, _ = _write(tmp_path, "qwen3_5_moe", algo="NVFP4", form="hf_quant_config")
    cfg = ModelConfig.from_hf_config(path)
    moe = load_params(path, cfg, progress=False).layers[0].moe
    ckpt = SafetensorsCheckpoint(path)
    fused = ckpt.get("model.layers.0.mlp.experts.gate_up_proj")
    np.testing.assert_array_equal(np.asarray(moe.gate_proj.packed), fused[:, : cfg.moe_intermediate_size])
    np.testing.assert_array_equal(np.asarray(moe.up_proj.packed), fused[:, cfg.moe_intermediate_size :])
    scale_2 = ckpt.get("model.layers.0.mlp.experts.gate_up_proj_weight_scale_2")
    assert scale_2.shape == (cfg.num_experts,)
    np.testing.assert_array_equal(np.asarray(moe.gate_proj.tensor_scale), scale_2)


def test_excluded_module_stored_quantized_is_a_clear_error(tmp_path):
    path, _, _ = _write(tmp_path, "qwen3_dense", algo="FP8", form="hf_quant_config", exclude=("lm_head",))
    text = (path / "hf_quant_config.json").read_text().replace('"lm_head"', '"lm_head", "*.self_attn.o_proj"')
    (path / "hf_quant_config.json").write_text(text)
    with pytest.raises(CheckpointError, match=r"layers\.0\.self_attn\.o_proj is excluded .* float8_e4m3fn"):
        load_params(path, ModelConfig.from_hf_config(path), progress=False)


def test_missing_scale_is_named(tmp_path):
    path, _, _ = _write(tmp_path, "qwen3_dense", algo="NVFP4", form="hf_quant_config", exclude=("lm_head",))
    ckpt = SafetensorsCheckpoint(path)
    tensors = {n: np.array(ckpt.get(n)) for n in ckpt.names()}
    del tensors["model.layers.1.mlp.up_proj.weight_scale_2"]
    save_safetensors(tensors, path / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"mlp\.up_proj\.weight_scale_2"):
        load_params(path, ModelConfig.from_hf_config(path), progress=False)


def test_e4m3_scales_stored_as_e4m3(tmp_path):
    path, _, _ = _write(tmp_path, "qwen3_dense", algo="NVFP4", form="hf_quant_config", exclude=())
    ckpt = SafetensorsCheckpoint(path)
    assert ckpt.get("model.layers.0.mlp.gate_proj.weight_scale").dtype == ml_dtypes.float8_e4m3fn
    assert ckpt.get("model.layers.0.mlp.gate_proj.weight").dtype == np.uint8
