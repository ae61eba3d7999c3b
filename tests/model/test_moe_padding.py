"""Padding tokens of a bucket (position -1) touch no expert of their own: the valid tokens' outputs
are unchanged, and with experts beyond device memory padding causes no fetch and no lookup."""

from __future__ import annotations

import jax
import numpy as np

from infernix_jax.experts.offload import ExpertOffload
from infernix_jax.model.mlp import moe, route
from tests.experts.tiny_moe import tiny_config, tiny_params

VALID = np.array([True, True, True, False, False, False])


def hidden(cfg, seed: int = 0) -> jax.Array:
    """Rows 3-5 are padding: far from the valid rows, so that they would route elsewhere."""
    x = np.random.default_rng(seed).normal(size=(len(VALID), cfg.hidden_size)).astype(np.float32)
    x[~VALID] = 40.0 * x[~VALID][::-1]
    return jax.numpy.asarray(x)


def experts_of(p, x, cfg) -> set[int]:
    return {
        int(e) for e in np.asarray(route(p.router, x, cfg.num_experts_per_tok, cfg.norm_topk_prob)[1]).ravel()
    }


def test_valid_tokens_keep_their_outputs():
    cfg = tiny_config()
    p = tiny_params(cfg).layers[0].moe
    x = hidden(cfg)
    assert experts_of(p, x[~VALID], cfg) - experts_of(p, x[VALID], cfg), "padding would route elsewhere"
    masked = jax.jit(lambda x, v: moe(p, x, cfg, valid=v))(x, VALID)
    plain = jax.jit(lambda x: moe(p, x, cfg))(x)
    np.testing.assert_allclose(np.asarray(masked)[VALID], np.asarray(plain)[VALID], rtol=1e-6, atol=1e-6)


def test_padding_makes_no_fetch_and_no_lookup():
    cfg = tiny_config()
    params = tiny_params(cfg)
    offload = ExpertOffload.build(cfg, params, gpu_budget=1, host_budget="all")  # one slot per layer: misses
    layer = params.layers[offload.layout.moe_layers[0]].moe
    x = hidden(cfg)
    jax.block_until_ready(jax.jit(lambda x, v: moe(offload.params.layers[0].moe, x, cfg, valid=v))(x, VALID))
    cache = offload.cache
    routed = experts_of(layer, x[VALID], cfg)
    resident = {int(e) for e in cache.slot_owner[0] if e >= 0}
    assert set(cache.last_missed[0]) == routed - resident
    assert cache.stats.lookups == len(routed)
    assert cache.routing_counts[0].sum() == VALID.sum() * cfg.num_experts_per_tok
    offload.close()
