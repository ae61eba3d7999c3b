"""A layer's projections taking their float16 rows from the norm's own launch
(`quant.norm_rows("kernel")`, pallas_kernels/norm_rows.py) leave a decode step's logits as they
are, one launch per norm: the input norm's (attention or GDN projections) and the
post-attention norm's (the MLP's gate / up, or the MoE layer's shared expert)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels.norm_rows as norm_rows_kernel
from infernix_jax.cache.sequence import init_cache
from infernix_jax.config import ModelConfig
from infernix_jax.model.forward import forward
from infernix_jax.weights.hf import load_params
from infernix_jax.weights.quant import kernel_mode, norm_rows
from tests.conftest import HF_FIXTURES
from tests.model.test_fused_projections import _nvfp4_projections


def _decode_step_logits(ways: tuple[str, ...]) -> tuple[ModelConfig, dict[str, np.ndarray]]:
    """The qwen3_next fixture with NVFP4 projections: one decode step's logits after an 8-token
    prefill, traced under each `norm_rows` way."""
    path = HF_FIXTURES / "qwen3_next"
    cfg = ModelConfig.from_hf_config(path)
    params = _nvfp4_projections(load_params(path, cfg, jnp.bfloat16, progress=False))
    ids = np.load(path / "reference.npz")["input_ids"][:9]
    prefill = jax.jit(forward, static_argnums=(4,))
    _, _, cache = prefill(
        params, jnp.asarray(ids[:8])[None], jnp.arange(8)[None], init_cache(cfg, 1, 64), cfg
    )
    out = {}
    for way in ways:
        with kernel_mode("interpret"), norm_rows(way):
            # a fresh function, traced under this way (jit wrappers of one function share traces)
            step = jax.jit(lambda p, t, pos, c: forward(p, t, pos, c, cfg))
            logits, _, _ = step(params, jnp.asarray(ids[8:9])[None], jnp.full((1, 1), 8), cache)
        out[way] = np.asarray(logits[0, 0], np.float32)
    return cfg, out


def test_a_decode_step_gives_the_same_logits_with_rows_from_the_norm(monkeypatch):
    """qwen3_next fixture (GDN and gated attention layers, MoE with a shared expert): the input
    norm's rows go to the GDN or q / k / v projections, the post-attention norm's to the shared
    expert's gate / up (the dense MLP's `mlp` call is the same)."""
    launches = []
    real = norm_rows_kernel.rms_norm_rows
    monkeypatch.setattr(
        norm_rows_kernel,
        "rms_norm_rows",
        lambda x, w, **kw: launches.append(kw["layout"]) or real(x, w, **kw),
    )
    cfg, out = _decode_step_logits(("xla", "kernel"))
    # one a norm under "kernel", shared by that norm's projections (and none under "xla")
    assert len(launches) == 2 * len(cfg.layer_types)
    # not bit for bit: XLA fuses the norm into its own row preparation and keeps the normed rows in
    # float32 there (excess precision), where the kernel rounds them to bfloat16 as the model's
    # norm does; with XLA_FLAGS=--xla_allow_excess_precision=false the two ways agree exactly
    scale = np.abs(out["xla"]).max()
    assert np.abs(out["kernel"] - out["xla"]).max() <= 3e-2 * scale
    assert np.argmax(out["kernel"]) == np.argmax(out["xla"])


def test_rows_scaled_from_the_norms_input_give_the_same_logits(monkeypatch):
    """norm_rows("source") (weights/norm_words.py): XLA's rows, their scale bounded from the norm's
    input; a decode step's logits stay those of the "xla" way, one set of rows a norm and layout."""
    from infernix_jax.weights import quant

    made = []
    real = quant.rms_norm_words
    monkeypatch.setattr(
        quant, "rms_norm_words", lambda x, w, **kw: made.append(kw["layout"]) or real(x, w, **kw)
    )
    cfg, out = _decode_step_logits(("xla", "source"))
    assert len(made) == 2 * len(cfg.layer_types)
    # the "xla" way's rows keep XLA's float32 norm (excess precision), these the bfloat16 output
    scale = np.abs(out["xla"]).max()
    assert np.abs(out["source"] - out["xla"]).max() <= 3e-2 * scale
    assert np.argmax(out["source"]) == np.argmax(out["xla"])


def test_prefill_rows_keep_xlas_norm(monkeypatch):
    """Past the kernel's rows (a prompt of 20 tokens) the projections make their rows as before."""
    path = HF_FIXTURES / "qwen3_5"
    cfg = ModelConfig.from_hf_config(path)
    params = _nvfp4_projections(load_params(path, cfg, jnp.bfloat16, progress=False))
    launches = []
    monkeypatch.setattr(norm_rows_kernel, "rms_norm_rows", lambda *a, **kw: launches.append(1))
    ids = jnp.arange(20)[None] % cfg.vocab_size
    with kernel_mode("interpret"), norm_rows("kernel"):
        step = jax.jit(lambda p, t, pos, c: forward(p, t, pos, c, cfg))
        step.lower(params, ids, jnp.arange(20)[None], init_cache(cfg, 1, 64))
    assert launches == []


def test_unknown_way_is_refused():
    with pytest.raises(ValueError, match="norm rows"), norm_rows("fused"):
        pass


def test_the_gdn_output_projection_takes_its_rows_from_the_gated_norm(monkeypatch):
    """The 80B-A3B's GDN output shape (32 heads of 128, out_proj on the streamed gemv at one row):
    the projection of the gated norm takes its rows from one gated launch, with the same result as
    the norm's XLA rows but for the norm's rounding (see above)."""
    from types import SimpleNamespace

    from infernix_jax.model.gated_deltanet import _output_projection
    from infernix_jax.weights.quant import quantize_nvfp4

    rng = np.random.default_rng(0)
    out = jnp.asarray(rng.standard_normal((1, 1, 32, 128)), jnp.bfloat16)
    z = jnp.asarray(rng.standard_normal((1, 1, 32, 128)), jnp.bfloat16)
    p = SimpleNamespace(
        norm=jnp.asarray(1 + 0.2 * rng.standard_normal(128), jnp.bfloat16),
        out_proj=quantize_nvfp4(jnp.asarray(rng.standard_normal((64, 4096)) * 0.02, jnp.bfloat16)),
    )
    cfg = SimpleNamespace(rms_norm_eps=1e-6)
    launches = []
    real = norm_rows_kernel.gated_rms_norm_rows
    monkeypatch.setattr(
        norm_rows_kernel,
        "gated_rms_norm_rows",
        lambda *a, **kw: launches.append(kw["layout"]) or real(*a, **kw),
    )
    from infernix_jax.weights import quant

    made = []
    real_words = quant.gated_rms_norm_words
    monkeypatch.setattr(
        quant, "gated_rms_norm_words", lambda *a, **kw: made.append(kw["layout"]) or real_words(*a, **kw)
    )
    got = {}
    for way in ("xla", "kernel", "source"):
        with kernel_mode("interpret"), norm_rows(way):
            step = jax.jit(
                lambda w, o, z: _output_projection(SimpleNamespace(norm=p.norm, out_proj=w), o, z, cfg)
            )
            got[way] = np.asarray(step(p.out_proj, out, z), np.float32)
    assert launches == ["columns"] and made == ["columns"]  # "source": XLA's rows bounded from the input
    scale = np.abs(got["xla"]).max()
    assert np.abs(got["source"] - got["xla"]).max() <= 2e-2 * scale
    assert got["kernel"].shape == (1, 1, 64) and np.abs(got["kernel"] - got["xla"]).max() <= 2e-2 * scale


def test_a_moe_layer_routes_on_the_norm_launchs_output_when_its_shared_expert_took_rows_from_it():
    """With the shared expert's gate / up on the norm's launch, the router, the routing and the
    shared gate read that launch's normed rows too (XLA's own norm is then read by nothing): given
    an x that is not the norm's output, the layer still computes from the norm of the source."""
    from infernix_jax.model.mlp import moe
    from infernix_jax.model.norm import rms_norm
    from infernix_jax.weights.quant import NormSource

    path = HF_FIXTURES / "qwen3_next"
    cfg = ModelConfig.from_hf_config(path)
    params = _nvfp4_projections(load_params(path, cfg, jnp.bfloat16, progress=False))
    layer = params.layers[0]
    source = jnp.asarray(np.random.default_rng(1).standard_normal((1, 1, cfg.hidden_size)), jnp.bfloat16)
    h = rms_norm(source, layer.post_norm, cfg.rms_norm_eps, cfg.zero_centered_norm)

    def run(way, x):
        with kernel_mode("interpret"), norm_rows(way):
            norm = NormSource(source, layer.post_norm, cfg.rms_norm_eps, cfg.zero_centered_norm)
            step = jax.jit(lambda p, x: moe(p, x, cfg, norm=norm))
            return np.asarray(step(layer.moe, x), np.float32)

    want = run("xla", h)
    got = run("kernel", jnp.zeros_like(h))  # only the norm's launch can give the layer its input
    assert np.abs(got - want).max() <= 3e-2 * np.abs(want).max()
    assert np.abs(run("xla", jnp.zeros_like(h)) - want).max() > 0.5 * np.abs(want).max()  # x matters there
