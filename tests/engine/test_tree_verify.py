"""Tree verification math: greedy takes the longest matching path; multi-candidate rejection
sampling over siblings reproduces plain sampling; drafters' branches merge into a trie.

The statistical test reuses test_speculative_verify's toy target (vocabulary 6, logits depending on
the depth only, temperature 0.8, top-k 5, top-p 0.95, repetition and frequency penalties) and its
chi-square harness: N = 20,000 fixed-seed rows verify one tree with three candidates at depth 1 and
candidates under two of them at depth 2; the joint law of the first two emitted tokens is compared
with the exact law (24 degrees of freedom) and with plain `sample` draws, rejection at p < 1e-3.
Power as there: 0.94 against an effect of Cohen's w = 0.05 (lambda = N w^2 = 50). A control shows
the test rejecting the law of a target at temperature 0.9.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from scipy.stats import chi2_contingency

from infernix_jax.engine.protocol import SamplingParams
from infernix_jax.engine.sampling import PenaltyState, SamplingArrays, row_keys, sample
from infernix_jax.engine.speculative.drafters import CombinedDrafter, MtpDrafter, NgramDrafter, ngram_branches
from infernix_jax.engine.speculative.tree import build_tree, verify_tree
from tests.engine.test_speculative_verify import (
    ALPHA,
    LOGITS,
    PARAMS,
    N,
    V,
    batch_state,
    cell_counts,
    exact_pair_law,
    goodness_of_fit,
    plain_pairs,
)

verify = jax.jit(verify_tree, static_argnames=("num_top_logprobs",))

# window: root, then depth-1 candidates 0, 4, 1 (nodes 1-3), depth-2 candidates 1 under 0 (node 4),
# 3 and 0 under 4 (nodes 5, 6); a repeated sibling token (node 7: 4 again under the root) is ignored
TREE_TOKENS = [2, 0, 4, 1, 1, 3, 0, 4]
TREE_PARENTS = [-1, 0, 0, 0, 1, 2, 2, 0]
TREE_DEPTH = [0, 1, 1, 1, 2, 2, 2, 1]


def tree_pairs(params: SamplingParams = PARAMS) -> np.ndarray:
    """(first, second) token of N rows: one tree verify, then a plain step where only one came out."""
    arrays, penalties = batch_state(params, N)
    w = len(TREE_TOKENS)
    logits = jnp.asarray(np.broadcast_to(LOGITS[TREE_DEPTH], (N, w, V)))
    out = verify(
        logits,
        jnp.asarray(np.tile(TREE_TOKENS, (N, 1)), jnp.int32),
        jnp.asarray(np.tile(TREE_PARENTS, (N, 1)), jnp.int32),
        jnp.full(N, w, jnp.int32),
        arrays,
        penalties,
        jnp.ones(N, bool),
    ).out
    tokens, counts = np.asarray(out.tokens), np.asarray(out.counts)
    assert counts.min() >= 1 and counts.max() <= 3
    second = jax.jit(sample)(
        jnp.asarray(np.broadcast_to(LOGITS[1], (N, V))),
        arrays,
        out.penalties,
        row_keys(arrays, out.penalties.num_generated),
    ).tokens
    second = np.where(counts >= 2, tokens[1], np.asarray(second))
    return np.stack([tokens[0], second], axis=1)


def test_tree_sampling_has_the_law_of_plain_sampling():
    spec, plain = cell_counts(tree_pairs()), cell_counts(plain_pairs())
    law = exact_pair_law(PARAMS)
    assert goodness_of_fit(spec, law) > ALPHA
    keep = (spec + plain) > 0
    _, p_homogeneous, _, _ = chi2_contingency(np.stack([spec[keep], plain[keep]]))
    assert p_homogeneous > ALPHA
    # the control: the same counts against a target at another temperature are rejected
    assert goodness_of_fit(spec, exact_pair_law(PARAMS.replace(temperature=0.9))) < ALPHA


def test_greedy_tree_accepts_the_longest_matching_path():
    rng = np.random.default_rng(3)
    b, w = 3, 6
    logits = rng.normal(size=(b, w, V)).astype(np.float32)
    target = logits.argmax(-1)  # the argmax after each node
    other = lambda t: (t + 1) % V
    # row 0: the second branch matches twice; row 1: nothing matches; row 2: no drafts
    parents = np.array([[-1, 0, 0, 1, 2, 4], [-1, 0, 0, 1, 2, 4], [-1, -1, -1, -1, -1, -1]], np.int32)
    tokens = np.zeros((b, w), np.int32)
    tokens[0, 1], tokens[0, 2] = other(target[0, 0]), target[0, 0]  # node 2 matches the root's argmax
    tokens[0, 3] = target[0, 1]
    tokens[0, 4] = target[0, 2]  # matches after node 2
    tokens[0, 5] = other(target[0, 4])  # rejected after node 4
    tokens[1, 1:] = [other(target[1, 0]), other(other(target[1, 0])), 0, 0, 0]
    num_nodes = np.array([6, 3, 1], np.int32)
    arrays, penalties = SamplingArrays.build([SamplingParams()] * b, [0] * b, b), PenaltyState.zeros(b, V)
    verified = verify(jnp.asarray(logits), jnp.asarray(tokens), jnp.asarray(parents), jnp.asarray(num_nodes),
                      arrays, penalties, jnp.ones(b, bool))  # fmt: skip
    out, path = verified.out, np.asarray(verified.path)
    np.testing.assert_array_equal(np.asarray(out.accepted), [2, 0, 0])
    assert list(path[0, :3]) == [0, 2, 4]
    emitted = np.asarray(out.tokens)
    assert list(emitted[:3, 0]) == [target[0, 0], target[0, 2], target[0, 4]]  # path, then the argmax
    assert emitted[0, 1] == target[1, 0] and emitted[0, 2] == target[2, 0]


def test_build_tree_merges_shared_prefixes_within_the_budget():
    tree = build_tree([[5, 6, 7], [5, 6, 8], [9, 1]], max_nodes=5, max_depth=3)
    assert tree.tokens == [5, 6, 7, 8, 9] and tree.parents == [0, 1, 2, 2, 0]
    assert tree.depth == 3
    assert build_tree([[1, 2, 3, 4]], max_nodes=8, max_depth=2).tokens == [1, 2]
    assert build_tree([], max_nodes=4, max_depth=4).tokens == []


def test_ngram_branches_collect_different_continuations_longest_match_first():
    # "a b" occurs three times, followed by x, y and x again; "c a b" once, followed by y
    a, b, c, x, y, z = 1, 2, 3, 10, 11, 12
    tokens = [a, b, x, z, c, a, b, y, z, a, b, x, z, c, a, b]
    assert ngram_branches(tokens, 2, 1, 8, width=3) == [[y, z], [x, z]]  # the second "a b x" adds nothing
    assert ngram_branches(tokens, 2, 1, 8, width=1) == [[y, z]]
    assert NgramDrafter(1, 8, 2).propose_branches(tokens, (), 4, 2) == [[y, z], [x, z]]


def test_mtp_and_combined_branches():
    chain_then_alternatives = [7, 8, 9, 4, 5]  # a chain of 3 and two alternatives to its first token
    assert MtpDrafter().propose_branches([1, 2], chain_then_alternatives, 2, width=3) == [[7, 8], [4], [5]]
    combined = CombinedDrafter(NgramDrafter(1, 8, 4))
    assert combined.propose_branches([1, 2, 1], [7, 6], 3, width=2) == [[2, 1], [7], [6]]
