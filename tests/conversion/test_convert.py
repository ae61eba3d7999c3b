"""HF folder -> artifact -> `infernix_jax.load`: the same weights as quantizing the loaded folder in
memory, logits near the float model per recipe, ModelOpt bytes kept, one expert readable alone."""

from __future__ import annotations

import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import infernix_jax
from conversion import apply, convert, parse_recipe
from conversion.__main__ import main
from infernix_jax.config import ModelConfig
from infernix_jax.loaded_model import Model
from infernix_jax.weights.artifact import Artifact, ArtifactError, load_artifact_params
from infernix_jax.weights.hf import leaf_paths, load_params
from infernix_jax.weights.quant import NVFP4Weight, QuantizedWeight
from infernix_jax.weights.safetensors_io import SafetensorsCheckpoint
from tests.conftest import HF_FIXTURES
from tests.fixtures import modelopt_checkpoint as mo

TOKENS = [3, 17, 250, 9, 41, 77, 12, 300, 5, 199, 64, 2, 480, 33, 7, 101]
# Relative RMS error of the logits against the float32 model (qwen3_dense fixture), per recipe.
# Measured: bf16 0.006, int8 0.014, q8 0.013, fp8 0.058, q4 0.18, nvfp4 0.21 (random weights are
# harder to quantize than trained ones: no outliers to spend the scale on, no redundancy).
# (dense8 is int8 on a dense model; the MoE test below covers it.)
TOLERANCE = {"bf16": 0.02, "int8": 0.04, "q8": 0.04, "fp8": 0.12, "q4": 0.35, "nvfp4": 0.35}


def _leaves(params) -> dict:
    is_q = lambda x: isinstance(x, QuantizedWeight)
    flat = jax.tree_util.tree_flatten_with_path(params, is_leaf=is_q)[0]
    return {jax.tree_util.keystr(k, simple=True, separator="."): v for k, v in flat}


def _in_memory(params, recipe):
    """The loaded HF model quantized with `recipe` without an artifact, placed like `load(dtype=float32)`."""
    out = {p: apply(recipe, p, v) for p, v in _leaves(params).items()}
    treedef = jax.tree_util.tree_structure(params, is_leaf=lambda x: isinstance(x, QuantizedWeight))
    placed = [jax.tree.map(jnp.asarray, v) if isinstance(v, QuantizedWeight) else jnp.asarray(v, jnp.float32)
              for v in out.values()]
    return jax.tree_util.tree_unflatten(treedef, placed)


def _assert_same_params(got, want):
    g, w = _leaves(got), _leaves(want)
    assert g.keys() == w.keys()
    for path in g:
        assert type(g[path]) is type(w[path]), path
        for a, b in zip(jax.tree.leaves(g[path]), jax.tree.leaves(w[path])):
            a, b = np.asarray(a), np.asarray(b)
            assert a.dtype == b.dtype and a.shape == b.shape, path
            assert a.tobytes() == b.tobytes(), path


def _rel_rms(got, want) -> float:
    return float(np.sqrt(np.mean((got - want) ** 2) / np.mean(want**2)))


@pytest.mark.parametrize("recipe", list(TOLERANCE))
def test_each_recipe_round_trips_and_stays_near_the_float_model(tmp_path, recipe):
    src = HF_FIXTURES / "qwen3_dense"
    summary = convert(src, tmp_path / "art", parse_recipe(recipe), progress=False)
    assert summary.stored_bytes < summary.source_bytes
    model = infernix_jax.load(tmp_path / "art", dtype=jnp.float32, max_context=64)
    hf = load_params(src, model.config, progress=False)
    in_memory = _in_memory(hf, parse_recipe(recipe))
    _assert_same_params(model.params, in_memory)
    logits = model.logits(TOKENS)
    np.testing.assert_array_equal(logits, Model(model.config, in_memory, None, 64).logits(TOKENS))
    float_logits = Model(model.config, hf, None, 64).logits(TOKENS)
    assert _rel_rms(logits, float_logits) < TOLERANCE[recipe]
    assert model.tokenizer is None or model.tokenizer.encode("hi")


def test_moe_artifact_matches_in_memory_quantization_and_reads_one_expert_alone(tmp_path):
    src, art = HF_FIXTURES / "qwen3_next", tmp_path / "art"
    recipe = parse_recipe("dense8")
    convert(src, art, recipe, progress=False)
    cfg = ModelConfig.from_hf_config(src)
    hf = load_params(src, cfg, progress=False)
    params = load_artifact_params(art, cfg, jnp.float32, progress=False)
    in_memory = _in_memory(hf, recipe)
    _assert_same_params(params, in_memory)
    assert params.mtp is not None and isinstance(params.layers[0].moe.gate_proj, NVFP4Weight)
    np.testing.assert_array_equal(
        Model(cfg, params, None, 64).logits(TOKENS), Model(cfg, in_memory, None, 64).logits(TOKENS)
    )

    # one expert is one chunk per array: delete every other expert's chunks and it still reads
    artifact = Artifact(art)
    full = params.layers[1].moe.down_proj
    for info in artifact.record("layers.1.moe.down_proj")["arrays"].values():
        assert info["chunks"][0] == 1
        for chunk in (art / info["path"] / "c").iterdir():
            if chunk.name != "5":
                shutil.rmtree(chunk) if chunk.is_dir() else chunk.unlink()
    one = artifact.read_expert("layers.1.moe.down_proj", 5)
    assert one.shape == (cfg.hidden_size, cfg.moe_intermediate_size)
    for a, b in zip(jax.tree.leaves(one), jax.tree.leaves(jax.tree.map(lambda x: x[5], full))):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    with pytest.raises(ArtifactError, match="layers.1.moe.down_proj"):
        artifact.read_expert("layers.1.moe.down_proj", 4)


def test_modelopt_experts_keep_their_bytes_through_conversion(tmp_path):
    src, ref = tmp_path / "modelopt", tmp_path / "dequantized"
    mo.write_modelopt_checkpoint(HF_FIXTURES / "qwen3_next", src, ref, exclude=("lm_head", "*.mlp.gate"))
    summary = convert(src, tmp_path / "art", parse_recipe("experts=nvfp4,attention=int8"), progress=False)
    assert summary.classes["experts"].kept == summary.classes["experts"].tensors > 0
    assert summary.classes["attention"].requantized == summary.classes["attention"].tensors  # nvfp4 -> int8
    cfg = ModelConfig.from_hf_config(tmp_path / "art")
    params = load_artifact_params(tmp_path / "art", cfg, jnp.float32, progress=False)
    ckpt = SafetensorsCheckpoint(src)
    gate = params.layers[2].moe.gate_proj
    for e in range(cfg.num_experts):
        name = f"model.layers.2.mlp.experts.{e}.gate_proj"
        np.testing.assert_array_equal(np.asarray(gate.packed[e]), ckpt.get(name + ".weight"))
        np.testing.assert_array_equal(
            np.asarray(gate.block_scale[e]).view(np.uint8), ckpt.get(name + ".weight_scale").view(np.uint8)
        )
        assert np.float32(gate.tensor_scale[e]) == ckpt.get(name + ".weight_scale_2")
    assert type(params.layers[3].attn.q_proj).__name__ == "Int8Weight"
    assert "quantization_config" not in (tmp_path / "art" / "config.json").read_text()


def test_cli_converts_and_prints_bytes_per_class(tmp_path, capsys):
    assert main(["--in", str(HF_FIXTURES / "qwen3_moe"), "--out", str(tmp_path / "art"), "--recipe",
                 "experts=q4_g64,dense=fp8", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "experts" in out and "q4_g32" in out and "fp8" in out and "total" in out  # 32 = K of down_proj
    meta = Artifact(tmp_path / "art").meta
    assert meta["recipe"]["formats"]["experts"] == "q4_g64" and meta["recipe"]["formats"]["router"] == "bf16"
    assert main(["--in", ".", "--out", str(tmp_path / "x"), "--recipe", "int3"]) == 2
    assert "unknown recipe 'int3'" in capsys.readouterr().err


def test_module_help_runs():
    run = subprocess.run([sys.executable, "-m", "conversion", "--help"], capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 0 and "--recipe" in run.stdout and "dense8" in run.stdout


def test_recipe_rules_and_classes():
    from conversion.recipes import RecipeError, module_class

    r = parse_recipe("experts=nvfp4,dense=q8_g64,default=fp8")
    assert (r.format_for("experts"), r.format_for("attention"), r.format_for("router"), r.format_for("norm")) == (
        "nvfp4", "q8_g64", "fp8", "bf16")
    with pytest.raises(RecipeError, match="module class 'embed' cannot be quantized"):
        parse_recipe("embed=int8")
    with pytest.raises(RecipeError, match="unknown format 'int4'"):
        parse_recipe("experts=int4")
    cfg = ModelConfig.from_hf_config(HF_FIXTURES / "qwen3_next")
    from infernix_jax.model.params import declare_params

    classes = {p: module_class(p) for p in leaf_paths(declare_params(cfg))}
    assert classes["layers.0.moe.gate_proj"] == "experts" and classes["layers.0.moe.shared.up_proj"] == "shared_expert"
    assert classes["layers.0.moe.router"] == classes["layers.0.moe.shared_gate"] == "router"
    assert classes["layers.3.attn.q_proj"] == "attention" and classes["layers.0.gdn.in_proj_qkv"] == "linear_attn"
    assert classes["layers.0.gdn.norm"] == classes["layers.3.attn.q_norm"] == classes["final_norm"] == "norm"
    assert classes["layers.0.gdn.conv_weight"] == classes["layers.0.gdn.A_log"] == "other"
    assert (classes["embed"], classes["lm_head"], classes["mtp.fc"]) == ("embed", "lm_head", "mtp_fc")


# ---- a damaged artifact is one clear error ------------------------------------------------------


@pytest.fixture(scope="module")
def small_artifact(tmp_path_factory):
    art = tmp_path_factory.mktemp("artifact") / "art"
    convert(HF_FIXTURES / "qwen3_moe", art, parse_recipe("nvfp4"), progress=False)
    return art


def _damaged(small_artifact, tmp_path):
    art = tmp_path / "art"
    shutil.copytree(small_artifact, art)
    return art


def _load(art):
    return load_artifact_params(art, ModelConfig.from_hf_config(art), jnp.float32, progress=False)


def test_truncated_chunk_is_named(small_artifact, tmp_path):
    art = _damaged(small_artifact, tmp_path)
    chunk = art / "tensors/layers.1.moe.up_proj/packed/c/3/0/0"
    chunk.write_bytes(chunk.read_bytes()[:-7])
    with pytest.raises(ArtifactError, match=r"layers\.1\.moe\.up_proj\.packed is damaged or incomplete"):
        _load(art)


def test_missing_chunk_is_an_error_not_zeros(small_artifact, tmp_path):
    art = _damaged(small_artifact, tmp_path)
    (art / "tensors/layers.1.moe.up_proj/block_scale/c/6/0/0").unlink()
    with pytest.raises(ArtifactError, match=r"layers\.1\.moe\.up_proj\.block_scale is damaged or incomplete"):
        _load(art)


def test_missing_tensor_is_named(small_artifact, tmp_path):
    art = _damaged(small_artifact, tmp_path)
    shutil.rmtree(art / "tensors/layers.2.attn.o_proj")
    with pytest.raises(ArtifactError, match=r"layers\.2\.attn\.o_proj\.packed .* cannot be opened"):
        _load(art)


def test_wrong_format_version_says_to_reconvert(small_artifact, tmp_path):
    art = _damaged(small_artifact, tmp_path)
    meta = art / "infernix_artifact.json"
    meta.write_text(meta.read_text().replace('"format_version": 1', '"format_version": 99', 1))
    with pytest.raises(ArtifactError, match=r"version 99; this build reads 'infernix-artifact' version 1\. Re-run"):
        infernix_jax.load(art)


def test_interrupted_conversion_is_not_an_artifact(small_artifact, tmp_path):
    art = _damaged(small_artifact, tmp_path)
    (art / "infernix_artifact.json").unlink()
    with pytest.raises(ArtifactError, match="not an infernix artifact"):
        _load(art)
