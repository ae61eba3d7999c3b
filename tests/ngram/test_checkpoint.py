"""A model with an n-gram memory round-trips through a Hugging Face folder: its dense memory
weights are saved under their checkpoint names and load back bit for bit."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np

from infernix_jax.config import ModelConfig
from infernix_jax.weights.hf import load_params
from infernix_jax.weights.hf_export import params_to_hf, save_hf
from tests.ngram.conftest import tiny_raw_config


def test_memory_weights_load_from_a_checkpoint(tmp_path, tiny_cfg, tiny_params):
    (tmp_path / "config.json").write_text(json.dumps(tiny_raw_config()))
    save_hf(tiny_params, tiny_cfg, tmp_path)
    names = params_to_hf(tiny_params, tiny_cfg)
    memory_names = sorted(n for n in names if ".ngram_memory." in n)
    assert memory_names == [
        f"model.layers.{i}.ngram_memory.{w}.weight"
        for i in (1, 3)
        for w in ("key_norm", "key_proj", "query_norm", "value_proj")
    ]
    cfg = ModelConfig.from_hf_config(tmp_path)
    loaded = load_params(tmp_path, cfg, jnp.float32, with_mtp=False, progress=False)
    for want, got in zip(jax.tree_util.tree_leaves(tiny_params), jax.tree_util.tree_leaves(loaded), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert loaded.layers[1].ngram is not None and loaded.layers[0].ngram is None
