"""Device time of one call of a small kernel: many calls chained inside one program.

A lone call of a kernel of a few microseconds is mostly dispatch. `chained` runs it `calls`
times in one jitted loop, each call's first input nudged by a scalar `tie` of the last call's
outputs (1e-30 of it: the values stay, but no call can be skipped or hoisted), and
`best_seconds` takes the best of a few runs of that program. Used by bench.moe_routing and
bench.norm_rows."""

from __future__ import annotations

import time
from collections.abc import Callable

import jax


def chained(fn: Callable, calls: int, tie: Callable) -> Callable:
    """A jitted program (first, *rest) -> first after `calls` calls of fn(first, *rest), each with
    first + 1e-30 * tie(outputs of the call before) (tie: outputs -> a float32 scalar)."""

    def run(first, *rest):
        def body(_, a):
            return a + (1e-30 * tie(fn(a, *rest))).astype(a.dtype)

        return jax.lax.fori_loop(0, calls, body, first)

    return jax.jit(run)


def best_seconds(fn: Callable, *args, repeats: int = 5) -> float:
    """Best wall time of `repeats` runs of fn(*args) to completion, after one untimed run."""
    fn(*args).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return best
