"""Tree verification: several candidate continuations per row, verified in one forward.

A draft tree is a window [t0, n_1 .. n_N]: t0 the pending token (node 0, the root), each draft node
with a parent index into the window (< its own index). The forward (`tree_parents`) scores every
node with attention restricted to its ancestors and each GDN node continuing its parent's state, so
logits[:, i] is the target's distribution of the token after the path root .. i.

Acceptance walks down from the root, depth d = 0, 1, ..., at the current node c with the row's
sampling applied exactly as `sampling.sample` applies it (penalty state advanced by the path):

- greedy rows move to the child of c whose token is the target's argmax; with none, they emit the
  argmax and stop;
- sampled rows run the multi-candidate rejection rule over c's children (SpecInfer's, for
  deterministic drafters; distinct sibling tokens t_1 .. t_m in node order): child j is accepted
  with probability p_j(t_j), where p_1 = p and p_{j+1} is p_j with t_j removed and renormalised,
  i.e. p(t_j) / (1 - p(t_1) - .. - p(t_{j-1})); if none is, draw from p with all of t_1 .. t_m
  removed. The emitted token is then distributed exactly as p: P(t_j) = prod_{l<j} (1 - p_l(t_l))
  p_j(t_j) = p(t_j), and any other token x comes out with (1 - sum p(t_l)) p(x) / (1 - sum p(t_l)).

A chain (parents i - 1) is the linear window; the rule is then verify.py's for a point-mass q.

After acceptance the accepted path n_0 = 0, n_1 .. n_L is committed: its keys/values, written at
slots start + n_d, are copied to start + d (`compact_path_kv`), and the GDN state kept is the one
after node n_L (rollback.keep_accepted_states with index n_L).

Letters: b rows, w window (nodes, the root included), v vocabulary, k top logprobs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from infernix_jax.cache.allocators import BLOCK_SIZE, NULL_BLOCK
from infernix_jax.cache.kv_pool import PagedKV
from infernix_jax.cache.sequence import ContiguousKV, SequenceCache
from infernix_jax.engine.sampling import (
    PenaltyState,
    SamplingArrays,
    SamplingPlan,
    planned_branch,
    process_logits,
    row_keys,
    stop_token_hit,
    top_alternatives,
    truncated_logits,
    update_penalty_state,
)
from infernix_jax.engine.speculative.verify import VerifyOutput


# ---- host: building a tree from candidate branches --------------------------------------------
@dataclass(frozen=True)
class DraftTree:
    """Draft nodes in window order (node 0, the pending token, is implicit)."""

    tokens: list[int]  # the token of draft node 1 .. N
    parents: list[int]  # window index of each draft node's parent (0 = the pending token)

    @property
    def depth(self) -> int:
        """Nodes on the longest root-to-leaf path, the root excluded."""
        depths = [0]
        for parent in self.parents:
            depths.append(depths[parent] + 1)
        return max(depths)


def build_tree(branches: Sequence[Sequence[int]], max_nodes: int, max_depth: int) -> DraftTree:
    """Merge candidate continuations into a trie (shared prefixes become one path), in the order
    given (earlier branches are preferred by verification's tie-breaks), within max_nodes draft
    nodes and max_depth tokens per branch. Siblings carry distinct tokens."""
    tokens: list[int] = []
    parents: list[int] = []
    children: dict[tuple[int, int], int] = {}  # (parent window index, token) -> window index
    for branch in branches:
        node = 0
        for token in list(branch)[:max_depth]:
            found = children.get((node, int(token)))
            if found is None:
                if len(tokens) >= max_nodes:
                    break
                tokens.append(int(token))
                parents.append(node)
                found = len(tokens)
                children[(node, int(token))] = found
            node = found
    return DraftTree(tokens, parents)


# ---- device: acceptance --------------------------------------------------------------------------
@dataclass(frozen=True)
class TreeVerifyOutput:
    """What one tree verification emitted per row, and the accepted path."""

    out: VerifyOutput  # tokens [w, b] emitted (the first counts[b] valid), counts, accepted, ...
    path: jax.Array  # i32 [b, w]: window index of the node at each depth (valid up to accepted)


jax.tree_util.register_dataclass(TreeVerifyOutput, data_fields=["out", "path"], meta_fields=[])


def verify_tree(
    logits: jax.Array,
    tokens: jax.Array,
    parents: jax.Array,
    num_nodes: jax.Array,
    arrays: SamplingArrays,
    penalties: PenaltyState,
    active: jax.Array,
    *,
    num_top_logprobs: int = 0,
    search_bits: int | None = None,
    plan: SamplingPlan | None = None,
) -> TreeVerifyOutput:
    """Accept the longest root-to-leaf path verification allows and emit accepted + 1 tokens.

    logits f32 [b, w, v] (target, per window node), tokens i32 [b, w] (node 0: the pending token),
    parents i32 [b, w] (node 0: -1), num_nodes i32 [b] (valid nodes, root included; 1 = no drafts),
    active bool [b] (False: padding row, emits nothing). Deterministic drafters (q point masses).
    plan (static): the sampling branches compiled in, as for `verify_window`.
    """
    b, w, v = logits.shape
    rows = jnp.arange(b)
    node_index = jnp.arange(w)[None, :]
    is_node = (node_index >= 1) & (node_index < num_nodes[:, None])
    # a sibling repeating an earlier sibling's token is no candidate (its p_j(t) is 0 anyway)
    same = (tokens[:, :, None] == tokens[:, None, :]) & (parents[:, :, None] == parents[:, None, :])
    earlier = jnp.tril(jnp.ones((w, w), bool), -1)[None]
    first_of_token = ~jnp.any(same & earlier & is_node[:, None, :], axis=2)
    candidate_node = is_node & first_of_token

    def step(carry, _):
        penalties, live, count, node = carry
        raw = logits[rows, node].astype(jnp.float32)
        processed = process_logits(raw, arrays, penalties)
        target_argmax = jnp.argmax(processed, axis=1).astype(jnp.int32)
        children = candidate_node & (parents == node[:, None])  # [b, w]
        keys = jax.vmap(lambda key: jax.random.split(key, 2))(row_keys(arrays, penalties.num_generated))

        def pick(hit):  # the first hit in node order, and whether there is one
            return jnp.argmax(hit, axis=1).astype(jnp.int32), jnp.any(hit, axis=1)

        def greedy_only():
            child, found = pick(children & (tokens == target_argmax[:, None]))
            return child, found, target_argmax

        def with_sampling():
            final = truncated_logits(processed, arrays, search_bits=search_bits, plan=plan)
            p = jax.nn.softmax(final, axis=1)
            p_child = jnp.where(children, jnp.take_along_axis(p, tokens, axis=1), 0.0)  # [b, w]
            before = jnp.cumsum(p_child, axis=1) - p_child  # mass of the earlier siblings
            remaining = 1.0 - before
            chance = jnp.where(remaining > 0, p_child / jnp.where(remaining > 0, remaining, 1.0), 0.0)
            u = jax.vmap(lambda key: jax.random.uniform(key[0], (w,), jnp.float32))(keys)
            child, found = pick(children & (u < chance))
            taken = jnp.zeros((b, v), bool).at[rows[:, None], tokens].max(children)
            residual = jnp.where(taken, 0.0, p)
            residual = jnp.where(jnp.sum(residual, axis=1, keepdims=True) > 0, residual, p)
            noise = jax.vmap(lambda key: jax.random.gumbel(key[1], (v,), jnp.float32))(keys)
            drawn = jnp.argmax(jnp.where(residual > 0, jnp.log(residual), -jnp.inf) + noise, axis=1)
            greedy_child, greedy_found = pick(children & (tokens == target_argmax[:, None]))
            greedy = arrays.greedy
            return (
                jnp.where(greedy, greedy_child, child),
                jnp.where(greedy, greedy_found, found),
                jnp.where(greedy, target_argmax, drawn.astype(jnp.int32)),
            )

        child, found, correction = planned_branch(
            None if plan is None else not plan.draws, jnp.all(arrays.greedy), greedy_only, with_sampling
        )
        token = jnp.where(found, tokens[rows, child], correction)
        penalties = update_penalty_state(penalties, token, live)
        log_probs = jax.nn.log_softmax(raw, axis=1)
        token_logprob = log_probs[rows, token]
        top_logprobs, top_ids = top_alternatives(log_probs, num_top_logprobs)
        count = count + live.astype(jnp.int32)
        live_next = live & found & ~stop_token_hit(arrays, token)
        next_node = jnp.where(live_next, child, node)
        emitted = (token, token_logprob, top_ids, top_logprobs, node)
        return (penalties, live_next, count, next_node), emitted

    carry = (penalties, active, jnp.zeros(b, jnp.int32), jnp.zeros(b, jnp.int32))
    (penalties, _, counts, _), (emitted, logprobs, top_ids, top_logprobs, path) = jax.lax.scan(
        step, carry, None, length=w
    )
    accepted = jnp.maximum(counts - 1, 0)
    out = VerifyOutput(emitted, counts, accepted, logprobs, top_ids, top_logprobs, penalties)
    return TreeVerifyOutput(out, path.T)


# ---- device: committing the accepted path ----------------------------------------------------
def _page_address(block_table: jax.Array, positions: jax.Array, num_blocks: int):
    """(block, offset) of positions [b, n] in the rows' pages; invalid ones address block num_blocks."""
    capacity = block_table.shape[1] * BLOCK_SIZE
    valid = (positions >= 0) & (positions < capacity)
    index = jnp.where(valid, positions // BLOCK_SIZE, 0)
    block = jnp.take_along_axis(block_table, index, axis=1)
    block = jnp.where(valid & (block != NULL_BLOCK), block, num_blocks)
    return block, jnp.where(valid, positions % BLOCK_SIZE, 0)


def _move(entry, source: jax.Array, target: jax.Array):
    """Copy the stored keys/values (and scales) of positions source [b, n] to target [b, n] (-1: skip)."""
    if isinstance(entry, PagedKV):
        num_blocks = entry.k_pages.shape[0]
        src = _page_address(entry.block_table, source, num_blocks)
        dst = _page_address(entry.block_table, jnp.where(source >= 0, target, -1), num_blocks)

        def copy(pages):
            if pages is None:
                return None
            moved = pages.at[src].get(mode="fill", fill_value=0)
            return pages.at[dst].set(moved, mode="drop")

        return dataclasses.replace(
            entry,
            k_pages=copy(entry.k_pages),
            v_pages=copy(entry.v_pages),
            k_scales=copy(entry.k_scales),
            v_scales=copy(entry.v_scales),
        )
    if isinstance(entry, ContiguousKV):
        rows = jnp.arange(source.shape[0])[:, None]
        src = jnp.maximum(source, 0)
        dst = jnp.where(source >= 0, target, entry.capacity)
        return ContiguousKV(
            entry.k.at[rows, dst].set(entry.k[rows, src], mode="drop"),
            entry.v.at[rows, dst].set(entry.v[rows, src], mode="drop"),
        )
    return entry


def compact_path_kv(
    cache: SequenceCache, start: jax.Array, path: jax.Array, accepted: jax.Array
) -> SequenceCache:
    """Move the accepted path's keys/values from slots start + path[d] to start + d (d <= accepted)
    in every attention layer, so the committed tokens sit at consecutive positions.

    start i32 [b] (-1: padding row), path i32 [b, w], accepted i32 [b]."""
    depth = jnp.arange(path.shape[1])[None, :]
    moving = (depth >= 1) & (depth <= accepted[:, None]) & (start[:, None] >= 0) & (path != depth)
    source = jnp.where(moving, start[:, None] + path, -1)
    target = start[:, None] + depth
    return SequenceCache(
        layers=tuple(_move(e, source, target) for e in cache.layers),
        mtp=cache.mtp,
        snapshots=cache.snapshots,
    )
