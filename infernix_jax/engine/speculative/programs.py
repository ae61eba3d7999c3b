"""The speculative programs: verify [batch, window] and the prefill that also fills the MTP KV.

- `verify_program`: one forward over each row's window [pending token, drafts..] with per-position
  GDN states, exact acceptance (verify.py), the GDN state kept at the accepted length (rollback.py),
  penalty state advanced by the emitted tokens; with `mtp_steps` > 0 the MTP pass over the
  committed part of the window and the next draft chain (mtp.py).
- `tree_verify_program`: the same over a tree-shaped window (tree.py): tree attention mask and
  per-node GDN states, the accepted path's KV compacted to consecutive positions, the state after
  its last node kept, the MTP pass over the path.
- `mtp_prefill_program`: the engine's prefill (forward over a chunk, sample from the last token
  where the chunk ends the pending tokens) plus the MTP pass over the chunk and, where a token was
  sampled, the first draft chain.

Both donate the pools and the slot sampling state (on accelerators) like the runner's programs.
Letters: r prefill rows, t chunk, b batch, w window (= draft tokens + 1), m blocks per row, k drafts.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from infernix_jax.cache import SCRATCH_SLOT, KVPool, StatePool, cache_view, commit_view
from infernix_jax.config import ModelConfig
from infernix_jax.engine.sampling import SamplingPlan, row_keys, sample, update_penalty_state
from infernix_jax.engine.speculative.mtp import chain_drafts, shifted_mtp_pass
from infernix_jax.engine.speculative.rollback import keep_accepted_states
from infernix_jax.engine.speculative.tree import compact_path_kv, verify_tree
from infernix_jax.engine.speculative.verify import verify_window
from infernix_jax.jit import jit
from infernix_jax.model.forward import forward
from infernix_jax.model.params import Params

_DONATED = ("kv_pool", "state_pool", "slot_sampling")


def _commit_verified(kv_pool, state_pool, slot_sampling, cache, slots, out, drafts, cfg: ModelConfig):
    """A verify program's end (linear or tree): the window's cache into the pools, the penalty state
    advanced by the emitted tokens, and what the host reads back."""
    kv_pool, state_pool = commit_view(kv_pool, state_pool, cache, slots, cfg)
    slot_sampling = slot_sampling.with_penalties(slots, out.penalties)
    sampled = (out.counts, out.tokens, out.logprobs, out.top_ids, out.top_logprobs, drafts)
    return kv_pool, state_pool, slot_sampling, sampled


@partial(jit, static_argnames=("cfg", "num_top", "mtp_steps", "plan"), donate_argnames=_DONATED)
def verify_program(
    params: Params,
    kv_pool: KVPool,
    state_pool: StatePool,
    slot_sampling,
    tokens: jax.Array,  # i32 [b, w]: pending token, then the drafts (padding after num_drafts)
    positions: jax.Array,  # i32 [b, w]: P .. P + num_drafts, then -1
    block_table: jax.Array,  # i32 [b, m]
    slots: jax.Array,  # i32 [b]
    num_drafts: jax.Array,  # i32 [b]
    masks: jax.Array,  # i32 [b, w, ceil(v / 32)]: structured-output mask per window position (-1: free)
    ngram_rows: jax.Array | None = None,  # [L, b, w, heads, width]: n-gram memory rows of the window
    *,
    cfg: ModelConfig,
    num_top: int,
    mtp_steps: int,
    plan: SamplingPlan | None = None,  # the sampling branches compiled in (verify_window)
):
    active = positions[:, 0] >= 0
    cache = cache_view(kv_pool, state_pool, block_table, slots, cfg)
    logits, hidden, cache = forward(
        params, tokens, positions, cache, cfg, keep_states=True, ngram_rows=ngram_rows
    )
    arrays, penalties = slot_sampling.rows(slots)
    out = verify_window(
        logits, tokens[:, 1:], num_drafts, arrays, penalties, active, masks=masks, num_top_logprobs=num_top,
        plan=plan,
    )  # fmt: skip
    cache = keep_accepted_states(cache, out.accepted)
    b, w = tokens.shape
    drafts = jnp.zeros((b, max(mtp_steps, 1)), jnp.int32)
    if mtp_steps:
        committed = active[:, None] & (jnp.arange(w)[None, :] <= out.accepted[:, None])
        mtp_positions = jnp.where(committed, positions, -1)
        # window position j is followed by emitted token j (accepted drafts, then the correction)
        first_logits, first_hidden, cache = shifted_mtp_pass(
            params, out.tokens.T, hidden, mtp_positions, out.accepted, cache, cfg
        )
        last_position = jnp.take_along_axis(positions, out.accepted[:, None], axis=1)[:, 0]
        drafts, cache = chain_drafts(
            params, first_logits, first_hidden, last_position, active, cache, cfg, mtp_steps
        )
    return _commit_verified(kv_pool, state_pool, slot_sampling, cache, slots, out, drafts, cfg)


@partial(jit, static_argnames=("cfg", "num_top", "mtp_steps", "mtp_branches", "plan"), donate_argnames=_DONATED)
def tree_verify_program(
    params: Params,
    kv_pool: KVPool,
    state_pool: StatePool,
    slot_sampling,
    tokens: jax.Array,  # i32 [b, w]: pending token (node 0), then the draft nodes
    positions: jax.Array,  # i32 [b, w]: P + depth of each node, -1 past num_nodes
    parents: jax.Array,  # i32 [b, w]: each node's parent window index (-1 for node 0 and padding)
    block_table: jax.Array,  # i32 [b, m]
    slots: jax.Array,  # i32 [b]
    num_nodes: jax.Array,  # i32 [b]: valid nodes, the pending token included
    *,
    cfg: ModelConfig,
    num_top: int,
    mtp_steps: int,
    mtp_branches: int,
    plan: SamplingPlan | None = None,  # the sampling branches compiled in (verify_tree)
):
    active = positions[:, 0] >= 0
    cache = cache_view(kv_pool, state_pool, block_table, slots, cfg)
    logits, hidden, cache = forward(params, tokens, positions, cache, cfg, tree_parents=parents)
    arrays, penalties = slot_sampling.rows(slots)
    verified = verify_tree(
        logits, tokens, parents, num_nodes, arrays, penalties, active, num_top_logprobs=num_top, plan=plan
    )
    out, path = verified.out, verified.path
    last_node = jnp.take_along_axis(path, out.accepted[:, None], axis=1)[:, 0]
    cache = keep_accepted_states(cache, last_node)
    cache = compact_path_kv(cache, jnp.where(active, positions[:, 0], -1), path, out.accepted)
    b, w = tokens.shape
    drafts = jnp.zeros((b, max(mtp_steps, 1) + mtp_branches), jnp.int32)
    if mtp_steps:
        depth = jnp.arange(w)[None, :]
        committed = active[:, None] & (depth <= out.accepted[:, None])
        mtp_positions = jnp.where(committed, positions[:, :1] + depth, -1)
        path_hidden = jnp.take_along_axis(hidden, path[:, :, None], axis=1)
        # the node at depth d is followed by emitted token d (accepted nodes, then the correction)
        first_logits, first_hidden, cache = shifted_mtp_pass(
            params, out.tokens.T, path_hidden, mtp_positions, out.accepted, cache, cfg
        )
        last_position = positions[:, 0] + out.accepted
        drafts, cache = chain_drafts(
            params, first_logits, first_hidden, last_position, active, cache, cfg, mtp_steps, mtp_branches
        )
    return _commit_verified(kv_pool, state_pool, slot_sampling, cache, slots, out, drafts, cfg)


@partial(jit, static_argnames=("cfg", "num_top", "mtp_steps", "mtp_branches"), donate_argnames=_DONATED)
def mtp_prefill_program(
    params: Params,
    kv_pool: KVPool,
    state_pool: StatePool,
    slot_sampling,
    tokens: jax.Array,  # i32 [r, t]
    positions: jax.Array,  # i32 [r, t], -1 after a row's tokens
    next_tokens: jax.Array,  # i32 [r, t]: the token after each one (the last of a sampled row: ignored)
    block_table: jax.Array,  # i32 [r, m]
    slots: jax.Array,  # i32 [r]
    sample_rows: jax.Array,  # bool [r]
    *,
    cfg: ModelConfig,
    num_top: int,
    mtp_steps: int,
    mtp_branches: int = 0,
):
    cache = cache_view(kv_pool, state_pool, block_table, slots, cfg)
    last = jnp.maximum(jnp.sum(positions >= 0, axis=1) - 1, 0).astype(jnp.int32)
    logits, hidden, cache = forward(params, tokens, positions, cache, cfg, logit_indices=last[:, None])
    arrays, penalties = slot_sampling.rows(slots)
    out = sample(
        logits[:, 0], arrays, penalties, row_keys(arrays, penalties.num_generated), num_top_logprobs=num_top
    )
    penalties = update_penalty_state(penalties, out.tokens, sample_rows)
    slot_sampling = slot_sampling.with_penalties(jnp.where(sample_rows, slots, SCRATCH_SLOT), penalties)
    t = tokens.shape[1]
    at_last = jnp.arange(t)[None, :] == last[:, None]
    next_tokens = jnp.where(at_last & sample_rows[:, None], out.tokens[:, None], next_tokens)
    first_logits, first_hidden, cache = shifted_mtp_pass(
        params, next_tokens, hidden, positions, last, cache, cfg
    )
    last_position = jnp.take_along_axis(positions, last[:, None], axis=1)[:, 0]
    drafts, cache = chain_drafts(
        params,
        first_logits,
        first_hidden,
        last_position,
        sample_rows & (last_position >= 0),
        cache,
        cfg,
        mtp_steps,
        mtp_branches,
    )
    kv_pool, state_pool = commit_view(kv_pool, state_pool, cache, slots, cfg)
    sampled = (out.tokens[None], out.logprobs[None], out.top_ids[None], out.top_logprobs[None])
    return kv_pool, state_pool, slot_sampling, sampled, drafts
