"""A tree-shaped verify window leaves exactly the state of a run that only saw the accepted path.

On the hybrid fixture (float32): one forward over a tree window; for two root-to-leaf paths, the
logits along the path, the GDN state kept after the path's last node (conv and recurrent, compared
directly) and, after moving the path's keys/values to consecutive positions, the next token's
logits all equal those of a plain forward over just that path. Tolerance 1e-5 as in
tests/model/test_speculative_rollback.py (matmuls over 8 tokens round differently from matmuls over
fewer); a state that also saw a rejected sibling branch differs by far more (checked).
Every forward has the same shape [1, 8] (padding with position -1), so two programs compile.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infernix_jax.cache.sequence import GDNState, init_cache
from infernix_jax.config import ModelConfig
from infernix_jax.engine.speculative.rollback import keep_accepted_states
from infernix_jax.engine.speculative.tree import compact_path_kv
from infernix_jax.model.forward import forward
from infernix_jax.weights.hf import load_params
from tests.conftest import HF_FIXTURES

T = 8
# node: 0 root; 1, 2 under 0; 3 under 1; 4 under 2; 5 under 4; 6 under 3; 7 under 0
PARENTS = [-1, 0, 0, 1, 2, 4, 3, 0]
DEPTH = [0, 1, 1, 2, 2, 3, 3, 1]

plain_forward = jax.jit(forward, static_argnums=(4,))
tree_forward = jax.jit(lambda p, t, pos, c, parents, cfg: forward(p, t, pos, c, cfg, tree_parents=parents),
                       static_argnums=(5,))  # fmt: skip


@pytest.fixture(scope="module")
def model():
    path = HF_FIXTURES / "qwen3_next"
    cfg = ModelConfig.from_hf_config(path)
    return cfg, load_params(path, cfg, jnp.float32, progress=False)


def padded(tokens: list[int], start: int):
    n = len(tokens)
    ids = jnp.asarray([tokens + [0] * (T - n)], jnp.int32)
    positions = jnp.asarray([[start + i for i in range(n)] + [-1] * (T - n)], jnp.int32)
    return ids, positions


def path_to(leaf: int) -> list[int]:
    path = []
    while leaf >= 0:
        path.append(leaf)
        leaf = PARENTS[leaf]
    return path[::-1]


def gdn(cache):
    return [e for e in cache.layers if isinstance(e, GDNState)]


@pytest.mark.parametrize("leaf", [5, 6])
def test_state_after_a_tree_window_is_the_state_of_the_accepted_path_alone(model, leaf):
    cfg, params = model
    rng = np.random.default_rng(leaf)
    prompt = rng.integers(0, cfg.vocab_size, T).tolist()
    nodes = rng.integers(0, cfg.vocab_size, T).tolist()
    _, _, prefix = plain_forward(params, *padded(prompt, 0), init_cache(cfg, 1, 32), cfg)
    start = len(prompt)
    depth_positions = jnp.asarray([[start + d for d in DEPTH]], jnp.int32)
    tree_logits, _, tree_cache = tree_forward(
        params, jnp.asarray([nodes], jnp.int32), depth_positions, prefix, jnp.asarray([PARENTS]), cfg
    )
    path = path_to(leaf)
    path_tokens = [nodes[n] for n in path]
    path_logits, _, alone = plain_forward(params, *padded(path_tokens, start), prefix, cfg)
    np.testing.assert_allclose(
        np.asarray(tree_logits[0, path]), np.asarray(path_logits[0, : len(path)]), rtol=0, atol=1e-4
    )

    kept = keep_accepted_states(tree_cache, jnp.asarray([leaf]))
    for got, want in zip(gdn(kept), gdn(alone)):
        np.testing.assert_allclose(np.asarray(got.conv), np.asarray(want.conv), rtol=0, atol=1e-5)
        np.testing.assert_allclose(np.asarray(got.recurrent), np.asarray(want.recurrent), rtol=0, atol=1e-5)
    # the last node in window order continues another branch: its state is no substitute
    other = keep_accepted_states(tree_cache, jnp.asarray([11 - leaf]))
    assert np.abs(np.asarray(gdn(other)[-1].recurrent - gdn(alone)[-1].recurrent)).max() > 1e-3

    path_array = jnp.asarray([path + [0] * (T - len(path))], jnp.int32)
    committed = compact_path_kv(kept, jnp.asarray([start]), path_array, jnp.asarray([len(path) - 1]))
    follow = rng.integers(0, cfg.vocab_size, 1).tolist()
    after = start + len(path)
    next_tree, _, _ = plain_forward(params, *padded(follow, after), committed, cfg)
    next_alone, _, _ = plain_forward(params, *padded(follow, after), alone, cfg)
    np.testing.assert_allclose(np.asarray(next_tree[0, 0]), np.asarray(next_alone[0, 0]), rtol=0, atol=1e-4)
