"""A tiny hybrid model with an n-gram memory, built in the tests with random weights."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infernix_jax.config import ModelConfig
from infernix_jax.model.params import init_params
from infernix_jax.ngram.memory import random_table

VOCAB = 256


def tiny_config(**memory_changes) -> ModelConfig:
    """Qwen3.5-style dense hybrid (GDN + gated attention), 4 layers, memory at layers 1 and 3."""
    return ModelConfig.from_hf_config(tiny_raw_config(**memory_changes))


def tiny_raw_config(**memory_changes) -> dict:
    """tiny_config()'s config.json as a dict."""
    memory = {
        "orders": [2, 3],
        "heads_per_order": 2,
        "table_rows": 4096,
        "row_width": 8,
        "layers": [1, 3],
        "seed": 7,
        "table_dtype": "float32",
    }
    memory.update(memory_changes)
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "vocab_size": VOCAB,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "max_position_embeddings": 512,
        "ngram_memory": memory,
    }


@pytest.fixture(scope="session")
def tiny_cfg() -> ModelConfig:
    return tiny_config()


@pytest.fixture(scope="session")
def tiny_params(tiny_cfg):
    return init_params(tiny_cfg, jax.random.PRNGKey(0), jnp.float32, with_mtp=False)


@pytest.fixture(scope="session")
def tiny_table(tiny_cfg) -> np.ndarray:
    return random_table(tiny_cfg, seed=1)
