"""Missed experts computed on the host's CPU: the same outputs as the device's path, and a cost
model that gives the CPU the share that takes least time."""

from __future__ import annotations

import logging

import jax
import numpy as np
import pytest

from infernix_jax.experts.host_compute import HostComputeCost, HostExpertCompute
from infernix_jax.experts.layout import layout_of, projections
from infernix_jax.experts.offload import cpu_share_at_start
from infernix_jax.model.mlp import _experts_gathered
from infernix_jax.model.params import MoEParams
from tests.experts.tiny_moe import NUM_EXPERTS, TOP_K, tiny_config, tiny_params


@pytest.fixture(scope="module")
def moe_layer():
    cfg = tiny_config()
    params = tiny_params(cfg)
    layout = layout_of(cfg, params)
    moe = params.layers[layout.moe_layers[0]].moe
    stacks = [np.asarray(a) for a in jax.tree.leaves(projections(moe))]
    return cfg, layout, moe, stacks


def test_the_cpus_pairs_equal_the_device_paths_and_leave_the_rest_zero(moe_layer):
    cfg, layout, moe, stacks = moe_layer
    rng = np.random.default_rng(0)
    n = 6
    x = rng.standard_normal((n, cfg.hidden_size)).astype(np.float32)
    ids = np.stack([rng.choice(NUM_EXPERTS, TOP_K, replace=False) for _ in range(n)]).astype(np.int32)
    valid = np.array([1, 1, 1, 1, 1, 0], np.int32)  # the last row is padding
    chosen = sorted({int(ids[0, 0]), int(ids[2, 1]), int(ids[5, 3])})  # ids[5] routes only padding
    compute = HostExpertCompute(layout)
    out = compute.outputs([[a[e] for a in stacks] for e in chosen], chosen, x, ids, valid)
    compute.close()

    stack = MoEParams(router=None, gate_proj=moe.gate_proj, up_proj=moe.up_proj, down_proj=moe.down_proj)
    want = np.asarray(jax.jit(_experts_gathered)(stack, x, ids))  # every pair, on the device's path
    mine = np.isin(ids, chosen) & (valid[:, None] == 1)
    assert mine.sum() >= 2
    np.testing.assert_allclose(out[mine], want[mine], rtol=1e-5, atol=1e-6)
    assert not out[~mine].any()


def test_the_cost_model_gives_the_cpu_the_share_that_takes_least_time():
    # the CPU's work runs beside the staging of the other experts: even a slow CPU takes the share
    # that ends with the staging, and that beats copying everything
    slow = HostComputeCost(cpu_seconds=1e-3, stage_seconds=1e-4, copy_seconds=5e-5)
    share = slow.best_share()
    assert share == pytest.approx(1e-4 / 1.1e-3)
    assert slow.layer_seconds(share * 8, 8) < slow.layer_seconds(0, 8)
    # staging that costs nothing leaves the CPU only what it computes faster than the copy
    assert HostComputeCost(cpu_seconds=1e-3, stage_seconds=0.0, copy_seconds=5e-5).best_share() == 0.0
    assert HostComputeCost(cpu_seconds=1e-5, stage_seconds=0.0, copy_seconds=5e-5).best_share() == 1.0
    # a slow link (or a CPU faster than staging plus the copy): the CPU takes every miss
    assert HostComputeCost(cpu_seconds=1e-4, stage_seconds=1e-4, copy_seconds=1e-3).best_share() == 1.0
    # the share is the best whatever the number of misses (the time is piecewise linear in it)
    for missed in (1, 4, 37):
        times = [slow.layer_seconds(c, missed) for c in np.linspace(0, missed, 101)]
        assert slow.layer_seconds(share * missed, missed) <= min(times) + 1e-12


def test_auto_measures_the_cost_model_off_the_cpu_backend(moe_layer, monkeypatch, caplog):
    """"auto" where the device is not the CPU: the cost is measured at start and said in the log.
    (Here the "device" is the CPU too, so the measured copy is a host copy.)"""
    cfg, layout, _moe, stacks = moe_layer
    sample = [a[0] for a in stacks]
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with caplog.at_level(logging.INFO, logger="infernix_jax.experts"):
        share, compute = cpu_share_at_start("auto", "callback", layout, sample, cfg.hidden_size, np.float32)
    assert 0.0 <= share <= 1.0
    assert (compute is None) == (share == 0.0)
    if compute is not None:
        compute.close()
    assert "expert CPU share" in caplog.text and "ms on the CPU against" in caplog.text
    # where no callback brings outputs back, auto measures nothing
    assert cpu_share_at_start("auto", "program", layout, sample, cfg.hidden_size, np.float32) == (0.0, None)
