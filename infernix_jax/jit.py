"""`jit` that donates buffers only on accelerators.

Donating the cache or the KV/state pools lets XLA update them in place, which is what keeps decode
from copying gigabytes per step on a GPU. On the CPU, jaxlib 0.10.2 can hang (the process sleeps,
no error) executing a program with donated inputs of some sizes (seen with the demo model: a
1024-token prefill chunk, and the engine's 4 x 256 prefill bucket), while the same program without
donation runs in seconds; and CPU memory is not the constraint there. So donation is kept off on
the CPU backend. Facts: docs/model_config.md.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax


def jit(fn: Callable | None = None, *, donate_argnums: Any = (), donate_argnames: Any = (), **kwargs):
    """Like `jax.jit` (also as `@jit(...)`), with donation applied only when the backend is not the CPU."""
    if fn is None:
        return functools.partial(jit, donate_argnums=donate_argnums, donate_argnames=donate_argnames, **kwargs)

    @functools.cache
    def compiled(backend: str):
        if backend == "cpu":
            return jax.jit(fn, **kwargs)
        return jax.jit(fn, donate_argnums=donate_argnums, donate_argnames=donate_argnames, **kwargs)

    @functools.wraps(fn)
    def call(*args, **kw):
        return compiled(jax.default_backend())(*args, **kw)

    return call
