"""The prefix cache's weights fingerprint names the model, not where its experts live: the same
checkpoint with experts on the device, in host RAM or still in an artifact gets the same salt (a
restart with another expert budget hits the cache file); another checkpoint gets another."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from infernix_jax.engine.prefix import weights_fingerprint
from tests.experts.tiny_moe import tiny_config, tiny_params


def with_experts(params, move):
    layers = []
    for layer in params.layers:
        moe = layer.moe
        stacks = {n: jax.tree.map(move, getattr(moe, n)) for n in ("gate_proj", "up_proj", "down_proj")}
        layers.append(dataclasses.replace(layer, moe=dataclasses.replace(moe, **stacks)))
    return dataclasses.replace(params, layers=tuple(layers))


def test_where_experts_live_does_not_change_the_fingerprint():
    params = tiny_params(tiny_config())
    on_device = weights_fingerprint(params)
    assert weights_fingerprint(with_experts(params, np.asarray)) == on_device
    assert (
        weights_fingerprint(with_experts(params, lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype)))
        == on_device
    )


def test_other_weights_change_the_fingerprint():
    params = tiny_params(tiny_config())
    layer = params.layers[0]
    changed = dataclasses.replace(layer, moe=dataclasses.replace(layer.moe, router=layer.moe.router * 1.5))
    assert weights_fingerprint(dataclasses.replace(params, layers=(changed, *params.layers[1:]))) != (
        weights_fingerprint(params)
    )
    assert weights_fingerprint(tiny_params(tiny_config(), seed=1)) != weights_fingerprint(params)
