"""The engine with experts beyond device memory: exact output in every tier, honest statistics,
no compiles after warm-up, and a failed expert read that fails only its step's requests."""

from __future__ import annotations

import dataclasses
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import pjit

from infernix_jax.engine import memory_plan
from infernix_jax.engine.config import EngineConfig
from infernix_jax.engine.core import EngineCore
from infernix_jax.engine.protocol import FINISH_ERROR, GenerationRequest, SamplingParams
from infernix_jax.experts.offload import PREFETCH_COPIES_CPU_ONLY, ExpertOffload, check_prefetch_copy
from infernix_jax.model.host_copy import PREFETCH_GATHER_BLOCKS
from infernix_jax.model.mlp import expert_row_bytes
from infernix_jax.weights.artifact import ArtifactWriter
from tests.experts.tiny_moe import NUM_EXPERTS, expert_bytes, tiny_config, tiny_params

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CONFIG = EngineConfig(
    max_concurrency=4,
    max_context=128,
    kv_capacity=12,
    prefill_chunk=32,
    prefill_shape_override=((1, 32),),
    decode_batch_sizes=(4,),
    decode_steps_per_dispatch=4,
    max_top_logprobs=2,
    compilation_cache_dir=None,
    progress=False,
    prefix_cache=False,
    structured_output=False,
    scoring=False,
    # swap on the routing scores alone: these tests check that swaps keep the output exact and the
    # statistics honest, in runs too short for the payback gate's evidence (its own tests:
    # tests/experts/test_store_and_policy.py)
    expert_swap_payback=0.0,
)
PROMPT_LENGTHS = (5, 12, 30, 9)
MAX_TOKENS = 10
MOE_LAYERS = 5


@pytest.fixture(scope="module")
def model():
    cfg = tiny_config()
    return cfg, tiny_params(cfg)


@pytest.fixture(scope="module")
def artifact(model, tmp_path_factory):
    """The expert stacks in our artifact format (one chunk per expert): the disk tier's source."""
    _cfg, params = model
    path = tmp_path_factory.mktemp("artifact")
    writer = ArtifactWriter(path, num_experts=NUM_EXPERTS)
    for i, layer in enumerate(params.layers):
        for name in ("gate_proj", "up_proj", "down_proj"):
            writer.write(f"layers.{i}.moe.{name}", getattr(layer.moe, name))
    writer.finish(recipe="test", source="tiny", with_mtp=False)
    return str(path)


def budget(params, experts_per_layer: int) -> int:
    return experts_per_layer * expert_bytes(params) * MOE_LAYERS


def requests(seed: int = 0, lengths=PROMPT_LENGTHS, prefix: str = "r") -> list[GenerationRequest]:
    rng = np.random.default_rng(seed)
    return [
        GenerationRequest(
            f"{prefix}{i}",
            rng.integers(0, 512, size=n).tolist(),
            SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0),
        )
        for i, n in enumerate(lengths)
    ]


def drive(core: EngineCore, reqs, on_step=None) -> dict[str, dict]:
    """Run to completion; per request its tokens, finish reason and error."""
    out = {r.request_id: {"tokens": [], "finish": None, "error": None} for r in reqs}

    def collect(events):
        for e in events:
            out[e.request_id]["tokens"] += e.token_ids
            if e.finished:
                out[e.request_id]["finish"], out[e.request_id]["error"] = e.finish_reason, e.error

    for r in reqs:
        collect(core.add_request(r))
    while core.has_work():
        before = None if core.experts is None else core.experts.stats.misses
        collect(core.step())
        if on_step is not None:
            on_step(core, before)
    return out


@pytest.fixture(scope="module")
def resident(model):
    cfg, params = model
    core = EngineCore(cfg, params, CONFIG)
    return drive(core, requests())


SLOTS = 4  # device slots per layer in every offloaded engine here (one set of compiled programs)
TIERS = {  # name -> (host experts per layer or "all", with the artifact)
    "slots+host": ("all", False),
    "disk": (0, True),
    "slots+host+disk": (8, True),
}


@pytest.mark.parametrize("tier", list(TIERS))
def test_greedy_output_equals_all_resident_with_misses_every_step(tier, model, artifact, resident):
    cfg, params = model
    host, disk = TIERS[tier]
    config = CONFIG.replace(
        gpu_expert_budget=budget(params, SLOTS),
        host_expert_budget=host if host == "all" else (budget(params, host) if host else 0),
        expert_artifact=artifact if disk else None,
    )
    core = EngineCore(cfg, params, config)
    steps_without_miss = []
    out = drive(
        core, requests(), lambda c, before: steps_without_miss.append(c.experts.stats.misses == before)
    )
    assert {k: v["tokens"] for k, v in out.items()} == {k: v["tokens"] for k, v in resident.items()}
    assert all(v["finish"] != FINISH_ERROR for v in out.values())
    assert not any(steps_without_miss), "the budget should force misses on every step"
    stats = core.experts.stats
    assert stats.misses > 0 and stats.promotions > 0, "the cache should adapt its slots to the routing"
    if tier == "slots+host":
        assert stats.host_hits > 0 and stats.disk_hits == 0
    if tier == "disk":  # RAM holds only experts evicted from slots while it has room: none here
        assert stats.disk_hits > 0 and stats.host_hits == 0
    if tier == "slots+host+disk":
        assert stats.disk_hits > 0 and stats.host_hits > 0


def test_statistics_add_up(model, artifact):
    cfg, params = model
    eb = expert_bytes(params)
    cores = [
        EngineCore(cfg, params, CONFIG.replace(gpu_expert_budget=budget(params, SLOTS), **tiers))
        for tiers in ({}, {"host_expert_budget": budget(params, 10), "expert_artifact": artifact})
    ]
    for core in cores:
        drive(core, requests(seed=3))
    reference, core = cores[0].experts, cores[1].experts
    stats = core.stats
    # the same tokens route the same experts, wherever the experts live
    assert stats.lookups == reference.stats.lookups > 0 and stats.layer_steps == reference.stats.layer_steps
    np.testing.assert_array_equal(core.cache.routing_counts, reference.cache.routing_counts)
    assert stats.gpu_hits + stats.host_hits + stats.disk_hits == stats.lookups
    assert stats.host_hits > 0 and stats.disk_hits > 0 and stats.read_failures == 0
    assert stats.misses == sum(stats.per_layer_misses.values())
    assert stats.fetched_bytes == stats.misses * eb
    assert stats.promoted_bytes == stats.promotions * eb > 0
    assert stats.bytes_moved == stats.fetched_bytes + stats.promoted_bytes
    report = cores[1].stats().experts  # what /metrics shows
    assert sum(report.hits.values()) == report.lookups == stats.lookups
    assert report.hits["disk"] == stats.disk_hits and report.moved_bytes["fetched"] == stats.fetched_bytes
    assert report.slots_used == report.slots_total == SLOTS * MOE_LAYERS
    assert report.tokens == cores[1].metrics.prefill_tokens + cores[1].metrics.generated_tokens > 0
    assert report.bytes_per_token == stats.bytes_moved / report.tokens
    # tiers stay within their budgets and exclusive: each expert lives in exactly one place
    cache, store = core.cache, core.store
    assert report.host_experts == sum(store.host_count(layer) for layer in range(MOE_LAYERS))
    for layer in range(MOE_LAYERS):
        in_slots = {int(e) for e in cache.slot_owner[layer] if e >= 0}
        in_host = {e for e in range(NUM_EXPERTS) if store.in_host(layer, e)}
        assert len(in_slots) == SLOTS and len(in_host) <= 10 and not in_slots & in_host
        assert all(cache.slot_map[layer, e] == s for s, e in enumerate(cache.slot_owner[layer]))
        assert (cache.slot_map[layer] >= 0).sum() == SLOTS


@pytest.mark.parametrize("host_reads", ["callback", "program+dma"])  # dma: the GPU default for "program"
def test_no_compilation_after_warmup_while_slots_change(model, host_reads):
    """Swapped slots come out of the slot programs committed to the device, and so were built:
    a swap never makes the step programs compile again (it once did with host reads in the
    program, every step, costing seconds per token on a GPU)."""
    cfg, params = model
    reads, _, copy = host_reads.partition("+")
    config = CONFIG.replace(  # the same engine as another test's: its programs are compiled already
        gpu_expert_budget=budget(params, SLOTS), expert_host_reads=reads, expert_host_copy=copy or "auto"
    )
    core = EngineCore(cfg, params, config)
    compiles = []

    def listener(event, duration, **kwargs):
        if event == COMPILE_EVENT:
            compiles.append(duration)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        drive(core, requests(seed=5))
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert core.experts.stats.promotions > 0
    assert compiles == []


@pytest.mark.parametrize(
    ("tier", "cpu_share"),
    [("host", 0.0), ("disk", 0.0), ("disk", 1.0)],  # 1.0: every miss is read by the CPU's worker
)
def test_failed_expert_read_fails_only_that_steps_requests(tier, cpu_share, model, artifact, resident):
    cfg, params = model
    config = CONFIG.replace(gpu_expert_budget=budget(params, SLOTS), expert_cpu_share=cpu_share)
    if tier == "disk":
        config = config.replace(host_expert_budget=0, expert_artifact=artifact)
    core = EngineCore(cfg, params, config)
    store, cache = core.experts.store, core.experts.cache
    reqs = requests()
    core.add_request(reqs[0])
    for e in range(NUM_EXPERTS):  # any expert layer 0 misses in the next step fails to read
        if cache.slot_map[0, e] < 0:
            store.inject_fault(0, e, "checksum" if tier == "host" else "io")
    events = core.step()  # r0's prefill: its step fails
    store.clear_faults()
    failed = [e for e in events if e.finished]
    assert [e.request_id for e in failed] == ["r0"] and failed[0].finish_reason == FINISH_ERROR
    assert ("checksum mismatch" if tier == "host" else "disk read failed") in failed[0].error
    assert "expert" in failed[0].error and "MoE layer 0" in failed[0].error
    # the step failed once; promotions planned after it also met the faults and were skipped
    assert core.experts.stats.read_failures >= 1
    # the engine keeps serving: later requests (a batch of them) give the all-resident tokens
    out = drive(core, reqs[1:])
    assert {k: v["tokens"] for k, v in out.items()} == {k: resident[k]["tokens"] for k in out}
    assert all(v["finish"] != FINISH_ERROR for v in out.values())


def test_misses_computed_on_the_cpu_give_the_resident_output(model, artifact, resident):
    """expert_cpu_share: the host's CPU computes a share of each layer's misses (from RAM and from
    disk) and returns their outputs; only the other misses' weights cross. Greedy output is the
    all-resident model's, and the statistics say which misses the CPU took."""
    cfg, params = model
    config = CONFIG.replace(
        gpu_expert_budget=budget(params, SLOTS),
        host_expert_budget=budget(params, 8),
        expert_artifact=artifact,
        expert_cpu_share=0.5,
    )
    core = EngineCore(cfg, params, config)
    assert core.experts.placement.cpu_share == 0.5 and "CPU computes 50%" in core.experts.placement.describe()
    out = drive(core, requests())
    assert {k: v["tokens"] for k, v in out.items()} == {k: v["tokens"] for k, v in resident.items()}
    stats = core.experts.stats
    assert stats.host_hits > 0 and stats.disk_hits > 0
    assert stats.gpu_hits + stats.host_hits + stats.disk_hits == stats.lookups
    assert stats.misses == sum(stats.per_layer_misses.values())
    # each layer-step rounds half its misses: the whole lies near half
    assert 0 < stats.cpu_computed < stats.misses and 0.4 <= stats.cpu_share <= 0.6
    assert stats.fetched_bytes == (stats.misses - stats.cpu_computed) * expert_bytes(params)
    report = core.stats().experts  # what /metrics shows
    assert report.cpu_computed == stats.cpu_computed and report.cpu_share == stats.cpu_share


def test_a_cpu_share_needs_callbacks_and_a_share_in_range(model):
    from infernix_jax.experts.offload import ExpertOffload

    cfg, params = model
    gpu = budget(params, SLOTS)
    with pytest.raises(ValueError, match="needs expert host reads by callback"):
        ExpertOffload.build(cfg, params, gpu, host_reads="program", cpu_share=0.5)
    for bad in (1.5, -0.1, "half"):
        with pytest.raises(ValueError, match="expert_cpu_share must be auto or a number in"):
            CONFIG.replace(expert_cpu_share=bad)
    # auto: where the device is the CPU itself, nothing is computed "on the host"
    offload = ExpertOffload.build(cfg, params, gpu, host_reads="callback", cpu_share="auto")
    assert offload.cache.host_compute is None and offload.placement.cpu_share == 0.0
    assert offload.params.layers[offload.layout.moe_layers[0]].moe.gate_proj.cpu_share is None
    offload.close()


def test_a_recorded_profile_places_the_most_routed_experts_in_slots(model, tmp_path):
    from infernix_jax.engine.llm import LLM
    from infernix_jax.experts import ExpertOffload, RoutingProfile
    from infernix_jax.experts.profile import record_profile
    from infernix_jax.loaded_model import Model

    cfg, params = model
    options = {f.name: getattr(CONFIG, f.name) for f in dataclasses.fields(CONFIG)}
    llm = LLM(
        model=Model(cfg, params, None, CONFIG.max_context),
        **{**options, "gpu_expert_budget": budget(params, SLOTS)},
    )
    prompts = [r.prompt_token_ids for r in requests(seed=7)]
    profile = record_profile(llm, prompts, max_tokens=4)
    np.testing.assert_array_equal(profile.counts, llm.core.experts.cache.routing_counts)
    assert (profile.counts.sum(axis=1) % cfg.num_experts_per_tok == 0).all() and profile.counts.sum() > 0
    profile.save(tmp_path / "profile.json")
    placed = ExpertOffload.build(cfg, params, budget(params, SLOTS), profile=str(tmp_path / "profile.json"))
    for layer in range(MOE_LAYERS):
        hottest = set(
            np.argsort(-RoutingProfile.load(tmp_path / "profile.json").counts[layer], kind="stable")[:SLOTS]
        )
        assert set(placed.cache.slot_owner[layer].tolist()) == hottest


def test_auto_budget_gives_the_experts_what_kv_and_other_weights_leave(model, resident, monkeypatch):
    cfg, params = model
    config = CONFIG.replace(gpu_expert_budget="auto", gpu_memory_utilization=1.0)
    dtype = params.final_norm.dtype

    def auto(limit: int, in_use: int = 0):
        monkeypatch.setattr(memory_plan, "device_memory", lambda: (limit, in_use))
        return memory_plan.auto_expert_budget(cfg, config, dtype, params)

    monkeypatch.setattr(memory_plan, "device_memory", lambda: None)
    assert memory_plan.auto_expert_budget(cfg, config, dtype, params) == "all", "no limit (the CPU): all"
    assert auto(10**12) == "all"
    assert auto(10**5) == 0, "below what the rest needs: no budget (one slot per layer is kept anyway)"
    limit = next(n for n in range(10**6, 2 * 10**6, 10**4) if isinstance(auto(n), int) and auto(n) > 0)
    fixed = limit - auto(limit)  # other weights, state slots, KV for every sequence at full length
    assert auto(limit + 12345) == auto(limit) + 12345, "the experts get every further byte"
    on_device = sum(a.nbytes for a in jax.tree.leaves(params))
    assert auto(limit, in_use=on_device) == auto(limit), "experts already on the device are not counted twice"
    assert 0 < fixed < limit

    auto(fixed + budget(params, SLOTS) + expert_bytes(params) // 2)  # room for SLOTS experts per layer
    core = EngineCore(cfg, params, config)
    assert core.experts.placement.slots_per_layer == SLOTS
    assert {k: v["tokens"] for k, v in drive(core, requests()).items()} == {
        k: v["tokens"] for k, v in resident.items()
    }
    auto(fixed + budget(params, NUM_EXPERTS))  # every expert fits: the plain model, no slots
    core = EngineCore(cfg, params, config)
    assert core.experts is None
    assert {k: v["tokens"] for k, v in drive(core, requests()).items()} == {
        k: v["tokens"] for k, v in resident.items()
    }


def test_budgets_that_are_not_sizes_are_refused():
    with pytest.raises(ValueError, match="gpu_expert_budget.*auto"):
        CONFIG.replace(gpu_expert_budget="lots")
    with pytest.raises(ValueError, match="host_expert_budget"):
        CONFIG.replace(host_expert_budget="auto")
    assert CONFIG.replace(gpu_expert_budget="auto", host_expert_budget="48GiB").gpu_expert_budget == "auto"


def test_layers_whose_experts_all_sit_in_slots_make_no_host_round_trip(model, resident):
    cfg, params = model
    core = EngineCore(cfg, params, CONFIG.replace(gpu_expert_budget="all"))
    cache = core.experts.cache
    fetches = []
    fetch = cache.fetch
    cache.fetch = lambda *args, **kwargs: fetches.append(args[0]) or fetch(*args, **kwargs)
    out = drive(core, requests())
    assert {k: v["tokens"] for k, v in out.items()} == {k: v["tokens"] for k, v in resident.items()}
    assert not fetches, "nothing was missed, so no layer should have called the host"
    stats = core.experts.stats
    assert stats.lookups == stats.gpu_hits > 0, "the forwards' routing reports still count every lookup"
    assert stats.layer_steps > 0 and cache.routing_counts.sum() > 0


@pytest.mark.parametrize("host_copy", ["dma", "mapped"])  # "loop", "buckets": their rows in test_host_rows.py
def test_host_reads_in_the_program_give_the_resident_output_without_fetch_callbacks(
    model, resident, host_copy
):
    """expert_host_reads="program", with each way of copying (expert_host_copy): missed experts are
    copied from pinned-host stacks inside the program. The output equals the all-resident model's,
    no layer calls the fetch callback, and the routing reports still count every miss as a host
    hit with its bytes."""
    cfg, params = model
    config = CONFIG.replace(
        gpu_expert_budget=budget(params, SLOTS),
        expert_host_reads="program",
        expert_host_copy=host_copy,
        async_decode=False,  # one dispatch a step, so that each step's misses show in its stats
    )
    core = EngineCore(cfg, params, config)
    slotted = core.experts.params.layers[core.experts.layout.moe_layers[0]].moe.gate_proj
    assert slotted.host_copy == host_copy and (slotted.host_rows_ref is not None) == (
        host_copy in ("dma", "mapped")
    )
    rows = slotted.host_stacks  # one byte row per expert, all of them
    assert rows.sharding.memory_kind == "pinned_host"
    assert (
        rows.shape == (NUM_EXPERTS, expert_row_bytes(core.experts.layout.expert_bytes))
        and rows.dtype == jnp.uint8
    )
    cache = core.experts.cache
    fetches = []
    fetch = cache.fetch
    cache.fetch = lambda *args, **kwargs: fetches.append(args[0]) or fetch(*args, **kwargs)
    steps_without_miss = []
    out = drive(
        core, requests(), lambda c, before: steps_without_miss.append(c.experts.stats.misses == before)
    )
    assert {k: v["tokens"] for k, v in out.items()} == {k: v["tokens"] for k, v in resident.items()}
    assert not fetches, "misses are read inside the program"
    assert not any(steps_without_miss), "the budget should force misses on every step"
    stats = core.experts.stats
    assert stats.host_hits > 0 and stats.disk_hits == 0 and stats.promotions > 0
    assert stats.demoted_bytes == 0, "an evicted expert is still in the pinned stacks: nothing comes back"
    assert core.experts.store.host_experts == 0, "no second (numpy) copy of the host tier"
    assert cache.report(1).host_experts == NUM_EXPERTS * len(core.experts.layout.moe_layers)
    assert stats.gpu_hits + stats.host_hits == stats.lookups
    assert stats.fetched_bytes == stats.misses * expert_bytes(params)
    assert stats.misses == sum(stats.per_layer_misses.values())


def test_async_decode_runs_with_host_reads_in_the_program(model, resident):
    """With misses copied inside the programs, the next decode dispatch is enqueued before the last
    is read, and slot swaps queue behind it: the output is still the all-resident model's, and
    every routing report is counted once, by what its own step missed."""
    cfg, params = model
    config = CONFIG.replace(
        gpu_expert_budget=budget(params, SLOTS), expert_host_reads="program", expert_host_copy="mapped"
    )
    core = EngineCore(cfg, params, config)
    assert core.async_decode.enabled
    cache, plans = core.experts.cache, []
    plan = cache.plan_swaps
    cache.plan_swaps = lambda: plans.append(plan()) or plans[-1]
    out = drive(core, requests())
    assert {k: v["tokens"] for k, v in out.items()} == {k: v["tokens"] for k, v in resident.items()}
    assert core.metrics.async_dispatches > 0
    stats = core.experts.stats
    assert stats.promotions > 0 and stats.host_hits > 0
    # one slot program a rebalance that swaps, whatever the layers it swaps in (one a layer took
    # 42-54 ms of host time a rebalance of 12 layers on an H100); its host time is kept by part
    assert stats.slot_programs == sum(1 for swaps in plans if swaps) > 0
    assert len({swap.layer for swaps in plans for swap in swaps}) > 1
    parts = stats.rebalance_deliver_seconds + stats.rebalance_plan_seconds + stats.rebalance_apply_seconds
    assert 0 < parts <= core.metrics.expert_rebalance_s
    assert stats.gpu_hits + stats.host_hits == stats.lookups
    assert stats.fetched_bytes == stats.misses * expert_bytes(params)
    assert stats.misses == sum(stats.per_layer_misses.values())

    # the routing report declares no side effect, so once compiled the decode program is called
    # through jit's C++ fast path, never its Python path (~13 ms a dispatch of the 80B shape)
    slow_path = []
    python_path = pjit._pjit_call_impl_python

    def counting(*args, **kwargs):
        slow_path.append(kwargs["name"])
        return python_path(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pjit, "_pjit_call_impl_python", counting)
        again = drive(core, requests(seed=3))
    assert core.metrics.async_dispatches > 0 and all(v["tokens"] for v in again.values())
    assert "decode_program" not in slow_path


def test_fetch_callbacks_keep_one_dispatch_at_a_time(model):
    """The host serves a callback dispatch's misses, so nothing is enqueued ahead of one."""
    cfg, params = model
    core = EngineCore(cfg, params, CONFIG.replace(gpu_expert_budget=budget(params, SLOTS)))
    assert not core.async_decode.enabled


def test_host_reads_in_the_program_refuse_a_disk_tier_and_unknown_modes(model, artifact):
    cfg, params = model
    config = CONFIG.replace(
        gpu_expert_budget=budget(params, SLOTS), host_expert_budget=0, expert_artifact=artifact
    )
    with pytest.raises(ValueError, match="every expert in host RAM"):
        EngineCore(cfg, params, config.replace(expert_host_reads="program"))
    with pytest.raises(ValueError, match="expert_host_reads must be auto, callback or program"):
        CONFIG.replace(expert_host_reads="dma")
    with pytest.raises(ValueError, match="expert_host_copy must be auto, loop, buckets, dma or mapped"):
        CONFIG.replace(expert_host_copy="gather")
    with pytest.raises(ValueError, match="expert_swap_payback must be >= 0"):
        CONFIG.replace(expert_swap_payback=-1.0)
    with pytest.raises(ValueError, match="expert_prefetch_blocks must be >= 1"):
        CONFIG.replace(expert_prefetch_blocks=0)


def test_the_engine_and_a_direct_offload_build_prefetch_with_the_same_gather():
    """EngineConfig's default prefetch gather is the one `ExpertOffload.build` takes unless told."""
    assert EngineConfig().expert_prefetch_blocks == PREFETCH_GATHER_BLOCKS
    build = inspect.signature(ExpertOffload.build).parameters
    assert build["prefetch_blocks"].default == PREFETCH_GATHER_BLOCKS


@pytest.mark.parametrize("host_copy", ["mapped", "loop"])
def test_prefetching_the_next_layers_misses_gives_the_resident_output(model, resident, host_copy):
    """expert_prefetch: each MoE layer of a decode step guesses the next layer's experts and copies
    the guessed misses ahead; the next layer takes those it missed and copies only the rest. The
    output is still the all-resident model's, guesses were made and some were used, and the bytes
    of guesses that were not used count as moved."""
    cfg, params = model
    config = CONFIG.replace(
        gpu_expert_budget=budget(params, SLOTS),
        expert_host_reads="program",
        expert_host_copy=host_copy,
        expert_prefetch=True,
    )
    core = EngineCore(cfg, params, config)
    layout = core.experts.layout
    flags = [core.experts.params.layers[i].moe.gate_proj.prefetch for i in layout.moe_layers]
    assert all(flags)
    out = drive(core, requests())
    assert {k: v["tokens"] for k, v in out.items()} == {k: v["tokens"] for k, v in resident.items()}
    stats = core.experts.stats
    assert stats.prefetched > stats.prefetch_used > 0
    wasted = stats.prefetched - stats.prefetch_used
    assert stats.fetched_bytes == (stats.misses + wasted) * expert_bytes(params)
    assert stats.gpu_hits + stats.host_hits == stats.lookups


def test_fewer_prefetch_guesses_copy_fewer_experts_ahead_and_keep_the_output(model, resident):
    """expert_prefetch_guesses: each token guesses only the router's likeliest experts of the next
    layer. Fewer experts cross ahead (fewer bytes on wrong guesses), some guesses are still used,
    and the output stays the all-resident model's."""
    cfg, params = model
    config = CONFIG.replace(
        gpu_expert_budget=budget(params, SLOTS),
        expert_host_reads="program",
        expert_host_copy="mapped",
        expert_prefetch=True,
    )
    prefetched = {}
    for guesses in (0, 1):
        core = EngineCore(cfg, params, config.replace(expert_prefetch_guesses=guesses))
        out = drive(core, requests())
        assert {k: v["tokens"] for k, v in out.items()} == {k: v["tokens"] for k, v in resident.items()}
        stats = core.experts.stats
        assert stats.prefetch_used > 0
        prefetched[guesses] = stats.prefetched
    assert prefetched[1] < prefetched[0]
    with pytest.raises(ValueError, match="expert_prefetch_guesses must be >= 0"):
        config.replace(expert_prefetch_guesses=-1)


def test_prefetch_on_a_gpu_refuses_the_host_copies_with_control_flow():
    """XLA does not place a while loop or a switch on the prefetch stream of a GPU (measured on
    the H200): the engine says so at start instead of failing its first decode step."""
    for copy in PREFETCH_COPIES_CPU_ONLY:
        with pytest.raises(ValueError, match=f"cannot use the '{copy}' host copy on a gpu device"):
            check_prefetch_copy(copy, "gpu")
        check_prefetch_copy(copy, "cpu")
    for copy in ("mapped", "dma"):
        check_prefetch_copy(copy, "gpu")


def test_prefetch_needs_host_reads_in_the_program(model):
    cfg, params = model
    config = CONFIG.replace(gpu_expert_budget=budget(params, SLOTS), expert_prefetch=True)
    with pytest.raises(ValueError, match="expert prefetch .* needs expert host reads in the program"):
        EngineCore(cfg, params, config.replace(expert_host_reads="callback"))


def test_ngram_speculation_with_offloaded_experts_gives_the_resident_output(model, resident):
    """Verify windows (several tokens a row through one forward) read their experts from slots and
    misses as decode does (here copied inside the program, the GPU default): greedy n-gram
    speculation over offloaded experts gives the all-resident engine's tokens without
    speculation, with drafts proposed and verified."""
    cfg, params = model
    config = CONFIG.replace(
        gpu_expert_budget=budget(params, SLOTS), expert_host_reads="program", spec="ngram",
        ngram_draft_tokens=3, ngram_min_match=1,  # 1-token matches: drafts even on random prompts
    )  # fmt: skip
    core = EngineCore(cfg, params, config)
    got = drive(core, requests())
    assert {k: v["tokens"] for k, v in got.items()} == {k: v["tokens"] for k, v in resident.items()}
    assert core.metrics.drafted_tokens > 0 and core.experts.stats.misses > 0
