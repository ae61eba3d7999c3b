"""The prefix-cache replay benchmark: its figures are what its per-request log says, and the cache
changes no greedy output.

One quick replay of the tiny hybrid MoE fixture (two coding sessions with subagents, retries, aborts and
compactions in a 1024-token context), run once for the module.
"""

from __future__ import annotations

import pytest

from bench.prefix_replay import KINDS, main
from bench.record import read_records
from tests.conftest import HF_FIXTURES


@pytest.fixture(scope="module")
def replay(tmp_path_factory):
    out = tmp_path_factory.mktemp("replay") / "prefix-replay.json"
    main(["--quick", "--model", str(HF_FIXTURES / "qwen3_next"), "--seeds", "1", "--out", str(out)])
    share, ttft = read_records(out)
    return share, ttft


def test_the_reported_share_is_cached_over_prompt_tokens_of_the_requests(replay):
    share, _ = replay
    log = share["details"]["requests_log"]
    prompt = sum(r["prompt_tokens"] for r in log)
    cached = sum(r["cached_tokens"] for r in log)
    assert cached > 0 and share["figure"] == pytest.approx(100 * cached / prompt)
    assert share["details"]["requests"] == len(log)
    # The engine's own counters agree with what the requests reported.
    engine = share["details"]["engine_prefix_cache_stats"]
    assert (engine["query_tokens"], engine["hit_tokens"]) == (prompt, cached)
    assert engine["hit_rate"] == pytest.approx(cached / prompt)
    # The ceiling is the share of prompt tokens computed before (no cache can serve more).
    reusable = sum(r["reusable_tokens"] for r in log)
    assert share["ceiling"] == pytest.approx(100 * reusable / prompt)
    assert all(r["cached_tokens"] <= r["reusable_tokens"] for r in log)


def test_the_replay_exercises_every_kind_of_request(replay):
    share, _ = replay
    log = share["details"]["requests_log"]
    assert {r["kind"] for r in log} == set(KINDS)
    assert any(r["finish_reason"] == "abort" for r in log)
    # A resent prompt is served from cache up to its last token.
    retries = [r for r in log if r["kind"] == "retry"]
    assert all(r["cached_tokens"] == r["prompt_tokens"] - 1 for r in retries)


def test_greedy_outputs_are_the_same_with_the_cache_on_and_off(replay):
    share, _ = replay
    outputs = share["details"]["outputs"]
    assert outputs["greedy_compared"] >= 1
    assert outputs["greedy_equal"] == outputs["greedy_compared"]
    # float32 on the CPU: no reply parts from its cache-off twin, not even sampled ones
    compared = outputs["greedy_compared"] + outputs["sampled_compared"]
    assert outputs["first_token_equal"] == compared and outputs["differing"] == 0
    assert outputs["median_tokens_equal_before_first_difference"] is None


def test_time_to_first_token_is_reported_for_both_runs(replay):
    share, ttft = replay
    assert all(r["ttft_s"] > 0 and r["ttft_off_s"] > 0 for r in share["details"]["requests_log"])
    on, off = ttft["details"]["ttft_cache_on"], ttft["details"]["ttft_cache_off"]
    assert ttft["figure"] == on["median_s"] and ttft["fraction"] == pytest.approx(
        off["median_s"] / on["median_s"]
    )
    assert on["median_s"] <= on["p90_s"]


def test_a_dry_run_measures_the_workload_without_a_model():
    shape = main(["--dry-run", "--quick", "--seeds", "2"])["dry_run"]
    kinds = shape["by_kind"]
    assert sum(k["requests"] for k in kinds.values()) == shape["requests"]
    assert sum(k["prompt_tokens"] for k in kinds.values()) == shape["prompt_tokens"]
    assert all(0.0 <= k["reusable_share"] < 1.0 for k in kinds.values())
    # a resent prompt can reuse everything but its last token; a first session's first prompt nothing
    assert kinds["retry"]["reusable_share"] > 0.99
    assert 0.0 < shape["reusable_share"] < 1.0
