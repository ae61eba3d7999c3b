"""SwiGLU MLP and the mixture-of-experts block (softmax router, top-k, optional shared expert).

Routed experts come either from full stacks in `MoEParams` ([E, ...] each) or, when experts do not
fit in device memory, from a `SlottedExperts` held in `MoEParams.gate_proj`: a fixed number of
device slots per layer, a slot map, and a host callback that supplies the experts a step needs
but the slots lack (infernix_jax/experts/ builds and fills them; docs/experts.md). Inside
`forward` the layers' routing counts reach the host in one message per forward that the device
does not wait for (`collect_expert_routing`, `model/host_report.py`), so a layer whose experts all
sit in slots makes no host round trip.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import itertools
import math
import threading
import weakref
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback
from jax.experimental.compute_on import compute_on

from infernix_jax.config import ModelConfig
from infernix_jax.model import host_copy, host_report
from infernix_jax.model.host_copy import GATHER_BLOCKS
from infernix_jax.model.params import MLPParams, MoEParams
from infernix_jax.switches import env_mode, switched
from infernix_jax.weights.quant import (
    GROUPED_DECODE_MAX_TOKENS,
    ExpertStackPair,
    NormSource,
    QuantizedWeight,
    dequantize,
    grouped_expert_matmul,
    grouped_expert_matmuls,
    grouped_kernel_ready,
    grouped_norm_words,
    grouped_routing,
    matmul,
    matmuls,
    pair_norm_words,
    pairs_read_in_place,
    routing_kernel_takes,
    row_experts_ready,
    swiglu_words,
    take,
    with_expert_rows,
)

# With few (token, expert) pairs, gather each pair's expert weights: it reads only the chosen experts
# (the decode case). Once the pairs would read more than half of all experts, sort the pairs by
# expert and run a grouped matmul (`_experts_grouped`): on a GPU the grouped Pallas kernel, which
# reads each routed expert once, elsewhere dequantize + `ragged_dot`. NVFP4 / FP8 expert stacks
# take the grouped kernel at every size when it runs (`grouped_kernel_ready`): it unpacks only the
# routed experts in registers.
GATHER_MIN_PAIRS = 64
# Up to this many ids (a decode step's (token, expert) pairs) the pairs' order and the experts'
# counts come from comparisons, not a sort and scatters (`_sort_pairs`, `_count_ids`).
COUNT_BY_COMPARING_MAX = 256
# Up to this many tokens the router's top-k comes from comparisons (`_top_k`), not a sort.
TOP_K_BY_COMPARING_MAX = 64
# How a slotted layer's grouped kernel reads the routed experts (`slot_reads`): "copy" them from
# their slots and the fetched set into one stack of the routed experts first, or read them "in_place"
# (`ExpertStackPair`: the slots as they are).
SLOT_READS = ("copy", "in_place")
ROUTER_TOP_K_WAYS = ("compare", "sort")
# How a resident MoE layer whose experts take the grouped kernel routes a decode step (`moe_routing`):
# "kernel": the softmax, top-k, the pairs' order and the rows in that order in one launch
# (pallas_kernels/moe_routing.py, up to its MAX_TOKENS tokens; slower than what it replaces so
# far: docs/pallas.md); "xla": XLA's ~8 small launches.
MOE_ROUTING_WAYS = ("xla", "kernel")
ON_OFF = ("on", "off")
# read while tracing: "compare" (comparisons up to TOP_K_BY_COMPARING_MAX tokens) or "sort"
# (lax.top_k at every size); INFERNIX_ROUTER_TOP_K, or a `router_top_k` block
_modes = {
    "router_top_k": env_mode("INFERNIX_ROUTER_TOP_K", "compare", ROUTER_TOP_K_WAYS),
    "slot_reads": env_mode("INFERNIX_SLOT_READS", "copy", SLOT_READS),
    "moe_routing": env_mode("INFERNIX_MOE_ROUTING", "xla", MOE_ROUTING_WAYS),
    "shared_expert_rows": env_mode("INFERNIX_SHARED_EXPERT_ROWS", "on", ON_OFF),
}


def router_top_k(way: str) -> contextlib.AbstractContextManager[None]:
    """How the MoE router's top-k runs in programs traced inside this block: "compare" or "sort"
    (lax.top_k's sort kernel on a GPU; the same values and ids either way)."""
    return switched(_modes, "router_top_k", way, ROUTER_TOP_K_WAYS, "router top-k")


def slot_reads_mode() -> str:
    """The way slotted layers read their routed experts in programs traced now (SLOT_READS)."""
    return _modes["slot_reads"]


def slot_reads(way: str) -> contextlib.AbstractContextManager[None]:
    """How slotted MoE layers' grouped kernel reads the routed experts in programs traced inside
    this block: "copy" (into one stack first) or "in_place" (slots and fetched experts where they
    are); the same output either way (SLOT_READS; default: INFERNIX_SLOT_READS, "copy" until a GPU
    measures "in_place": docs/gpu_runs.md row 11i)."""
    return switched(_modes, "slot_reads", way, SLOT_READS, "slot reads")


def moe_routing_mode() -> str:
    """The way resident MoE layers route decode steps in programs traced now (MOE_ROUTING_WAYS)."""
    return _modes["moe_routing"]


def moe_routing(way: str) -> contextlib.AbstractContextManager[None]:
    """How resident MoE layers on the grouped kernel route a decode step in programs traced inside
    this block: "kernel" (one launch, pallas_kernels/moe_routing.py; compiled or interpreted as the
    grouped kernel is, `quant.kernel_mode`) or "xla"; the same routing either way (MOE_ROUTING_WAYS;
    default: INFERNIX_MOE_ROUTING, "xla": on an H100 the kernel saved its launches but took 10.5 us
    a call at one token and 35.5 us at eight, where XLA's launches take 11.6 and 15.9 us in all,
    docs/gpu_runs.md row 6w)."""
    return switched(_modes, "moe_routing", way, MOE_ROUTING_WAYS, "MoE routing")


def shared_expert_rows_mode() -> str:
    """Whether shared experts ride in the routed experts' launches in programs traced now (ON_OFF)."""
    return _modes["shared_expert_rows"]


def shared_expert_rows(way: str) -> contextlib.AbstractContextManager[None]:
    """Whether a MoE layer's shared expert runs, at decode sizes with resident experts on the
    grouped kernel, as one more pair of each token in the routed experts' launches ("on":
    `_shared_expert_rows`) or in launches of its own ("off"), in programs traced inside this block
    (default: INFERNIX_SHARED_EXPERT_ROWS, "on": 80B-A3B decode steps 96 launches fewer at one
    token, 192 at eight by `bench.deviceless`, device time a step -10.4% / -6.4% on an H100; the
    outputs agree to the kernels' rounding, not bit for bit)."""
    return switched(_modes, "shared_expert_rows", way, ON_OFF, "shared expert rows")


def mlp(p: MLPParams, x: jax.Array, norm: NormSource | None = None) -> jax.Array:
    """SwiGLU: down(silu(gate(x)) * up(x)). norm: x is that RMSNorm's output (`NormSource`)."""
    gate, up = matmuls(x, (p.gate_proj, p.up_proj), norm)  # one launch where the weights allow it
    return matmul(jax.nn.silu(gate) * up, p.down_proj)


def route(router: jax.Array, x: jax.Array, top_k: int, renormalize: bool) -> tuple[jax.Array, jax.Array]:
    """Softmax router in fp32 -> (weights [N, k] in x's dtype, expert ids [N, k]).

    With `renormalize` the full softmax cancels out: the chosen experts are the top-k of the
    logits (softmax keeps their order) and their weights the softmax of the chosen logits, one
    launch a layer less than a softmax over every expert first (the same weights within float32
    rounding)."""
    logits = _router_logits(router, x)
    if renormalize:
        values, ids = _top_k(logits, top_k)
        return jax.nn.softmax(values, axis=-1).astype(x.dtype), ids
    values, ids = _top_k(jax.nn.softmax(logits, axis=-1), top_k)
    return values.astype(x.dtype), ids


def _router_logits(router: jax.Array, x: jax.Array) -> jax.Array:
    return matmul(x, router).astype(jnp.float32)


def _top_k(probs: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """jax.lax.top_k over the last axis of probs [N, E]: (values [N, k], indices [N, k] int32).

    Up to TOP_K_BY_COMPARING_MAX rows (decode) each expert's rank is the count of experts before
    it (a larger value, or an equal one at a lower index: top_k's order), and the k winners' ids and
    values come from one variadic reduce over the experts by rank (the id a masked sum, the value a
    masked max: XLA cannot split it, where a gather at the ids was a launch of its own). XLA's GPU
    top-k of 10 among 512 is a sort kernel of ~5 us a layer (the 80B-A3B profile, docs/pallas.md).
    The same values and indices, ties included."""
    n, e = probs.shape
    if n > TOP_K_BY_COMPARING_MAX or _modes["router_top_k"] == "sort":
        return jax.lax.top_k(probs, k)
    idx = jnp.arange(e, dtype=jnp.int32)
    a, b = probs[:, :, None], probs[:, None, :]
    before = (b > a) | ((b == a) & (idx[None, None, :] < idx[None, :, None]))  # [n, i, j]: j before i
    rank = jnp.sum(before, axis=2, dtype=jnp.int32)  # [n, e]
    hit = rank[:, None, :] == jnp.arange(k, dtype=jnp.int32)[None, :, None]  # [n, k, e]
    ids, values = jax.lax.reduce(
        (jnp.where(hit, idx[None, None, :], 0), jnp.where(hit, probs[:, None, :], -jnp.inf)),
        (jnp.int32(0), jnp.array(-jnp.inf, probs.dtype)),
        lambda a, b: (a[0] + b[0], jnp.maximum(a[1], b[1])), (2,),
    )  # fmt: skip
    return values, ids


def _experts_gathered(p: MoEParams, x: jax.Array, ids: jax.Array) -> jax.Array:
    """x [N, D], ids [N, k] -> per-pair expert outputs [N, k, D], reading only chosen experts
    (quantized experts: only their packed bytes, unpacked after the gather)."""
    return _pair_outputs(x, take(p.gate_proj, ids), take(p.up_proj, ids), take(p.down_proj, ids))


def _pair_outputs(x: jax.Array, gate: Any, up: Any, down: Any) -> jax.Array:
    """x [N, D] and each pair's (packed) expert weights gate/up [N, k, I, D], down [N, k, D, I]
    -> per-pair outputs [N, k, D]."""
    gate = dequantize(gate, x.dtype)
    up = dequantize(up, x.dtype)
    down = dequantize(down, x.dtype)
    h = jax.nn.silu(jnp.einsum("nd,nkid->nki", x, gate)) * jnp.einsum("nd,nkid->nki", x, up)
    return jnp.einsum("nki,nkdi->nkd", h, down)


def _count_ids(flat_ids: jax.Array, length: int, weights: jax.Array | None = None) -> jax.Array:
    """jnp.bincount(flat_ids, weights, length) (ids outside [0, length) count nothing). Up to
    COUNT_BY_COMPARING_MAX ids it compares every id with every bin and sums: one fusion on a GPU,
    where bincount's scatter is a zero fill and a scatter, two launches (decode's few pairs)."""
    if flat_ids.size > COUNT_BY_COMPARING_MAX:
        return jnp.bincount(flat_ids, weights=weights, length=length)
    hits = flat_ids[:, None] == jnp.arange(length, dtype=flat_ids.dtype)[None, :]
    if weights is None:
        return jnp.sum(hits, axis=0, dtype=jnp.int32)
    return jnp.sum(jnp.where(hits, weights[:, None], 0), axis=0)


def _sort_pairs(ids: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """ids [N, k] -> (order [N*k]: the flat (token, slot) pairs sorted by expert, stable;
    group_sizes [E] int32: how many pairs each expert got; rank [N*k]: where each pair lands in
    that order, or None).

    Up to COUNT_BY_COMPARING_MAX pairs (decode) the order comes from comparing every pair with
    every other (a pair's rank is the number of pairs before it: smaller expert, or the same
    expert earlier), which XLA fuses into a kernel or two; a sort on a GPU is a radix sort of
    several launches, and the unsort after it a zero fill and a scatter (`_unsort_pairs` gathers
    by rank instead). The order is the same as the stable argsort's."""
    flat_ids = ids.reshape(-1)
    group_sizes = _count_ids(flat_ids, num_experts).astype(jnp.int32)
    if flat_ids.size > COUNT_BY_COMPARING_MAX:
        return jnp.argsort(flat_ids, stable=True), group_sizes, None
    pos = jnp.arange(flat_ids.size, dtype=jnp.int32)
    a, b = flat_ids[:, None], flat_ids[None, :]
    before = (b < a) | ((b == a) & (pos[None, :] < pos[:, None]))  # [i, j]: pair j goes before pair i
    rank = jnp.sum(before, axis=1, dtype=jnp.int32)
    order = jnp.sum(jnp.where(rank[None, :] == pos[:, None], pos[None, :], 0), axis=1)  # rank's inverse
    return order, group_sizes, rank


def _unsort_pairs(
    ys: jax.Array, order: jax.Array, ids: jax.Array, rank: jax.Array | None = None
) -> jax.Array:
    """Per-pair outputs [N*k, D] in sorted order -> [N, k, D] in (token, slot) order (a gather by
    `rank` when given, else a scatter by `order`)."""
    out = jnp.take(ys, rank, axis=0) if rank is not None else jnp.zeros_like(ys).at[order].set(ys)
    return out.reshape(*ids.shape, -1)


def _experts_grouped(
    p: MoEParams,
    x: jax.Array,
    ids: jax.Array,
    num_experts: int,
    norm: NormSource | None = None,
    stacks: tuple[Any, ...] | None = None,
) -> jax.Array:
    """Sort the (token, expert) pairs by expert and run one grouped matmul per projection
    (`grouped_expert_matmul`: the grouped kernel where it runs, else dequantize + ragged_dot)
    -> per-pair outputs [N, k, D]. norm: x is that RMSNorm's output; the grouped kernel may take
    the pairs' rows from its tokens' rows (`grouped_norm_words`). stacks: the (gate, up, down)
    pairs of `_shared_expert_rows`: each token gets one more pair, naming the shared expert
    (expert E, the last group) -> [N, k + 1, D]."""
    if stacks is not None:
        ids = jnp.concatenate([ids, jnp.full((ids.shape[0], 1), num_experts, ids.dtype)], axis=1)
        num_experts += 1
    k = ids.shape[1]
    order, group_sizes, rank = _sort_pairs(ids, num_experts)
    token = order // k
    xs = jnp.take(x, token, axis=0)  # [N*k, D] grouped by expert
    x_words = grouped_norm_words(norm, x, (p.gate_proj, p.up_proj), token)
    return _grouped_outputs(p, xs, ids, order, group_sizes, rank, x_words, stacks)


def _grouped_outputs(
    p: MoEParams,
    xs: jax.Array,
    ids: jax.Array,
    order: jax.Array,
    group_sizes: jax.Array,
    rank: jax.Array | None,
    x_words: tuple[jax.Array, jax.Array] | None = None,
    stacks: tuple[Any, ...] | None = None,
) -> jax.Array:
    """The grouped matmuls over the pairs' rows sorted by expert, xs [N*k, D] (and, made before, as
    the word kernels take them: `x_words`) -> per-pair outputs [N, k, D] in (token, slot) order.
    stacks: (gate, up, down) in place of p's (`_experts_grouped`)."""
    n = ids.shape[0]
    gate_w, up_w, down_w = (p.gate_proj, p.up_proj, p.down_proj) if stacks is None else stacks
    gate, up = grouped_expert_matmuls(xs, (gate_w, up_w), group_sizes, tokens=n, x_words=x_words)
    h = jax.nn.silu(gate) * up  # [N*k, I]
    h_words = swiglu_words(gate, up, p.down_proj, n)  # h's rows from one launch, where that runs
    down = grouped_expert_matmul(h, down_w, group_sizes, tokens=n, x_words=h_words)
    return _unsort_pairs(down, order, ids, rank)


def _takes_grouped_kernel(stacks: tuple[Any, Any, Any]) -> bool:
    """Whether quantized expert stacks (gate, up, down) go through the grouped kernel at every token
    count (the slotted and all-resident paths decide alike, so they give the same output)."""
    return any(isinstance(w, QuantizedWeight) for w in stacks) and grouped_kernel_ready(*stacks)


def _experts_by_pair(
    p: MoEParams, x: jax.Array, ids: jax.Array, norm: NormSource | None = None, stacks: tuple[Any, ...] | None = None
) -> jax.Array:
    """One token's per-pair outputs [1, k, D] through the grouped kernel with each pair naming its
    expert (`grouped_expert_matmuls(row_experts=True)`): at one token every pair has an expert of
    its own, so the pairs need no count, sort, gather of their rows or unsort (four launches a
    layer fewer than `_experts_grouped` on the 80B-A3B shape); the half2 gemv reads the token's
    word row from its norm for all of its pairs. The same outputs as `_experts_grouped`.
    stacks: the (gate, up, down) pairs of `_shared_expert_rows`: each token gets one more row, after
    its pairs, naming the shared expert (expert E of the pairs) -> [1, k + 1, D]."""
    n, k = ids.shape
    pair_experts = ids.reshape(-1)  # with the shared row: it goes unnamed (the pairs' second stack)
    if stacks is None:
        stacks = (p.gate_proj, p.up_proj, p.down_proj)
    else:
        k += 1
    xs = jnp.repeat(x, k, axis=0)  # [N*k, D]: read only where no words are given
    x_words = pair_norm_words(norm, x, (p.gate_proj, p.up_proj), k)
    gate, up = grouped_expert_matmuls(xs, stacks[:2], pair_experts, tokens=n, x_words=x_words, row_experts=True)
    h_words = swiglu_words(gate, up, p.down_proj, n)
    down = grouped_expert_matmul(jax.nn.silu(gate) * up, stacks[2], pair_experts, tokens=n, x_words=h_words,
                                 row_experts=True)  # fmt: skip
    return down.reshape(n, k, -1)


def _experts_resident(
    p: MoEParams, x: jax.Array, ids: jax.Array, num_experts: int, norm: NormSource | None = None
) -> jax.Array:
    """Per-pair outputs [N, k, D] of experts whose stacks are all on the device (norm: x is that
    RMSNorm's output, `_experts_grouped`); one token through `_experts_by_pair`."""
    stacks = (p.gate_proj, p.up_proj, p.down_proj)
    if _takes_grouped_kernel(stacks):
        if ids.shape[0] == 1 and row_experts_ready(stacks, 1, ids.size, x.dtype):
            return _experts_by_pair(p, x, ids, norm)
        return _experts_grouped(p, x, ids, num_experts, norm)
    if ids.size <= max(GATHER_MIN_PAIRS, num_experts // 2):
        return _experts_gathered(p, x, ids)
    return _experts_grouped(p, x, ids, num_experts, norm)


def _routes_in_kernel(p: MoEParams, tokens: int, cfg: ModelConfig) -> bool:
    """Whether this decode step routes in one kernel launch: under `moe_routing("kernel")`, for a
    resident layer whose experts take the grouped kernel, within the routing kernel's sizes."""
    if _modes["moe_routing"] != "kernel" or isinstance(p.gate_proj, SlottedExperts):
        return False
    if not routing_kernel_takes(tokens, cfg.num_experts, cfg.num_experts_per_tok):
        return False
    return _takes_grouped_kernel((p.gate_proj, p.up_proj, p.down_proj))


def _experts_routed_in_kernel(
    p: MoEParams, xf: jax.Array, cfg: ModelConfig, valid: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    """The resident grouped path with the routing in one launch: (weights [N, k], per-pair outputs
    [N, k, D]), the same as `route` + `_experts_resident`."""
    weights, ids, order, rank, group_sizes, xs, x_words = grouped_routing(
        _router_logits(p.router, xf), xf, valid, top_k=cfg.num_experts_per_tok, renormalize=cfg.norm_topk_prob,
        stacks=(p.gate_proj, p.up_proj),
    )  # fmt: skip
    return weights, _grouped_outputs(p, xs, ids, order, group_sizes, rank, x_words)


def moe(
    p: MoEParams, x: jax.Array, cfg: ModelConfig, valid: jax.Array | None = None, norm: NormSource | None = None
) -> jax.Array:
    """x [..., D] -> [..., D]: sum_k w_k E_k(x) + sigmoid(shared_gate(x)) * shared(x).

    valid [...] bool (optional): False marks padding tokens (of a batch or chunk bucket). They take
    the first valid token's experts, so that they make no expert read (nor fetch, for experts
    beyond device memory) of their own; their outputs are meaningless, as they are anyway.
    norm: x is that RMSNorm's output (the layer's post-attention norm; `NormSource`), which the
    shared expert's projections may take their rows from. Where they do, the router, the routing
    and the shared gate read the norm launch's own output too, so XLA's norm of x goes unused
    (one launch a layer less; its values may differ from XLA's by an ulp)."""
    shape = x.shape
    xf = x.reshape(-1, shape[-1])
    valid = None if valid is None else valid.reshape(-1)
    slotted = isinstance(p.gate_proj, SlottedExperts)
    shared_rows = None if slotted else _shared_expert_rows(p, xf, cfg)
    if shared_rows is not None:  # the norm's words first: the router then reads the norm's output
        pair_norm_words(norm, xf, (p.gate_proj, p.up_proj), cfg.num_experts_per_tok + 1)
    # the shared expert's own launches first: they may launch the norm's kernel
    shared = None if p.shared is None or shared_rows is not None else mlp(p.shared, xf, norm)
    kernel_normed = None if norm is None else norm.kernel_output()
    if kernel_normed is not None and kernel_normed.dtype == xf.dtype:
        xf = kernel_normed.reshape(xf.shape)
    if _routes_in_kernel(p, xf.shape[0], cfg):
        _prefetch_next_layer(xf, valid, cfg)  # nothing of this layer's own crosses PCIe
        weights, per_pair = _experts_routed_in_kernel(p, xf, cfg, valid)
        return _combine(p, xf, weights, per_pair, shared).reshape(shape)
    weights, ids = route(p.router, xf, cfg.num_experts_per_tok, cfg.norm_topk_prob)
    if valid is not None and xf.shape[0] > 1:  # one row is its own first row
        ids = jnp.where(valid[:, None], ids, ids[jnp.argmax(valid)])
    prefetched = _take_prefetched(p.gate_proj) if slotted else None
    if slotted:  # the next layer's likely misses are copied after this layer's own (`then`)
        then = functools.partial(_prefetch_next_layer, xf, valid, cfg)
        per_pair = _experts_slotted(p.gate_proj, xf, ids, cfg.num_experts, valid, prefetched, then)
    else:
        _prefetch_next_layer(xf, valid, cfg)  # nothing of this layer's own crosses PCIe
        if shared_rows is not None:  # the shared expert's output is each token's last row
            if xf.shape[0] == 1:
                per_pair = _experts_by_pair(p, xf, ids, norm, shared_rows)
            else:
                per_pair = _experts_grouped(p, xf, ids, cfg.num_experts, norm, shared_rows)
            return _combine(p, xf, weights, per_pair[:, :-1], per_pair[:, -1]).reshape(shape)
        per_pair = _experts_resident(p, xf, ids, cfg.num_experts, norm)
    return _combine(p, xf, weights, per_pair, shared).reshape(shape)


def _shared_expert_rows(p: MoEParams, xf: jax.Array, cfg: ModelConfig) -> tuple[Any, ...] | None:
    """The (gate, up, down) stacks paired with the shared expert as one more expert
    (`quant.with_expert_rows`) where a decode step's resident experts run on the grouped kernel
    and the shared expert can ride in those launches as each token's last pair; else None. Three
    launches a MoE layer fewer than its own projections and SwiGLU (`shared_expert_rows`)."""
    tokens = xf.shape[0]
    if (
        _modes["shared_expert_rows"] != "on" or p.shared is None or tokens > GROUPED_DECODE_MAX_TOKENS
        or _routes_in_kernel(p, tokens, cfg) or not _takes_grouped_kernel((p.gate_proj, p.up_proj, p.down_proj))
    ):  # fmt: skip
        return None
    shared = (p.shared.gate_proj, p.shared.up_proj, p.shared.down_proj)
    rows = tokens * (cfg.num_experts_per_tok + 1)
    return with_expert_rows((p.gate_proj, p.up_proj, p.down_proj), shared, tokens, rows, xf.dtype)


def _combine(
    p: MoEParams, xf: jax.Array, weights: jax.Array, per_pair: jax.Array, shared: jax.Array | None
) -> jax.Array:
    """The routed experts' weighted sum plus the gated shared expert's output `shared`: [N, D]."""
    out = jnp.einsum("nk,nkd->nd", weights, per_pair)
    if shared is not None:
        out = out + jax.nn.sigmoid(matmul(xf, p.shared_gate)) * shared
    return out


# ---- experts in device slots ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SlottedExperts:
    """One MoE layer's routed experts in a fixed number of device slots (placed in MoEParams.gate_proj;
    up_proj and down_proj are then None).

    The slot arrays and the slot map are ordinary inputs of the jitted programs: changing which
    expert sits in which slot changes their contents, never their shapes, so nothing recompiles.
    A step that routes a token to an expert without a slot asks its source (found by `source_id`
    in `EXPERT_SOURCES`) for it through a host callback: its packed bytes, exactly as stored, so
    the output equals the all-resident model's. The source is found by a number carried as data,
    not held in the tree's static part, so that engines of the same shapes share compiled programs.
    """

    gate_proj: Any  # [S, I, D] plain or quantized (packed) slot arrays
    up_proj: Any  # [S, I, D]
    down_proj: Any  # [S, D, I]
    slot_map: jax.Array  # i32 [E]: the slot holding each expert, -1 when it has none
    source_id: jax.Array  # i32 []: key of the source in EXPERT_SOURCES
    layer: int = 0  # static: the source's key for this layer
    # Every expert of the layer as one byte row each, u8 [E, expert_bytes] in `pinned_host` memory
    # (its flattened (gate, up, down) leaves end to end), or None. When given, a missed expert is
    # copied from it inside the program (`_read_missed_in_program`: no host callback); the routing
    # still reaches the source through the forward's one report.
    host_stacks: Any = None
    # static: how the program copies the missed rows out of host_stacks (`host_copy.HOST_COPIES`)
    host_copy: str = "loop"
    # how the host-side of the copy finds host_stacks (else None): host_copy "dma": i32 [], their key
    # in `host_copy.HOST_ROWS`; "mapped": i32 [2], their device address (`host_copy.host_rows_address`)
    host_rows_ref: Any = None
    # static: the layer before copies this layer's likely misses ahead, on a second stream
    # (`prefetching_experts`; only with host_stacks)
    prefetch: bool = False
    # static: blocks of the "mapped" gather that prefetches (`host_copy.copy_rows_mapped`): few, so
    # the copy runs beside the layer's kernels instead of taking every SM until it is done
    prefetch_blocks: int = GATHER_BLOCKS
    # static: experts guessed per token for this layer, the router's likeliest first (0: its top-k);
    # fewer guesses waste fewer bytes on experts the layer does not route to, and catch fewer misses
    prefetch_guesses: int = 0
    # f32 []: the share of a step's missed experts the host computes on its CPU (the fetch callback
    # returns their pairs' outputs instead of their weights; `_split_missed`), or None: every missed
    # expert crosses to the device. Data, so a re-measured share recompiles nothing. Callbacks only.
    cpu_share: Any = None


jax.tree_util.register_dataclass(
    SlottedExperts,
    data_fields=[
        "gate_proj",
        "up_proj",
        "down_proj",
        "slot_map",
        "source_id",
        "host_stacks",
        "host_rows_ref",
        "cpu_share",
    ],
    meta_fields=["layer", "host_copy", "prefetch", "prefetch_blocks", "prefetch_guesses"],
)

# id -> the host object serving missed experts: fetch(layer, counts i32 [E], missed i32 [m]) -> leaves [m, ...]
EXPERT_SOURCES: weakref.WeakValueDictionary[int, Any] = weakref.WeakValueDictionary()
_next_source_id = itertools.count(1)


def register_expert_source(source: Any) -> int:
    """Make `source` reachable from programs; returns the id to put in SlottedExperts.source_id."""
    source_id = next(_next_source_id)
    EXPERT_SOURCES[source_id] = source
    return source_id


_routing = threading.local()  # .counts: the routing counts collected while tracing one forward


@contextlib.contextmanager
def collect_expert_routing():
    """While tracing one forward: each slotted MoE layer adds (source id, layer, counts [E]) to the
    yielded list instead of reporting its routing through its fetch callback, which then runs only
    when the layer misses an expert. The forward then calls `report_expert_routing` once."""
    previous = getattr(_routing, "counts", None)
    _routing.counts = []
    try:
        yield _routing.counts
    finally:
        _routing.counts = previous


def report_expert_routing(collected: list) -> jax.Array | None:
    """Send every collected layer's routing counts to their source in one message that the device
    does not wait for (`host_report.send_to_host`: the source records them when the host next
    calls `host_report.deliver`). An entry is (source id, layer, counts [E]) or, with the layer's
    prefetch counts, (source id, layer, counts [E], i32 [2]: rows the layer before prefetched for
    it, of which its step used). Returns the send's receipt, a float32 zero the caller must add to
    its result (else XLA drops the send); None when nothing was collected."""
    if not collected:
        return None
    layers = tuple(entry[1] for entry in collected)
    counts = jnp.stack([entry[2] for entry in collected]).astype(jnp.int32)  # [L, E]
    zero = jnp.zeros(2, jnp.int32)
    prefetch = jnp.stack([entry[3] if len(entry) > 3 else zero for entry in collected]).astype(jnp.int32)
    source_id = jnp.reshape(collected[0][0], (1,)).astype(jnp.int32)
    return host_report.send_to_host(
        jnp.concatenate([source_id, counts.reshape(-1), prefetch.reshape(-1)]),
        functools.partial(_receive_routing, layers),
    )


def _receive_routing(layers: tuple[int, ...], message: np.ndarray) -> None:
    """Host side of the routing report: message is [source id, counts [L, E] flattened, prefetch
    counts [L, 2] flattened]."""
    source = EXPERT_SOURCES.get(int(message[0]))
    if source is None:  # its engine was closed while the message was on its way: nothing to record
        return
    num_layers = len(layers)
    counts, prefetch = message[1 : len(message) - 2 * num_layers], message[len(message) - 2 * num_layers :]
    source.record_routing(layers, counts.reshape(num_layers, -1), prefetch.reshape(num_layers, 2))


# ---- prefetching the next layer's misses ------------------------------------------------------------

# A decode step's misses of layer l + 1 are guessed at layer l (layer l + 1's router applied to
# layer l's MoE input) and copied on a second GPU stream while layer l computes; layer l + 1 takes
# the guessed rows it needs and copies only the rest. Steps with more token-expert pairs than this
# (prefill) do not prefetch: they miss most of a layer anyway, and the rows would double the
# copy buffers.
PREFETCH_MAX_PAIRS = 64
PREFETCH_STREAM = "gpu_stream:1"  # jax's compute_on stream annotation (XLA runs it on its own stream)

_prefetch = threading.local()  # .next: the next layer's MoEParams or None; .rows: {layer: (have, rows)}


@contextlib.contextmanager
def prefetching_experts():
    """While tracing one forward: slotted layers with `prefetch` receive their guessed misses from
    the layer before (`announce_next_moe` names that layer before each layer runs)."""
    previous = (getattr(_prefetch, "next", None), getattr(_prefetch, "rows", None))
    _prefetch.next, _prefetch.rows = None, {}
    try:
        yield
    finally:
        _prefetch.next, _prefetch.rows = previous


def announce_next_moe(p: MoEParams | None) -> None:
    """Inside `prefetching_experts`: the MoE parameters of the layer after the one about to run
    (None at the last layer, or when it is not a slotted layer that prefetches)."""
    if getattr(_prefetch, "rows", None) is None:
        return
    se = p.gate_proj if p is not None else None
    wants = isinstance(se, SlottedExperts) and se.prefetch and se.host_stacks is not None
    _prefetch.next = p if wants else None


def _prefetch_next_layer(xf: jax.Array, valid: jax.Array | None, cfg: ModelConfig, after: Any = None) -> None:
    """Guess the next layer's routed experts from this layer's MoE input `xf` [N, D] and start
    copying the ones without a slot, on the prefetch stream (nothing when no next layer prefetches
    or the step is large). With `after` (this layer's copied misses), the guess waits for them: the
    copy this layer needs now has PCIe to itself, and the guessed one runs beside its compute."""
    p = getattr(_prefetch, "next", None)
    k, num_experts = cfg.num_experts_per_tok, cfg.num_experts
    if p is None or xf.shape[0] * k > PREFETCH_MAX_PAIRS:
        return
    if after is not None:
        xf, _ = jax.lax.optimization_barrier((xf, after))
    se = p.gate_proj
    _, guess = route(p.router, xf, min(se.prefetch_guesses or k, k), cfg.norm_topk_prob)
    if valid is not None:
        guess = jnp.where(valid[:, None], guess, guess[jnp.argmax(valid)])
    have = (_count_ids(guess.reshape(-1), num_experts) > 0) & (se.slot_map < 0)  # [E]
    size = min(guess.size, num_experts)
    ids, count = _first_ids(have, size, fill=-1), jnp.sum(have.astype(jnp.int32))

    def copy(host_stacks, ids, count, rows_ref):
        return copy_missed_rows(se.host_copy, host_stacks, ids, count, rows_ref, se.prefetch_blocks)

    rows = on_stream(copy, PREFETCH_STREAM)(se.host_stacks, ids, count, se.host_rows_ref)
    _prefetch.rows[se.layer] = (have, rows)


def on_stream(f: Callable[..., jax.Array], stream: str) -> Callable[..., jax.Array]:
    """`f` (one device result) run on the XLA stream `stream` ("gpu_stream:N"), across jax
    versions: jax 0.10 has `compute_on(type)`, a context manager around a jitted call; jax 0.11
    made it a function transform taking the results' memory spaces too."""
    if "out_memory_spaces" in inspect.signature(compute_on).parameters:
        return compute_on(f, compute_type=stream, out_memory_spaces=jax.memory.Space.Device)

    def run(*args):
        with compute_on(stream):
            return jax.jit(f)(*args)

    return run


def _take_prefetched(se: SlottedExperts) -> tuple[jax.Array, jax.Array] | None:
    """(have [E] bool, rows [P, row bytes]): what the layer before copied ahead for this layer,
    rows in ascending expert order; None when it copied nothing."""
    rows = getattr(_prefetch, "rows", None)
    return rows.pop(se.layer, None) if rows is not None else None


def fetch_buckets(max_missed: int) -> tuple[int, ...]:
    """Static sizes of the fetch callback's result (0, 1, 2, 3, 4, 6, 8, 12, ... up to max_missed):
    a step moves at most 1.5x the bytes of the experts it misses, with a few compiled branches."""
    sizes, m = [0], 1
    while m < max_missed:
        sizes.append(m)
        m = m + 1 if m < 2 else (m * 3 // 2 if m & (m - 1) == 0 else m * 4 // 3)
    return (*sizes, max_missed) if max_missed else (0,)


def _fetch_missed(
    se: SlottedExperts,
    counts: jax.Array,
    missed: jax.Array,
    num_missed: jax.Array,
    record: bool = True,
    host_work: tuple | None = None,
):
    """(the missed experts' weights (gate, up, down), each [len(missed), ...], from the host
    callback; the host's outputs or None).

    `missed` i32 [M] lists the missed expert ids first (ascending), then -1. With `record` the
    callback runs on every call and also records the layer's routing counts; without, it runs only
    when something was missed. Its result size is the smallest bucket that holds `num_missed`
    experts, padded to M on the device. With `host_work` (x [N, D], ids [N, k], valid i32 [N],
    cpu_ids i32 [M]: the experts the host computes, first, then -1, and their count), the same
    callback also returns those experts' pairs' outputs [N, k, D] (zeros elsewhere), computed on
    the host's CPU: one round trip serves both."""
    projections = (se.gate_proj, se.up_proj, se.down_proj)
    leaves, treedef = jax.tree.flatten(projections)
    max_missed = missed.shape[0]
    buckets = fetch_buckets(max_missed)
    work, out_like = (), None
    if host_work is not None:
        x, ids, valid, cpu_ids, num_cpu = host_work
        work = (x, ids, valid, cpu_ids)
        out_like = jax.ShapeDtypeStruct((*ids.shape, x.shape[-1]), x.dtype)

    def nothing(*_):
        zeros = [jnp.zeros((max_missed, *leaf.shape[1:]), leaf.dtype) for leaf in leaves]
        return zeros if out_like is None else [*zeros, jnp.zeros(out_like.shape, out_like.dtype)]

    def branch(m: int):
        shapes = [jax.ShapeDtypeStruct((m, *leaf.shape[1:]), leaf.dtype) for leaf in leaves]
        results = shapes if out_like is None else [*shapes, out_like]

        def call(counts, missed, *work):
            out = io_callback(
                functools.partial(_call_fetch, se.layer, results, record),
                results,
                se.source_id,
                counts,
                missed[:m],
                *work,
                ordered=False,
            )
            fetched = [
                jnp.pad(a, [(0, max_missed - m)] + [(0, 0)] * (a.ndim - 1)) for a in out[: len(leaves)]
            ]
            return fetched + list(out[len(leaves) :])

        def run(counts, missed, *work):
            if m > 0 or record:
                return call(counts, missed, *work)
            if out_like is None:  # nothing missed and nothing to record: no host round trip
                return nothing()
            return jax.lax.cond(num_cpu > 0, call, nothing, counts, missed, *work)

        return run

    index = jnp.searchsorted(jnp.asarray(buckets, jnp.int32), num_missed.astype(jnp.int32), side="left")
    out = jax.lax.switch(index, [branch(m) for m in buckets], counts, missed, *work)
    fetched = jax.tree.unflatten(treedef, out[: len(leaves)])
    return fetched, (None if out_like is None else out[len(leaves)])


def _split_missed(se: SlottedExperts, counts: jax.Array, missing: jax.Array, num_missed: jax.Array):
    """(on_cpu [E] bool, num_cpu i32 []): the share `se.cpu_share` of the missed experts (rounded)
    that the host computes, those with the fewest tokens (ties: lower ids): a CPU's time grows
    with an expert's tokens, a copy's does not. The device decides, so that the callback moves
    only the other experts' weights."""
    e = missing.shape[0]
    share = se.cpu_share.astype(jnp.float32)
    num_cpu = jnp.minimum(
        num_missed, jnp.floor(num_missed.astype(jnp.float32) * share + 0.5).astype(jnp.int32)
    )
    key = jnp.where(missing, counts, jnp.iinfo(jnp.int32).max)
    order = jnp.argsort(key, stable=True)  # the missed experts by tokens, then the rest
    place = jnp.zeros(e, jnp.int32).at[order].set(jnp.arange(e, dtype=jnp.int32))
    return missing & (place < num_cpu), num_cpu


# An expert's byte row is padded with zeros to a multiple of this, so that every row starts 16-byte
# aligned and a copy can move it in 16-byte loads (host copy "mapped": 4-byte loads of unpadded
# NVFP4 rows read PCIe at about half the rate).
EXPERT_ROW_ALIGN = 16


def expert_row_bytes(expert_bytes: int) -> int:
    """Width of the byte row holding an expert of `expert_bytes` packed bytes (`EXPERT_ROW_ALIGN`)."""
    return -(-expert_bytes // EXPERT_ROW_ALIGN) * EXPERT_ROW_ALIGN


def expert_rows_to_leaves(rows: jax.Array, like: list[jax.Array]) -> list[jax.Array]:
    """Leaves [M, ...] cut out of byte rows [M, expert_row_bytes] (one expert's leaves laid end to
    end, in the order of `like`, whose leaves [S, ...] give each one's shape and dtype, then the
    row's padding). Bitcasts only: the bytes are the stored ones."""
    sizes = [math.prod(leaf.shape[1:]) * jnp.dtype(leaf.dtype).itemsize for leaf in like]
    if expert_row_bytes(sum(sizes)) != rows.shape[1]:
        raise ValueError(
            f"expert rows hold {rows.shape[1]} bytes; the leaves take {sum(sizes)} "
            f"({expert_row_bytes(sum(sizes))} a row with padding)"
        )
    out, at = [], 0
    for leaf, size in zip(like, sizes):
        shape, dtype = leaf.shape[1:], jnp.dtype(leaf.dtype)
        part = rows[:, at : at + size]
        at += size
        if dtype.itemsize > 1:
            part = part.reshape(rows.shape[0], -1, dtype.itemsize)
        out.append(jax.lax.bitcast_convert_type(part, dtype).reshape(rows.shape[0], *shape))
    return out


def copy_host_rows(host_rows: jax.Array, experts: jax.Array, count: jax.Array | None = None) -> jax.Array:
    """Rows [len(experts), expert_bytes] copied from `pinned_host` rows [E, expert_bytes] to device
    memory inside the program. With `count`, a loop copies the first `count` rows and leaves zeros
    (a layer that misses little copies little); without, every row is copied, unrolled (-1 ids copy
    expert 0's row). One host-to-device copy per expert, as one row holds all its leaves: on the
    H200 8 Qwen3-Next experts took 0.69 ms a layer so (0.60 unrolled), against 0.85 ms with a copy
    per leaf (bench/expert_copies.py)."""
    experts = jnp.maximum(experts, 0)
    row = functools.partial(host_copy.device_row, host_rows)
    m = experts.shape[0]
    if count is None:
        return jnp.concatenate([row(experts[i]) for i in range(m)])
    out = jnp.zeros((m, host_rows.shape[1]), host_rows.dtype)
    return jax.lax.fori_loop(  # count <= m by construction
        0, count, lambda i, buf: jax.lax.dynamic_update_slice_in_dim(buf, row(experts[i]), i, 0), out
    )


def copy_missed_rows(
    method: str,
    host_rows: jax.Array,
    missed: jax.Array,
    num_missed: jax.Array,
    rows_ref: jax.Array | None = None,
    blocks: int = GATHER_BLOCKS,
) -> jax.Array:
    """Rows [len(missed), row bytes] on the device: the first `num_missed` of `missed` copied
    from the `pinned_host` rows `host_rows` the way `method` names (`host_copy.HOST_COPIES`), zeros
    after. "dma" finds the rows by `rows_ref`, their id (`host_copy.register_host_rows`), and
    "mapped" reads them at `rows_ref`, their device address (`host_copy.host_rows_address`), with
    a gather of at most `blocks` blocks."""
    if method == "loop":
        return copy_host_rows(host_rows, missed, num_missed)
    if method == "buckets":
        return host_copy.copy_rows_in_buckets(host_rows, missed, num_missed, fetch_buckets(missed.shape[0]))
    if method == "dma":
        if rows_ref is None:
            raise ValueError('host copy "dma" needs the host rows\' id (host_copy.register_host_rows)')
        return host_copy.copy_rows_by_dma(rows_ref, missed, num_missed, host_rows.shape[1])
    if method == "mapped":
        if rows_ref is None:
            raise ValueError('host copy "mapped" needs the host rows\' address (host_copy.host_rows_address)')
        return host_copy.copy_rows_mapped(
            rows_ref, missed, num_missed, host_rows.shape[1], host_rows.shape[0], blocks
        )
    raise ValueError(f"host copy must be one of {host_copy.HOST_COPIES}, got {method!r}")


def _read_missed_in_program(
    se: SlottedExperts, missed: jax.Array, num_missed: jax.Array, ahead: jax.Array | None = None
):
    """The missed experts' weights (gate, up, down), each [len(missed), ...] on the device, copied
    from the `pinned_host` byte rows inside the program (`copy_missed_rows`, the way
    `se.host_copy` names; rows past `num_missed` are never selected). With `ahead` (rows [P, row
    bytes] the layer before prefetched), those rows come first: [P + len(missed), ...].

    `missed` i32 [M] lists the missed expert ids first, then -1: a layer that misses nothing in a
    large step copies nothing."""
    slots = (se.gate_proj, se.up_proj, se.down_proj)
    like, treedef = jax.tree.flatten(slots)
    rows = copy_missed_rows(se.host_copy, se.host_stacks, missed, num_missed, se.host_rows_ref)
    if ahead is not None:
        rows = jnp.concatenate([ahead, rows])
    return jax.tree.unflatten(treedef, expert_rows_to_leaves(rows, like))


def _call_fetch(layer: int, results, record: bool, source_id, counts, missed, *work):
    """Host side of the fetch: the source's leaves (and, with `work` = (x, ids, valid, cpu_ids),
    the outputs of the experts it computes itself), checked against the shapes the program expects."""
    source = EXPERT_SOURCES.get(int(source_id))
    if source is None:
        raise RuntimeError(f"no expert source {int(source_id)} (its engine was closed)")
    if work:
        x, ids, valid, cpu_ids = (np.asarray(a) for a in work)
        out = source.fetch_and_compute(
            layer, np.asarray(counts), np.asarray(missed), x, ids, valid, cpu_ids, record_routing=record
        )
    else:
        out = source.fetch(layer, np.asarray(counts), np.asarray(missed), record_routing=record)
    if len(out) != len(results) or any(
        a.shape != s.shape or a.dtype != s.dtype for a, s in zip(out, results)
    ):
        got = [(a.shape, a.dtype.name) for a in out]
        raise ValueError(
            f"expert source returned {got} for layer {layer}; expected {[(s.shape, s.dtype.name) for s in results]}"
        )
    return out


def _positions(flags: jax.Array) -> jax.Array:
    """i32 [E]: each flagged index's place among the flagged ones, in ascending order (0 where unflagged
    before the first)."""
    return jnp.maximum(jnp.cumsum(flags.astype(jnp.int32)) - 1, 0)


def _first_ids(flags: jax.Array, size: int, fill: int) -> jax.Array:
    """i32 [size]: the indices where `flags` [E] is True, ascending, then `fill` (a cumulative
    count, not a sort: one fewer sort launch per layer on a GPU)."""
    return jnp.nonzero(flags, size=size, fill_value=fill)[0].astype(jnp.int32)


def _experts_slotted(
    se: SlottedExperts,
    x: jax.Array,
    ids: jax.Array,
    num_experts: int,
    valid: jax.Array | None = None,
    prefetched: tuple[jax.Array, jax.Array] | None = None,
    then: Callable[..., None] | None = None,
) -> jax.Array:
    """Per-pair outputs [N, k, D] with experts read from slots, the missing ones fetched for this step.
    `then(after=fetched)`, if given, is called once the missed experts' copy is in the graph (the
    next layer's prefetch, ordered after it).

    The weights each pair uses are the same packed bytes as in the full stacks and go through the
    same functions (`_experts_grouped` where the grouped kernel runs, else `_pair_outputs` or
    `_experts_grouped`) as the all-resident path, so the result is bit for bit the same. The routing
    counts the host records leave out padding (`valid`)."""
    n, k = ids.shape
    counted = jnp.repeat(jnp.ones(n, jnp.int32) if valid is None else valid.astype(jnp.int32), k)
    counts = _count_ids(ids.reshape(-1), num_experts, weights=counted).astype(jnp.int32)  # [E]
    resident = se.slot_map >= 0  # [E]
    # padding takes valid tokens' experts (see moe); with no valid token nothing is fetched and the
    # padding's pairs read zeros (their outputs are meaningless)
    missing = (counts > 0) & ~resident  # [E]
    num_missed = jnp.sum(missing.astype(jnp.int32))
    max_missed = min(n * k, num_experts)
    missed = _first_ids(missing, max_missed, fill=-1)  # missed ids first, ascending, then -1
    # what the host records: tokens per expert, negative for the experts this step found in no slot
    # (the slot map the program ran with, which the host may have changed since it was enqueued)
    routing = jnp.where(resident, counts, -counts)
    entry = (se.source_id, se.layer, routing)
    fetch_pos = _positions(missing)  # [E]: index into `missed`
    ahead = None  # rows the layer before copied ahead for this one (only with host_stacks)
    if prefetched is not None:
        # the layer before copied its guesses ahead: take the misses it guessed from its rows and
        # copy only the rest (ascending, as ever); the fetched set is both, guesses first
        have, ahead = prefetched
        rest = missing & ~have
        missed, num_missed = _first_ids(rest, max_missed, fill=-1), jnp.sum(rest.astype(jnp.int32))
        used = jnp.sum((missing & have).astype(jnp.int32))
        entry += (jnp.stack([jnp.sum(have.astype(jnp.int32)), used]),)
        fetch_pos = jnp.where(have, _positions(have), ahead.shape[0] + _positions(rest))
    collected = getattr(_routing, "counts", None)  # inside forward: its one routing report records
    if collected is not None:
        collected.append(entry)
    receipt = host_out = None
    if se.host_stacks is None:
        work = None
        if se.cpu_share is not None:  # the host computes a share of the misses; the rest cross
            on_cpu, num_cpu = _split_missed(se, counts, missing, num_missed)
            crossing = missing & ~on_cpu
            missed, num_missed = _first_ids(crossing, max_missed, fill=-1), num_missed - num_cpu
            fetch_pos = _positions(crossing)
            rows_valid = counted[::k]  # i32 [N]: the host computes no padding row
            work = (x, ids, rows_valid, _first_ids(on_cpu, max_missed, fill=-1), num_cpu)
        fetched, host_out = _fetch_missed(se, routing, missed, num_missed, collected is None, work)
    else:
        if collected is None:  # outside forward: report this layer's routing on its own
            receipt = report_expert_routing([entry])
        fetched = _read_missed_in_program(se, missed, num_missed, ahead)
    if then is not None:  # the next layer's prefetch, ordered after this copy
        then(after=fetched)
    out = _slotted_outputs(se, x, ids, num_experts, resident, fetch_pos, fetched)
    if host_out is not None:  # the host's experts' pairs take its outputs (the device's used other weights)
        out = jnp.where(on_cpu[ids][..., None], host_out.astype(out.dtype), out)
    return out if receipt is None else out + receipt.astype(out.dtype)


def _slotted_outputs(
    se: SlottedExperts,
    x: jax.Array,
    ids: jax.Array,
    num_experts: int,
    resident: jax.Array,
    fetch_pos: jax.Array,
    fetched: tuple,
) -> jax.Array:
    """`_experts_slotted`'s outputs from the slots and the `fetched` experts (`fetch_pos` [E]: where
    each expert without a slot sits in them)."""
    n, k = ids.shape
    slot_of = jnp.maximum(se.slot_map, 0)
    slots = (se.gate_proj, se.up_proj, se.down_proj)

    def pick(expert_ids, from_slot):
        """Each id's packed weights, from its slot or from the fetched set -> leaves [*ids.shape, ...]."""

        def leaf(s, f):
            a, b = s[slot_of[expert_ids]], f[fetch_pos[expert_ids]]
            return jnp.where(from_slot.reshape(from_slot.shape + (1,) * (a.ndim - from_slot.ndim)), a, b)

        return tuple(jax.tree.map(leaf, s, f) for s, f in zip(slots, fetched))

    in_place = _modes["slot_reads"] == "in_place" and pairs_read_in_place(slots, n, n * k, x.dtype)
    if _takes_grouped_kernel(slots) and in_place:
        # The grouped kernel reads each routed expert where it is: the slots, then the fetched
        # set, numbered after them (`ExpertStackPair`). Each row still meets its own expert's
        # bytes with the all-resident model's tiles (the tiles depend on the row count, not on
        # the numbering), so the output is the same bit for bit; the slot experts are not copied
        # (the fetched ones are, once, cut out of their byte rows: docs/experts.md).
        s, f = se.gate_proj.shape[0], fetched[0].shape[0]  # slots, fetched experts
        place = jnp.where(resident, slot_of, s + fetch_pos)  # [E]: each expert's index in the pair
        pairs = [ExpertStackPair(a, b) for a, b in zip(slots, fetched, strict=True)]
        stacks = MoEParams(router=None, gate_proj=pairs[0], up_proj=pairs[1], down_proj=pairs[2])
        return _experts_grouped(stacks, x, place[ids], s + f)
    if _takes_grouped_kernel(slots):
        # The grouped kernel over a stack of only the step's routed experts, each from its slot or
        # the fetched set: the kernel sees the all-resident model's rows and tiles (so its output
        # bit for bit), and nothing is dequantized outside it. The stack's tail past the routed
        # experts repeats expert 0 and gets no rows.
        routed = _count_ids(ids.reshape(-1), num_experts) > 0  # padding's pairs included
        used = min(n * k, num_experts)
        used_ids = _first_ids(routed, used, fill=0)
        rank = jnp.cumsum(routed.astype(jnp.int32)) - 1  # [E]: each routed expert's place in the stack
        gate, up, down = pick(used_ids, resident[used_ids])
        stacks = MoEParams(router=None, gate_proj=gate, up_proj=up, down_proj=down)
        return _experts_grouped(stacks, x, rank[ids], used)
    if ids.size <= max(GATHER_MIN_PAIRS, num_experts // 2):
        gate, up, down = pick(ids, resident[ids])
        return _pair_outputs(x, gate, up, down)
    every = jnp.arange(num_experts, dtype=jnp.int32)
    gate, up, down = pick(every, resident)
    stacks = MoEParams(router=None, gate_proj=gate, up_proj=up, down_proj=down)
    return _experts_grouped(stacks, x, ids, num_experts)
