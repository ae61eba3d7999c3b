"""Experts beyond device memory: build the slotted model, place experts in tiers, move them between steps.

`ExpertOffload.build(cfg, params, ...)` takes a model whose MoE layers hold full expert stacks and
returns one whose MoE layers hold `SlottedExperts`: a fixed number of device slots per layer (the
GPU budget), the rest of the experts in host RAM (the host budget, exclusive of the slots) and,
beyond that, in the artifact on disk. Placement at start follows a routing profile when one is
given (hottest experts in slots, the next in RAM); `rebalance()` (called by the engine between
steps, when no program is running) applies the cache's swaps: promoted experts are copied into
their slot, evicted ones go back to RAM (or to disk only, where the artifact holds them and RAM
is full). Slot writes run through one fixed-width program, so nothing recompiles.

On a GPU the slot arrays live in device memory; the host tier is numpy RAM. A missed expert
reaches a step in one of two ways (`host_reads`): "callback", a host callback per layer that
misses, which serves host RAM and the disk tier alike; or "program", where every layer's full
stacks also sit in `pinned_host` memory and the program copies its missed experts from them
itself (no callback but the forward's one routing report; needs every expert in host RAM, so no
disk tier). On the CPU backend every tier is host memory; the code paths are the same.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from functools import partial
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from infernix_jax.cache.prefix_host import PINNED_HOST, HostMemory, memory_kinds
from infernix_jax.config import ModelConfig
from infernix_jax.experts.cache import ExpertCache
from infernix_jax.experts.host_compute import HostExpertCompute, host_cpu_device
from infernix_jax.experts.layout import ExpertLayout, Leaves, experts_in_budget, layout_of, projections
from infernix_jax.experts.profile import RoutingProfile
from infernix_jax.experts.store import ExpertReadError, ExpertStore
from infernix_jax.jit import jit
from infernix_jax.model import host_report
from infernix_jax.model.host_copy import (
    HOST_COPIES,
    PREFETCH_GATHER_BLOCKS,
    host_rows_address,
    register_host_rows,
)
from infernix_jax.model.mlp import (
    SlottedExperts,
    copy_missed_rows,
    expert_row_bytes,
    expert_rows_to_leaves,
    register_expert_source,
)
from infernix_jax.model.params import Params
from infernix_jax.weights.artifact import Artifact, is_artifact
from infernix_jax.weights.hf import to_device

log = logging.getLogger("infernix_jax.experts")

WRITE_WIDTH = 8  # slots written per dispatch of the slot programs (one compiled shape)


@partial(jit, donate_argnums=(0,))
def write_slots_program(slots, slot_ids: jax.Array, data):
    """slots leaves [S, ...]; slot_ids i32 [W] (-1: skip); data leaves [W, ...] -> updated slots."""
    n = jax.tree.leaves(slots)[0].shape[0]
    target = jnp.where(slot_ids < 0, n, slot_ids)
    return jax.tree.map(lambda x, d: x.at[target].set(d.astype(x.dtype), mode="drop"), slots, data)


def _promote_from_host(
    slots,
    slot_ids: jax.Array,
    host_rows: jax.Array,
    expert_ids: jax.Array,
    rows_ref: jax.Array | None = None,
    method: str = "loop",
):
    """slots leaves [S, ...]; slot_ids i32 [W] (-1: skip); host_rows u8 [E, expert_bytes] in
    `pinned_host` memory; expert_ids i32 [W], the listed experts first, then -1 -> slots with each
    listed expert copied into its slot by the program itself, the way the layer's forward copies
    its misses (`method`, `rows_ref`: `SlottedExperts.host_copy`, `.host_rows_ref`): no host
    round trip and no numpy staging. ("loop" waits for the stream at every row on a GPU, so a
    rebalance of many layers cost ~30 ms of host time a step on the H200.)"""
    leaves, treedef = jax.tree.flatten(slots)
    n = leaves[0].shape[0]
    target = jnp.where(slot_ids < 0, n, slot_ids)
    count = jnp.sum((expert_ids >= 0).astype(jnp.int32))
    rows = copy_missed_rows(method, host_rows, expert_ids, count, rows_ref)
    incoming = expert_rows_to_leaves(rows, leaves)
    return jax.tree.unflatten(treedef, [x.at[target].set(d, mode="drop") for x, d in zip(leaves, incoming)])


@partial(jit, donate_argnums=(0,), static_argnames=("method",))
def promote_layers_from_host_program(
    layers_slots: tuple,
    slot_ids: jax.Array,
    host_rows: tuple,
    expert_ids: jax.Array,
    rows_refs: tuple,
    method: str = "loop",
) -> tuple:
    """`_promote_from_host` for every slotted layer in one program: layers_slots, host_rows and
    rows_refs hold one entry a layer; slot_ids / expert_ids i32 [L, W] (a row of -1: that layer is
    left as it is). One call a rebalance whatever the layers that swap: the host's cost of a
    program call is paid once, not once a layer (48 on the 80B-A3B)."""
    return tuple(
        _promote_from_host(slots, slot_ids[i], rows, expert_ids[i], ref, method)
        for i, (slots, rows, ref) in enumerate(zip(layers_slots, host_rows, rows_refs, strict=True))
    )


@jit
def read_slots_program(slots, slot_ids: jax.Array):
    return jax.tree.map(lambda x: x[jnp.maximum(slot_ids, 0)], slots)


def _stack(experts: list[Leaves], layout: ExpertLayout, rows: int) -> list[np.ndarray]:
    out = [np.zeros((rows, *s), d) for s, d in zip(layout.leaf_shapes, layout.leaf_dtypes)]
    for row, leaves in enumerate(experts):
        for dst, src in zip(out, leaves):
            dst[row] = src
    return out


HOST_READS = ("auto", "callback", "program")


def resolve_host_reads(host_reads: str, disk_experts: int) -> str:
    """`"auto"` -> "program" on a GPU with pinned host memory when no expert stays on disk (copies
    inside the program ran 4-9x the callbacks' tok/s on the H200), else "callback" (the CPU: the
    callbacks' failure injection and disk reads are what the tests exercise there)."""
    if host_reads != "auto":
        return host_reads
    device = jax.devices()[0]
    on_gpu = device.platform in ("gpu", "cuda", "rocm")
    return "program" if on_gpu and not disk_experts and PINNED_HOST in memory_kinds(device) else "callback"


PREFETCH_COPIES_CPU_ONLY = ("loop", "buckets")  # host copies with control flow (see check_prefetch_copy)


def resolve_host_copy(host_copy: str, rows: jax.Array) -> str:
    """`"auto"` -> "mapped" when the device can address the pinned host rows (`host_rows_address`:
    on the H200 its gather beat "dma" at batch 1 and tied it at batch 4, docs/experts.md), else
    "dma" (said in the log)."""
    if host_copy != "auto":
        return host_copy
    try:
        host_rows_address(rows)
    except RuntimeError as e:
        log.warning("expert host copy: %s; copying with dma instead", e)
        return "dma"
    return "mapped"


def check_prefetch_copy(host_copy: str, backend: str) -> None:
    """Raise ValueError where expert prefetch cannot run with this host copy: on a GPU, XLA could
    not place the "loop" copy (a while loop) nor the "buckets" one (a switch) on the prefetch
    stream ("No ExecutionStreamId found", jax 0.11 on the H200, docs/experts.md); "mapped" and
    "dma" ran there and gave the all-resident tokens. The CPU runs all four."""
    if backend != "cpu" and host_copy in PREFETCH_COPIES_CPU_ONLY:
        raise ValueError(
            f"expert prefetch cannot use the {host_copy!r} host copy on a {backend} device (XLA does not "
            "run its control flow on the prefetch stream); use expert_host_copy mapped or dma"
        )


def cpu_share_at_start(
    cpu_share: float | str, host_reads: str, layout: ExpertLayout, sample: Leaves, hidden_size: int, dtype
) -> tuple[float, HostExpertCompute | None]:
    """(the share of each layer's misses the host's CPU computes, what computes them or None).

    "auto": measured here (`HostExpertCompute.measure` on `sample`, one expert's leaves, and
    `HostComputeCost.best_share`), said in the log; 0 without a measurement where no callback
    brings outputs back (host reads "program") or where the device is the CPU itself. A number in
    [0, 1] is taken as given; above 0 it needs callback host reads. Raises ValueError otherwise."""
    if cpu_share == "auto":
        if host_reads != "callback":
            return 0.0, None
        if jax.default_backend() == "cpu":
            log.info("expert CPU share 0: the device is the CPU")
            return 0.0, None
        if host_cpu_device() is None:
            log.info("expert CPU share 0: jax's CPU backend is not loaded")
            return 0.0, None
        compute = HostExpertCompute(layout)
        cost = compute.measure(sample, hidden_size, dtype)
        share = cost.best_share()
        log.info("expert CPU share %.2f of each layer's misses: %s", share, cost.describe())
        if share == 0:
            compute.close()
            return 0.0, None
        return share, compute
    share = float(cpu_share)
    if not 0.0 <= share <= 1.0:
        raise ValueError(f"the expert CPU share must be auto or within [0, 1], got {cpu_share!r}")
    if share == 0.0:
        return 0.0, None
    if host_reads != "callback":
        raise ValueError(
            "computing missed experts on the CPU returns their outputs through the fetch callback: it "
            f"needs expert host reads by callback, and these resolved to {host_reads!r}"
        )
    return share, HostExpertCompute(layout)


def _committed(a: np.ndarray) -> jax.Array:
    """`a` on the default device, committed to it. The slot programs return committed arrays and
    jit keys its compiled programs on whether an argument is committed, so slots built any other
    way would recompile every program that reads them after their first swap."""
    return jax.device_put(a, jax.devices()[0])


def _committed_all(arrays: list[np.ndarray]) -> list[jax.Array]:
    """`_committed` of each, in one transfer call."""
    return list(jax.device_put(arrays, jax.devices()[0])) if arrays else []


def expert_rows(experts: list[Leaves]) -> np.ndarray:
    """u8 [len(experts), expert_row_bytes]: each expert's leaves' bytes end to end, in leaf order,
    then zeros to `mlp.EXPERT_ROW_ALIGN` (the layout `model.mlp.expert_rows_to_leaves` cuts them
    back out of)."""
    rows = [np.concatenate([np.ascontiguousarray(a).reshape(-1).view(np.uint8) for a in e]) for e in experts]
    width = expert_row_bytes(max((r.size for r in rows), default=0))
    return np.stack([np.pad(r, (0, width - r.size)) for r in rows])


def _not_loaded(moe) -> bool:
    """Whether a MoE layer's expert stacks are shapes only (loaded with experts="artifact")."""
    return isinstance(jax.tree.leaves(projections(moe))[0], jax.ShapeDtypeStruct)


def _placed_experts(moe, store: ExpertStore, rank: int, experts: list[int]) -> dict[int, Leaves]:
    """The leaves of the experts a layer places in slots and RAM: sliced from its stacks (on the
    device or in host RAM: one host copy per layer), or read from the artifact when the stacks
    were not loaded (the disk tier's experts are then never read here)."""
    if _not_loaded(moe):
        return dict(zip(experts, store.read_many(rank, experts)))
    stacks = [np.asarray(jax.device_get(a)) for a in jax.tree.leaves(projections(moe))]
    return {e: [a[e] for a in stacks] for e in experts}


def experts_on_device(params: Params, artifact: str | None) -> Params:
    """`params` with every routed expert stack on the device (from host RAM, or read whole from
    `artifact` where loading left them there): the plain model, for when they all fit."""

    def stack(path, moe, name):
        leaf = getattr(moe, name)
        if isinstance(jax.tree.leaves(leaf)[0], jax.ShapeDtypeStruct):  # loaded with experts="artifact"
            if artifact is None:
                raise ValueError(f"{path}.{name} was not loaded and no artifact holds it")
            leaf = Artifact(artifact).read(f"{path}.{name}")
        return to_device(leaf, dtype)  # plain stacks take the model's dtype, quantized ones stay packed

    dtype = params.final_norm.dtype
    layers = list(params.layers)
    for i, layer in enumerate(layers):
        if layer.moe is not None:
            moe = layer.moe
            placed = {n: stack(f"layers.{i}.moe", moe, n) for n in ("gate_proj", "up_proj", "down_proj")}
            layers[i] = dataclasses.replace(layer, moe=dataclasses.replace(moe, **placed))
    return dataclasses.replace(params, layers=tuple(layers))


def placement_order(profile: RoutingProfile | None, layer: int, num_experts: int) -> np.ndarray:
    """Experts of one MoE layer, hottest first (profile counts; ties and no profile: by id)."""
    if profile is None:
        return np.arange(num_experts)
    return np.argsort(-profile.counts[layer], kind="stable")


@dataclasses.dataclass
class Placement:
    """Where each expert went at start, for the start-up log."""

    slots_per_layer: int
    host_per_layer: int
    disk_per_layer: int
    expert_bytes: int
    num_layers: int
    cpu_share: float = 0.0  # of each layer's misses, computed on the host's CPU

    def describe(self) -> str:
        gib = lambda n: n * self.expert_bytes * self.num_layers / 2**30
        return (
            f"experts: {self.num_layers} MoE layers x (slots {self.slots_per_layer} = {gib(self.slots_per_layer):.2f} GiB device, "
            f"host {self.host_per_layer} = {gib(self.host_per_layer):.2f} GiB RAM, "
            f"disk {self.disk_per_layer} = {gib(self.disk_per_layer):.2f} GiB artifact); "
            f"{self.expert_bytes / 2**20:.2f} MiB per expert; CPU computes {self.cpu_share:.0%} of the misses"
        )


def experts_at_load(model_dir, options: dict) -> str:
    """Where `load` should put the routed experts for these engine options (`EngineConfig` fields):
    on the device when nothing is offloaded; in host RAM when they all fit there; left in the
    artifact (read one by one as they are placed) when the model is an artifact whose experts
    exceed the host budget. In that case the model's artifact becomes the disk tier
    (options["expert_artifact"])."""
    if options.get("gpu_expert_budget") is None:
        return "device"
    if model_dir is None or not is_artifact(model_dir):
        return "host"
    artifact = options.get("expert_artifact")
    same = artifact is None or Path(artifact).resolve() == Path(model_dir).resolve()
    if options.get("host_expert_budget", "all") in (None, "all") or not same:
        return "host"
    options["expert_artifact"] = str(model_dir)
    return "artifact"


class ExpertOffload:
    """Owns the slot arrays, the cache's host state and the store; hands the engine its params."""

    def __init__(self, params: Params, layout: ExpertLayout, cache: ExpertCache, placement: Placement):
        self.params = params
        self.layout = layout
        self.cache = cache
        self.store = cache.store
        self.placement = placement
        self.host_per_layer = placement.host_per_layer

    @property
    def stats(self):
        """The cache's counters, once every routing report sent so far has been recorded."""
        host_report.deliver(wait=True)
        return self.cache.stats

    def report(self, tokens: int):
        """`ExpertCache.report` with the routing reports that have arrived recorded (waits for none)."""
        host_report.deliver()
        return self.cache.report(tokens)

    def routing_counts(self) -> np.ndarray:
        """A copy of the routing counts [MoE layers, E] recorded since the last reset, every report
        sent so far included."""
        host_report.deliver(wait=True)
        return self.cache.routing_counts.copy()

    def reset_stats(self) -> None:
        """Zero the counters, once the routing reports already sent are in (so none lands after)."""
        host_report.deliver(wait=True)
        self.cache.reset_stats()

    # ---- build ---------------------------------------------------------------------------------
    @classmethod
    def build(
        cls,
        cfg: ModelConfig,
        params: Params,
        gpu_budget: int | str | None,
        host_budget: int | str | None = "all",
        artifact: str | Artifact | None = None,
        profile: RoutingProfile | str | None = None,
        host_reads: str = "auto",
        host_copy: str = "auto",
        prefetch: bool = False,
        cpu_share: float | str = "auto",
        prefetch_blocks: int = PREFETCH_GATHER_BLOCKS,
        prefetch_guesses: int = 0,
        **cache_options: Any,
    ) -> ExpertOffload:
        """Replace every MoE layer's expert stacks by slots; see the module docstring.

        gpu_budget / host_budget: bytes ("16GiB"), "all", or 0. Experts beyond both budgets need
        `artifact` (a converted artifact holding these weights). host_reads: "callback",
        "program" (the module docstring) or "auto" (`resolve_host_reads`); host_copy: how
        "program" copies the missed experts (`model.host_copy.HOST_COPIES`, or "auto":
        `resolve_host_copy`); prefetch: each layer copies the next one's guessed misses ahead
        (`SlottedExperts.prefetch`; "program" only) with a gather of `prefetch_blocks` blocks
        ("mapped"; `SlottedExperts.prefetch_blocks`), `prefetch_guesses` experts guessed a token
        (0: the router's top-k); cpu_share: the share of each layer's misses
        computed on the host's CPU ("auto": measured, `cpu_share_at_start`; "callback" only).
        Raises ValueError when they do not fit anywhere, when "program" is asked for with experts
        on disk, or prefetch or a CPU share without the host reads they need."""
        if host_reads not in HOST_READS:
            raise ValueError(f"host_reads must be one of {HOST_READS}, got {host_reads!r}")
        if host_copy not in (*HOST_COPIES, "auto"):
            raise ValueError(f"host_copy must be auto or one of {HOST_COPIES}, got {host_copy!r}")
        layout = layout_of(cfg, params)
        if isinstance(profile, str):
            profile = RoutingProfile.load(profile)
        if profile is not None:
            profile.check(len(layout.moe_layers), layout.num_experts)
        if isinstance(artifact, str):
            artifact = Artifact(artifact)
        num_experts = layout.num_experts
        slots = max(1, experts_in_budget(gpu_budget, layout))  # one slot at least: a static shape
        host = min(num_experts - min(slots, num_experts), experts_in_budget(host_budget, layout))
        disk = num_experts - min(slots, num_experts) - host
        if artifact is None and _not_loaded(params.layers[layout.moe_layers[0]].moe):
            raise ValueError(
                "the model's routed experts were not loaded (experts='artifact'); give the artifact "
                "they are in as the expert artifact"
            )
        if disk and artifact is None:
            raise ValueError(
                f"{disk} experts per layer fit neither the GPU expert budget ({gpu_budget}) nor the host "
                f"budget ({host_budget}); give an artifact for the disk tier or raise a budget"
            )
        host_reads = resolve_host_reads(host_reads, disk)
        if disk and host_reads == "program":
            raise ValueError(
                f"expert host reads in the program need every expert in host RAM; {disk} experts per "
                f"layer would stay on disk: raise the host budget ({host_budget}) or use callbacks"
            )
        if prefetch and host_reads != "program":
            raise ValueError(
                "expert prefetch copies the next layer's guessed misses inside the program: it needs "
                f"expert host reads in the program, and these resolved to {host_reads!r}"
            )
        paths = {
            rank: tuple(f"layers.{layer}.moe.{name}" for name in ("gate_proj", "up_proj", "down_proj"))
            for rank, layer in enumerate(layout.moe_layers)
        }
        store = ExpertStore(layout, artifact, paths)
        host_memory = None  # pinned host memory the program reads missed experts from
        if host_reads == "program":
            device = jax.devices()[0]
            if PINNED_HOST not in memory_kinds(device):
                raise ValueError(
                    f"expert host reads in the program need {PINNED_HOST} memory; {device} has none"
                )
            host_memory = HostMemory(device, pinned=True)
        cache = ExpertCache(layout, store, slots, reads_in_program=host_memory is not None, **cache_options)
        source_id = jnp.asarray(register_expert_source(cache), jnp.int32)
        layers = list(params.layers)
        share = None  # f32 [] on the device when the host's CPU computes a share of the misses
        for rank, layer in enumerate(layout.moe_layers):
            order = placement_order(profile, rank, num_experts)
            resident = [int(e) for e in order[:slots]]
            in_ram = [int(e) for e in order[slots : slots + host]]
            experts = _placed_experts(params.layers[layer].moe, store, rank, resident + in_ram)
            if rank == 0:
                dtype = params.final_norm.dtype  # the activations' (the CPU computes in it too)
                value, cache.host_compute = cpu_share_at_start(
                    cpu_share, host_reads, layout, experts[resident[0]], cfg.hidden_size, dtype
                )
                share = None if cache.host_compute is None else _committed(np.float32(value))
            if host_memory is None:  # else the pinned stacks below are the host tier (no second copy)
                for e in in_ram:
                    store.put_host(rank, e, experts[e])
            slot_leaves = _stack([experts[e] for e in resident], layout, slots)
            for slot, e in enumerate(resident):
                cache.assign(rank, slot, e)
            host_stacks = rows_ref = None
            if host_memory is not None:  # every expert, the slotted ones too: slots are a cache
                rows = expert_rows([experts[e] for e in range(num_experts)])
                (host_stacks,) = host_memory.adopt((rows,))
                del rows
                host_copy = resolve_host_copy(host_copy, host_stacks)  # the first layer decides for all
                if prefetch:
                    check_prefetch_copy(host_copy, jax.default_backend())
                if host_copy == "dma":
                    rows_ref = _committed(np.int32(register_host_rows(host_stacks)))
                elif host_copy == "mapped":
                    rows_ref = _committed(host_rows_address(host_stacks))
            slotted = SlottedExperts(
                *jax.tree.unflatten(layout.treedef, [_committed(a) for a in slot_leaves]),
                slot_map=_committed(cache.slot_map[rank]),
                source_id=source_id,
                layer=rank,
                host_stacks=host_stacks,
                host_copy=host_copy,
                host_rows_ref=rows_ref,
                prefetch=prefetch and host_stacks is not None,
                prefetch_blocks=prefetch_blocks,
                prefetch_guesses=prefetch_guesses,
                cpu_share=share,
            )
            new_moe = dataclasses.replace(
                params.layers[layer].moe, gate_proj=slotted, up_proj=None, down_proj=None
            )
            layers[layer] = dataclasses.replace(params.layers[layer], moe=new_moe)
            del experts
        placement = Placement(
            slots, host, disk, layout.expert_bytes, len(layout.moe_layers), 0.0 if share is None else value
        )
        log.info("%s", placement.describe())
        return cls(dataclasses.replace(params, layers=tuple(layers)), layout, cache, placement)

    # ---- between steps -------------------------------------------------------------------------
    def _slotted(self, rank: int) -> SlottedExperts:
        return self.params.layers[self.layout.moe_layers[rank]].moe.gate_proj

    def _set_slotted(self, rank: int, slotted: SlottedExperts) -> None:
        index = self.layout.moe_layers[rank]
        layers = list(self.params.layers)
        moe = dataclasses.replace(layers[index].moe, gate_proj=slotted)
        layers[index] = dataclasses.replace(layers[index], moe=moe)
        self.params = dataclasses.replace(self.params, layers=tuple(layers))

    def rebalance(self) -> Params:
        """Apply the cache's planned swaps. Returns the new params. A program still running keeps
        the slots it was given: the swaps' programs take the slot arrays over (donated) after it.

        An expert whose read fails is not promoted (the failure is counted and logged); the slots
        and the output stay consistent. The plan uses the routing reports that have arrived
        (`host_report.deliver`): those of a step still running count at the next call."""
        stats = self.cache.stats
        t0 = time.perf_counter()
        host_report.deliver()
        t1 = time.perf_counter()
        by_layer: dict[int, list] = {}
        for swap in self.cache.plan_swaps():
            by_layer.setdefault(swap.layer, []).append(swap)
        t2 = time.perf_counter()
        if by_layer and self.cache.reads_in_program:  # every layer's stacks sit in pinned host memory
            self._apply_from_host_stacks(by_layer)
        else:
            for rank, swaps in by_layer.items():
                self._apply(rank, swaps)
        stats.rebalance_deliver_seconds += t1 - t0
        stats.rebalance_plan_seconds += t2 - t1
        stats.rebalance_apply_seconds += time.perf_counter() - t2
        return self.params

    def _apply(self, rank: int, swaps: list) -> None:
        store, cache, layout = self.store, self.cache, self.layout
        incoming, kept = [], []
        for swap in swaps:
            try:
                incoming.append(store.read(rank, swap.expert))
                kept.append(swap)
            except ExpertReadError as e:
                cache.stats.read_failures += 1
                cache.last_error = str(e)
                log.warning("expert promotion skipped: %s", e)
        if not kept:
            return
        slotted = self._slotted(rank)
        slots = (slotted.gate_proj, slotted.up_proj, slotted.down_proj)
        for swap in kept:
            store.drop_host(rank, swap.expert)  # it lives in its slot now (tiers are exclusive)
        evicted = [s for s in kept if s.evicted >= 0]
        for start in range(0, len(evicted), WRITE_WIDTH):  # evicted experts go back to RAM while it has room
            part = evicted[start : start + WRITE_WIDTH]
            ids = np.full(WRITE_WIDTH, -1, np.int32)
            ids[: len(part)] = [s.slot for s in part]
            rows = [np.asarray(a) for a in jax.tree.leaves(jax.device_get(read_slots_program(slots, ids)))]
            for i, s in enumerate(part):
                if store.host_count(rank) < self.host_per_layer or not store.has_disk:
                    store.put_host(rank, s.evicted, [r[i] for r in rows])
                    cache.stats.demoted_bytes += layout.expert_bytes
                # otherwise RAM is full and the artifact is its home
        for start in range(0, len(kept), WRITE_WIDTH):
            part = kept[start : start + WRITE_WIDTH]
            ids = np.full(WRITE_WIDTH, -1, np.int32)
            ids[: len(part)] = [s.slot for s in part]
            data = _stack(incoming[start : start + WRITE_WIDTH], layout, WRITE_WIDTH)
            slots = write_slots_program(slots, jnp.asarray(ids), jax.tree.unflatten(layout.treedef, data))
            cache.stats.slot_programs += 1
        for swap in kept:
            cache.assign(rank, swap.slot, swap.expert)
            cache.stats.promotions += 1
            cache.stats.promoted_bytes += layout.expert_bytes
        self._set_slotted(
            rank,
            dataclasses.replace(
                slotted,
                gate_proj=slots[0],
                up_proj=slots[1],
                down_proj=slots[2],
                slot_map=_committed(cache.slot_map[rank]),
            ),
        )

    def _apply_from_host_stacks(self, by_layer: dict[int, list]) -> None:
        """Swaps where every expert also sits in pinned host stacks (`host_reads="program"`): one
        program (`promote_layers_from_host_program`) copies the promoted experts of every layer from
        them into their slots, WRITE_WIDTH a layer a call, and an evicted expert needs no copy back
        (its host copy never left). Nothing waits for the device, so the swaps queue behind the
        running step instead of ending the asynchronous decode pipeline."""
        cache, layout = self.cache, self.layout
        ranks = range(cache.num_layers)
        slotted = [self._slotted(rank) for rank in ranks]
        layers_slots = tuple((se.gate_proj, se.up_proj, se.down_proj) for se in slotted)
        rounds = max((-(-len(swaps) // WRITE_WIDTH) for swaps in by_layer.values()), default=1)
        for r in range(rounds):
            ids = np.full((len(ranks), WRITE_WIDTH), -1, np.int32)
            experts = np.full((len(ranks), WRITE_WIDTH), -1, np.int32)
            for rank, swaps in by_layer.items():
                part = swaps[r * WRITE_WIDTH : (r + 1) * WRITE_WIDTH]
                ids[rank, : len(part)] = [s.slot for s in part]
                experts[rank, : len(part)] = [s.expert for s in part]
            layers_slots = promote_layers_from_host_program(
                layers_slots,
                jnp.asarray(ids),
                tuple(se.host_stacks for se in slotted),
                jnp.asarray(experts),
                tuple(se.host_rows_ref for se in slotted),
                method=slotted[0].host_copy,
            )
            cache.stats.slot_programs += 1
        for rank, swaps in by_layer.items():
            for swap in swaps:
                cache.assign(rank, swap.slot, swap.expert)
                cache.stats.promotions += 1
                cache.stats.promoted_bytes += layout.expert_bytes
        maps = dict(zip(by_layer, _committed_all([cache.slot_map[rank] for rank in by_layer]), strict=True))
        for rank, se, slots in zip(ranks, slotted, layers_slots, strict=True):
            update = dict(zip(("gate_proj", "up_proj", "down_proj"), slots, strict=True))
            if rank in maps:
                update["slot_map"] = maps[rank]
            self._set_slotted(rank, dataclasses.replace(se, **update))

    def warmup(self) -> None:
        """Compile the slot programs now (all-skip writes), so that the first swap compiles nothing."""
        slotted = self._slotted(0)
        slots = (slotted.gate_proj, slotted.up_proj, slotted.down_proj)
        ids = np.full(WRITE_WIDTH, -1, np.int32)
        jax.block_until_ready(read_slots_program(slots, ids))
        if self.cache.reads_in_program:
            self._apply_from_host_stacks({})  # one all-skip call: every layer's slots, nothing moved
            return
        data = jax.tree.unflatten(self.layout.treedef, _stack([], self.layout, WRITE_WIDTH))
        self._set_slotted(
            0,
            dataclasses.replace(
                slotted,
                **dict(
                    zip(
                        ("gate_proj", "up_proj", "down_proj"),
                        write_slots_program(slots, jnp.asarray(ids), data),
                    )
                ),
            ),
        )

    def describe(self) -> str:
        s = self.stats
        return (
            f"{self.placement.describe()}\nexpert cache: {s.lookups} lookups, hit rate {s.hit_rate:.1%}, "
            f"misses {s.misses} (host {s.host_hits}, disk {s.disk_hits}), {s.bytes_moved / 2**20:.1f} MiB moved"
        )

    def close(self) -> None:
        self.store.close()
        if self.cache.host_compute is not None:
            self.cache.host_compute.close()
