"""A decode step's MoE routing in one launch: softmax, top-k, the pairs' expert order and the
tokens' rows in that order, a Pallas GPU (Triton) kernel.

Between a MoE layer's router matmul and its grouped expert matmul, XLA runs the softmax, the top-k
(by comparisons, `model.mlp._top_k`), the renormalisation, the padding tokens' fix, the count of
pairs per expert, the pairs' order and the gather of the tokens' rows in that order as about eight
small launches (the 80B-A3B census, docs/pallas.md: ~7-8 of a layer's ~40). Each moves a few
hundred bytes; on a GPU their cost is the launch and the gap after it, in device time and in the
host's graph work. Here one launch does all of it from the router's float32 logits.

For N tokens over E experts, top k, P = N * k (token, expert) pairs:

    probs    = softmax(logits)                         [N, E] float32
    ids      = the k largest probs' experts (ties: the lower expert first, as lax.top_k); with
               `renormalize` the k largest logits' (the same experts: softmax keeps the order)
    weights  = their probs, in x's dtype; with `renormalize` the softmax of the chosen logits
               (the probs over their sum, which is what `model.mlp.route` computes)
    ids[t]   = ids[first valid token] where valid[t] is False (padding makes no reads of its own)
    rank[p]  = pairs before pair p = t * k + j: a smaller expert, or the same expert earlier
    order    = rank's inverse (the stable argsort of the pairs' experts)
    sizes[e] = pairs routed to expert e
    xs[r]    = x[order[r] // k]                        [P, D]: the rows the grouped matmul reads

With `word_rows` it also gives xs as the grouped word kernels (dot_w) take it: each row scaled to
float16 by `f16_rows`' power of two, its columns in `word_columns`' order, and the inverse factors
[P]; the grouped kernel then needs no XLA op before its launch (`grouped_matmuls(x_words=...)`).

The grid is (blocks of PAIR_BLOCK sorted places, blocks of D columns). Every program recomputes
the routing (a few thousand elements): the top-k marks which tokens route to which experts
([N, E]), so the per-expert counts, their running sum over experts (where each expert's places
begin) and the running count over tokens give each sorted place its expert, its token and the
token's slot with a few reductions and a loop of two a token; the rows at its places come in by
one gathered load (with `word_rows`: whole 8-column words), the rank by a scatter of its places.
Program (0, 0) writes the weights, ids and counts. (Earlier forms compared pairs with pairs: all
[P, P] at once, 344 us a call at eight tokens on an H100 with its tiles spilled, then [16, P] a
block at a time, ~20 reductions a block and token.)

The arithmetic is the plain-JAX reference's, so in the interpreter the two agree bit for bit;
compiled, Triton's exp and its reduction order may move the weights by an ulp (and so a near-tie
between two experts' probs), like any two XLA builds.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _quant_common as qc
from pallas_kernels import compat

MAX_TOKENS = 16  # tokens a step it takes: a place's token is found by a loop of two reductions a token
MAX_EXPERTS = 1024
DEFAULT_BLOCK_D = 256  # xs columns per program
PAIR_BLOCK = 16  # sorted pairs per program (grid axis 0)
DEFAULT_NUM_WARPS = 4


def reference_moe_routing(
    logits: jax.Array, x: jax.Array, valid: jax.Array | None, *, top_k: int, renormalize: bool, word_rows: bool = False
) -> tuple[jax.Array, ...]:
    """The routing in plain JAX: (weights [N, k] in x's dtype, ids [N, k] i32, order [P] i32,
    rank [P] i32, sizes [E] i32, xs [P, D]), and with `word_rows` also xs as the grouped word
    kernels take it: (float16 [P, D] in word-column order, inverse row factors [P] float32), what
    `f16_rows` + `word_columns` make of xs. logits [N, E] float32, x [N, D], valid [N] bool or None."""
    e = logits.shape[1]
    probs = logits if renormalize else jax.nn.softmax(logits, axis=-1)  # the order either way
    idx = jnp.arange(e, dtype=jnp.int32)
    a, b = probs[:, :, None], probs[:, None, :]
    before = (b > a) | ((b == a) & (idx[None, None, :] < idx[None, :, None]))  # [n, i, j]: j before i
    place = jnp.sum(before, axis=2, dtype=jnp.int32)
    hit = place[:, None, :] == jnp.arange(top_k, dtype=jnp.int32)[None, :, None]  # [n, k, e]
    ids = jnp.sum(jnp.where(hit, idx[None, None, :], 0), axis=2)
    weights = jnp.sum(jnp.where(hit, probs[:, None, :], 0), axis=2)
    if renormalize:
        weights = jax.nn.softmax(weights, axis=-1)
    if valid is not None:
        ids = jnp.where(valid[:, None], ids, ids[jnp.argmax(valid)])
    flat = ids.reshape(-1)
    pos = jnp.arange(flat.size, dtype=jnp.int32)
    earlier = (flat[None, :] < flat[:, None]) | ((flat[None, :] == flat[:, None]) & (pos[None, :] < pos[:, None]))
    rank = jnp.sum(earlier, axis=1, dtype=jnp.int32)
    order = jnp.sum(jnp.where(rank[None, :] == pos[:, None], pos[None, :], 0), axis=1)
    sizes = jnp.sum(flat[None, :] == idx[:, None], axis=1, dtype=jnp.int32)
    xs = jnp.take(x, order // top_k, axis=0)
    routed = (weights.astype(x.dtype), ids, order, rank, sizes, xs)
    if not word_rows:
        return routed
    x16, inverse = qc.f16_rows(xs)
    return (*routed, qc.word_columns(x16), inverse)


def _routing_kernel(
    valid_ref, logits_ref, x_ref,
    weights_ref, ids_ref, order_ref, rank_ref, sizes_ref, xs_ref, *word_refs,
    n: int, e: int, k: int, d: int, renormalize: bool, block_d: int,
):  # fmt: skip
    n_pad, e_pad, k_pad = compat.pow2_at_least(n), compat.pow2_at_least(e), compat.pow2_at_least(k)
    pairs = n * k
    block = min(PAIR_BLOCK, compat.pow2_at_least(pairs))
    rows = jnp.arange(n_pad, dtype=jnp.int32)
    cols = jnp.arange(e_pad, dtype=jnp.int32)
    slots = jnp.arange(k_pad, dtype=jnp.int32)
    row_ok, col_ok = rows < n, cols < e

    tile_ok = row_ok[:, None] & col_ok[None, :]
    logits = compat.load(logits_ref.at[compat.ds(0, n_pad), compat.ds(0, e_pad)], mask=tile_ok, other=0.0)
    logits = jnp.where(col_ok[None, :], logits, -jnp.inf)
    if renormalize:  # the chosen logits' softmax below: the same experts and weights as the probs'
        scores = logits
    else:
        unnormalized = jnp.exp(logits - jnp.max(logits, axis=1, keepdims=True))
        scores = unnormalized / jnp.sum(unnormalized, axis=1, keepdims=True)

    # top-k: the largest remaining score, the lowest expert among equals, k times; slot_of[t, e] is
    # the place j at which token t picked expert e (-1: not picked)
    remaining = jnp.where(col_ok[None, :], scores, -jnp.inf)
    ids = jnp.zeros((n_pad, k_pad), jnp.int32)
    weights = jnp.zeros((n_pad, k_pad), jnp.float32)
    slot_of = jnp.full((n_pad, e_pad), -1, jnp.int32)
    for j in range(k):
        best = jnp.max(remaining, axis=1, keepdims=True)
        pick = jnp.min(jnp.where(remaining == best, cols[None, :], e_pad), axis=1, keepdims=True)
        ids = jnp.where(slots[None, :] == j, pick, ids)
        weights = jnp.where(slots[None, :] == j, best, weights)
        picked = cols[None, :] == pick
        slot_of = jnp.where(picked, j, slot_of)
        remaining = jnp.where(picked, -jnp.inf, remaining)
    if renormalize:  # the softmax over the k chosen (slots past k hold nothing)
        chosen = jnp.where(slots[None, :] < k, weights, -jnp.inf)
        unnormalized = jnp.exp(chosen - jnp.max(chosen, axis=1, keepdims=True))
        weights = unnormalized / jnp.sum(unnormalized, axis=1, keepdims=True)

    # padding tokens route as the first valid token (as the reference: no reads of their own)
    valid = compat.load(valid_ref.at[compat.ds(0, n_pad)], mask=row_ok, other=0) != 0
    first = jnp.min(jnp.where(valid, rows, n_pad))
    first = jnp.where(first == n_pad, 0, first)  # no valid token: argmax's 0
    is_first = rows[:, None] == first
    ids = jnp.where(valid[:, None], ids, jnp.sum(jnp.where(is_first, ids, 0), axis=0)[None, :])
    slot_of = jnp.where(valid[:, None], slot_of, jnp.sum(jnp.where(is_first, slot_of + 1, 0), axis=0)[None, :] - 1)
    hit = ((slot_of >= 0) & row_ok[:, None]).astype(jnp.int32)  # [n_pad, e_pad]: t routed to e

    # the sorted order is by expert, then token: expert e's pairs take sorted places
    # [ends[e] - sizes[e], ends[e]), its j-th token the place ends[e] - sizes[e] + j
    sizes = jnp.sum(hit, axis=0)
    ends = jnp.cumsum(sizes)
    within = jnp.cumsum(hit, axis=0)  # [t, e]: tokens up to t routed to e
    here = compat.program_id(0) * block + jnp.arange(block, dtype=jnp.int32)  # this program's places
    here_ok = here < pairs
    expert = jnp.sum((ends[None, :] <= here[:, None]).astype(jnp.int32), axis=1)  # [block]
    this_expert = cols[None, :] == expert[:, None]
    m = here - jnp.sum(jnp.where(this_expert, (ends - sizes)[None, :], 0), axis=1)  # place among its pairs
    code = within * k_pad + jnp.maximum(slot_of, 0)

    def find(t, carry):  # the place's token: the first t with `within` past m
        token, slot, found = carry
        code_t = jnp.sum(jnp.where(rows[:, None] == t, code, 0), axis=0)  # [e_pad]
        at = jnp.sum(jnp.where(this_expert, code_t[None, :], 0), axis=1)  # code[t, expert]: [block]
        newly = (at // k_pad == m + 1) & ~found
        return token + (at // k_pad <= m).astype(jnp.int32), jnp.where(newly, at % k_pad, slot), found | newly

    start = (jnp.zeros((block,), jnp.int32), jnp.zeros((block,), jnp.int32), jnp.zeros((block,), jnp.bool_))
    token, slot, _ = jax.lax.fori_loop(0, n, find, start)
    token = jnp.minimum(token, n - 1)  # places past the pairs: any row, masked below
    order = token * k + slot
    first_column = here_ok & (compat.program_id(1) == 0)
    compat.store(order_ref.at[compat.ds(compat.program_id(0) * block, block)], order, mask=first_column)
    # rank, order's inverse, by a scatter: places past the pairs repeat the block's first place
    # (the same index and value), so no lane's write is masked and none can hide another's
    lead = jnp.arange(block, dtype=jnp.int32) == 0
    lead_order = jnp.sum(jnp.where(lead, order, 0))
    rank_to, rank_of = jnp.where(here_ok, order, lead_order), jnp.where(here_ok, here, compat.program_id(0) * block)
    compat.store(rank_ref.at[rank_to], rank_of, mask=jnp.full((block,), compat.program_id(1) == 0))

    if word_refs:
        _word_rows(x_ref, xs_ref, *word_refs, token=token, here_ok=here_ok, n=n, n_pad=n_pad,
                   block_w=block_d // 8, d=d, block=block)  # fmt: skip
    else:  # xs: this program's columns of the tokens' rows at its sorted places
        c0 = compat.program_id(1) * block_d
        dcols = c0 + jnp.arange(block_d, dtype=jnp.int32)
        xs_ok = here_ok[:, None] & (dcols < d)[None, :]
        xs = compat.load(x_ref.at[token[:, None], jnp.minimum(dcols, d - 1)[None, :]], mask=xs_ok, other=0)
        compat.store(xs_ref.at[compat.ds(compat.program_id(0) * block, block), compat.ds(c0, block_d)], xs, mask=xs_ok)

    @compat.when((compat.program_id(0) == 0) & (compat.program_id(1) == 0))
    def _():
        out_ok = row_ok[:, None] & (slots < k)[None, :]
        compat.store(weights_ref.at[compat.ds(0, n_pad), compat.ds(0, k_pad)], weights.astype(weights_ref.dtype), mask=out_ok)
        compat.store(ids_ref.at[compat.ds(0, n_pad), compat.ds(0, k_pad)], ids, mask=out_ok)
        compat.store(sizes_ref.at[compat.ds(0, e_pad)], sizes, mask=col_ok)


def _word_rows(x_ref, xs_ref, words_ref, inverse_ref, *, token, here_ok, n, n_pad, block_w, d, block):
    """The rows at this program's sorted places as given and as the grouped word kernels take them
    (`f16_rows`' float16 rows in `word_columns`' order), for its block_w words: x_ref [N, D/8, 8],
    xs_ref [P, D/8, 8], words_ref [P, 8, D/8] (the free reshapes of [P, D] in natural and word
    order), inverse_ref [P]. Each row's factor needs its max |x| over all of D (a few KB)."""
    rows = jnp.arange(n_pad, dtype=jnp.int32)
    row_ok = (rows < n)[:, None, None]

    def row_max(i, running):  # elementwise: one reduction after the loop, not two a step
        tile = compat.load(x_ref.at[compat.ds(0, n_pad), compat.ds(i * block_w, block_w), compat.ds(0, 8)],
                           mask=row_ok, other=0)  # fmt: skip
        return jnp.maximum(running, jnp.abs(tile.astype(jnp.float32)))

    running = jax.lax.fori_loop(0, d // 8 // block_w, row_max, jnp.zeros((n_pad, block_w, 8), jnp.float32))
    max_abs = jnp.max(jnp.max(running, axis=2), axis=1)  # [n_pad]
    place_max = jnp.sum(jnp.where(token[:, None] == rows[None, :], max_abs[None, :], 0.0), axis=1)
    factor, inverse = qc.f16_row_factors(place_max)
    w0 = compat.program_id(1) * block_w
    ok = here_ok[:, None, None]
    row = compat.load(
        x_ref.at[token[:, None, None], (w0 + jnp.arange(block_w, dtype=jnp.int32))[None, :, None],
                 jnp.arange(8, dtype=jnp.int32)[None, None, :]],
        mask=ok, other=0,
    )  # fmt: skip  # [block, block_w, 8]
    scaled = (row.astype(jnp.float32) * factor[:, None, None]).astype(jnp.float16)
    p0 = compat.program_id(0) * block
    compat.store(xs_ref.at[compat.ds(p0, block), compat.ds(w0, block_w), compat.ds(0, 8)], row, mask=ok)
    compat.store(words_ref.at[compat.ds(p0, block), compat.ds(0, 8), compat.ds(w0, block_w)],
                 jnp.swapaxes(scaled, 1, 2), mask=ok)  # fmt: skip
    compat.store(inverse_ref.at[compat.ds(p0, block)], inverse, mask=here_ok & (compat.program_id(1) == 0))


def supports(tokens: int, experts: int, top_k: int) -> bool:
    """Whether the kernel takes a step of `tokens` tokens over `experts` experts, top `top_k`."""
    return 1 <= tokens <= MAX_TOKENS and 1 <= top_k <= experts <= MAX_EXPERTS


def validate_moe_routing(
    logits: jax.Array, x: jax.Array, valid: jax.Array | None, top_k: int, word_rows: bool = False
) -> None:
    if logits.ndim != 2 or x.ndim != 2 or logits.shape[0] != x.shape[0]:
        raise ValueError(f"logits [N, E] and x [N, D] must share N; got {logits.shape} and {x.shape}")
    if logits.dtype != jnp.float32:
        raise ValueError(f"logits must be float32; got {logits.dtype}")
    if valid is not None and valid.shape != (x.shape[0],):
        raise ValueError(f"valid must be [N] = [{x.shape[0]}]; got {valid.shape}")
    n, e = logits.shape
    if word_rows and x.shape[1] % 8:
        raise ValueError(f"word rows need D divisible by 8; got D = {x.shape[1]}")
    if not supports(n, e, top_k):
        raise ValueError(
            f"the routing kernel takes 1-{MAX_TOKENS} tokens and top_k <= E <= {MAX_EXPERTS}; "
            f"got {n} tokens, E = {e}, top_k = {top_k}"
        )


@functools.partial(
    jax.jit, static_argnames=("top_k", "renormalize", "word_rows", "block_d", "num_warps", "interpret")
)
def moe_routing(
    logits: jax.Array,
    x: jax.Array,
    valid: jax.Array | None = None,
    *,
    top_k: int,
    renormalize: bool,
    word_rows: bool = False,
    block_d: int = DEFAULT_BLOCK_D,
    num_warps: int = DEFAULT_NUM_WARPS,
    interpret: bool = False,
) -> tuple[jax.Array, ...]:
    """`reference_moe_routing` in one launch (see the module docstring); the same outputs."""
    validate_moe_routing(logits, x, valid, top_k, word_rows)
    n, e = logits.shape
    d = x.shape[1]
    if word_rows:  # a program's block: block_w whole words, the largest power of two dividing D / 8
        words = d // 8
        block_d = 8 * min(block_d // 8, words & -words)
    else:
        block_d = min(block_d, compat.pow2_at_least(d))
    valid = jnp.ones((n,), jnp.int32) if valid is None else valid.astype(jnp.int32)
    kernel = functools.partial(
        _routing_kernel, n=n, e=e, k=top_k, d=d, renormalize=renormalize, block_d=block_d
    )
    pairs = n * top_k
    i32 = jnp.int32
    out_shape = [
        jax.ShapeDtypeStruct((n, top_k), x.dtype),
        jax.ShapeDtypeStruct((n, top_k), i32),
        jax.ShapeDtypeStruct((pairs,), i32),
        jax.ShapeDtypeStruct((pairs,), i32),
        jax.ShapeDtypeStruct((e,), i32),
        jax.ShapeDtypeStruct((pairs, d // 8, 8) if word_rows else (pairs, d), x.dtype),
    ]
    if word_rows:
        out_shape += [jax.ShapeDtypeStruct((pairs, 8, d // 8), jnp.float16), jax.ShapeDtypeStruct((pairs,), jnp.float32)]
        x = x.reshape(n, d // 8, 8)
    out = compat.pallas_call(
        kernel,
        out_shape=tuple(out_shape),
        grid=(compat.cdiv(pairs, min(PAIR_BLOCK, compat.pow2_at_least(pairs))), compat.cdiv(d, block_d)),
        compiler_params=compat.triton_compiler_params(num_warps=num_warps, num_stages=1),
        interpret=interpret,
        name="moe_routing",
    )(valid, logits, x)
    if not word_rows:
        return out
    weights, ids, order, rank, sizes, xs, words, inverse = out
    return weights, ids, order, rank, sizes, xs.reshape(pairs, d), words.reshape(pairs, d), inverse
