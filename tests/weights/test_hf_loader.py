"""The loader reports every missing, mis-shaped or unexpected tensor in one readable error."""

from __future__ import annotations

import shutil

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from infernix_jax.config import ModelConfig
from infernix_jax.weights.hf import load_params
from infernix_jax.weights.safetensors_io import CheckpointError, SafetensorsCheckpoint, save_safetensors
from tests.conftest import HF_FIXTURES


def _copy_with(tmp_path, change):
    src = HF_FIXTURES / "qwen3_next"
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    ckpt = SafetensorsCheckpoint(dst)
    tensors = {n: np.array(ckpt.get(n)) for n in ckpt.names()}
    change(tensors)
    (dst / "model.safetensors").unlink()
    save_safetensors(tensors, dst / "model.safetensors")
    return dst


def test_missing_tensor_is_named(tmp_path):
    path = _copy_with(tmp_path, lambda t: t.pop("model.layers.3.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors \(1\): model\.layers\.3\.self_attn\.k_proj\.weight"):
        load_params(path, ModelConfig.from_hf_config(path), progress=False)


def test_misshaped_tensor_is_named_with_both_shapes(tmp_path):
    def change(t):
        t["model.layers.0.linear_attn.out_proj.weight"] = np.zeros((64, 60), np.float32)

    path = _copy_with(tmp_path, change)
    with pytest.raises(CheckpointError, match=r"out_proj\.weight: expected \[64, 64\] .* found \[64, 60\]"):
        load_params(path, ModelConfig.from_hf_config(path), progress=False)


def test_unexpected_tensor_is_named(tmp_path):
    def change(t):
        t["model.layers.0.linear_attn.surprise.weight"] = np.zeros((3,), np.float32)

    path = _copy_with(tmp_path, change)
    with pytest.raises(CheckpointError, match=r"unexpected tensors \(1\): model\.layers\.0\.linear_attn\.surprise"):
        load_params(path, ModelConfig.from_hf_config(path), progress=False)


def test_bf16_roundtrip_through_safetensors(tmp_path):
    x = (np.arange(12, dtype=np.float32) / 7).reshape(3, 4).astype(ml_dtypes.bfloat16)
    save_safetensors({"a": x}, tmp_path / "t.safetensors")
    got = SafetensorsCheckpoint(tmp_path).get("a")
    assert got.dtype == ml_dtypes.bfloat16 and np.array_equal(got, x)


def test_dtype_choice_casts_weights():
    path = HF_FIXTURES / "qwen3_next_bf16"
    params = load_params(path, ModelConfig.from_hf_config(path), jnp.bfloat16, progress=False)
    assert params.embed.dtype == jnp.bfloat16
    assert params.layers[0].gdn.A_log.dtype == jnp.float32  # feeds exp: kept in fp32
