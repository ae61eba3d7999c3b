"""Capacity planning: auto fills the budget, max_context sizes exactly, impossible plans fail clearly."""

from __future__ import annotations

import jax.numpy as jnp
import pytest

from infernix_jax.cache import (
    CapacityError,
    kv_bytes_per_block,
    parse_bytes,
    plan_capacity,
    state_bytes_per_slot,
)
from infernix_jax.cache.capacity import GiB
from infernix_jax.config import ModelConfig
from tests.conftest import HF_FIXTURES


@pytest.fixture(scope="module")
def big_cfg() -> ModelConfig:
    """The tiny qwen3_next layout with Qwen3-Next-80B's attention and GDN sizes (48 layers, 12 attention)."""
    cfg = ModelConfig.from_hf_config(HF_FIXTURES / "qwen3_next")
    types = tuple("full_attention" if i % 4 == 3 else "linear_attention" for i in range(48))
    return cfg.replace(
        num_layers=48, layer_types=types, mlp_types=("moe",) * 48, num_heads=16, num_kv_heads=2, head_dim=256,
        linear_num_k_heads=16, linear_num_v_heads=32, linear_k_head_dim=128, linear_v_head_dim=128,
        max_position_embeddings=262144,
    )  # fmt: skip


def test_real_shape_block_and_slot_sizes(big_cfg):
    # 12 layers x (K and V) x 64 tokens x 2 heads x 256 dims x 2 bytes
    assert kv_bytes_per_block(big_cfg, "bf16") == 12 * 2 * 64 * 2 * 256 * 2 == 1.5 * 2**20
    # int8/fp8: 1 byte a value + a 4-byte scale per token per head
    assert kv_bytes_per_block(big_cfg, "fp8") == 12 * 2 * 64 * 2 * (256 + 4)
    # 36 GDN layers x (conv 8192 channels x 3 taps x 2 bytes + 32 x 128 x 128 fp32)
    assert state_bytes_per_slot(big_cfg, jnp.bfloat16) == 36 * (8192 * 3 * 2 + 32 * 128 * 128 * 4)


@pytest.mark.parametrize("kv_dtype", ["bf16", "int8", "fp8"])
def test_auto_fills_what_the_weights_leave(big_cfg, kv_dtype):
    plan = plan_capacity(big_cfg, weights_bytes=80 * GiB, device_bytes=141 * GiB, kv_dtype=kv_dtype)
    used = plan.bytes_kv + plan.bytes_state
    assert used <= plan.budget_bytes < used + plan.bytes_per_block  # not one more block would fit
    assert plan.budget_bytes == int(141 * GiB * 0.9) - 80 * GiB - plan.safety_margin_bytes
    assert plan.num_slots == 8 + 1
    assert plan.max_context == min(262144, plan.token_capacity)


def test_quantized_formats_hold_about_twice_the_tokens(big_cfg):
    kw = {"weights_bytes": 80 * GiB, "device_bytes": 141 * GiB}
    bf16 = plan_capacity(big_cfg, kv_dtype="bf16", **kw)
    int8 = plan_capacity(big_cfg, kv_dtype="int8", **kw)
    assert 1.9 < int8.token_capacity / bf16.token_capacity < 2.0  # scales cost 4 bytes per 256


def test_explicit_max_context_gives_exact_block_count(big_cfg):
    plan = plan_capacity(big_cfg, 80 * GiB, 141 * GiB, "fp8", max_concurrency=16, max_context=32_000)
    assert plan.num_blocks == 16 * 500 + 1  # ceil(32000 / 64) = 500, plus the null block
    assert plan.max_context == 32_000 and plan.mode == "max_context"
    assert plan.bytes_kv == plan.num_blocks * plan.bytes_per_block


def test_plan_that_does_not_fit_is_an_error(big_cfg):
    with pytest.raises(CapacityError, match="int8/fp8"):
        plan_capacity(big_cfg, 80 * GiB, 141 * GiB, "bf16", max_concurrency=64, max_context=262_144)
    with pytest.raises(CapacityError):
        plan_capacity(big_cfg, 130 * GiB, 141 * GiB)  # weights leave nothing


def test_kv_capacity_as_blocks_or_bytes(big_cfg):
    plan = plan_capacity(big_cfg, 80 * GiB, 141 * GiB, "bf16", kv_capacity="6GiB")
    assert plan.mode == "bytes" and plan.num_blocks == 6 * GiB // plan.bytes_per_block == 4096
    plan = plan_capacity(big_cfg, 80 * GiB, 141 * GiB, "bf16", kv_capacity=1000)
    assert plan.mode == "blocks" and plan.usable_blocks == 1000 and plan.num_blocks == 1001
    with pytest.raises(CapacityError):
        plan_capacity(big_cfg, 80 * GiB, 141 * GiB, "bf16", kv_capacity=100_000)  # 146 GiB of bf16 KV
    assert parse_bytes("500MB") == 500 * 10**6 and parse_bytes("1.5gib") == 3 * 2**29
    with pytest.raises(ValueError):
        parse_bytes("lots")


def test_describe_reports_the_plan(big_cfg):
    plan = plan_capacity(big_cfg, 80 * GiB, 141 * GiB, "fp8", max_concurrency=4, max_context=8192)
    text = plan.describe()
    assert "fp8" in text and f"{plan.usable_blocks:,} blocks of 64 tokens" in text
    assert "4 (+1 scratch)" in text and "80.00 GiB" in text
