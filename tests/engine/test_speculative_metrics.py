"""/metrics exports the speculative-decoding counters the engine reports in EngineStats."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from infernix_jax.api.metrics import ServerMetrics
from infernix_jax.engine.protocol import EngineStats


def scrape(stats: EngineStats) -> dict[str, float]:
    text = ServerMetrics().render(stats).decode()
    return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples}


def test_speculation_counters_are_exported():
    samples = scrape(
        EngineStats(
            spec_verify_steps=10,
            spec_rows=25,
            spec_drafted_tokens=90,
            spec_accepted_tokens=40,
            spec_forced_draft_tokens=12,
            structured_forced_tokens=30,
        )
    )
    assert samples["infernix_spec_decode_verify_steps"] == 10
    assert samples["infernix_spec_decode_verified_rows"] == 25
    assert samples["infernix_spec_decode_draft_tokens"] == 90
    assert samples["infernix_spec_decode_accepted_tokens"] == 40
    assert samples["infernix_spec_decode_forced_draft_tokens"] == 12
    assert samples["infernix_structured_forced_tokens"] == 30
    assert samples["infernix_spec_decode_mean_accepted_length"] == (40 + 25) / 25


def test_without_speculation_the_counters_read_zero():
    samples = scrape(EngineStats())
    assert samples["infernix_spec_decode_draft_tokens"] == 0
    assert samples["infernix_spec_decode_mean_accepted_length"] == 0
