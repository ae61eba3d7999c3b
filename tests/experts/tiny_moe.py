"""A tiny hybrid MoE with many experts (32, top-4) and NVFP4-packed experts, built in memory.

Shapes follow the qwen3_next fixture (GDN + gated attention layers, a shared expert) with the
expert count raised, so that small budgets force misses on every step.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np

from infernix_jax.config import ModelConfig
from infernix_jax.model.params import Params, init_params
from infernix_jax.weights.quant import quantize_nvfp4
from tests.conftest import HF_FIXTURES

NUM_EXPERTS, TOP_K = 32, 4


def tiny_config() -> ModelConfig:
    base = ModelConfig.from_hf_config(json.loads((HF_FIXTURES / "qwen3_next" / "config.json").read_text()))
    return dataclasses.replace(base, num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K, mtp_num_layers=0)


def tiny_params(cfg: ModelConfig, seed: int = 0) -> Params:
    """Random float32 weights with every routed expert stack quantized to NVFP4. The router is
    scaled up so that routing is decisive and varies from token to token."""
    params = init_params(cfg, jax.random.PRNGKey(seed), with_mtp=False)
    layers = []
    for layer in params.layers:
        moe = layer.moe
        moe = dataclasses.replace(
            moe,
            router=moe.router * 8.0,
            gate_proj=quantize_nvfp4(moe.gate_proj),
            up_proj=quantize_nvfp4(moe.up_proj),
            down_proj=quantize_nvfp4(moe.down_proj),
        )
        layers.append(dataclasses.replace(layer, moe=moe))
    return dataclasses.replace(params, layers=tuple(layers))


def expert_bytes(params: Params) -> int:
    moe = params.layers[0].moe
    return (
        sum(np.asarray(a).nbytes for a in jax.tree.leaves((moe.gate_proj, moe.up_proj, moe.down_proj)))
        // NUM_EXPERTS
    )
