"""/metrics exports the expert cache's figures (hit rate per tier, bytes per token, occupancy) when
experts live beyond device memory, and nothing of them otherwise."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from infernix_jax.api.metrics import ServerMetrics
from infernix_jax.engine.protocol import EngineStats
from infernix_jax.experts.cache import ExpertCacheReport


def scrape(stats: EngineStats) -> dict[tuple[str, tuple], float]:
    text = ServerMetrics().render(stats).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_expert_cache_figures_are_exported():
    report = ExpertCacheReport(
        lookups=200,
        hits={"gpu": 150, "host": 40, "disk": 10},
        moved_bytes={"fetched": 50 * 1000, "promoted": 5 * 1000, "demoted": 3 * 1000},
        read_failures=1,
        slots_used=60,
        slots_total=64,
        host_experts=300,
        tokens=110,
        cpu_computed=20,
    )
    samples = scrape(EngineStats(experts=report))
    assert samples[("infernix_expert_lookups", ())] == 200
    assert samples[("infernix_expert_hits", (("tier", "host"),))] == 40
    assert samples[("infernix_expert_hit_rate", (("tier", "gpu"),))] == pytest.approx(0.75)
    assert samples[("infernix_expert_hit_rate", (("tier", "disk"),))] == pytest.approx(0.05)
    assert samples[("infernix_expert_moved_bytes", (("kind", "demoted"),))] == 3000
    assert samples[("infernix_expert_pcie_bytes_per_token", ())] == pytest.approx(55_000 / 110)
    assert samples[("infernix_expert_slots_used", ())] == 60
    assert samples[("infernix_expert_slots_total", ())] == 64
    assert samples[("infernix_expert_host_experts", ())] == 300
    assert samples[("infernix_expert_read_failures", ())] == 1
    assert samples[("infernix_expert_cpu_computed", ())] == 20
    assert samples[("infernix_expert_cpu_share", ())] == pytest.approx(20 / 50)  # of the host and disk hits


def test_without_offloaded_experts_no_tier_is_reported():
    samples = scrape(EngineStats())
    assert not any(name == "infernix_expert_hits" for name, _ in samples)
    assert samples[("infernix_expert_lookups", ())] == 0
