"""The expert tiers and the replacement policy on their own (no engine): reads, faults, budgets,
swaps, the routing profile and the server flags."""

from __future__ import annotations

import shutil

import jax
import numpy as np
import pytest

from infernix_jax.experts import (
    ExpertCache,
    ExpertReadError,
    ExpertStore,
    RoutingProfile,
    experts_in_budget,
    layout_of,
)
from infernix_jax.experts.offload import ExpertOffload
from infernix_jax.model.mlp import fetch_buckets
from infernix_jax.weights.artifact import Artifact, ArtifactWriter
from tests.experts.tiny_moe import NUM_EXPERTS, tiny_config, tiny_params


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config()
    return cfg, tiny_params(cfg)


@pytest.fixture()
def artifact_dir(model, tmp_path):
    _cfg, params = model
    writer = ArtifactWriter(tmp_path, num_experts=NUM_EXPERTS)
    for i, layer in enumerate(params.layers):
        for name in ("gate_proj", "up_proj", "down_proj"):
            writer.write(f"layers.{i}.moe.{name}", getattr(layer.moe, name))
    writer.finish(recipe="test", source="tiny", with_mtp=False)
    return tmp_path


def as_bytes(a) -> np.ndarray:
    return np.asarray(a).reshape(-1).view(np.uint8)


def expert_of(params, layer: int, expert: int) -> list[np.ndarray]:
    moe = params.layers[layer].moe
    return [np.asarray(a)[expert] for a in jax.tree.leaves((moe.gate_proj, moe.up_proj, moe.down_proj))]


def disk_store(model, artifact_dir) -> ExpertStore:
    cfg, params = model
    layout = layout_of(cfg, params)
    paths = {
        i: tuple(f"layers.{i}.moe.{n}" for n in ("gate_proj", "up_proj", "down_proj"))
        for i in range(cfg.num_layers)
    }
    return ExpertStore(layout, Artifact(artifact_dir), paths)


def test_budgets_count_packed_bytes_per_layer(model):
    cfg, params = model
    layout = layout_of(cfg, params)
    per_expert = sum(np.asarray(a).nbytes for a in jax.tree.leaves(expert_of(params, 0, 0)))
    assert layout.expert_bytes == per_expert
    assert experts_in_budget(7 * per_expert * cfg.num_layers, layout) == 7
    assert experts_in_budget(7 * per_expert * cfg.num_layers - 1, layout) == 6
    assert experts_in_budget("all", layout) == experts_in_budget(None, layout) == NUM_EXPERTS
    assert experts_in_budget(0, layout) == 0
    assert experts_in_budget("1TiB", layout) == NUM_EXPERTS


def test_disk_tier_reads_one_expert_exactly_and_reads_ahead(model, artifact_dir):
    _cfg, params = model
    store = disk_store(model, artifact_dir)
    for got, want in zip(store.read(2, 17), expert_of(params, 2, 17)):
        np.testing.assert_array_equal(as_bytes(got), as_bytes(want))
    store.read_ahead(3, [4, 5])
    got = store.read_many(3, [5, 4, 6])
    for leaves, e in zip(got, (5, 4, 6)):
        for a, b in zip(leaves, expert_of(params, 3, e)):
            np.testing.assert_array_equal(as_bytes(a), as_bytes(b))
    store.close()


def test_a_missing_chunk_on_disk_is_an_expert_read_error(model, artifact_dir):
    store = disk_store(model, artifact_dir)
    shutil.rmtree(artifact_dir / "tensors" / "layers.1.moe.up_proj" / "packed" / "c")
    with pytest.raises(ExpertReadError, match="expert 3 of MoE layer 1: disk read failed"):
        store.read(1, 3)
    store.close()


def test_host_tier_checksum_catches_corruption(model):
    cfg, params = model
    store = ExpertStore(layout_of(cfg, params), verify_host_reads=True)
    store.put_host(0, 5, expert_of(params, 0, 5))
    store.read(0, 5)
    leaves = store._host[(0, 5)][0]
    leaves[0] = leaves[0].copy()
    as_bytes(leaves[0])[3] ^= 1  # a bit flips in RAM
    with pytest.raises(ExpertReadError, match="checksum mismatch"):
        store.read(0, 5)
    store.put_host(0, 6, expert_of(params, 0, 6))
    store.inject_fault(0, 6, "io")
    with pytest.raises(ExpertReadError, match="injected I/O error"):
        store.read(0, 6)
    store.read(0, 6)  # a fault fires once
    with pytest.raises(ExpertReadError, match="no home"):
        store.read(0, 7)


def test_fetch_returns_missed_experts_in_order_and_counts_them(model):
    cfg, params = model
    layout = layout_of(cfg, params)
    store = ExpertStore(layout)
    for e in range(NUM_EXPERTS):
        store.put_host(1, e, expert_of(params, 1, e))
    cache = ExpertCache(layout, store, slots_per_layer=2)
    cache.assign(1, 0, 9)
    counts = np.zeros(NUM_EXPERTS, np.int32)
    counts[[9, 3, 20]] = [2, -1, -1]  # negative: routed, found in no slot
    out = cache.fetch(1, counts, np.array([3, 20, -1, -1], np.int32))
    assert out[0].shape[0] == 4
    for row, e in ((0, 3), (1, 20)):
        for a, b in zip(out, expert_of(params, 1, e)):
            np.testing.assert_array_equal(as_bytes(a[row]), as_bytes(b))
    assert all(not a[2:].any() for a in out)
    s = cache.stats
    assert (s.lookups, s.gpu_hits, s.host_hits, s.disk_hits) == (3, 1, 2, 0)
    assert s.fetched_bytes == 2 * layout.expert_bytes and cache.routing_counts[1, 9] == 2
    assert cache.routing_counts[1, 3] == 1 and cache.last_missed[1] == [3, 20]


def test_a_report_counts_what_its_step_missed_even_after_the_slots_changed(model):
    """A routing report arrives after the step that sent it (host_report): its signs, not the slot
    map of the moment, say which experts that step found in slots."""
    cfg, params = model
    layout = layout_of(cfg, params)
    cache = ExpertCache(layout, ExpertStore(layout), slots_per_layer=2, reads_in_program=True)
    cache.assign(0, 0, 4)
    signed = np.zeros((1, NUM_EXPERTS), np.int32)
    signed[0, [4, 5]] = [3, -2]  # the step had 4 in a slot and missed 5
    cache.assign(0, 0, 5)  # then, before the report arrived, 5 took 4's slot
    cache.record_routing((0,), signed)
    s = cache.stats
    assert (s.lookups, s.gpu_hits, s.host_hits) == (2, 1, 1)
    assert s.fetched_bytes == layout.expert_bytes and cache.last_missed[0] == [5]
    assert cache.routing_counts[0, 4] == 3 and cache.routing_counts[0, 5] == 2


def test_policy_promotes_hot_experts_with_hysteresis(model):
    cfg, params = model
    layout = layout_of(cfg, params)
    cache = ExpertCache(
        layout, ExpertStore(layout), slots_per_layer=2, margin=0.5, swaps_per_layer=4, payback=0.0
    )
    cache.assign(0, 0, 1)
    cache.assign(0, 1, 2)
    cache.scores[0, [1, 2, 7, 8]] = [10.0, 4.0, 5.0, 20.0]
    swaps = cache.plan_swaps()
    # the hottest outsider (8) takes the coldest slot (expert 2, score 4); the next (7, score 5)
    # would face expert 1 (score 10) and does not beat it by 50%
    assert [(s.layer, s.slot, s.expert, s.evicted) for s in swaps] == [(0, 1, 8, 2)]
    cache.scores[0, 7] = 16.0  # now 7 beats 10 * 1.5 as well: both come in
    assert sorted((s.expert, s.evicted) for s in cache.plan_swaps()) == [(7, 1), (8, 2)]
    cache.scores[0, [7, 8]] = [5.0, 5.9]  # 5.9 does not beat 4 * 1.5: the margin holds everything
    assert cache.plan_swaps() == []


def test_one_report_and_one_plan_cover_every_layer_each_on_its_own(model):
    """A report of several layers (in any order) counts each layer's lookups, hits and misses on
    its own, and a plan proposes per layer: the empty slot first, the hottest outsider first with
    ties to the lower expert id, nothing for a layer whose routed experts all sit in slots."""
    cfg, params = model
    layout = layout_of(cfg, params)
    cache = ExpertCache(layout, ExpertStore(layout), slots_per_layer=2, swaps_per_layer=2, payback=0.0,
                        reads_in_program=True)  # fmt: skip
    for layer, slot, expert in [(0, 0, 1), (0, 1, 2), (1, 0, 3), (2, 0, 4), (2, 1, 5)]:  # layer 1: slot 1 empty
        cache.assign(layer, slot, expert)
    signed = np.zeros((3, NUM_EXPERTS), np.int32)
    signed[0, [6, 9]] = -1  # layer 2 (first row): two misses
    signed[1, [1, 7, 8]] = [2, -1, -1]  # layer 0: a hit and two misses
    signed[2, [3, 10]] = [1, -3]  # layer 1: a hit and a miss
    cache.record_routing((2, 0, 1), signed)
    s = cache.stats
    assert (s.layer_steps, s.lookups, s.gpu_hits, s.host_hits) == (3, 7, 2, 5)
    assert (cache.last_missed[2], cache.last_missed[0], cache.last_missed[1]) == ([6, 9], [7, 8], [10])
    assert s.per_layer_misses == {2: 2, 0: 2, 1: 1} and cache.routing_counts[1, 10] == 3
    cache.scores[0, [1, 2, 7, 8]] = [1.0, 1.0, 5.0, 5.0]  # a tie: 7 before 8, and both slots cold
    cache.scores[1, [3, 10, 11]] = [9.0, 2.0, 2.0]  # the empty slot goes to the lower id of the tie
    cache.scores[2] = 0.0
    cache.scores[2, [4, 5]] = 3.0  # layer 2: only its residents were routed
    swaps = [(w.layer, w.slot, w.expert, w.evicted) for w in cache.plan_swaps()]
    assert swaps == [(0, 0, 7, 1), (0, 1, 8, 2), (1, 1, 10, -1)]


def _routed(experts: list[int]) -> np.ndarray:
    signed = np.zeros((1, NUM_EXPERTS), np.int32)
    signed[0, experts] = -1  # missed (the sign only counts misses; scores see routing)
    return signed


def _policy_run(cache: ExpertCache, routing, steps: int, rebalance_every: int = 4) -> tuple[int, int]:
    """Feed `routing(step)` (experts routed by layer 0) for `steps` steps, making the planned swaps
    every `rebalance_every` steps as the engine does between dispatches. Returns (slot hits,
    lookups) over the run."""
    hits = lookups = 0
    for step in range(steps):
        routed = routing(step)
        hits += int((cache.slot_map[0, routed] >= 0).sum())
        lookups += len(routed)
        cache.record_routing((0,), _routed(routed))
        if step % rebalance_every == rebalance_every - 1:
            for swap in cache.plan_swaps():
                cache.assign(swap.layer, swap.slot, swap.expert)
    return hits, lookups


def test_swaps_stop_when_routing_has_no_locality_and_resume_when_it_does(model):
    """Under uniform random routing a proposed swap saves no copies later (the incoming expert is
    routed no more often than the evicted one), so after watching its proposals the cache keeps
    its placement instead of paying a copy for each swap; once a hot set appears, proposals pay
    back and the hot experts take the slots."""
    cfg, params = model
    layout = layout_of(cfg, params)
    cache = ExpertCache(layout, ExpertStore(layout), slots_per_layer=4, swaps_per_layer=2)
    for slot in range(4):
        cache.assign(0, slot, slot)
    rng = np.random.default_rng(0)

    def uniform(step):
        return rng.choice(NUM_EXPERTS, 2, replace=False)

    _policy_run(cache, uniform, 200)
    s = cache.stats
    assert s.proposals_watched >= cache.PAYBACK_EVIDENCE and s.swaps_held > 0
    assert cache.recent_payback < cache.payback and not cache.swaps_pay()
    placed = cache.slot_owner[0].copy()
    _policy_run(cache, uniform, 100)
    assert (cache.slot_owner[0] == placed).all(), "no swap under routing without locality"

    hot = [9, 10, 11, 12]  # every step routes one of them, the other expert at random
    cold = [e for e in range(NUM_EXPERTS) if e not in hot]

    def hot_routing(step):
        return [hot[step % 4], int(rng.choice(cold))]

    _policy_run(cache, hot_routing, 200)
    assert cache.swaps_pay() and cache.recent_payback >= cache.payback
    assert sorted(cache.slot_owner[0]) == hot
    hits, lookups = _policy_run(cache, hot_routing, 100)
    assert hits >= lookups // 2, "the hot half of the routing now hits its slots"


def test_payback_zero_swaps_on_scores_alone_and_empty_slots_are_always_filled(model):
    cfg, params = model
    layout = layout_of(cfg, params)
    gated = ExpertCache(layout, ExpertStore(layout), slots_per_layer=2)
    ungated = ExpertCache(layout, ExpertStore(layout), slots_per_layer=2, payback=0.0)
    for cache in (gated, ungated):
        cache.assign(0, 0, 1)  # slot 1 stays empty
        cache.record_routing((0,), _routed([5, 6]))
    # no evidence yet: the gated cache fills the empty slot only; the ungated one also evicts
    assert [(s.expert, s.evicted) for s in gated.plan_swaps()] == [(5, -1)]
    assert sorted((s.expert, s.evicted) for s in ungated.plan_swaps()) == [(5, -1), (6, 1)]
    assert gated.stats.swaps_held == 1 and ungated.stats.swaps_held == 0


def test_fetch_buckets_bound_the_bytes_moved():
    assert fetch_buckets(40) == (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 40)
    assert fetch_buckets(1) == (0, 1)
    for top in (1, 7, 40, 512):
        buckets = fetch_buckets(top)
        assert buckets[0] == 0 and buckets[-1] == top and list(buckets) == sorted(set(buckets))
        for missed in range(top + 1):  # the smallest bucket holding `missed` wastes at most half of it
            assert min(b for b in buckets if b >= missed) <= 1.5 * missed


def test_placement_follows_the_routing_profile(model, tmp_path):
    cfg, params = model
    counts = np.zeros((cfg.num_layers, NUM_EXPERTS), np.int64)
    counts[:, [30, 5, 17]] = [300, 200, 100]
    RoutingProfile(counts).save(tmp_path / "profile.json")
    offload = ExpertOffload.build(
        cfg, params, gpu_budget=None, host_budget="all", profile=str(tmp_path / "profile.json")
    )
    assert offload.placement.slots_per_layer == NUM_EXPERTS
    layout = offload.layout
    small = ExpertOffload.build(
        cfg,
        params,
        gpu_budget=3 * layout.expert_bytes * cfg.num_layers,
        host_budget=4 * layout.expert_bytes * cfg.num_layers,
        profile=RoutingProfile.load(tmp_path / "profile.json"),
        artifact=_artifact_stub(cfg, params, tmp_path),
    )
    assert sorted(small.cache.slot_owner[2].tolist()) == [5, 17, 30]
    assert small.store.host_count(2) == 4 and small.store.in_host(2, 0) and not small.store.in_host(2, 5)
    with pytest.raises(ValueError, match="routing profile covers"):
        RoutingProfile(counts[:, :4]).check(cfg.num_layers, NUM_EXPERTS)
    with pytest.raises(ValueError, match="give an artifact"):
        ExpertOffload.build(cfg, params, gpu_budget=3 * layout.expert_bytes * cfg.num_layers, host_budget=0)


def _artifact_stub(cfg, params, tmp_path):
    writer = ArtifactWriter(tmp_path / "artifact", num_experts=NUM_EXPERTS)
    for i, layer in enumerate(params.layers):
        for name in ("gate_proj", "up_proj", "down_proj"):
            writer.write(f"layers.{i}.moe.{name}", getattr(layer.moe, name))
    writer.finish(recipe="test", source="tiny", with_mtp=False)
    return str(tmp_path / "artifact")


def test_serve_flags_reach_the_engine_options():
    from infernix_jax.serve import build_parser

    args = build_parser().parse_args(
        [
            "--gpu-expert-budget",
            "16GiB",
            "--host-expert-budget",
            "48GiB",
            "--expert-artifact",
            "/a",
            "--expert-profile",
            "/p.json",
            "--expert-host-reads",
            "program",
        ]
    )
    assert args.expert_host_reads == "program"
    assert (args.gpu_expert_budget, args.host_expert_budget, args.expert_artifact, args.expert_profile) == (
        "16GiB",
        "48GiB",
        "/a",
        "/p.json",
    )
    assert build_parser().parse_args([]).gpu_expert_budget is None
    with pytest.raises(SystemExit):  # argparse refuses a mode it does not know
        build_parser().parse_args(["--expert-host-reads", "dma"])
    assert build_parser().parse_args(["--expert-cpu-share", "0.25"]).expert_cpu_share == 0.25
    assert build_parser().parse_args(["--expert-cpu-share", "auto"]).expert_cpu_share == "auto"
    for bad in ("1.5", "half"):  # a share is within [0, 1]
        with pytest.raises(SystemExit):
            build_parser().parse_args(["--expert-cpu-share", bad])


def test_a_failed_read_ahead_does_not_fail_a_later_step(model, artifact_dir):
    _, params = model
    store = disk_store(model, artifact_dir)
    store.inject_fault(3, 4, "io")
    store.read_ahead(3, [4])  # this early read meets the fault
    for a, b in zip(store.read(3, 4), expert_of(params, 3, 4)):  # the step's own read succeeds
        np.testing.assert_array_equal(as_bytes(a), as_bytes(b))
    store.inject_fault(3, 5, "io")
    with pytest.raises(ExpertReadError, match="expert 5 of MoE layer 3"):  # a direct read fails its step
        store.read_many(3, [4, 5])
    store.close()
