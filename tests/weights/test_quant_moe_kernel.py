"""Quantized MoE experts through the grouped Pallas kernel (interpret mode on the CPU) give the
same block output as the reference path, for decode batches and prefill chunks, with experts
shared by several tokens and experts that get none."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infernix_jax.config import ModelConfig
from infernix_jax.model import mlp
from infernix_jax.model.params import MoEParams
from infernix_jax.weights import quant
from infernix_jax.weights.quant import (
    GROUPED_DECODE_MAX_TOKENS,
    grouped_expert_matmul,
    grouped_kernel_ready,
    grouped_tiles,
    kernel_mode,
    quantize_fp8,
    quantize_int8,
    quantize_nvfp4,
)
from tests.conftest import HF_FIXTURES

E, TOP_K, D, I = 8, 2, 64, 32
QUANTIZERS = {
    "nvfp4": quantize_nvfp4,
    "fp8": quantize_fp8,
    "fp8_block32": lambda w: quantize_fp8(w, block_size=32),
}


def _config() -> ModelConfig:
    base = ModelConfig.from_hf_config(json.loads((HF_FIXTURES / "qwen3_next" / "config.json").read_text()))
    return dataclasses.replace(
        base, hidden_size=D, num_experts=E, num_experts_per_tok=TOP_K, mtp_num_layers=0
    )


def _block(fmt: str, seed: int = 0) -> MoEParams:
    """A MoE block with quantized routed experts, a bf16 router and no shared expert."""
    keys = jax.random.split(jax.random.key(seed), 4)
    quantize = QUANTIZERS[fmt]
    return MoEParams(
        router=jax.random.normal(keys[0], (E, D), jnp.bfloat16),
        gate_proj=quantize(0.2 * jax.random.normal(keys[1], (E, I, D))),
        up_proj=quantize(0.2 * jax.random.normal(keys[2], (E, I, D))),
        down_proj=quantize(0.2 * jax.random.normal(keys[3], (E, D, I))),
    )


def _close(got, want):
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    scale = float(np.abs(want).max())
    np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * scale)


def _uses_pallas(fn, *args) -> bool:
    return "pallas_call" in str(jax.make_jaxpr(fn)(*args))


# Decode: 3 tokens, expert 5 shared by all three, expert 0 by two, five experts empty; and one token.
ROUTINGS = {"decode": [[0, 5], [5, 2], [0, 5]], "one_token": [[6, 3]]}


def _prefill_ids(tokens: int) -> np.ndarray:
    """Routing over experts {1, 3, 4, 6} only (the rest get no rows), distinct per token."""
    rng = np.random.default_rng(7)
    return np.stack([rng.choice([1, 3, 4, 6], TOP_K, replace=False) for _ in range(tokens)])


@pytest.mark.parametrize("fmt", sorted(QUANTIZERS))
@pytest.mark.parametrize("case", ["one_token", "decode", "prefill"])
def test_kernel_expert_outputs_equal_the_reference_path(fmt, case):
    p = _block(fmt)
    ids = jnp.asarray(ROUTINGS[case] if case in ROUTINGS else _prefill_ids(24), jnp.int32)
    x = jax.random.normal(jax.random.key(1), (ids.shape[0], D), jnp.bfloat16)
    with kernel_mode("reference"):
        assert not grouped_kernel_ready(p.gate_proj, p.up_proj, p.down_proj)
        want = jax.jit(mlp._experts_gathered)(p, x, ids)
    with kernel_mode("interpret"):
        assert grouped_kernel_ready(p.gate_proj, p.up_proj, p.down_proj)
        kernel_fn = jax.jit(lambda p, x, ids: mlp._experts_grouped(p, x, ids, E))
        assert _uses_pallas(kernel_fn, p, x, ids)
        got = kernel_fn(p, x, ids)
    assert got.shape == (ids.shape[0], TOP_K, D) and got.dtype == x.dtype
    _close(got, want)


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8"])
@pytest.mark.parametrize("tokens", [3, 40])
def test_moe_block_output_is_the_same_in_kernel_and_reference_modes(fmt, tokens):
    """The whole block (router, top-k, experts, combine): 3 tokens take the decode tiles and
    40 tokens (80 pairs over 8 experts) the prefill tiles."""
    cfg, p = _config(), _block(fmt, seed=2)
    x = jax.random.normal(jax.random.key(3), (1, tokens, D), jnp.bfloat16)
    _, ids = mlp.route(p.router, x.reshape(-1, D), TOP_K, cfg.norm_topk_prob)
    counts = np.bincount(np.asarray(ids).ravel(), minlength=E)
    assert counts.max() >= 2  # some expert serves several tokens
    if tokens == 3:
        assert (counts == 0).any()  # and some get none
    with kernel_mode("reference"):
        want = jax.jit(lambda p, x: mlp.moe(p, x, cfg))(p, x)
    with kernel_mode("interpret"):
        fn = jax.jit(lambda p, x: mlp.moe(p, x, cfg))
        assert _uses_pallas(fn, p, x)
        got = fn(p, x)
    assert got.shape == x.shape
    _close(got, want)


def test_formats_without_a_grouped_kernel_keep_the_reference_path():
    w = quantize_int8(jax.random.normal(jax.random.key(0), (E, I, D)))
    nvfp4 = quantize_nvfp4(jax.random.normal(jax.random.key(0), (E, I, D)))
    with kernel_mode("interpret"):
        assert not grouped_kernel_ready(nvfp4, w)  # one stack the kernel cannot read: none use it
        assert not grouped_kernel_ready(jnp.zeros((E, I, D), jnp.int32))
        assert grouped_kernel_ready(nvfp4, jnp.zeros((E, I, D), jnp.bfloat16))  # plain stacks: fmt "plain"
        xs = jax.random.normal(jax.random.key(1), (5, D), jnp.float32)
        sizes = jnp.asarray([2, 0, 0, 3, 0, 0, 0, 0], jnp.int32)
        fn = jax.jit(lambda xs, w, s: grouped_expert_matmul(xs, w, s, tokens=5))
        assert not _uses_pallas(fn, xs, w, sizes)
        got = fn(xs, w, sizes)
    wf = np.asarray(w.dequantize(jnp.float32))
    want = np.stack([np.asarray(xs[r]) @ wf[e].T for r, e in enumerate([0, 0, 3, 3, 3])])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


def test_auto_mode_keeps_the_reference_path_off_the_gpu(monkeypatch):
    from pallas_kernels import compat

    monkeypatch.setattr(compat, "on_gpu", lambda: False)
    p = _block("nvfp4")
    assert not grouped_kernel_ready(p.gate_proj, p.up_proj, p.down_proj)


def test_auto_mode_on_a_gpu_runs_the_kernel_at_every_token_count(monkeypatch):
    """On a GPU, decode batches and prefill chunks alike take the grouped kernel, plain bf16 stacks
    too: XLA's GPU `ragged_dot` would expand the groups into a dense [M, E*K] operand."""
    from pallas_kernels import compat

    monkeypatch.setattr(compat, "on_gpu", lambda: True)
    p = _block("nvfp4")
    plain = jnp.zeros((E, I, D), jnp.bfloat16)
    assert grouped_kernel_ready(p.gate_proj, p.up_proj, p.down_proj)
    assert grouped_kernel_ready(plain)
    for tokens in (1, GROUPED_DECODE_MAX_TOKENS, GROUPED_DECODE_MAX_TOKENS + 1, 2048):
        xs = jnp.zeros((tokens * TOP_K, D), jnp.bfloat16)
        sizes = jnp.zeros((E,), jnp.int32).at[0].set(tokens * TOP_K)
        for w in (p.gate_proj, plain):  # traced only: the jaxpr shows which path runs
            fn = lambda xs, s, w=w, tokens=tokens: grouped_expert_matmul(xs, w, s, tokens=tokens)
            assert _uses_pallas(fn, xs, sizes), f"{tokens} tokens should take the kernel"


def _plain_block(seed: int = 0) -> MoEParams:
    keys = jax.random.split(jax.random.key(seed), 4)
    return MoEParams(
        router=jax.random.normal(keys[0], (E, D), jnp.bfloat16),
        gate_proj=(0.2 * jax.random.normal(keys[1], (E, I, D))).astype(jnp.bfloat16),
        up_proj=(0.2 * jax.random.normal(keys[2], (E, I, D))).astype(jnp.bfloat16),
        down_proj=(0.2 * jax.random.normal(keys[3], (E, D, I))).astype(jnp.bfloat16),
    )


@pytest.mark.parametrize("tokens", [3, 40])
def test_plain_bf16_experts_keep_the_gather_for_few_pairs_and_the_kernel_beyond(tokens):
    """bf16 experts: a decode batch (6 pairs) gathers its experts as before; 40 tokens (80 pairs
    over 8 experts) sort by expert and run the grouped kernel instead of ragged_dot, with the
    same block output as the reference path."""
    cfg, p = _config(), _plain_block(seed=4)
    x = jax.random.normal(jax.random.key(5), (1, tokens, D), jnp.bfloat16)
    with kernel_mode("reference"):
        want = jax.jit(lambda p, x: mlp.moe(p, x, cfg))(p, x)
    with kernel_mode("interpret"):
        fn = jax.jit(lambda p, x: mlp.moe(p, x, cfg))
        assert _uses_pallas(fn, p, x) == (tokens * TOP_K > max(mlp.GATHER_MIN_PAIRS, E // 2))
        got = fn(p, x)
    _close(got, want)


def test_grouped_expert_matmul_rejects_mismatched_shapes():
    w = quantize_nvfp4(jax.random.normal(jax.random.key(0), (E, I, D)))
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_expert_matmul(jnp.zeros((4, D)), w, jnp.zeros((E + 1,), jnp.int32), tokens=2)
    with pytest.raises(ValueError, match="expected xs"):
        grouped_expert_matmul(jnp.zeros((4, D + 16)), w, jnp.zeros((E,), jnp.int32), tokens=2)


@pytest.mark.parametrize("tokens", [1, 2, 8, 16])
def test_decode_tiles_read_each_routed_expert_once(tokens):
    """An expert gets at most `tokens` rows in decode; a work item of block_m >= tokens rows
    holds all of them, so the kernel streams that expert's weights once (the default tiles:
    `streamed_experts` off, whatever the environment says)."""
    with quant.streamed_experts(False):
        _check_default_decode_tiles(tokens)


def _check_default_decode_tiles(tokens):
    for fmt, block_size in (("nvfp4", None), ("fp8", None), ("fp8", 128)):
        tiles = grouped_tiles(fmt, tokens, tokens * 10, block_size)
        assert tiles["block_m"] >= tokens
        assert tiles["variant"] == ("gemv" if tokens == 1 else "dot_t")
    # bf16 activations on NVFP4 experts take the word-decoded float16 forms (float32 would round):
    # the half2 gemv at one token, the word dots past it
    tiles = grouped_tiles("nvfp4", tokens, tokens * 10, None, jnp.bfloat16)
    assert tiles["block_m"] >= tokens and tiles["variant"] == ("gemv_h2w" if tokens == 1 else "dot_w")
    assert grouped_tiles("fp8", tokens, tokens * 10, None, jnp.bfloat16)["variant"] != "dot_w"


def test_prefill_tiles_use_tensor_cores_and_fit_the_fp8_scale_block():
    tiles = grouped_tiles("nvfp4", 256, 2560)
    assert (tiles["variant"], tiles["block_m"]) == ("dot", 64)
    for tokens in (1, 4, 256):
        tiles = grouped_tiles("fp8", tokens, tokens * 10, block_size=32)
        assert 32 % tiles["block_n"] == 0 and 32 % tiles["block_k"] == 0


def test_whole_forward_with_nvfp4_experts_is_the_same_through_the_kernel():
    """A tiny hybrid MoE (32 experts, top-4, NVFP4 experts): prefill of 12 tokens, then one
    decode step, in interpret mode and in reference mode."""
    from infernix_jax.cache.sequence import init_cache
    from infernix_jax.model.forward import forward
    from tests.experts.tiny_moe import tiny_config, tiny_params

    cfg = tiny_config()
    params = tiny_params(cfg)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 13)), jnp.int32)

    def run():  # a fresh function for each mode: jit wrappers of one function share their traces
        step = jax.jit(lambda p, t, pos, c: forward(p, t, pos, c, cfg))
        cache = init_cache(cfg, 1, 32)
        prefill, _, cache = step(params, tokens[:, :12], jnp.arange(12)[None], cache)
        decode, _, _ = step(params, tokens[:, 12:], jnp.full((1, 1), 12), cache)
        return np.asarray(prefill), np.asarray(decode)

    with kernel_mode("reference"):
        want = run()
    with kernel_mode("interpret"):
        got = run()
    for g, w in zip(got, want):
        _close(g, w)


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8_block32"])
@pytest.mark.parametrize("tokens", [1, 3, 40])
def test_gate_and_up_in_one_launch_give_the_same_block_output(monkeypatch, fmt, tokens):
    """`fused_experts`: the expert's gate and up stacks in one grouped launch, at the decode
    (one token, a few) and prefill tiles: the block's output equals one launch a stack, bit for
    bit (each stack's tiles are computed alike)."""
    cfg, p = _config(), _block(fmt, seed=5)
    x = jax.random.normal(jax.random.key(6), (1, tokens, D), jnp.bfloat16)
    launches = []
    real = quant.grouped_matmuls
    monkeypatch.setattr(
        quant,
        "grouped_matmuls",
        lambda xs, ws, sizes, **kw: launches.append(len(ws)) or real(xs, ws, sizes, **kw),
    )
    out = {}
    for fused in (True, False):
        with kernel_mode("interpret"), quant.fused_experts(fused):
            out[fused] = np.asarray(jax.jit(lambda p, x: mlp.moe(p, x, cfg))(p, x), np.float32)
    assert launches == [2]  # traced once, fused only
    np.testing.assert_array_equal(out[True], out[False])


def test_gate_and_up_share_a_launch_by_default_but_not_when_off_or_on_the_reference_path(monkeypatch):
    cfg, p = _config(), _block("nvfp4", seed=7)
    x = jax.random.normal(jax.random.key(8), (1, 2, D), jnp.bfloat16)
    launches, real = [], quant.grouped_matmuls
    monkeypatch.setattr(quant, "grouped_matmuls", lambda *a, **kw: launches.append(1) or real(*a, **kw))
    with kernel_mode("interpret"):
        jax.eval_shape(lambda p, x: mlp.moe(p, x, cfg), p, x)
    assert launches == [1]
    with kernel_mode("interpret"), quant.fused_experts(False):
        jax.eval_shape(lambda p, x: mlp.moe(p, x, cfg), p, x)
    with kernel_mode("reference"), quant.fused_experts(True):
        jax.eval_shape(lambda p, x: mlp.moe(p, x, cfg), p, x)
    assert launches == [1]


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "fp8_block32"])
@pytest.mark.parametrize("tokens, fused", [(1, False), (3, True)])
def test_streamed_experts_give_the_block_output_of_the_default_kernel(fmt, tokens, fused):
    """`streamed_experts`: NVFP4 and FP8 experts at decode batches through the grouped streamed
    gemv ("gemv_ws"), alone or with gate and up in one launch, give the block output of the
    default grouped tiles (NVFP4 to the float16 sums' rounding)."""
    cfg, p = _config(), _block(fmt, seed=9)
    x = jax.random.normal(jax.random.key(10), (1, tokens, D), jnp.bfloat16)
    kernel_fmt, block_size = ("fp8", 32) if fmt == "fp8_block32" else (fmt, None)
    tiles = lambda t: grouped_tiles(kernel_fmt, t, t * TOP_K, block_size, jnp.bfloat16)
    out = {}
    for streamed in (False, True):
        with kernel_mode("interpret"), quant.streamed_experts(streamed), quant.fused_experts(fused):
            out[streamed] = jax.jit(lambda p, x: mlp.moe(p, x, cfg))(p, x)
            assert (tiles(tokens)["variant"] == "gemv_ws") == streamed
    _close(out[True], out[False])
    with quant.streamed_experts(True):  # past a small batch the default tiles again
        assert tiles(9)["variant"] != "gemv_ws"
        streamed_tiles = tiles(tokens)
    assert streamed_tiles["block_m"] == min(tokens, 2)
    if block_size is not None:
        assert block_size % streamed_tiles["block_k"] == 0 and block_size % streamed_tiles["block_n"] == 0


def test_nvfp4_scale_spread_switch_holds_inside_its_block_and_refuses_unknown_ways():
    assert quant.current_modes()["nvfp4_scale_spread"] == "reshape"
    with quant.nvfp4_scale_spread("gather"):
        assert quant.current_modes()["nvfp4_scale_spread"] == "gather"
    assert quant.current_modes()["nvfp4_scale_spread"] == "reshape"
    with pytest.raises(ValueError, match="NVFP4 scale spread"), quant.nvfp4_scale_spread("l1"):
        pass


def test_the_grouped_dot_switch_picks_the_decode_formulation_of_nvfp4_experts():
    # "auto" (the default): the half2 gemv for one token's ten rows, the word dots past one token
    assert grouped_tiles("nvfp4", 1, TOP_K, None, jnp.bfloat16)["variant"] == "gemv_h2w"
    assert grouped_tiles("nvfp4", 1, TOP_K, None, jnp.bfloat16)["block_m"] == 1
    assert grouped_tiles("nvfp4", 2, 2 * TOP_K, None, jnp.bfloat16)["variant"] == "dot_w"
    assert grouped_tiles("fp8", 1, TOP_K, None, jnp.bfloat16)["variant"] == "gemv"  # NVFP4 only
    with quant.nvfp4_grouped_dot("dot_w"):
        assert grouped_tiles("nvfp4", 1, TOP_K, None, jnp.bfloat16)["variant"] == "dot_w"
    with quant.nvfp4_grouped_dot("dot_jw"):
        assert grouped_tiles("nvfp4", 4, 4 * TOP_K, None, jnp.bfloat16)["variant"] == "dot_jw"
        assert grouped_tiles("nvfp4", 256, 256 * TOP_K, None, jnp.bfloat16)["variant"] == "dot"  # prefill
        assert grouped_tiles("fp8", 4, 4 * TOP_K, None, jnp.bfloat16)["variant"] == "dot_t"
    with quant.nvfp4_grouped_dot("gemv_h2w"):  # the item's rows unrolled: as many as an expert can get
        assert grouped_tiles("nvfp4", 1, TOP_K, None, jnp.bfloat16)["block_m"] == 1
        assert grouped_tiles("nvfp4", 3, 3 * TOP_K, None, jnp.bfloat16)["variant"] == "gemv_h2w"
        assert grouped_tiles("nvfp4", 3, 3 * TOP_K, None, jnp.bfloat16)["block_m"] == 3
    with pytest.raises(ValueError, match="NVFP4 grouped dot"), quant.nvfp4_grouped_dot("dot_t_w"):
        pass


@pytest.mark.parametrize("tokens", [1, 3])
def test_the_joined_grouped_dot_and_the_half2_gemv_give_the_block_output_of_dot_w(tokens):
    """NVFP4 experts at decode through "dot_jw" (x in natural order, one dot a K step) or
    "gemv_h2w" (half2 products on CUDA cores) give the MoE block's output of "dot_w" (float16
    products of the same exact weights, summed in a different order)."""
    cfg, p = _config(), _block("nvfp4", seed=11)
    x = jax.random.normal(jax.random.key(12), (1, tokens, D), jnp.bfloat16)
    out = {}
    for variant in ("dot_w", "dot_jw", "gemv_h2w"):
        with kernel_mode("interpret"), quant.nvfp4_grouped_dot(variant):
            assert grouped_tiles("nvfp4", tokens, tokens * TOP_K, None, jnp.bfloat16)["variant"] == variant
            out[variant] = jax.jit(lambda p, x: mlp.moe(p, x, cfg))(p, x)
    _close(out["dot_jw"], out["dot_w"])
    _close(out["gemv_h2w"], out["dot_w"])  # the half2 gemv: float16 sums of each word's products


@pytest.mark.parametrize("tokens", [1, 3])
def test_grouped_rows_made_in_the_kernel_give_the_same_block_output(tokens):
    """`nvfp4_grouped_rows("kernel")`: the grouped dot_jw scales its own rows to float16 (no op
    before each grouped call), and the MoE block's output stays that of the rows made before the
    call; "dot_w" ignores it. Not bit for bit here: XLA may keep an activation it fuses into its
    own row scaling in float32 (`xla_allow_excess_precision`, on by default; with it off the two
    agree exactly), while a kernel's operand is rounded to bf16. The kernel call alone is exact:
    tests/pallas_kernels/test_moe_matmul.py."""
    cfg, p = _config(), _block("nvfp4", seed=13)
    x = jax.random.normal(jax.random.key(14), (1, tokens, D), jnp.bfloat16) * 30.0
    out = {}
    for where in quant.GROUPED_ROWS:
        with kernel_mode("interpret"), quant.nvfp4_grouped_dot("dot_jw"), quant.nvfp4_grouped_rows(where):
            assert grouped_tiles("nvfp4", tokens, tokens * TOP_K, None, jnp.bfloat16)["x_rows"] == where
            out[where] = jax.jit(lambda p, x: mlp.moe(p, x, cfg))(p, x)
    _close(out["kernel"], out["xla"])
    with quant.nvfp4_grouped_rows("kernel"):  # dot_w (the default) makes its rows before the call
        assert grouped_tiles("nvfp4", tokens, tokens * TOP_K, None, jnp.bfloat16)["x_rows"] == "xla"
    with pytest.raises(ValueError, match="NVFP4 grouped rows"), quant.nvfp4_grouped_rows("gpu"):
        pass


def test_the_streamed_gemv_switch_picks_the_single_row_formulation():
    """"auto" (the default) takes the half2 word gemv on the wide K >= 4096 layers and gemv_ws on
    the smaller ones; any other value takes that formulation everywhere."""
    assert quant.nvfp4_tiles(1, 5120, 17408)["variant"] == "gemv_h2w_ws"  # the 27B gate / up
    assert quant.nvfp4_tiles(1, 4096, 2048)["variant"] == "gemv_ws"  # the 80B o_proj
    with quant.nvfp4_streamed_gemv("gemv_ws"):
        assert quant.nvfp4_tiles(1, 5120, 17408)["variant"] == "gemv_ws"
    with quant.nvfp4_streamed_gemv("gemv_bs_ws"):
        assert quant.nvfp4_tiles(1, 5120, 17408)["variant"] == "gemv_bs_ws"
        assert quant.nvfp4_tiles(8, 5120, 17408)["variant"] == "dot_w"  # more rows: not a gemv
    with quant.nvfp4_streamed_gemv("gemv_h2w_ws"):  # its own tiles: long K steps on wide layers
        assert quant.nvfp4_tiles(1, 5120, 17408)["block_k"] == 1024
        assert quant.nvfp4_tiles(1, 17408, 5120)["block_k"] == 512
    with pytest.raises(ValueError, match="NVFP4 streamed gemv"), quant.nvfp4_streamed_gemv("gemv_w"):
        pass


def test_pairs_in_place_and_rows_naming_experts_only_where_the_kernel_takes_them():
    """A slotted layer pairs its slots with the fetched experts only when the grouped kernel runs a
    formulation that reads two stacks: the streamed gemv (`streamed_experts`) reads one, and the
    pair would be joined whole every step. Nor does the streamed gemv take rows naming their
    experts (it locates its items itself): a one-token step there keeps the sorted pairs."""
    p = _block("nvfp4", seed=21)
    stacks = (p.gate_proj, p.up_proj, p.down_proj)
    for check in (quant.pairs_read_in_place, quant.row_experts_ready):
        with kernel_mode("interpret"):
            assert check(stacks, 1, TOP_K, jnp.bfloat16)
            with quant.streamed_experts(True):
                assert not check(stacks, 1, TOP_K, jnp.bfloat16)
        with kernel_mode("reference"):
            assert not check(stacks, 1, TOP_K, jnp.bfloat16)


@pytest.mark.parametrize("tokens", [1, 3])
def test_swiglu_rows_from_one_launch_give_the_same_block_output(monkeypatch, tokens):
    """`swiglu_rows("kernel")`: the grouped down projection takes the float16 rows of silu(gate) *
    up from one launch (`norm_rows.swiglu_rows`) instead of XLA's reduce and reorder; one launch a
    MoE block, and the block's output is the same. Past the launch's rows (prefill) XLA's stay."""
    import pallas_kernels.norm_rows as norm_rows_kernel

    launches = []
    real = norm_rows_kernel.swiglu_rows
    monkeypatch.setattr(
        norm_rows_kernel, "swiglu_rows", lambda *a, **kw: launches.append(a[0].shape) or real(*a, **kw)
    )
    cfg, p = _config(), _block("nvfp4", seed=21)
    x = jax.random.normal(jax.random.key(22), (1, tokens, D), jnp.bfloat16) * 5.0
    out = {}
    for where in quant.SWIGLU_ROWS:  # the word dots' rows (the half2 gemv takes word pairs)
        with kernel_mode("interpret"), quant.nvfp4_grouped_dot("dot_w"), quant.swiglu_rows(where):
            out[where] = np.asarray(jax.jit(lambda p, x: mlp.moe(p, x, cfg))(p, x), np.float32)
    assert launches == [(tokens * TOP_K, I)]
    # not bit for bit: XLA keeps the SwiGLU it fuses into its own row scaling in float32 (excess
    # precision), where the kernel rounds each op to bf16 as the model's SwiGLU alone does; with
    # XLA_FLAGS=--xla_allow_excess_precision=false the two ways agree exactly
    _close(out["kernel"], out["xla"])
    with kernel_mode("interpret"), quant.swiglu_rows("kernel"):  # 40 tokens: 80 rows, past the launch's 16
        jax.jit(lambda p, x: mlp.moe(p, x, cfg)).lower(p, jnp.zeros((1, 40, D), jnp.bfloat16))
    assert len(launches) == 1
    with pytest.raises(ValueError, match="SwiGLU rows"), quant.swiglu_rows("gpu"):
        pass


@pytest.mark.parametrize(("tokens", "grouped_dot"), [(1, "auto"), (3, "auto"), (1, "dot_w")])
def test_the_pairs_rows_from_the_norms_words_give_the_same_block_output(monkeypatch, tokens, grouped_dot):
    """`norm_rows("source")`: a MoE block whose input is a norm's output gives its grouped gate / up
    the pairs' rows from the tokens' word rows that the norm's reduce scales (word pairs for the
    one-token half2 gemv, which reads the token's row for each pair; word columns for dot_w), instead of a row max of every pair's
    row; the block's output stays that of XLA's rows, and the norm's rows are made once."""
    from infernix_jax.model.norm import rms_norm
    from infernix_jax.weights.quant import NormSource

    made, given = [], []
    real_grouped = quant.grouped_matmuls

    def spy(xs, *a, x_words=None, **kw):
        given.append(None if x_words is None else (x_words[0].dtype, x_words[0].shape))
        return real_grouped(xs, *a, x_words=x_words, **kw)

    monkeypatch.setattr(quant, "grouped_matmuls", spy)
    real = quant.rms_norm_words
    monkeypatch.setattr(
        quant, "rms_norm_words", lambda x, w, **kw: made.append(kw["layout"]) or real(x, w, **kw)
    )
    cfg, p = _config(), _block("nvfp4", seed=23)
    source = jax.random.normal(jax.random.key(24), (1, tokens, D), jnp.bfloat16) * 5.0
    weight = jax.random.normal(jax.random.key(25), (D,), jnp.bfloat16) * 0.2
    out = {}
    for way in ("xla", "source"):
        with kernel_mode("interpret"), quant.nvfp4_grouped_dot(grouped_dot), quant.norm_rows(way):

            def block(p, source, weight):
                x = rms_norm(source, weight, cfg.rms_norm_eps, True)
                return mlp.moe(p, x, cfg, norm=NormSource(source, weight, cfg.rms_norm_eps, True))

            out[way] = np.asarray(jax.jit(block)(p, source, weight), np.float32)
    want_layout = "pairs" if tokens == 1 and grouped_dot == "auto" else "columns"
    assert made == [want_layout]
    rows = tokens * TOP_K  # one token's half2 gemv reads the token's own row for all of its pairs
    want = (jnp.uint32, (tokens, D // 2)) if want_layout == "pairs" else (jnp.float16, (rows, D))
    assert given == [None, want]  # the gate / up launch of each way
    # not bit for bit: XLA's own rows keep the norm it fuses into them in float32 (excess precision)
    _close(out["source"], out["xla"])


@pytest.mark.parametrize("fmt", ["nvfp4", "fp8", "fp8_block32"])
@pytest.mark.parametrize("grouped_dot", ["auto", "dot_w"])
def test_one_token_pairs_naming_their_experts_give_the_sorted_pairs_outputs(monkeypatch, fmt, grouped_dot):
    """At one token the resident grouped path runs each (token, expert) pair as its own row naming
    its expert (no count, sort, gather or unsort around the kernel): the per-pair outputs equal the
    sorted path's bit for bit, from the token's norm words too, and the kernel is told so."""
    from infernix_jax.model.norm import rms_norm
    from infernix_jax.weights.quant import NormSource

    named = []
    real = quant.grouped_matmuls
    monkeypatch.setattr(
        quant, "grouped_matmuls", lambda *a, row_experts=False, **kw: named.append(row_experts) or real(
            *a, row_experts=row_experts, **kw)
    )  # fmt: skip
    cfg, p = _config(), _block(fmt, seed=31)
    source = jax.random.normal(jax.random.key(32), (1, D), jnp.bfloat16) * 5.0
    weight = jax.random.normal(jax.random.key(33), (D,), jnp.bfloat16) * 0.2
    ids = jnp.asarray([[6, 3]], jnp.int32)
    with kernel_mode("interpret"), quant.nvfp4_grouped_dot(grouped_dot):

        def outputs(p, source, weight, by_pair):
            x = rms_norm(source, weight, cfg.rms_norm_eps, True)
            norm = NormSource(source, weight, cfg.rms_norm_eps, True)
            if by_pair:
                return mlp._experts_resident(p, x, ids, E, norm)
            return mlp._experts_grouped(p, x, ids, E, norm)

        assert quant.row_experts_ready((p.gate_proj, p.up_proj, p.down_proj), 1, TOP_K, jnp.bfloat16)
        got = jax.jit(outputs, static_argnums=3)(p, source, weight, True)
        assert named and all(named)
        named.clear()
        want = jax.jit(outputs, static_argnums=3)(p, source, weight, False)
        assert named and not any(named)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))



def test_rows_naming_their_experts_off_the_kernel_gather_each_rows_expert():
    """Off the grouped kernel (the reference mode) rows naming their experts take each row's
    expert by a gather: `expert_matmul` with those ids."""
    p = _block("nvfp4", seed=41)
    xs = jax.random.normal(jax.random.key(42), (3, D), jnp.bfloat16)
    ids = jnp.asarray([5, 0, 5], jnp.int32)
    with kernel_mode("reference"):
        got = grouped_expert_matmul(xs, p.gate_proj, ids, tokens=1, row_experts=True)
    want = quant.expert_matmul(xs, p.gate_proj, expert_ids=ids)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    with pytest.raises(ValueError, match=r"row experts must be \[M=3\]"):
        grouped_expert_matmul(xs, p.gate_proj, ids[:2], tokens=1, row_experts=True)


@pytest.mark.parametrize(("fmt", "tokens"), [("nvfp4", 1), ("fp8", 1), ("nvfp4", 3)])
def test_the_shared_expert_as_the_tokens_last_row_gives_the_block_output(monkeypatch, fmt, tokens):
    """At decode sizes the shared expert (shaped like a routed one) runs as one more pair of each
    token in the routed experts' grouped launches, a one-expert second stack
    (`mlp.shared_expert_rows`; one token: its last row, several: the last group of the sorted
    pairs): no launch of its own, the block's output that of its own projections within the
    kernels' rounding, with the norm's word rows (made once) or without a norm."""
    from infernix_jax.model.norm import rms_norm
    from infernix_jax.model.params import MLPParams
    from infernix_jax.weights.quant import NormSource

    keys = jax.random.split(jax.random.key(41), 4)
    quantize = QUANTIZERS[fmt]
    shared = MLPParams(*(quantize(0.2 * jax.random.normal(k, s)) for k, s in zip(keys[:3], ((I, D), (I, D), (D, I)))))
    p = dataclasses.replace(_block(fmt, seed=40), shared=shared,
                            shared_gate=jax.random.normal(keys[3], (1, D), jnp.bfloat16))  # fmt: skip
    cfg = _config()
    source = jax.random.normal(jax.random.key(42), (tokens, D), jnp.bfloat16) * 5.0
    weight = jax.random.normal(jax.random.key(43), (D,), jnp.bfloat16) * 0.2
    seconds, made = [], []
    real_grouped, real_mlp, real_words = quant.grouped_matmuls, mlp.mlp, quant.rms_norm_words
    monkeypatch.setattr(quant, "grouped_matmuls", lambda *a, second=None, **kw: seconds.append(second is not None)
                        or real_grouped(*a, second=second, **kw))  # fmt: skip
    monkeypatch.setattr(mlp, "mlp", lambda *a, **kw: seconds.append("own") or real_mlp(*a, **kw))
    monkeypatch.setattr(quant, "rms_norm_words", lambda x, w, **kw: made.append(kw["layout"]) or real_words(x, w, **kw))
    out = {}
    for way in ("on", "off"):
        for with_norm in (True, False):
            seconds.clear(), made.clear()
            with kernel_mode("interpret"), quant.norm_rows("source"), mlp.shared_expert_rows(way):

                def block(p, source, weight, with_norm=with_norm):
                    x = rms_norm(source, weight, cfg.rms_norm_eps, True)
                    norm = NormSource(source, weight, cfg.rms_norm_eps, True) if with_norm else None
                    return mlp.moe(p, x, cfg, norm=norm)

                out[way, with_norm] = np.asarray(jax.jit(block)(p, source, weight), np.float32)
            if way == "on":
                assert seconds == [True, True]  # gate / up and down, each with the shared expert's stack
                want = "pairs" if tokens == 1 else "columns"  # the half2 gemv at one token, dot_w past it
                assert made == ([want] if with_norm and fmt == "nvfp4" else [])
            else:
                assert seconds[0] == "own" and not any(s is True for s in seconds)
    for with_norm in (True, False):
        _close(out["on", with_norm], out["off", with_norm])
    with pytest.raises(ValueError, match="shared expert rows"), mlp.shared_expert_rows("sometimes"):
        pass
