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

`.with_loop_graphs` is the program compiled with XLA's WHILE and CONDITIONAL commands added to
the command buffers: a loop whose body can be captured becomes one CUDA graph with the loop inside
(a conditional node), launched once per call, instead of one graph launch per iteration from the
host. A multi-step decode dispatch holds the launching thread for about as long as the device runs
it when every step is launched alone (~1.8 ms a step for the 80B-A3B shape's ~1100 kernels on an
H100), so the engine's host work between dispatches leaves the device idle (docs/engine.md). On an
H100 it sampled the same tokens and did not change the 80B-A3B decode rate (286.6 against 288.5
tok/s at batch 1; again with one command buffer a step and no conditional in it, 396.4 against
428.8; 332.3 against 394.7 at b1961fb), so the engine leaves it off (`EngineConfig.decode_loop_graphs`):
the graph holding the loop also holds the inputs' copies and the output's write, whose buffers
are new at every dispatch, so it is re-recorded each time (docs/engine.md, "Where the 80B-A3B's
host time went at batch 1, again").
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax

NO_COMMAND_BUFFERS = (("xla_gpu_enable_command_buffer", ""),)  # XLA compiler option: no command types
# XLA's default command types plus loops and conditionals. Named in full: as a compiler option
# (unlike XLA_FLAGS) "+WHILE" is refused ("'+WHILE' is not a valid enum value", jax 0.11.2)
LOOP_GRAPHS = (("xla_gpu_enable_command_buffer", "FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,WHILE,CONDITIONAL"),)


def jit(fn: Callable | None = None, *, donate_argnums: Any = (), donate_argnames: Any = (), **kwargs):
    """Like `jax.jit` (also as `@jit(...)`), with donation applied only when the backend is not the
    CPU; `.without_command_buffers` is the same program compiled without command buffers on a GPU,
    `.with_loop_graphs` with loops and conditionals in them."""
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
    call.with_loop_graphs = variant(LOOP_GRAPHS)
    return call
