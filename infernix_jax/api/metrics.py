"""Prometheus metrics for /metrics: requests, tokens, latency, queue depth, KV usage, speculation,
experts beyond device memory.

Each app owns its own registry, so several apps (tests, several servers in a process) never clash.
Gauges that mirror the engine are read from `engine.stats()` at scrape time.
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from infernix_jax.engine.protocol import EngineStats

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServerMetrics:
    """The counters, histograms and gauges of one server."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "infernix_requests", "HTTP requests answered", ["endpoint", "status"], registry=r
        )
        self.prompt_tokens = Counter("infernix_prompt_tokens", "Prompt tokens processed", registry=r)
        self.cached_prompt_tokens = Counter(
            "infernix_cached_prompt_tokens", "Prompt tokens served from the prefix cache", registry=r
        )
        self.generation_tokens = Counter("infernix_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter(
            "infernix_finished_requests", "Generations by finish reason", ["reason"], registry=r
        )
        self.time_to_first_token = Histogram(
            "infernix_time_to_first_token_seconds",
            "From arrival to the first generated token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.inter_token_latency = Histogram(
            "infernix_inter_token_latency_seconds",
            "Mean time between generated tokens, per event",
            buckets=_TOKEN_LATENCY_BUCKETS,
            registry=r,
        )
        self.request_latency = Histogram(
            "infernix_e2e_request_latency_seconds",
            "From arrival to the last token",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.running = Gauge("infernix_requests_running", "Requests being advanced by the engine", registry=r)
        self.waiting = Gauge("infernix_requests_waiting", "Requests queued for admission", registry=r)
        self.kv_blocks_used = Gauge("infernix_kv_blocks_used", "KV-cache blocks in use", registry=r)
        self.kv_blocks_total = Gauge("infernix_kv_blocks_total", "KV-cache blocks in the pool", registry=r)
        self.kv_usage = Gauge(
            "infernix_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use", registry=r
        )
        self.kv_blocks_cached = Gauge(
            "infernix_kv_blocks_cached", "KV blocks held only by the prefix cache (evictable)", registry=r
        )
        # the prefix cache's cumulative figures, mirrored at scrape time
        self.prefix_queries = Gauge(
            "infernix_prefix_cache_queries", "Prompts looked up in the prefix cache", registry=r
        )
        self.prefix_query_tokens = Gauge(
            "infernix_prefix_cache_query_tokens", "Prompt tokens looked up in the prefix cache", registry=r
        )
        self.prefix_hit_tokens = Gauge(
            "infernix_prefix_cache_hit_tokens",
            "Prompt tokens served from the prefix cache, by tier",
            ["tier"],
            registry=r,
        )
        self.prefix_hit_rate = Gauge(
            "infernix_prefix_cache_hit_rate",
            "Share of looked-up prompt tokens served from the cache",
            registry=r,
        )
        self.prefix_evicted = Gauge(
            "infernix_prefix_cache_evicted_to_host",
            "Prefix-cache entries moved from the GPU to host memory",
            registry=r,
        )
        # speculative decoding's cumulative figures (0 without it), mirrored at scrape time
        self.spec_verify_steps = Gauge(
            "infernix_spec_decode_verify_steps", "Speculative verify dispatches", registry=r
        )
        self.spec_rows = Gauge(
            "infernix_spec_decode_verified_rows",
            "Request-steps verified (one per request per dispatch)",
            registry=r,
        )
        self.spec_drafted_tokens = Gauge(
            "infernix_spec_decode_draft_tokens", "Draft tokens (tree nodes) verified", registry=r
        )
        self.spec_accepted_tokens = Gauge(
            "infernix_spec_decode_accepted_tokens", "Draft tokens accepted", registry=r
        )
        self.spec_forced_draft_tokens = Gauge(
            "infernix_spec_decode_forced_draft_tokens",
            "Draft tokens a grammar forced (structured output)",
            registry=r,
        )
        self.structured_forced_tokens = Gauge(
            "infernix_structured_forced_tokens",
            "Output tokens a grammar forced, fed without a sample of their own (structured output)",
            registry=r,
        )
        self.spec_mean_accepted_length = Gauge(
            "infernix_spec_decode_mean_accepted_length",
            "Tokens emitted per request per verify step (accepted drafts + 1)",
            registry=r,
        )

        # experts beyond device memory (absent without an expert budget), mirrored at scrape time
        self.expert_lookups = Gauge(
            "infernix_expert_lookups",
            "Routed experts looked up (per MoE layer and step, each expert once)",
            registry=r,
        )
        self.expert_hits = Gauge(
            "infernix_expert_hits",
            "Expert lookups served, by tier (gpu slot, host RAM, disk)",
            ["tier"],
            registry=r,
        )
        self.expert_hit_rate = Gauge(
            "infernix_expert_hit_rate", "Share of expert lookups served by each tier", ["tier"], registry=r
        )
        self.expert_moved_bytes = Gauge(
            "infernix_expert_moved_bytes",
            "Expert bytes moved: fetched into steps and promoted into slots (host to device), demoted to RAM",
            ["kind"],
            registry=r,
        )
        self.expert_pcie_bytes_per_token = Gauge(
            "infernix_expert_pcie_bytes_per_token",
            "Expert bytes moved host to device per token processed",
            registry=r,
        )
        self.expert_slots_used = Gauge(
            "infernix_expert_slots_used", "Device expert slots holding an expert", registry=r
        )
        self.expert_slots_total = Gauge("infernix_expert_slots_total", "Device expert slots", registry=r)
        self.expert_host_experts = Gauge(
            "infernix_expert_host_experts", "Experts held in host RAM", registry=r
        )
        self.expert_cpu_computed = Gauge(
            "infernix_expert_cpu_computed",
            "Missed experts computed on the host CPU (their outputs crossed, not their weights)",
            registry=r,
        )
        self.expert_cpu_share = Gauge(
            "infernix_expert_cpu_share", "Share of the missed experts computed on the host CPU", registry=r
        )
        self.expert_read_failures = Gauge(
            "infernix_expert_read_failures",
            "Expert reads that failed (their step's requests failed)",
            registry=r,
        )

    def observe_stats(self, stats: EngineStats) -> None:
        self.running.set(stats.running)
        self.waiting.set(stats.waiting)
        self.kv_blocks_used.set(stats.kv_blocks_used)
        self.kv_blocks_total.set(stats.kv_blocks_total)
        self.kv_usage.set(stats.kv_blocks_used / stats.kv_blocks_total if stats.kv_blocks_total else 0.0)
        self.kv_blocks_cached.set(stats.kv_blocks_cached)
        cache = stats.prefix_cache
        if cache is not None:
            self.prefix_queries.set(cache.queries)
            self.prefix_query_tokens.set(cache.query_tokens)
            for tier, tokens in cache.hit_tokens_by_tier.items():
                self.prefix_hit_tokens.labels(tier=tier).set(tokens)
            self.prefix_hit_rate.set(cache.hit_rate)
            self.prefix_evicted.set(cache.evicted_to_host)
        self.spec_verify_steps.set(stats.spec_verify_steps)
        self.spec_rows.set(stats.spec_rows)
        self.spec_drafted_tokens.set(stats.spec_drafted_tokens)
        self.spec_accepted_tokens.set(stats.spec_accepted_tokens)
        self.spec_forced_draft_tokens.set(stats.spec_forced_draft_tokens)
        self.structured_forced_tokens.set(stats.structured_forced_tokens)
        rows = stats.spec_rows
        self.spec_mean_accepted_length.set((stats.spec_accepted_tokens + rows) / rows if rows else 0.0)
        if stats.experts is not None:
            self._observe_experts(stats.experts)

    def _observe_experts(self, report) -> None:
        """report: an ExpertCacheReport."""
        self.expert_lookups.set(report.lookups)
        for tier, hits in report.hits.items():
            self.expert_hits.labels(tier=tier).set(hits)
            self.expert_hit_rate.labels(tier=tier).set(report.hit_rate(tier))
        for kind, moved in report.moved_bytes.items():
            self.expert_moved_bytes.labels(kind=kind).set(moved)
        self.expert_pcie_bytes_per_token.set(report.bytes_per_token)
        self.expert_slots_used.set(report.slots_used)
        self.expert_slots_total.set(report.slots_total)
        self.expert_host_experts.set(report.host_experts)
        self.expert_read_failures.set(report.read_failures)
        self.expert_cpu_computed.set(report.cpu_computed)
        self.expert_cpu_share.set(report.cpu_share)

    def render(self, stats: EngineStats) -> bytes:
        """The Prometheus text exposition, with the engine gauges refreshed first."""
        self.observe_stats(stats)
        return generate_latest(self.registry)
