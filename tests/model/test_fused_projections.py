"""One input through several NVFP4 projections in one kernel launch leaves the forward unchanged."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from infernix_jax.cache.allocators import SCRATCH_SLOT
from infernix_jax.cache.attention_choice import recurrent_update_mode
from infernix_jax.cache.sequence import GDNState, init_cache
from infernix_jax.cache.state_pool import slotted_states
from infernix_jax.config import ModelConfig
from infernix_jax.model import gated_deltanet as gdn_module
from infernix_jax.model.forward import forward
from infernix_jax.weights import quant
from infernix_jax.weights.hf import load_params
from infernix_jax.weights.quant import NVFP4Weight, fused_projections, kernel_mode, quantize_nvfp4
from pallas_kernels import compat
from tests.conftest import HF_FIXTURES

_PROJECTION = ("proj", "in_proj")  # the layers' 2-D projections; embeddings, norms and the head stay


def _nvfp4_projections(params):
    def convert(path, leaf):
        name = jax.tree_util.keystr(path)
        if (
            ".layers" in name
            and any(p in name for p in _PROJECTION)
            and leaf.ndim == 2
            and leaf.shape[1] % 16 == 0
        ):
            return quantize_nvfp4(leaf)
        return leaf

    return jax.tree_util.tree_map_with_path(convert, params)


def test_a_decode_step_gives_the_same_logits_with_projections_fused(monkeypatch):
    """qwen3_5 fixture (GDN + gated attention + MLP) with NVFP4 projections, one decode step
    after a short prompt: the GDN input projections, q / k / v and gate / up each run as one
    launch (on a GPU compiled, elsewhere through the interpreter), against one launch a weight."""
    path = HF_FIXTURES / "qwen3_5"
    cfg = ModelConfig.from_hf_config(path)
    params = _nvfp4_projections(load_params(path, cfg, jnp.bfloat16, progress=False))
    assert (
        sum(
            isinstance(w, NVFP4Weight)
            for w in jax.tree.leaves(params, is_leaf=lambda x: isinstance(x, NVFP4Weight))
        )
        >= 20
    )
    ids = np.load(path / "reference.npz")["input_ids"][:9]
    fn = jax.jit(forward, static_argnums=(4,))
    _, _, cache = fn(params, jnp.asarray(ids[:8])[None], jnp.arange(8)[None], init_cache(cfg, 1, 64), cfg)
    mode = "auto" if compat.on_gpu() else "interpret"
    launches = []
    real = quant.nvfp4_matmuls
    monkeypatch.setattr(
        quant, "nvfp4_matmuls", lambda x, ws, **kw: launches.append(len(ws)) or real(x, ws, **kw)
    )
    out = {}
    for fused in (True, False):
        with kernel_mode(mode), fused_projections(fused):
            # a fresh function, traced under this switch (jit wrappers of one function share traces)
            step = jax.jit(lambda p, t, pos, c: forward(p, t, pos, c, cfg))
            logits, _, _ = step(params, jnp.asarray(ids[8:9])[None], jnp.full((1, 1), 8), cache)
        out[fused] = np.asarray(logits[0, 0], np.float32)
    # per layer: 4 GDN input projections or q / k / v, then gate / up (fused only)
    gdn = sum(t == "linear_attention" for t in cfg.layer_types)
    assert sorted(launches) == sorted(
        [4] * gdn + [3] * (len(cfg.layer_types) - gdn) + [2] * len(cfg.layer_types)
    )
    scale = np.abs(out[False]).max()
    assert np.abs(out[True] - out[False]).max() <= 2e-2 * scale
    assert np.argmax(out[True]) == np.argmax(out[False])


def test_a_gdn_decode_step_reads_the_joined_projections_in_place(monkeypatch):
    """A linear-attention layer's decode on its slots with NVFP4 input projections in one launch:
    the gated delta kernel reads q | k | v, b and a from the launch's one joined array at their
    columns (no slice launch each), and the layer's output and states are those of the four
    arrays apart, bit for bit."""
    path = HF_FIXTURES / "qwen3_5"
    cfg = ModelConfig.from_hf_config(path)
    p = _nvfp4_projections(load_params(path, cfg, jnp.bfloat16, progress=False)).layers[0].gdn
    channels = p.conv_weight.shape[0]
    hv, dk, dv = cfg.linear_num_v_heads, cfg.linear_k_head_dim, cfg.linear_v_head_dim
    rng = np.random.default_rng(3)
    pools = GDNState(
        conv=jnp.asarray(rng.standard_normal((3, channels, p.conv_weight.shape[1] - 1)), jnp.bfloat16),
        recurrent=jnp.asarray(rng.standard_normal((3, hv, dk, dv)) * 0.3, jnp.float32),
    )
    x = jnp.asarray(rng.standard_normal((1, 1, cfg.hidden_size)), jnp.bfloat16)
    slots = jnp.asarray([2 if SCRATCH_SLOT != 2 else 1], jnp.int32)
    joined = []
    real = gdn_module.matmuls_joined

    def spy(*args, **kwargs):
        made = real(*args, **kwargs)
        joined.append(made is not None)
        return made

    monkeypatch.setattr(gdn_module, "matmuls_joined", spy)
    out = {}
    for way in ("joined", "apart"):
        if way == "apart":
            monkeypatch.setattr(gdn_module, "matmuls_joined", lambda *a, **k: None)
        with kernel_mode("interpret"), recurrent_update_mode("interpret"):
            y, state = jax.jit(lambda p, x, pools: gdn_module.gated_deltanet(
                p, x, jnp.full((1, 1), 5), slotted_states(pools, slots), cfg))(p, x, pools)  # fmt: skip
        out[way] = (np.asarray(y, np.float32), np.asarray(state.conv_pool), np.asarray(state.recurrent_pool))
    assert joined == [True]  # the joined launch ran
    for got, want in zip(out["joined"], out["apart"], strict=True):
        np.testing.assert_array_equal(got, want)
