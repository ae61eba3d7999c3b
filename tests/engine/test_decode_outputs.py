"""The decode program's packed output (runner.pack_decode): the host reads back exactly what the
step loop sampled, and the next dispatch's inputs come from it on the device (asynchronous decode)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infernix_jax.engine.runner import decode_width, next_decode_inputs, pack_decode, unpack_decode


def _outputs(steps: int, b: int, k: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    logprobs = rng.normal(size=(steps, b)).astype(np.float32) - 3
    logprobs[0, 0] = -np.inf  # a masked-out alternative's logprob survives the trip
    top = np.sort(rng.normal(size=(steps, b, k)).astype(np.float32), axis=-1)[..., ::-1] - 2
    return (
        rng.integers(0, steps + 1, size=b).astype(np.int32),  # count
        rng.integers(0, 151936, size=b).astype(np.int32),  # current
        rng.random(b) < 0.5,  # done
        rng.integers(0, 151936, size=(steps, b)).astype(np.int32),
        logprobs,
        rng.integers(0, 151936, size=(steps, b, k)).astype(np.int32),
        np.ascontiguousarray(top),
    )


@pytest.mark.parametrize("steps,b,k", [(8, 1, 20), (4, 3, 2), (1, 5, 0)])
def test_the_host_reads_back_what_the_loop_sampled_bit_for_bit(steps, b, k):
    count, current, done, tokens, logprobs, top_ids, top_logprobs = _outputs(steps, b, k)
    packed = jax.jit(pack_decode)(count, current, done, tokens, logprobs, top_ids, top_logprobs)
    assert packed.dtype == jnp.int32 and packed.shape == (b, decode_width(steps, k)) == (b, 3 + steps * (2 + 2 * k))
    read = unpack_decode(jax.device_get(packed), steps)
    np.testing.assert_array_equal(read.counts, count)
    np.testing.assert_array_equal(read.tokens, tokens)
    np.testing.assert_array_equal(read.logprobs.view(np.int32), logprobs.view(np.int32))
    np.testing.assert_array_equal(read.top_ids, top_ids)
    np.testing.assert_array_equal(read.top_logprobs.view(np.int32), top_logprobs.view(np.int32))
    assert read.tokens.shape == (steps, b) and read.top_ids.shape == (steps, b, k)


def test_the_next_dispatch_feeds_each_row_its_last_token_and_stops_the_finished_ones():
    steps = 4
    count, current, done, *rest = _outputs(steps, 6, 3, seed=2)
    count[:] = [4, 4, 2, 0, 3, 4]
    done[:] = [False, True, True, False, False, False]
    positions = np.array([10, 20, 30, -1, 50, 60], np.int32)
    budget = np.array([100, 100, 100, 0, 3, 5], np.int32)
    packed = pack_decode(count, current, done, *rest)
    tokens, next_positions, max_steps, left = next_decode_inputs(packed, positions, budget, steps=steps)
    np.testing.assert_array_equal(tokens, current)
    np.testing.assert_array_equal(next_positions, positions + count)
    np.testing.assert_array_equal(left, budget - count)
    # a stopped row and one whose budget ran out take no step; the rest at most `steps` or what is left
    np.testing.assert_array_equal(max_steps, [4, 0, 0, 0, 0, 1])
