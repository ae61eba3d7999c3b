"""Experts in device slots where the grouped kernel runs: a layer with some experts in slots and the
rest copied from pinned host memory gives the all-resident layer's output bit for bit, and the
kernel reads a stack of only the step's routed experts, or the slots and the fetched experts in
place (`mlp.slot_reads`), never the whole layer's and never dequantized outside the kernel."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infernix_jax.experts.offload import expert_rows
from infernix_jax.model import mlp
from infernix_jax.model.mlp import SlottedExperts, collect_expert_routing, moe
from infernix_jax.model.params import MoEParams
from infernix_jax.weights.quant import ExpertStackPair, kernel_mode
from tests.experts.tiny_moe import NUM_EXPERTS, TOP_K, tiny_config, tiny_params

PINNED = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")
RESIDENT = (1, 4, 5, 9, 17, 30)  # the experts with a slot; every other one is copied when routed


@pytest.fixture(scope="module")
def layer():
    cfg = tiny_config()
    return cfg, tiny_params(cfg).layers[0].moe


def slotted(p: MoEParams, resident: tuple[int, ...]) -> MoEParams:
    """p with its routed experts in len(resident) slots and every expert as a pinned host row."""
    stacks = (p.gate_proj, p.up_proj, p.down_proj)
    index = np.asarray(resident)
    slots = jax.tree.map(lambda a: a[index], stacks)
    slot_map = np.full(NUM_EXPERTS, -1, np.int32)
    slot_map[index] = np.arange(len(index))
    leaves = [np.asarray(a) for a in jax.tree.leaves(stacks)]
    rows = jax.device_put(expert_rows([[a[e] for a in leaves] for e in range(NUM_EXPERTS)]), PINNED)
    se = SlottedExperts(*slots, slot_map=jnp.asarray(slot_map), source_id=jnp.int32(0), host_stacks=rows)
    return dataclasses.replace(p, gate_proj=se, up_proj=None, down_proj=None)


def run(p: MoEParams, x: jax.Array, cfg) -> np.ndarray:
    with collect_expert_routing():  # the routing counts stay in the trace: no report callback
        return np.asarray(jax.jit(lambda p, x: moe(p, x, cfg))(p, x))


@pytest.mark.parametrize("reads", mlp.SLOT_READS)
@pytest.mark.parametrize("tokens", [1, 3, 12])
def test_slotted_layer_equals_the_resident_one_through_the_grouped_kernel(layer, monkeypatch, tokens, reads):
    cfg, p = layer
    x = jnp.asarray(np.random.default_rng(tokens).standard_normal((tokens, cfg.hidden_size)), jnp.float32)
    stacks_read = []
    grouped = mlp.grouped_expert_matmul

    def spy(xs, w, group_sizes, *, tokens, **rows):  # the down projection (its rows made before, or not)
        stacks_read.append((isinstance(w, ExpertStackPair), w.shape[0]))
        return grouped(xs, w, group_sizes, tokens=tokens, **rows)

    def spy_pair(xs, ws, group_sizes, *, tokens, **rows):  # gate and up (one launch or two, by `fused_experts`)
        stacks_read.extend((isinstance(w, ExpertStackPair), w.shape[0]) for w in ws)
        return grouped_pair(xs, ws, group_sizes, tokens=tokens, **rows)

    grouped_pair = mlp.grouped_expert_matmuls
    monkeypatch.setattr(mlp, "grouped_expert_matmul", spy)
    monkeypatch.setattr(mlp, "grouped_expert_matmuls", spy_pair)
    with kernel_mode("interpret"), mlp.slot_reads(reads):
        want = run(p, x, cfg)
        resident_stacks = list(stacks_read)
        stacks_read.clear()
        got = run(slotted(p, RESIDENT), x, cfg)
    np.testing.assert_array_equal(got, want)
    assert resident_stacks == [(False, NUM_EXPERTS)] * 3
    routed = min(tokens * TOP_K, NUM_EXPERTS)
    if reads == "copy":
        assert stacks_read == [(False, routed)] * 3, "a stack of the routed experts only"
    else:  # the slots, then a fetch buffer as long as the routed experts can be
        assert stacks_read == [(True, len(RESIDENT) + routed)] * 3, "the slots and the fetched experts in place"
    with kernel_mode("reference"):  # the CPU's path: per-pair gathers, the same output to rounding
        np.testing.assert_allclose(run(slotted(p, RESIDENT), x, cfg), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("tokens", [1, 3])
def test_slots_read_in_place_through_the_word_dot_equal_the_resident_layer(layer, tokens):
    """bf16 rows take the grouped kernel's float16 word dot (dot_w), the decode formulation on a
    GPU: reading the slots and the fetched experts in place gives the all-resident output."""
    cfg, p = layer
    x = jnp.asarray(np.random.default_rng(tokens).standard_normal((tokens, cfg.hidden_size)), jnp.bfloat16)
    with kernel_mode("interpret"), mlp.slot_reads("in_place"):
        want = run(p, x, cfg)
        got = run(slotted(p, RESIDENT), x, cfg)
    np.testing.assert_array_equal(got, want)


def test_the_prefetch_stream_takes_either_jax_versions_compute_on(monkeypatch):
    """jax 0.10's `compute_on` is a context manager; 0.11's a transform that also wants the
    results' memory spaces. `on_stream` runs the copy on the named stream with either, and the
    result is the function's."""

    def copy(x):
        return x * 2

    x = jnp.arange(4.0)
    np.testing.assert_array_equal(mlp.on_stream(copy, "gpu_stream:1")(x), x * 2)  # this jax's form

    calls = []

    def transform(f=None, *, compute_type, out_memory_spaces, compiler_options=None):  # jax 0.11's
        calls.append((compute_type, out_memory_spaces))
        return f

    monkeypatch.setattr(mlp, "compute_on", transform)
    np.testing.assert_array_equal(mlp.on_stream(copy, "gpu_stream:1")(x), x * 2)
    assert calls == [("gpu_stream:1", jax.memory.Space.Device)]
