"""On-device sampling: greedy, seeds, truncation, penalties, bias, masks and logprobs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infernix_jax.engine.protocol import SamplingParams
from infernix_jax.engine.sampling import (
    ANY_PLAN,
    GREEDY_PLAN,
    WIDE_SEARCH_MAX_ROWS,
    PenaltyState,
    SamplingArrays,
    SamplingPlan,
    engine_plan,
    process_logits,
    row_keys,
    sample,
    search_bits_for_backend,
    search_width,
    search_width_mode,
    set_penalty_rows,
    stop_token_hit,
    top_alternatives,
    truncated_logits,
    unpack_token_mask,
    update_penalty_state,
    wants_top,
)

VOCAB = 64


def _arrays(params, seeds=None, batch_size=None, **kwargs) -> SamplingArrays:
    seeds = list(seeds) if seeds is not None else [1000 + i for i in range(len(params))]
    return SamplingArrays.build(params, seeds, batch_size or len(params), **kwargs)


@jax.jit
def _sample_step(logits, arrays, state, mask=None):
    return sample(logits, arrays, state, row_keys(arrays, state.num_generated), mask, num_top_logprobs=4)


@jax.jit
def _sample_and_update(logits, arrays, state):
    out = sample(logits, arrays, state, row_keys(arrays, state.num_generated))
    return out.tokens, update_penalty_state(state, out.tokens, jnp.ones_like(out.tokens, bool))


def _generate(arrays, state, logits_per_step):
    """Sample one token per step, updating the penalty state; returns tokens [steps, b]."""
    tokens = []
    for logits in logits_per_step:
        step_tokens, state = _sample_and_update(logits, arrays, state)
        tokens.append(np.asarray(step_tokens))
    return np.stack(tokens)


# ---------------------------------------------------------------------------------------------
# Greedy and seeds


def test_greedy_rows_take_the_argmax_even_beside_sampled_rows():
    logits = jax.random.normal(jax.random.key(0), (6, VOCAB)) * 3
    params = [
        SamplingParams(),
        SamplingParams(temperature=1.5),
        SamplingParams(),
        SamplingParams(temperature=0.9, top_p=0.5),
        SamplingParams(top_k=3),
        SamplingParams(temperature=2.0, top_k=5),
    ]
    state = PenaltyState.zeros(6, VOCAB)
    mixed = _sample_step(logits, _arrays(params), state)
    argmax = np.argmax(np.asarray(logits), axis=1)
    greedy_rows = [0, 2, 4]
    np.testing.assert_array_equal(np.asarray(mixed.tokens)[greedy_rows], argmax[greedy_rows])
    all_greedy = _sample_step(logits, _arrays([SamplingParams()] * 6), state)
    np.testing.assert_array_equal(np.asarray(all_greedy.tokens), argmax)


def test_a_seed_gives_the_same_tokens_whatever_else_is_batched_and_wherever_its_row_is():
    steps = [jax.random.normal(jax.random.key(s), (1, VOCAB)) for s in range(12)]
    mine = SamplingParams(temperature=1.0, top_p=0.95, seed=7)

    def run(batch_size, my_row, others, other_seeds, my_seed=7):
        other_rows = [r for r in range(batch_size) if r != my_row][: len(others)]
        params, seeds = [None] * batch_size, [None] * batch_size
        for row, p, seed in zip(other_rows, others, other_seeds):
            params[row], seeds[row] = p, seed
        params[my_row], seeds[my_row] = mine.replace(seed=my_seed), my_seed
        arrays = _arrays(params, seeds, batch_size)
        # Every row sees different logits except ours, which are the same in both runs.
        noise = jax.random.normal(jax.random.key(batch_size), (len(steps), batch_size, VOCAB))
        per_step = [noise[i].at[my_row].set(steps[i][0]) for i in range(len(steps))]
        return _generate(arrays, PenaltyState.zeros(batch_size, VOCAB), per_step)[:, my_row]

    alone = run(1, 0, [], [])
    crowded = run(
        8,
        5,
        [SamplingParams(temperature=0.7, seed=1), SamplingParams(), SamplingParams(temperature=1.2, top_k=4)],
        [1, 2, 3],
    )
    other_slot = run(8, 1, [SamplingParams(temperature=1.0, seed=99)], [99])
    np.testing.assert_array_equal(alone, crowded)
    np.testing.assert_array_equal(alone, other_slot)
    assert not np.array_equal(alone, run(1, 0, [], [], my_seed=8)), "another seed should give another stream"


def test_resumed_request_continues_its_random_stream():
    """After preemption, set_penalty_rows restores num_generated, so the next token's key is the same."""
    params = [SamplingParams(temperature=1.0, seed=3)]
    arrays = _arrays(params, [3])
    steps = [jax.random.normal(jax.random.key(s), (1, VOCAB)) for s in range(6)]
    straight = _generate(arrays, PenaltyState.zeros(1, VOCAB), steps)[:, 0]
    prompt = jnp.array([[5, 6, -1]], jnp.int32)
    resumed_state = set_penalty_rows(
        PenaltyState.zeros(1, VOCAB), jnp.array([0]), prompt, jnp.asarray(straight[None, :3], jnp.int32)
    )
    resumed = _generate(arrays, resumed_state, steps[3:])[:, 0]
    np.testing.assert_array_equal(straight[3:], resumed)


# ---------------------------------------------------------------------------------------------
# Truncation: the allowed set and the distribution


def _reference_distribution(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Sort-based reference (vLLM's order): temperature, min_p, top_k, top_p; ties at a cut kept."""
    z = logits.astype(np.float64) / p.temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    keep = probs >= p.min_p * probs.max()
    if p.top_k > 0:
        kth = np.sort(z)[::-1][min(p.top_k, len(z)) - 1]
        keep &= z >= kth
    if p.top_p < 1.0:
        kept = np.where(keep, probs, 0.0)
        kept /= kept.sum()
        mass_above = np.array([kept[z > z[i]].sum() for i in range(len(z))])
        keep &= mass_above < p.top_p
    out = np.where(keep, probs, 0.0)
    return out / out.sum()


TINY_LOGITS = np.array([2.0, 1.5, 1.2, 1.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], np.float32)

TRUNCATION_CASES = {
    "no truncation": SamplingParams(temperature=1.0),
    "top_k 4 (a tie at the cut keeps 5)": SamplingParams(temperature=1.0, top_k=4),
    "top_k 3": SamplingParams(temperature=1.0, top_k=3),
    "top_p 0.7": SamplingParams(temperature=0.8, top_p=0.7),
    "min_p 0.2": SamplingParams(temperature=1.3, min_p=0.2),
    "all three": SamplingParams(temperature=1.1, top_k=7, top_p=0.85, min_p=0.05),
}


@pytest.mark.parametrize("case", sorted(TRUNCATION_CASES))
def test_truncated_sampling_draws_only_allowed_tokens_with_the_expected_frequencies(case):
    """Chi-square goodness of fit over 8000 draws, one per seed, at significance 0.001.

    Power: with 8000 draws over ~5 categories, moving 0.03 of probability between two categories
    near p = 0.2 gives a noncentrality of ~65, detected with probability > 0.999 (0.02: ~0.9).
    """
    params = TRUNCATION_CASES[case]
    expected = _reference_distribution(TINY_LOGITS, params)
    draws = 8000
    arrays = _arrays([params], [0])
    arrays = jax.tree.map(lambda x: jnp.repeat(x, draws, axis=0), arrays)
    arrays = SamplingArrays(
        **{
            **arrays.__dict__,
            "seed": jnp.stack([jnp.zeros(draws, jnp.uint32), jnp.arange(draws, dtype=jnp.uint32)], axis=1),
        }
    )
    logits = jnp.broadcast_to(jnp.asarray(TINY_LOGITS), (draws, len(TINY_LOGITS)))
    out = _sample_step(logits, arrays, PenaltyState.zeros(draws, len(TINY_LOGITS)))
    counts = np.bincount(np.asarray(out.tokens), minlength=len(TINY_LOGITS))
    assert counts[expected == 0].sum() == 0, f"drew disallowed tokens: {counts} vs {expected}"
    allowed = expected > 0
    expected_counts = expected[allowed] * draws
    statistic = float(np.sum((counts[allowed] - expected_counts) ** 2 / expected_counts))
    dof = int(allowed.sum()) - 1
    if dof > 0:
        p_value = float(jax.scipy.stats.chi2.sf(statistic, dof))
        assert p_value > 1e-3, f"{case}: counts {counts}, expected {np.round(expected_counts)}"


@pytest.mark.parametrize("search_bits", [1, 2, 4, 8])
def test_exact_truncation_matches_a_sort_based_reference(search_bits):
    """The threshold search keeps exactly the tokens a full sort keeps, including duplicate logits."""
    rng = np.random.default_rng(0)
    vocab = 4096
    logits = rng.normal(size=(6, vocab)).astype(np.float32) * 2
    logits[:, :50] = np.round(logits[:, :50])  # many exact ties
    logits[:, 100] = -np.inf  # a masked token
    params = [
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=0.7, top_k=300),
        SamplingParams(temperature=1.0, top_p=0.9),
        SamplingParams(temperature=2.0, top_p=0.5, top_k=2000),
        SamplingParams(temperature=0.5, min_p=0.01, top_p=0.99),
        SamplingParams(temperature=1.0, top_k=4096, top_p=1.0),
    ]
    truncate = jax.jit(lambda l, a: truncated_logits(l, a, search_bits=search_bits))
    final = np.asarray(truncate(jnp.asarray(logits), _arrays(params)))
    for row, p in enumerate(params):
        expected_keep = _reference_distribution(logits[row], p) > 0
        np.testing.assert_array_equal(np.isfinite(final[row]), expected_keep, err_msg=f"row {row}: {p}")


# ---------------------------------------------------------------------------------------------
# Penalties, bias, min_tokens, mask


def test_penalties_change_logits_as_openai_and_hf_define_them():
    logits = np.array([[2.0, -1.0, 0.5, -0.5, 3.0, 0.0]], np.float32)
    prompt = jnp.array([[0, 1, -1, -1]], jnp.int32)  # seen in the prompt only: tokens 0 and 1
    output = jnp.array([[2, 2, 3, -1]], jnp.int32)  # generated: token 2 twice, token 3 once
    state = set_penalty_rows(PenaltyState.zeros(1, 6), jnp.array([0]), prompt, output)
    p = SamplingParams(repetition_penalty=2.0, presence_penalty=0.3, frequency_penalty=0.25)
    got = np.asarray(process_logits(jnp.asarray(logits), _arrays([p]), state))[0]
    expected = np.array(
        [
            2.0 / 2.0,  # prompt token, positive logit: divided (HF/CTRL)
            -1.0 * 2.0,  # prompt token, negative logit: multiplied
            0.5 / 2.0 - 0.25 * 2 - 0.3,  # output token twice: repetition, then frequency x2 and presence once
            -0.5 * 2.0 - 0.25 * 1 - 0.3,
            3.0,  # never seen: unchanged
            0.0,
        ]
    )
    np.testing.assert_allclose(got, expected, rtol=1e-6)
    assert int(state.num_generated[0]) == 3


def test_update_penalty_state_counts_only_active_rows():
    state = PenaltyState.zeros(2, 8)
    for token in (3, 3, 5):
        state = update_penalty_state(state, jnp.array([token, token]), jnp.array([True, False]))
    np.testing.assert_array_equal(np.asarray(state.output_counts[0]), [0, 0, 0, 2, 0, 1, 0, 0])
    assert np.asarray(state.seen[0]).tolist() == [i in (3, 5) for i in range(8)]
    assert not np.asarray(state.seen[1]).any() and not np.asarray(state.output_counts[1]).any()
    np.testing.assert_array_equal(np.asarray(state.num_generated), [3, 0])


def test_logit_bias_is_added_and_can_force_or_ban_a_token():
    logits = jax.random.normal(jax.random.key(1), (2, VOCAB))
    best = int(jnp.argmax(logits[0]))
    params = [
        SamplingParams(logit_bias=((17, 100.0),)),
        SamplingParams(logit_bias=((best, -100.0), (3, 0.5))),
    ]
    arrays = _arrays(params, max_logit_bias=4)
    state = PenaltyState.zeros(2, VOCAB)
    processed = np.asarray(process_logits(logits, arrays, state))
    expected = np.asarray(logits).copy()
    expected[0, 17] += 100.0
    expected[1, best] -= 100.0
    expected[1, 3] += 0.5
    np.testing.assert_allclose(processed, expected, rtol=1e-6)
    tokens = np.asarray(_sample_step(jnp.stack([logits[0], logits[0]]), arrays, state).tokens)
    assert tokens[0] == 17 and tokens[1] != best


def test_min_tokens_suppresses_stop_and_eos_tokens_until_reached():
    logits = jnp.zeros((3, 8)).at[:, 2].set(5.0).at[:, 6].set(4.0)  # 2 is EOS, 6 a stop id
    params = [
        SamplingParams(min_tokens=2, stop_token_ids=(6,)),
        SamplingParams(min_tokens=2, ignore_eos=True),
        SamplingParams(stop_token_ids=(6,)),
    ]
    arrays = _arrays(params, eos_token_ids=(2,), max_stop_ids=4)
    state = PenaltyState.zeros(3, 8)
    first = np.asarray(_sample_step(logits, arrays, state).tokens)
    assert first[0] not in (2, 6)
    assert first[1] == 2  # ignore_eos: EOS is an ordinary token, not suppressed
    assert first[2] == 2
    state = update_penalty_state(state, jnp.array([0, 0, 0]), jnp.ones(3, bool))
    state = update_penalty_state(state, jnp.array([0, 0, 0]), jnp.ones(3, bool))
    later = _sample_step(logits, arrays, state).tokens
    assert int(later[0]) == 2
    np.testing.assert_array_equal(
        np.asarray(stop_token_hit(arrays, jnp.array([6, 2, 6]))), [True, False, True]
    )


def test_mask_restricts_greedy_and_sampled_rows_and_packed_bits_mean_the_same():
    logits = jax.random.normal(jax.random.key(2), (3, VOCAB))
    allowed = np.zeros((3, VOCAB), bool)
    allowed[0, [3, 9, 40]] = True
    allowed[1, [1, 2, 33, 63]] = True
    allowed[2, :] = True  # a row without a constraint
    packed = np.packbits(allowed, axis=1, bitorder="little").view(np.uint32)
    np.testing.assert_array_equal(np.asarray(unpack_token_mask(jnp.asarray(packed), VOCAB)), allowed)
    np.testing.assert_array_equal(
        np.asarray(unpack_token_mask(jnp.asarray(packed.view(np.int32)), VOCAB)), allowed
    )
    params = [SamplingParams(), SamplingParams(temperature=1.5), SamplingParams()]
    for seed in range(20):
        arrays = _arrays(params, [seed] * 3)
        state = PenaltyState.zeros(3, VOCAB)
        with_bool = np.asarray(_sample_step(logits, arrays, state, jnp.asarray(allowed)).tokens)
        with_bits = np.asarray(_sample_step(logits, arrays, state, jnp.asarray(packed)).tokens)
        np.testing.assert_array_equal(with_bool, with_bits)
        assert allowed[np.arange(3), with_bool].all()
    expected_greedy = np.argmax(np.where(allowed[0], np.asarray(logits[0]), -np.inf))
    assert with_bool[0] == expected_greedy
    assert with_bool[2] == np.argmax(np.asarray(logits[2]))


def test_the_unmasked_choice_is_the_free_sample_and_where_allowed_the_masked_one():
    # What a constrained split step tells the check way's chooser: the token each row would take
    # unmasked is the free sample (same keys, penalties, bias), and equals the masked sample
    # exactly when the mask allows it (Gumbel-max: the free argmax, if allowed, is the masked one).
    # Asking for it changes nothing of the masked sample.
    logits = jax.random.normal(jax.random.key(3), (4, VOCAB)) * 2
    params = [SamplingParams(), SamplingParams(temperature=0.7, presence_penalty=0.5),
              SamplingParams(temperature=1.3, logit_bias=((5, 4.0),)), SamplingParams(temperature=1.0)]  # fmt: skip
    state = update_penalty_state(PenaltyState.zeros(4, VOCAB), jnp.array([1, 2, 3, 4]), jnp.ones(4, bool))

    @jax.jit
    def with_unmasked(logits, arrays, state, mask):
        keys = row_keys(arrays, state.num_generated)
        return sample(logits, arrays, state, keys, mask, num_top_logprobs=4, with_unmasked=True)

    agreed = refused = 0
    for seed in range(24):
        arrays = _arrays(params, [seed] * 4)
        free = np.asarray(_sample_step(logits, arrays, state).tokens)
        allowed = np.asarray(jax.random.bernoulli(jax.random.key(100 + seed), 0.5, (4, VOCAB)))
        packed = jnp.asarray(np.packbits(allowed, axis=1, bitorder="little").view(np.int32))
        masked = _sample_step(logits, arrays, state, packed)
        out = with_unmasked(logits, arrays, state, packed)
        np.testing.assert_array_equal(np.asarray(out.unmasked), free)
        for name in ("tokens", "logprobs", "top_ids", "top_logprobs"):
            np.testing.assert_array_equal(np.asarray(getattr(out, name)), np.asarray(getattr(masked, name)))
        kept = allowed[np.arange(4), free]
        np.testing.assert_array_equal(np.asarray(masked.tokens) == free, kept)
        agreed, refused = agreed + kept.sum(), refused + (~kept).sum()
    assert agreed > 10 and refused > 10  # both cases were seen
    greedy = _arrays([SamplingParams()] * 4)  # the all-greedy branch
    out = with_unmasked(logits, greedy, state, packed)
    expected = _sample_step(logits, greedy, state).tokens
    np.testing.assert_array_equal(np.asarray(out.unmasked), np.asarray(expected))


# ---------------------------------------------------------------------------------------------
# Logprobs


def test_raw_logprobs_are_the_models_normalised_distribution():
    logits = jax.random.normal(jax.random.key(3), (4, 16)) * 2
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.5, top_k=2),
        SamplingParams(temperature=1.0),
        SamplingParams(repetition_penalty=1.5),
    ]
    arrays = _arrays(params)
    state = PenaltyState.zeros(4, 16)
    out = jax.jit(lambda l, a, s: sample(l, a, s, row_keys(a, s.num_generated), num_top_logprobs=16))(
        logits, arrays, state
    )
    reference = np.asarray(jax.nn.log_softmax(logits, axis=1))
    np.testing.assert_allclose(np.exp(np.asarray(out.top_logprobs)).sum(axis=1), 1.0, rtol=1e-5)
    np.testing.assert_allclose(
        np.asarray(out.logprobs), reference[np.arange(4), np.asarray(out.tokens)], rtol=1e-6
    )
    top = np.asarray(out.top_logprobs)
    assert (np.diff(top, axis=1) <= 0).all(), "alternatives come most likely first"
    np.testing.assert_allclose(top, np.take_along_axis(reference, np.asarray(out.top_ids), axis=1), rtol=1e-6)


def test_processed_logprobs_describe_the_distribution_sampled_from():
    logits = jnp.asarray(np.tile(TINY_LOGITS, (2, 1)))
    params = [SamplingParams(temperature=0.8, top_k=3), SamplingParams()]
    arrays = _arrays(params)
    state = PenaltyState.zeros(2, len(TINY_LOGITS))
    out = jax.jit(
        lambda l, a, s: sample(
            l, a, s, row_keys(a, s.num_generated), num_top_logprobs=4, logprobs_mode="processed"
        )
    )(logits, arrays, state)
    np.testing.assert_allclose(
        np.exp(np.asarray(out.top_logprobs[0])),
        np.sort(_reference_distribution(TINY_LOGITS, params[0]))[::-1][:4],
        atol=1e-6,
    )
    np.testing.assert_allclose(
        np.asarray(out.logprobs[1]), np.asarray(jax.nn.log_softmax(logits[1]))[0], rtol=1e-6
    )
    with pytest.raises(ValueError, match="logprobs_mode"):
        sample(logits, arrays, state, row_keys(arrays, state.num_generated), logprobs_mode="final")


# ---------------------------------------------------------------------------------------------
# Building the arrays


def test_new_settings_of_the_same_batch_size_do_not_recompile():
    traces = []

    @jax.jit
    def step(logits, arrays, state):
        traces.append(1)
        return sample(logits, arrays, state, row_keys(arrays, state.num_generated))

    logits = jnp.zeros((4, VOCAB))
    state = PenaltyState.zeros(4, VOCAB)
    step(logits, _arrays([SamplingParams()], batch_size=4), state)
    step(
        logits,
        _arrays(
            [
                SamplingParams(temperature=0.5, top_k=3, logit_bias=((1, 2.0),)),
                None,
                SamplingParams(top_p=0.3, temperature=1.0),
            ],
            [1, None, 5],
            batch_size=4,
        ),
        state,
    )
    assert len(traces) == 1


# ---------------------------------------------------------------------------------------------
# Plans: the branches chosen on the host

PLAN_ROWS = {
    "greedy": [SamplingParams(), None, SamplingParams(repetition_penalty=1.3)],
    "temperature only": [SamplingParams(temperature=0.8), SamplingParams(), None],
    "mixed": [
        SamplingParams(temperature=1.1, top_k=7, top_p=0.85, min_p=0.05),
        SamplingParams(),
        SamplingParams(temperature=0.6, top_p=0.3),
        SamplingParams(temperature=1.0, top_k=2),
    ],
}


def _plans_covering(params) -> list[SamplingPlan]:
    """Every plan that covers these rows (each branch the rows need, any others too)."""
    need = SamplingPlan.covering(params)
    flags = [(d, k, p) for d in (False, True) for k in (False, True) for p in (False, True)]
    return [
        SamplingPlan(d, k, p)
        for d, k, p in flags
        if d >= need.draws and k >= need.top_k and p >= need.top_p and (d or not (k or p))
    ]


@pytest.mark.parametrize("rows", sorted(PLAN_ROWS))
def test_a_plan_that_covers_the_rows_samples_what_the_device_branches_sample(rows):
    """Tokens, logprobs (raw and processed) and top alternatives under every plan that covers the
    rows equal those of the branches chosen on the device, bit for bit."""
    params = PLAN_ROWS[rows]
    arrays = _arrays(params)
    state = PenaltyState.zeros(len(params), VOCAB)
    logits = jax.random.normal(jax.random.key(3), (len(params), VOCAB)) * 2
    plans = _plans_covering(params)

    @jax.jit
    def run(logits, arrays, state):
        keys = row_keys(arrays, state.num_generated)
        return {
            mode: [
                sample(logits, arrays, state, keys, num_top_logprobs=3, logprobs_mode=mode, plan=plan)
                for plan in [None, *plans]
            ]
            for mode in ("raw", "processed")
        }

    for mode, (device, *planned) in run(logits, arrays, state).items():
        for plan, out in zip(plans, planned):
            for name in ("tokens", "logprobs", "top_ids", "top_logprobs"):
                got, want = np.asarray(getattr(out, name)), np.asarray(getattr(device, name))
                np.testing.assert_array_equal(got, want, err_msg=f"{mode} {plan} {name}")


def test_plans_cover_the_rows_they_are_made_for():
    assert SamplingPlan.covering(PLAN_ROWS["greedy"]) == GREEDY_PLAN
    assert SamplingPlan.covering(PLAN_ROWS["temperature only"]) == SamplingPlan(True, False, False)
    assert SamplingPlan.covering(PLAN_ROWS["mixed"][2:]) == SamplingPlan(True, True, True)
    assert SamplingPlan.covering(PLAN_ROWS["mixed"][1:3]) == SamplingPlan(True, False, True)
    assert SamplingPlan.covering(PLAN_ROWS["mixed"][3:]) == SamplingPlan(True, True, False)
    assert SamplingPlan.covering(PLAN_ROWS["mixed"]) == ANY_PLAN
    # a greedy row's top_k / top_p are never used: it takes the argmax
    assert SamplingPlan.covering([SamplingParams(top_k=3, top_p=0.5)]) == GREEDY_PLAN
    # the engine keeps two plans, so warm-up compiles every plan it will use
    assert engine_plan(PLAN_ROWS["greedy"]) == GREEDY_PLAN
    assert engine_plan([None, None]) == GREEDY_PLAN
    assert {engine_plan(PLAN_ROWS[r]) for r in PLAN_ROWS if r != "greedy"} == {ANY_PLAN}
    # top alternatives make programs of their own (either plan); a token's own logprob alone
    # needs no top-k
    assert engine_plan([SamplingParams(logprobs=2), None]) == GREEDY_PLAN
    assert wants_top([None, SamplingParams(), SamplingParams(logprobs=3)])
    assert not wants_top([None, SamplingParams(), SamplingParams(logprobs=0)])


def _branches(plan) -> int:
    """Data-dependent branches (stablehlo case / if) in the lowered sample of a mixed batch."""
    arrays = _arrays(PLAN_ROWS["mixed"])
    state = PenaltyState.zeros(4, VOCAB)
    keys = row_keys(arrays, state.num_generated)
    step = jax.jit(lambda logits: sample(logits, arrays, state, keys, plan=plan))
    text = step.lower(jnp.zeros((4, VOCAB))).as_text()
    return text.count("stablehlo.case") + text.count("stablehlo.if")


def test_a_plan_leaves_no_branch_for_the_device_to_choose():
    """The point of a plan: XLA's GPU runtime makes the host wait for the device at every
    data-dependent branch; a planned sample has none (three without a plan)."""
    assert _branches(None) == 3
    assert _branches(ANY_PLAN) == 0
    assert _branches(GREEDY_PLAN) == 0


def test_build_rejects_what_does_not_fit_and_unresolved_seeds():
    with pytest.raises(ValueError, match="logit_bias"):
        _arrays([SamplingParams(logit_bias=tuple((i, 1.0) for i in range(5)))], max_logit_bias=4)
    with pytest.raises(ValueError, match="must be >= 0"):
        _arrays([SamplingParams(logit_bias=((-1, 1.0),))])
    with pytest.raises(ValueError, match="stop token ids"):
        _arrays([SamplingParams(stop_token_ids=(1, 2, 3))], eos_token_ids=(4, 5), max_stop_ids=4)
    with pytest.raises(ValueError, match="resolve_seed"):
        SamplingArrays.build([SamplingParams(temperature=1.0)], [None], 1)
    with pytest.raises(ValueError, match="batch_size"):
        SamplingArrays.build([SamplingParams()] * 3, [1, 2, 3], 2)


@pytest.mark.parametrize("k", [0, 5, 16, 17, 20, 40])
def test_top_alternatives_in_passes_equal_one_top_k(k):
    """Top alternatives past 16 come in passes of XLA's TopK kernel (one top-k of 20 is a sort of
    the vocabulary on a GPU): the same values and ids as lax.top_k, ties (lower id first) and
    masked (-inf) tokens included, even where fewer than k tokens are finite."""
    rng = np.random.default_rng(k)
    logits = rng.normal(size=(3, 300)).astype(np.float32)
    logits[0, ::7] = logits[0, 3]  # ties
    logits[1, rng.choice(300, 280, replace=False)] = -np.inf  # 20 finite tokens
    logits[2, 10:] = -np.inf  # 10 finite tokens: the rest of the top k are -inf ties
    log_probs = jax.nn.log_softmax(jnp.asarray(logits), axis=1)
    values, ids = top_alternatives(log_probs, k)
    want_values, want_ids = jax.lax.top_k(log_probs, k)
    assert ids.dtype == jnp.int32 and ids.shape == (3, k)
    np.testing.assert_array_equal(np.asarray(ids), np.asarray(want_ids))
    np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values))


def test_the_search_width_is_4_bits_a_pass_on_accelerators_at_few_rows_and_1_elsewhere(monkeypatch):
    """The threshold searches settle 4 bits a pass where each pass is a launch (accelerators, up to
    WIDE_SEARCH_MAX_ROWS rows: a quarter of the launches of a sampled decode step's searches) and 1
    on the CPU and on larger batches, where the 15 comparisons a key are the cost; a width can be
    forced for a block (or INFERNIX_SEARCH_BITS), whatever the rows."""
    assert search_width_mode() == "auto" and search_bits_for_backend() == 1
    with search_width("8"):
        assert search_bits_for_backend() == 8 and search_bits_for_backend(64) == 8
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert search_bits_for_backend() == 4 and search_bits_for_backend(WIDE_SEARCH_MAX_ROWS) == 4
    assert search_bits_for_backend(WIDE_SEARCH_MAX_ROWS + 1) == 1 and search_bits_for_backend(8) == 1
    with pytest.raises(ValueError, match="search bits"), search_width("3"):
        pass
