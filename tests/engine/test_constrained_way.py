"""`ConstrainedWayChooser`: check or split, by the seconds per token each took lately."""

from __future__ import annotations

import pytest

from infernix_jax.engine.constrained_way import CHECK, SPLIT, ConstrainedWayChooser


def run(
    chooser: ConstrainedWayChooser, batch: int, seconds: dict[str, float], steps: int, tokens=None
) -> list[str]:
    """`steps` steps, each way taking its fixed seconds for its tokens (default 1); the ways chosen."""
    ways = []
    for _ in range(steps):
        way = chooser.choose(batch)
        chooser.record(batch, way, seconds[way], tokens=(tokens or {}).get(way, 1))
        ways.append(way)
    return ways


def test_it_tries_check_then_split_then_keeps_the_faster():
    chooser = ConstrainedWayChooser(retry_steps=8)
    ways = run(chooser, 1, {CHECK: 1.0, SPLIT: 3.0}, 10)
    assert ways[:2] == [CHECK, SPLIT]
    assert ways[2:10] == [CHECK] * 8  # split is retried only after 8 steps
    assert chooser.best(1) == CHECK


def test_a_losing_retry_waits_twice_as_long_each_time():
    # A model that leaves its grammar (random weights): check loses, and is retried after 8, 16,
    # 32 ... steps, so it costs few steps over a long run.
    chooser = ConstrainedWayChooser(retry_steps=8, max_retry_steps=64)
    ways = run(chooser, 1, {CHECK: 9.0, SPLIT: 1.0}, 400)
    checks = [i for i, way in enumerate(ways) if way == CHECK]
    assert checks[:5] == [0, 9, 26, 59, 124]  # the gaps grow 8, 16, 32, 64 split steps
    assert checks[5] - checks[4] == 65  # capped at max_retry_steps
    assert chooser.chosen[CHECK] == len(checks) == 9  # of 400 steps


def test_a_winning_retry_takes_over_at_once():
    chooser = ConstrainedWayChooser(retry_steps=4)
    run(chooser, 1, {CHECK: 9.0, SPLIT: 1.0}, 6)  # check keeps one token a step
    assert chooser.best(1) == SPLIT
    # the workload changes: the model now keeps to its grammar, 8 tokens a check step
    ways = run(chooser, 1, {CHECK: 4.0, SPLIT: 1.0}, 16, tokens={CHECK: 8})
    first = ways.index(CHECK)  # the next retry (check's stale sums shrink first)
    assert first <= 8 and ways[first : first + 4] == [CHECK] * 4  # then split's own retry
    assert chooser.best(1) == CHECK


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
