"""ModelConfig: every family variant resolves, full-size shapes cost nothing, bad configs fail clearly."""

from __future__ import annotations

import numpy as np
import pytest

from infernix_jax.config import (
    FULL_ATTENTION,
    LINEAR_ATTENTION,
    MLP_DENSE,
    MLP_MOE,
    ModelConfig,
    UnsupportedModelError,
)
from infernix_jax.model.params import abstract_params, count_params

QWEN3_NEXT_80B = dict(
    architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", vocab_size=151936, hidden_size=2048,
    intermediate_size=5120, num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
    rope_theta=10000000, partial_rotary_factor=0.25, linear_conv_kernel_dim=4, linear_key_head_dim=128,
    linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32, decoder_sparse_step=1,
    num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
    norm_topk_prob=True, tie_word_embeddings=False, full_attention_interval=4, max_position_embeddings=262144,
    num_nextn_predict_layers=1, mlp_only_layers=[],
)
QWEN3_5_27B = dict(
    architectures=["Qwen3_5ForConditionalGeneration"], model_type="qwen3_5", tie_word_embeddings=False,
    text_config=dict(
        model_type="qwen3_5_text", vocab_size=248320, hidden_size=5120, intermediate_size=17408,
        num_hidden_layers=64, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, max_position_embeddings=262144, mtp_num_hidden_layers=1,
        rope_parameters=dict(rope_type="default", rope_theta=10000000, partial_rotary_factor=0.25,
                             mrope_section=[11, 11, 10], mrope_interleaved=True),
    ),
)


def test_qwen3_next_80b_shapes_match_published_size():
    cfg = ModelConfig.from_hf_config(QWEN3_NEXT_80B)
    assert cfg.full_attention_layers == tuple(range(3, 48, 4))
    assert cfg.rope.rotary_dim == 64 and cfg.linear_conv_dim == 8192
    text = count_params(abstract_params(cfg, with_mtp=False))
    total = count_params(abstract_params(cfg))
    print(f"Qwen3-Next-80B-A3B: {text / 1e9:.2f}B without MTP, {total / 1e9:.2f}B with MTP")
    assert 79.0e9 < text < 81.0e9  # published: 80B (Hugging Face lists 81.3B with the MTP layer)
    assert 81.0e9 < total < 81.6e9


def test_qwen3_5_27b_shapes_match_published_size():
    cfg = ModelConfig.from_hf_config(QWEN3_5_27B)
    assert cfg.weight_prefix == "model.language_model."
    assert cfg.gdn_projection == "split" and cfg.mlp_types == (MLP_DENSE,) * 64
    text = count_params(abstract_params(cfg, with_mtp=False))
    print(f"Qwen3.5-27B: {text / 1e9:.2f}B text model without MTP")
    assert 26.5e9 < text < 27.5e9  # published: 27B


def test_layer_pattern_sparse_step_and_dense_layers():
    raw = dict(QWEN3_NEXT_80B, num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[1],
               layer_types=["full_attention", "linear_attention"] * 3)
    cfg = ModelConfig.from_hf_config(raw)
    assert cfg.layer_types == (FULL_ATTENTION, LINEAR_ATTENTION) * 3
    assert cfg.mlp_types == (MLP_DENSE, MLP_DENSE, MLP_DENSE, MLP_MOE, MLP_DENSE, MLP_MOE)


def test_yarn_frequencies():
    raw = dict(QWEN3_NEXT_80B, rope_scaling=dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=262144))
    cfg = ModelConfig.from_hf_config(raw)
    assert cfg.rope.kind == "yarn"
    assert cfg.rope.attention_factor == pytest.approx(0.1 * np.log(4.0) + 1.0)
    inv = cfg.rope.inv_freq()
    plain = 1.0 / (1e7 ** (np.arange(0, 64, 2) / 64))
    # fast-rotating dims are kept, slow ones are interpolated by the factor
    np.testing.assert_allclose(inv[0], plain[0], rtol=1e-6)
    np.testing.assert_allclose(inv[-1], plain[-1] / 4.0, rtol=1e-5)


def test_unsupported_architecture_is_one_clear_error():
    with pytest.raises(UnsupportedModelError, match="supported: Qwen3ForCausalLM"):
        ModelConfig.from_hf_config(dict(QWEN3_NEXT_80B, architectures=["LlamaForCausalLM"], model_type="llama"))


def test_value_heads_must_be_a_multiple_of_key_heads():
    with pytest.raises(UnsupportedModelError, match="multiple of linear_num_key_heads"):
        ModelConfig.from_hf_config(dict(QWEN3_NEXT_80B, linear_num_value_heads=24, linear_num_key_heads=16))


def test_unsupported_activation_and_rope_type():
    with pytest.raises(UnsupportedModelError, match="hidden_act"):
        ModelConfig.from_hf_config(dict(QWEN3_NEXT_80B, hidden_act="gelu"))
    with pytest.raises(UnsupportedModelError, match="rope_type"):
        ModelConfig.from_hf_config(dict(QWEN3_NEXT_80B, rope_scaling=dict(rope_type="longrope", factor=2.0)))


def test_config_is_hashable_for_jit():
    cfg = ModelConfig.from_hf_config(QWEN3_NEXT_80B)
    assert hash(cfg) == hash(ModelConfig.from_hf_config(QWEN3_NEXT_80B))
