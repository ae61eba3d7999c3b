"""bench.deviceless builds the engine's decode dispatch from shapes alone (the GPU compile itself
needs the CUDA plugin, which CI does not install: on a CPU the same call compiles for the CPU)."""

from __future__ import annotations

import os

import jax

from bench import deviceless


def test_the_decode_dispatch_is_built_from_shapes_and_compiles_for_the_given_device():
    device = jax.devices("cpu")[0]
    program, args, static = deviceless.decode_call(
        "tiny", "nvfp4", batch=2, context=100, steps=3, device=device
    )
    leaves = jax.tree.leaves(args)
    assert leaves and all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves)  # nothing materialised
    assert all(leaf.sharding.device_set == {device} for leaf in leaves)
    assert static["steps"] == 3 and args[4].shape == (2,)  # the rows' first tokens
    text = program.lower(*args, **static).compile().as_text()
    assert "while" in text  # the dispatch's steps run in one loop on the device


def test_the_environment_asks_for_the_cuda_plugin_without_its_driver_checks_and_dumps_the_program(
    monkeypatch,
):
    for name in ("JAX_PLATFORMS", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "XLA_FLAGS"):
        monkeypatch.delenv(name, raising=False)
    deviceless.prepare_environment("/tmp/dump-here")
    assert os.environ["JAX_PLATFORMS"] == "cpu,cuda"
    assert os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] == "1"
    assert "--xla_dump_to=/tmp/dump-here" in os.environ["XLA_FLAGS"]
    assert set(deviceless.TARGETS.values()) <= {p.name for p in deviceless.CONFIG_DIR.iterdir()}
