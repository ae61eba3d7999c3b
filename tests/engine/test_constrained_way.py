"""`ConstrainedWayChooser`: check or split, by the seconds per token each took lately and how
often the model's free choice was one its grammar allows."""

from __future__ import annotations

import itertools

import pytest

from infernix_jax.engine.constrained_way import CHECK, SPLIT, ConstrainedWayChooser, tokens_per_check


def run(
    chooser: ConstrainedWayChooser,
    batch: int,
    seconds: dict[str, float],
    steps: int,
    tokens=None,
    judged=None,
) -> list[str]:
    """`steps` steps, each way taking its fixed seconds for its tokens (default 1) and reporting
    its (kept, judged) free choices (default: each of its tokens judged and kept); the ways
    chosen."""
    ways = []
    for _ in range(steps):
        way = chooser.choose(batch)
        n = (tokens or {}).get(way, 1)
        kept, seen = (judged or {}).get(way, (n, n))
        chooser.record(batch, way, seconds[way], n, kept, seen)
        ways.append(way)
    return ways


def test_split_first_then_check_once_the_model_keeps_to_its_grammar():
    chooser = ConstrainedWayChooser(retry_steps=8)
    ways = run(chooser, 1, {CHECK: 4.0, SPLIT: 3.0}, 10, tokens={CHECK: 8})
    assert ways[:2] == [SPLIT, CHECK]  # split's free choice was allowed: check is worth a try
    assert ways[2:9] == [CHECK] * 7  # split is retried only after 8 steps
    assert chooser.best(1) == CHECK


def test_a_model_that_leaves_its_grammar_never_pays_for_a_check_dispatch():
    # A random-weight model: its free choice is almost never allowed, which split's steps show.
    chooser = ConstrainedWayChooser()
    ways = run(chooser, 1, {CHECK: 9.0, SPLIT: 1.0}, 400, judged={SPLIT: (0, 1)})
    assert ways == [SPLIT] * 400
    assert chooser.keep_share(1) < 0.2 and chooser.chosen[CHECK] == 0


def test_check_is_tried_when_the_keep_share_rises():
    chooser = ConstrainedWayChooser()
    ways = run(chooser, 4, {CHECK: 4.0, SPLIT: 1.0}, 20, judged={SPLIT: (1, 4)})
    assert CHECK not in ways
    ways = run(chooser, 4, {CHECK: 4.0, SPLIT: 1.0}, 20, judged={SPLIT: (4, 4)})
    assert CHECK in ways[:6]


def test_a_losing_retry_waits_twice_as_long_each_time():
    # A model that keeps to its grammar: check (8 tokens for 4 s) beats split (1 token a second),
    # whose retries come after 8, 16, 32 ... check steps, so they cost few steps over a long run.
    chooser = ConstrainedWayChooser(retry_steps=8, max_retry_steps=64)
    ways = run(chooser, 1, {CHECK: 4.0, SPLIT: 1.0}, 400, tokens={CHECK: 8})
    splits = [i for i, way in enumerate(ways) if way == SPLIT]
    gaps = [b - a - 1 for a, b in itertools.pairwise(splits)]  # check steps between two retries
    assert splits[0] == 0 and gaps[:6] == [8, 16, 32, 64, 64, 64]  # capped at max_retry_steps
    assert len(splits) <= 9  # of 400 steps


def test_a_check_that_loses_at_the_same_keep_share_waits_for_the_longest_interval():
    # The model keeps to its grammar, yet a check dispatch costs more than its 8 tokens save
    # (9 s against split's 1 s a token): at an unchanged share the prediction says it loses, so it
    # is tried again only every `max_retry_steps` steps.
    chooser = ConstrainedWayChooser(retry_steps=8, max_retry_steps=64)
    ways = run(chooser, 1, {CHECK: 9.0, SPLIT: 1.0}, 400, tokens={CHECK: 8})
    checks = [i for i, way in enumerate(ways) if way == CHECK]
    gaps = [b - a - 1 for a, b in itertools.pairwise(checks)]
    assert checks[0] == 1 and gaps[:5] == [64] * 5


def test_check_is_not_retried_while_its_prediction_loses():
    # Check was measured at the keep share it would meet again: 1 token per 4 s against split's
    # 1 token per second. The retry schedule comes due, the prediction says no.
    chooser = ConstrainedWayChooser(retry_steps=4)
    run(chooser, 1, {CHECK: 4.0, SPLIT: 1.0}, 2)  # split, then check (first try at share 2/3)
    assert chooser.chosen == {CHECK: 1, SPLIT: 1}
    ways = run(chooser, 1, {CHECK: 4.0, SPLIT: 1.0}, 200, judged={SPLIT: (1, 2), CHECK: (1, 2)})
    assert CHECK not in ways
    assert chooser.predicted_check(1) > chooser.seconds_per_token(1, SPLIT)


def test_a_winning_retry_takes_over_at_once():
    chooser = ConstrainedWayChooser(retry_steps=4)
    run(chooser, 1, {CHECK: 3.0, SPLIT: 1.0}, 1)  # split: its one choice was allowed
    # the model leaves its grammar: check (tried once) keeps nothing, split's choices are refused
    run(chooser, 1, {CHECK: 3.0, SPLIT: 1.0}, 20, judged={CHECK: (0, 3), SPLIT: (0, 1)})
    assert chooser.best(1) == SPLIT and chooser.chosen[CHECK] == 1
    # the workload changes: the model now keeps to its grammar, 8 tokens a check step
    ways = run(chooser, 1, {CHECK: 4.0, SPLIT: 1.0}, 24, tokens={CHECK: 8})
    first = ways.index(CHECK)  # once the keep share predicts a win
    assert first <= 16 and ways[first : first + 4] == [CHECK] * 4  # then split's own retry
    assert chooser.best(1) == CHECK


def test_tokens_per_check_dispatch():
    assert tokens_per_check(0.0, 8) == 1.0  # the refused first position, sampled again
    assert tokens_per_check(1.0, 8) == 8.0
    assert tokens_per_check(0.5, 8) == pytest.approx(2 - 2**-7)
    assert tokens_per_check(0.9, 8) == pytest.approx(sum(0.9**j for j in range(8)))


def test_batch_sizes_are_measured_apart():
    chooser = ConstrainedWayChooser()
    run(chooser, 1, {CHECK: 1.0, SPLIT: 2.0}, 4)
    run(chooser, 8, {CHECK: 2.0, SPLIT: 1.0}, 4)
    assert chooser.best(1) == CHECK and chooser.best(8) == SPLIT


def test_a_slow_step_of_few_tokens_weighs_by_its_tokens():
    # A request's last check step: the model writes on where its grammar ends, so the dispatch
    # yields one token for the price of eight steps. Against steps of 8 tokens at 1 s a token it
    # moves check's rate a little, not past split's.
    chooser = ConstrainedWayChooser()
    chooser.record(1, SPLIT, seconds=9.6, tokens=8)
    for _ in range(10):
        chooser.record(1, CHECK, seconds=8.0, tokens=8)
    chooser.record(1, CHECK, seconds=10.0, tokens=1)
    assert 1.0 < chooser.seconds_per_token(1, CHECK) < chooser.seconds_per_token(1, SPLIT) == 1.2
    assert chooser.best(1) == CHECK


def test_seconds_per_token_not_per_step():
    chooser = ConstrainedWayChooser()
    chooser.record(1, CHECK, seconds=4.0, tokens=8)  # 0.5 s a token
    chooser.record(1, SPLIT, seconds=1.0, tokens=1)
    assert chooser.best(1) == CHECK


def test_bad_settings_and_ways_are_refused():
    with pytest.raises(ValueError):
        ConstrainedWayChooser(retry_steps=0)
    with pytest.raises(ValueError):
        ConstrainedWayChooser(decay=1.0)
    with pytest.raises(ValueError, match="unknown constrained decode way"):
        ConstrainedWayChooser().record(1, "fused", 1.0, 1)
    with pytest.raises(ValueError, match="kept <= judged"):
        ConstrainedWayChooser().record(1, SPLIT, 1.0, 1, kept=2, judged=1)


def test_one_misleading_check_step_does_not_rule_check_out():
    # Check's only step compiled its programs (a minute for one dispatch). The model keeps to its
    # grammar, so check is tried again at the longest interval, wins, and takes over.
    chooser = ConstrainedWayChooser(retry_steps=4, max_retry_steps=32)
    chooser.record(1, SPLIT, 1.0, 1, kept=1, judged=1)
    assert chooser.choose(1) == CHECK
    chooser.record(1, CHECK, 60.0, 8, kept=8, judged=8)
    ways = run(chooser, 1, {CHECK: 2.0, SPLIT: 1.0}, 40, tokens={CHECK: 8})
    assert ways[:32] == [SPLIT] * 32 and ways[32:36] == [CHECK] * 4
    assert chooser.best(1) == CHECK


def test_a_workload_that_leaves_its_grammar_goes_back_to_split():
    chooser = ConstrainedWayChooser()
    run(chooser, 1, {CHECK: 4.0, SPLIT: 1.0}, 40, tokens={CHECK: 8})
    assert chooser.best(1) == CHECK
    # the requests change: each check dispatch now keeps nothing (one token for 4 s)
    judged = {CHECK: (0, 1), SPLIT: (0, 1)}
    ways = run(chooser, 1, {CHECK: 4.0, SPLIT: 1.0}, 20, tokens={CHECK: 1}, judged=judged)
    assert ways[12:] == [SPLIT] * 8 and chooser.best(1) == SPLIT


def test_the_chance_a_row_keeps_a_whole_dispatch_comes_from_measured_evidence_only():
    # Asynchronous check dispatches (core._checks_on) need a row to keep whole dispatches: no
    # evidence is no chance; 8 of 8 kept is certainty; a share of 0.95 over 8 steps is ~0.66.
    chooser = ConstrainedWayChooser(window=8)
    assert chooser.dispatch_keep_chance(1) == 0.0
    chooser.record(1, SPLIT, 1.0, 4, kept=4, judged=4)  # half a dispatch's worth
    assert chooser.dispatch_keep_chance(1) == 0.0
    chooser.record(1, CHECK, 1.0, 8, kept=8, judged=8)
    assert chooser.dispatch_keep_chance(1) == 1.0
    assert chooser.dispatch_keep_chance(4) == 0.0  # batch sizes apart
    chooser.record(4, CHECK, 1.0, 200, kept=190, judged=200)
    assert chooser.dispatch_keep_chance(4) == pytest.approx(0.95**8)
