"""The engine's MTP drafts are the chain the MTP head drafts over a cache holding every committed position.

The reference runs the target over the whole committed path, the MTP head over every position
(token x_{i+1} beside hidden h_i), and chains from the newest token, as bench/mtp_acceptance.py
measures it. The engine must reach the same drafts after its prefill and after each verify step,
which holds only if its MTP KV covers every committed position exactly once (no rejected draft).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infernix_jax.cache.sequence import init_cache
from infernix_jax.engine.protocol import GenerationRequest, SamplingParams
from infernix_jax.model.forward import forward, mtp_forward
from tests.engine.test_speculative_engine import model, speculative_core

REFERENCE_WIDTH = 128  # every committed path fits; one shape, so the reference compiles once
_forward = jax.jit(forward, static_argnums=(4,))
_mtp_forward = jax.jit(mtp_forward, static_argnums=(5,))


def reference_chain(params, cfg, path: list[int], steps: int) -> list[int]:
    """Greedy MTP drafts following path[-1] (the newest token; path[:-1] is committed).

    The prefill programs run on REFERENCE_WIDTH tokens whatever the path's length: the path's
    tokens, then padding at position -1 (nothing reads or writes it), so the path is exact and one
    compiled program serves every length."""
    n = len(path) - 1
    assert n <= REFERENCE_WIDTH
    cache = init_cache(cfg, 1, 256, jnp.float32, with_mtp=True)
    positions = jnp.asarray(np.where(np.arange(REFERENCE_WIDTH) < n, np.arange(REFERENCE_WIDTH), -1))[None]

    def padded(tokens: list[int]) -> jax.Array:
        return jnp.asarray(tokens + [0] * (REFERENCE_WIDTH - len(tokens)))[None]

    _, hidden, cache = _forward(params, padded(path[:-1]), positions, cache, cfg)
    logits, h, cache = _mtp_forward(params, padded(path[1:]), hidden, positions, cache, cfg)
    drafts = [int(jnp.argmax(logits[0, n - 1]))]
    h = h[:, n - 1 : n]
    for j in range(1, steps):
        logits, h, cache = _mtp_forward(
            params, jnp.asarray([[drafts[-1]]]), h, jnp.asarray([[n - 1 + j]]), cache, cfg
        )
        drafts.append(int(jnp.argmax(logits[0, 0])))
    return drafts


@pytest.mark.slow  # ~30 s: compiles the MTP prefill and verify programs, and the reference's three
def test_mtp_drafts_follow_the_committed_path_through_prefill_and_verify():
    m = model("hybrid")
    core = speculative_core("hybrid", "mtp")
    steps = core.config.draft_tokens
    prompt = np.random.default_rng(3).integers(0, 512, size=90).tolist()  # two prefill chunks
    core.add_request(GenerationRequest("m", prompt, SamplingParams(max_tokens=12, ignore_eos=True)))
    state = core.requests["m"]
    checked = 0
    while core.has_work():
        core.step()
        if state.output and "m" in core.requests and state.num_pending == 1:
            path = prompt + state.output
            assert core.speculation.device_drafts["m"] == reference_chain(m.params, m.config, path, steps)
            checked += 1
    assert checked >= 3
