"""infernix_jax.jit: donation and compiler options only where the backend is an accelerator."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from infernix_jax import jit as jit_module


def test_the_twin_without_command_buffers_computes_the_same():
    @jit_module.jit(donate_argnums=(0,))
    def double(x):
        return 2 * x

    x = np.arange(6, dtype=np.float32)
    np.testing.assert_array_equal(double(jnp.asarray(x)), 2 * x)
    np.testing.assert_array_equal(double.without_command_buffers(jnp.asarray(x)), 2 * x)


def test_options_and_donation_reach_xla_only_on_an_accelerator(monkeypatch):
    """On a GPU the twin is compiled with command buffers off and both donate; on the CPU neither
    donates, no option is passed and the twin is the program itself (no second compile)."""
    calls = []

    def recording_jit(fn, **kwargs):
        calls.append(kwargs)
        return fn

    monkeypatch.setattr(jax, "jit", recording_jit)
    program = jit_module.jit(lambda x: x + 1, donate_argnums=(0,), static_argnames=())
    for backend in ("cpu", "gpu"):
        monkeypatch.setattr(jax, "default_backend", lambda backend=backend: backend)
        assert program(1) == 2 and program.without_command_buffers(1) == 2 and program.with_loop_graphs(1) == 2
    cpu, gpu_plain, gpu_twin, gpu_loops = calls  # on the CPU the twins are the same compiled program
    assert cpu == {"static_argnames": ()}
    assert gpu_plain == {"donate_argnums": (0,), "donate_argnames": (), "static_argnames": ()}
    assert gpu_twin == {**gpu_plain, "compiler_options": {"xla_gpu_enable_command_buffer": ""}}
    # loops and conditionals join the command types, named in full: a compiler option refuses the
    # "+WHILE" form that XLA_FLAGS accepts (jax 0.11.2 on a GPU)
    types = gpu_loops["compiler_options"]["xla_gpu_enable_command_buffer"].split(",")
    assert {"FUSION", "CUSTOM_CALL", "WHILE", "CONDITIONAL"} <= set(types)
    assert not any(t.startswith(("+", "-")) for t in types)
