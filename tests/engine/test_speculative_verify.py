"""Verification math: greedy acceptance, and rejection sampling that reproduces plain sampling.

Statistical tests (fixed seeds, so they are deterministic): a toy target whose logits depend only on
the position (vocabulary of 6), with temperature, top-k, top-p, repetition and frequency penalties.
N = 20,000 rows, each its own seed, run one verification of a 2-token draft window (and, where the
first draft was rejected, one plain step for the second token). The joint law of the first two
emitted tokens is compared with the exact law of plain sampling (goodness of fit over the cells
with non-zero probability, 24 degrees of freedom with top-k 5) and with 20,000 draws of
`sampling.sample` run twice (homogeneity). Rejection at p < 1e-3. Power: with 24 degrees of freedom
and N = 20,000, an effect of Cohen's w = 0.05 (a total-variation error of roughly 2-3 points spread
over the cells) is detected with probability 0.94 (noncentral chi-square, lambda = N w^2 = 50);
w = 0.03 only with probability 0.19. `test_the_chi_square_test_detects_a_wrong_temperature` shows
the test failing for a target at temperature 0.9 instead of 0.8.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy.stats import chi2, chi2_contingency

from infernix_jax.engine.protocol import SamplingParams
from infernix_jax.engine.sampling import (
    PenaltyState,
    SamplingArrays,
    process_logits,
    row_keys,
    sample,
    truncated_logits,
    update_penalty_state,
)
from infernix_jax.engine.speculative.verify import greedy_accepted_length, verify_window

V = 6
N = 20_000
ALPHA = 1e-3
PARAMS = SamplingParams(
    temperature=0.8, top_k=5, top_p=0.95, repetition_penalty=1.3, frequency_penalty=0.4, max_tokens=8
)
# logits of the token after window position 0, 1, 2 (the toy target ignores its context)
LOGITS = np.array(
    [
        [1.0, 0.6, 0.2, -0.3, 0.9, -1.0],
        [0.2, 1.1, 0.4, 0.8, -0.5, 0.0],
        [0.5, 0.5, -0.2, 1.0, 0.3, 0.1],
    ],
    np.float32,
)
PROMPT = [2, 5]  # seen by the repetition penalty


def batch_state(params: SamplingParams, n: int):
    arrays = SamplingArrays.build([params] * n, list(range(n)), n)
    seen = np.zeros((n, V), bool)
    seen[:, PROMPT] = True
    penalties = PenaltyState(
        seen=jnp.asarray(seen),
        output_counts=jnp.zeros((n, V), jnp.int32),
        num_generated=jnp.zeros(n, jnp.int32),
    )
    return arrays, penalties


@jax.jit
def _pair_law(arrays: SamplingArrays, penalties: PenaltyState, logits: jax.Array) -> jax.Array:
    dist = lambda row_logits, pen: jax.nn.softmax(
        truncated_logits(process_logits(jnp.tile(row_logits, (V, 1)), arrays, pen), arrays), axis=1
    )
    p0 = dist(logits[0], penalties)[0]
    after = update_penalty_state(penalties, jnp.arange(V), jnp.ones(V, bool))
    p1 = dist(logits[1], after)  # row a: the second token after a
    return p0[:, None] * p1


def exact_pair_law(params: SamplingParams) -> np.ndarray:
    """P(first, second) of plain sampling: p0(a) * p1(b | penalties after a)."""
    return np.asarray(_pair_law(*batch_state(params, V), jnp.asarray(LOGITS)), np.float64)


verify = jax.jit(verify_window, static_argnames=("num_top_logprobs",))


def speculative_pairs(drafts: np.ndarray, draft_probs: np.ndarray | None) -> np.ndarray:
    """(first, second) token of N rows: one verify of [t0, d1, d2], then a plain step if needed."""
    arrays, penalties = batch_state(PARAMS, N)
    logits = jnp.asarray(np.broadcast_to(LOGITS, (N, 3, V)))
    out = verify(
        logits,
        jnp.asarray(drafts),
        jnp.full(N, drafts.shape[1], jnp.int32),
        arrays,
        penalties,
        jnp.ones(N, bool),
        None if draft_probs is None else jnp.asarray(draft_probs),
    )
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


def plain_pairs() -> np.ndarray:
    arrays, penalties = batch_state(PARAMS, N)
    first = jax.jit(sample)(
        jnp.asarray(np.broadcast_to(LOGITS[0], (N, V))),
        arrays,
        penalties,
        row_keys(arrays, penalties.num_generated),
    ).tokens
    penalties = update_penalty_state(penalties, first, jnp.ones(N, bool))
    second = jax.jit(sample)(
        jnp.asarray(np.broadcast_to(LOGITS[1], (N, V))),
        arrays,
        penalties,
        row_keys(arrays, penalties.num_generated),
    ).tokens
    return np.stack([np.asarray(first), np.asarray(second)], axis=1)


def cell_counts(pairs: np.ndarray) -> np.ndarray:
    return np.bincount(pairs[:, 0] * V + pairs[:, 1], minlength=V * V).reshape(V, V)


def goodness_of_fit(observed: np.ndarray, law: np.ndarray) -> float:
    """p-value of a chi-square test of observed counts against the law (cells of zero probability
    must be empty, else p = 0)."""
    if observed[law == 0].sum() > 0:
        return 0.0
    cells = law > 0
    expected = law[cells] * observed.sum()
    stat = float(((observed[cells] - expected) ** 2 / expected).sum())
    return float(chi2.sf(stat, cells.sum() - 1))


@pytest.fixture(scope="module")
def plain():
    return cell_counts(plain_pairs())


@pytest.fixture(scope="module")
def point_mass():
    # one draft the target likes, one it rarely samples: both accept and reject paths are taken
    return cell_counts(speculative_pairs(np.tile(np.array([[0, 4]], np.int32), (N, 1)), None))


def sampled_drafts():
    rng = np.random.default_rng(0)
    q = rng.dirichlet(np.ones(V), size=2).astype(np.float32)  # a proposal law per draft position
    drafts = np.stack([rng.choice(V, size=N, p=q[j] / q[j].sum()) for j in range(2)], axis=1).astype(np.int32)
    return cell_counts(speculative_pairs(drafts, np.broadcast_to(q, (N, 2, V))))


@pytest.mark.parametrize("kind", ["point-mass drafts", "drafts sampled from q"])
def test_speculative_sampling_has_the_law_of_plain_sampling(kind, plain, point_mass):
    spec = point_mass if kind == "point-mass drafts" else sampled_drafts()
    law = exact_pair_law(PARAMS)
    assert goodness_of_fit(spec, law) > ALPHA
    assert goodness_of_fit(plain, law) > ALPHA
    keep = (spec + plain) > 0
    _, p_homogeneous, _, _ = chi2_contingency(np.stack([spec[keep], plain[keep]]))
    assert p_homogeneous > ALPHA


def test_the_chi_square_test_detects_a_wrong_temperature(point_mass):
    assert goodness_of_fit(point_mass, exact_pair_law(PARAMS.replace(temperature=0.9))) < ALPHA


def test_greedy_rows_accept_the_longest_prefix_equal_to_the_argmax_and_add_the_bonus():
    rng = np.random.default_rng(1)
    b, w = 5, 4
    logits = rng.normal(size=(b, w, V)).astype(np.float32)
    target = logits.argmax(-1)
    drafts = target[:, :-1].copy()
    drafts[1, 0] = (drafts[1, 0] + 1) % V  # rejected at once
    drafts[2, 2] = (drafts[2, 2] + 1) % V  # two accepted
    num_drafts = np.array([3, 3, 3, 1, 0], np.int32)  # row 3: one draft, row 4: plain decode
    arrays, penalties = SamplingArrays.build([SamplingParams()] * b, [0] * b, b), PenaltyState.zeros(b, V)
    out = verify(jnp.asarray(logits), jnp.asarray(drafts), jnp.asarray(num_drafts), arrays, penalties,
                 jnp.array([True] * 4 + [True]))  # fmt: skip
    expected_accepted = np.array([3, 0, 2, 1, 0])
    np.testing.assert_array_equal(np.asarray(out.accepted), expected_accepted)
    np.testing.assert_array_equal(
        np.asarray(greedy_accepted_length(jnp.asarray(target), jnp.asarray(drafts), jnp.asarray(num_drafts))),
        expected_accepted,
    )
    tokens = np.asarray(out.tokens)
    for row, a in enumerate(expected_accepted):
        assert list(tokens[: a + 1, row]) == list(target[row, : a + 1])  # drafts, then the argmax
    assert list(np.asarray(out.penalties.num_generated)) == list(expected_accepted + 1)


def test_inactive_rows_and_stop_tokens_end_the_window():
    logits = np.zeros((2, 3, V), np.float32)
    logits[:, :, 3] = 5.0  # the argmax is 3 everywhere
    params = SamplingParams(stop_token_ids=(3,))
    arrays = SamplingArrays.build([params, params], [0, 0], 2)
    out = verify(jnp.asarray(logits), jnp.full((2, 2), 3, jnp.int32), jnp.array([2, 2]), arrays,
                 PenaltyState.zeros(2, V), jnp.array([True, False]))  # fmt: skip
    assert list(np.asarray(out.counts)) == [1, 0]  # the accepted stop token ends the row


@pytest.mark.parametrize("rows", ["greedy", "mixed"])
def test_a_plan_chosen_on_the_host_verifies_as_the_device_branches_do(rows):
    """Linear and tree verification under the engine's plan for the rows (GREEDY_PLAN, ANY_PLAN)
    and under ANY_PLAN emit what the branches chosen on the device emit, bit for bit: the engine
    passes a plan on accelerators so that no window position waits for the host (SamplingPlan)."""
    from infernix_jax.engine.sampling import ANY_PLAN, engine_plan
    from infernix_jax.engine.speculative.tree import verify_tree

    params = [SamplingParams()] * 3 if rows == "greedy" else [PARAMS, SamplingParams(), PARAMS.replace(top_k=0)]
    b, w = len(params), 4
    rng = np.random.default_rng(5)
    logits = jnp.asarray(rng.normal(size=(b, w, V)).astype(np.float32) * 2)
    drafts = jnp.asarray(rng.integers(0, V, size=(b, w)).astype(np.int32))
    drafts = drafts.at[:, 1:].set(jnp.argmax(logits[:, :-1], axis=-1))  # mostly accepted
    arrays, penalties = SamplingArrays.build(params, [7, 8, 9], b), PenaltyState.zeros(b, V)
    active, num_drafts = jnp.ones(b, bool), jnp.array([3, 2, 1], jnp.int32)
    parents = jnp.broadcast_to(jnp.array([-1, 0, 1, 1], jnp.int32), (b, w))

    plans = [None, engine_plan(params)] + ([ANY_PLAN] if rows == "greedy" else [])

    def both(plan_index):
        plan = plans[plan_index]
        linear = verify_window(logits, drafts[:, 1:], num_drafts, arrays, penalties, active,
                               num_top_logprobs=2, plan=plan)  # fmt: skip
        tree = verify_tree(logits, drafts, parents, num_drafts + 1, arrays, penalties, active, plan=plan)
        return linear, tree

    runs = [jax.tree.map(np.asarray, jax.jit(both, static_argnums=0)(i)) for i in range(len(plans))]
    assert int(runs[0][0].counts.sum()) > b  # some drafts were accepted
    for run in runs[1:]:
        for got, want in zip(jax.tree.leaves(run), jax.tree.leaves(runs[0]), strict=True):
            np.testing.assert_array_equal(got, want)
