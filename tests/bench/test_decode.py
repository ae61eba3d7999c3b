"""bench.decode with quantized weights: the bench model quantizes what the conversion recipe
quantizes, the roofline counts packed bytes and routed experts only, and a quick run works on
the CPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.decode import main, measure
from bench.engine_setup import build_model, weight_bytes_per_token
from infernix_jax.weights.quant import NVFP4Weight, QuantizedWeight


@pytest.fixture(scope="module")
def tiny_nvfp4():
    return build_model("tiny", jnp.float32, weights="nvfp4")


def test_nvfp4_bench_model_quantizes_projections_and_experts_only(tiny_nvfp4):
    cfg, params = tiny_nvfp4
    _, plain = build_model("tiny", jnp.float32)
    layer = next(i for i, t in enumerate(cfg.layer_types) if t != "full_attention")
    moe, gdn = params.layers[layer].moe, params.layers[layer].gdn
    for w in (moe.gate_proj, moe.up_proj, moe.down_proj, moe.shared.gate_proj, gdn.in_proj_qkv, gdn.out_proj):
        assert isinstance(w, NVFP4Weight)
    for leaf in (params.embed, params.lm_head, params.final_norm, moe.router, moe.shared_gate, gdn.A_log):
        assert not isinstance(leaf, QuantizedWeight)
    # the same random values as the bf16 bench model, within NVFP4's step
    want = np.asarray(plain.layers[layer].moe.gate_proj)
    got = np.asarray(moe.gate_proj.dequantize(jnp.float32))
    assert np.abs(got - want).max() <= 0.2 * np.abs(want).max()
    np.testing.assert_array_equal(np.asarray(params.embed), np.asarray(plain.embed))


@pytest.mark.parametrize(("weights", "block_size"), [("fp8_block", 128), ("int8", None)])
def test_the_bench_model_takes_block_scaled_fp8_and_int8_weights(weights, block_size):
    """The formats whose GPU paths changed (block-scaled FP8 prefill through the tiled kernel, INT8
    through its XLA dot) can be benchmarked end to end: the projections and experts come quantized."""
    from infernix_jax.weights.quant import FP8Weight, Int8Weight

    cfg, params = build_model("tiny", jnp.float32, weights=weights)
    layer = next(i for i, t in enumerate(cfg.layer_types) if t != "full_attention")
    moe = params.layers[layer].moe
    for w in (moe.gate_proj, moe.down_proj, params.layers[layer].gdn.in_proj_qkv):
        if weights == "int8":
            assert isinstance(w, Int8Weight)
        else:
            assert isinstance(w, FP8Weight) and w.block_size == block_size
    assert not isinstance(params.lm_head, QuantizedWeight)


def test_weight_bytes_count_packed_bytes_and_only_routed_experts(tiny_nvfp4):
    cfg, params = tiny_nvfp4

    def stored(tree):
        return sum(a.size * a.dtype.itemsize for a in jax.tree.leaves(tree))

    experts = sum(stored((lay.moe.gate_proj, lay.moe.up_proj, lay.moe.down_proj)) for lay in params.layers)
    embed_row = params.embed.shape[1] * params.embed.dtype.itemsize
    want = stored(params) - experts - stored(params.embed) + embed_row
    want += sum(
        stored(w) * cfg.num_experts_per_tok // cfg.num_experts
        for lay in params.layers
        for w in (lay.moe.gate_proj, lay.moe.up_proj, lay.moe.down_proj)
    )
    # per-expert tensor scales [E] count top_k / E of them, like the packed bytes
    assert weight_bytes_per_token(cfg, params) == want
    _, plain = build_model("tiny", jnp.float32)
    assert weight_bytes_per_token(cfg, params) < weight_bytes_per_token(cfg, plain) / 3


def test_decode_bench_measures_an_nvfp4_model(tiny_nvfp4):
    cfg, params = tiny_nvfp4
    record = measure(cfg, params, "tiny", 1, 256, 2, 1, "bf16", 1e9, "cpu", "test", "nvfp4")
    assert record.name == "decode tiny nvfp4 batch1 ctx256"
    assert record.figure > 0 and record.details["weights"] == "nvfp4"
    assert record.details["bytes_per_step"] > weight_bytes_per_token(cfg, params)  # + KV and state


def test_an_xla_gpu_variant_gets_a_record_name_of_its_own():
    from bench.decode import xla_gpu_flags_tag

    flags = "--xla_backend_optimization_level=0 --xla_gpu_command_buffer_update_mode=SKIP_TEMP"
    assert xla_gpu_flags_tag(flags) == " xla[command_buffer_update_mode=SKIP_TEMP]"
    assert xla_gpu_flags_tag("--xla_backend_optimization_level=0") == xla_gpu_flags_tag("") == ""


def test_quick_decode_rejects_an_unknown_weight_format():
    with pytest.raises(SystemExit):
        main(["--quick", "--weights", "int3"])


def test_decode_rejects_an_unknown_moe_routing_before_building_a_model():
    with pytest.raises(SystemExit):
        main(["--quick", "--moe-routing", "xla,heap"])


def test_prefill_flops_count_quantized_weights_by_their_logical_shape(tiny_nvfp4):
    from bench.engine_setup import active_params_per_token

    cfg, params = tiny_nvfp4
    _, plain = build_model("tiny", jnp.float32)
    assert active_params_per_token(cfg, params) == active_params_per_token(cfg, plain)
    assert active_params_per_token(cfg, plain) * 4 == weight_bytes_per_token(cfg, plain)  # float32: 4 bytes each
