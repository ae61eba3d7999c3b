"""`jit` that donates buffers only on accelerators.

Donating the cache or the KV/state pools lets XLA update them in place, which is what keeps decode
from copying gigabytes per step on a GPU. On the CPU, jaxlib 0.10.2 can hang (the process sleeps,
no error) executing a program with donated inputs of some sizes (seen with the demo model: a
1024-token prefill chunk, and the engine's 4 x 256 prefill bucket), while the same program without
donation runs in seconds; and CPU memory is not the constraint there. So donation is kept off on
the CPU backend. Facts: docs/model_config.md.

Every program also has a `.without_command_buffers` twin: the same function compiled on a GPU
with XLA's command buffers (CUDA graphs) off. It was built to test whether updating graphs is what
makes a once-per-token dispatch costly; on the H200 the twins were slower (every kernel launched
alone), so the engine keeps graphs (`EngineConfig.one_step_command_buffers`,
docs/structured_output.md). On the CPU the twin is the program itself (compiled once for both).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax

NO_COMMAND_BUFFERS = (("xla_gpu_enable_command_buffer", ""),)  # XLA compiler option: no command types


def jit(fn: Callable | None = None, *, donate_argnums: Any = (), donate_argnames: Any = (), **kwargs):
    """Like `jax.jit` (also as `@jit(...)`), with donation applied only when the backend is not the
    CPU; `.without_command_buffers` is the same program compiled without command buffers on a GPU."""
    if fn is None:
        return functools.partial(jit, donate_argnums=donate_argnums, donate_argnames=donate_argnames, **kwargs)

    @functools.cache
    def compiled(backend: str, options: tuple = ()):
        if backend == "cpu":
            return jax.jit(fn, **kwargs)
        extra = {"compiler_options": dict(options)} if options else {}
        return jax.jit(fn, donate_argnums=donate_argnums, donate_argnames=donate_argnames, **kwargs, **extra)

    def variant(options: tuple):
        @functools.wraps(fn)
        def call(*args, **kw):
            backend = jax.default_backend()
            return compiled(backend, () if backend == "cpu" else options)(*args, **kw)

        return call

    call = variant(())
    call.without_command_buffers = variant(NO_COMMAND_BUFFERS)
    return call
