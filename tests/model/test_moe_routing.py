"""A resident MoE layer on the grouped kernel routed in one launch (`mlp.moe_routing("kernel")`)
gives XLA's routing's output bit for bit, padding tokens included, and falls back to XLA past
the kernel's token count, for slotted layers and for experts off the grouped kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import pallas_kernels.moe_routing as routing_kernel
from infernix_jax.model import mlp
from infernix_jax.weights.quant import kernel_mode, nvfp4_grouped_dot
from tests.experts.tiny_moe import tiny_config, tiny_params


@pytest.fixture(scope="module")
def layer():
    cfg = tiny_config()
    return cfg, tiny_params(cfg).layers[0].moe


@pytest.fixture
def kernel_calls(monkeypatch):
    calls = []
    real = routing_kernel.moe_routing

    def spy(*args, **kwargs):
        calls.append(args[0].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(routing_kernel, "moe_routing", spy)
    return calls


def run(p, x, cfg, valid, way: str, mode: str = "interpret") -> np.ndarray:
    # a fresh function each time: jit wrappers of one function share their traces (docs/quant_formats.md)
    with kernel_mode(mode), mlp.moe_routing(way):
        return np.asarray(jax.jit(lambda p, x, v: mlp.moe(p, x, cfg, v))(p, x, valid))


@pytest.mark.parametrize("tokens", [1, 3, 12, routing_kernel.MAX_TOKENS + 4])
def test_routing_in_one_launch_gives_xlas_output(layer, kernel_calls, tokens):
    cfg, p = layer
    rng = np.random.default_rng(tokens)
    x = jnp.asarray(rng.standard_normal((tokens, cfg.hidden_size)), jnp.float32)
    valid = jnp.asarray(rng.random(tokens) < 0.7).at[0].set(False)  # padding tokens, the first one too
    want = run(p, x, cfg, valid, "xla")
    assert kernel_calls == []
    got = run(p, x, cfg, valid, "kernel")
    np.testing.assert_array_equal(got, want)
    assert kernel_calls == ([tokens] if tokens <= routing_kernel.MAX_TOKENS else [])


def test_without_valid_marks_too(layer, kernel_calls):
    cfg, p = layer
    x = jnp.asarray(np.random.default_rng(7).standard_normal((5, cfg.hidden_size)), jnp.float32)
    with kernel_mode("interpret"), mlp.moe_routing("kernel"):
        got = np.asarray(jax.jit(lambda p, x: mlp.moe(p, x, cfg))(p, x))
    with kernel_mode("interpret"), mlp.moe_routing("xla"):
        want = np.asarray(jax.jit(lambda p, x: mlp.moe(p, x, cfg))(p, x))
    np.testing.assert_array_equal(got, want)
    assert kernel_calls == [5]


def test_layers_off_the_grouped_kernel_keep_xlas_routing(layer, kernel_calls):
    """Under the reference kernel mode (the CPU's XLA path) the experts take no kernel, nor does
    their routing."""
    cfg, p = layer
    x = jnp.ones((2, cfg.hidden_size), jnp.float32)
    run(p, x, cfg, None, "kernel", mode="reference")
    assert kernel_calls == []


def test_unknown_way_is_refused():
    with pytest.raises(ValueError, match="MoE routing"), mlp.moe_routing("heap"):
        pass


@pytest.mark.parametrize("tokens", [1, 3, 8])
def test_bf16_rows_reach_the_word_dot_made_by_the_routing_kernel(layer, kernel_calls, monkeypatch, tokens):
    """bf16 rows take the grouped word dot (dot_w), whose float16 rows the routing kernel makes as
    well: the gate / up launch gets them (no XLA op before it), and the layer's output is XLA's
    routing's bit for bit."""
    cfg, p = layer
    seen = []
    real = mlp.grouped_expert_matmuls

    def spy(xs, ws, group_sizes, *, tokens, x_words=None, **options):
        seen.append(x_words is not None)
        return real(xs, ws, group_sizes, tokens=tokens, x_words=x_words, **options)

    monkeypatch.setattr(mlp, "grouped_expert_matmuls", spy)
    rng = np.random.default_rng(tokens)
    x = jnp.asarray(rng.standard_normal((tokens, cfg.hidden_size)) * 40, jnp.bfloat16)
    valid = jnp.arange(tokens) != 1
    with nvfp4_grouped_dot("dot_w"):  # one token's default, the half2 gemv, takes word pairs
        want = run(p, x, cfg, valid, "xla")
        got = run(p, x, cfg, valid, "kernel")
    np.testing.assert_array_equal(got, want)
    assert kernel_calls == [tokens] and seen == [False, True]
