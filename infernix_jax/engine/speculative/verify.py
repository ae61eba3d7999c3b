"""Verification of a draft window: pure, jittable, exact.

The target model scores a window [t0, d_1 .. d_n] (t0 the pending token, d the drafts) in one
forward; logits[:, i] is the target's distribution of the token after window position i. Walking
i = 0 .. n, with the row's sampling settings applied exactly as `sampling.sample` applies them
(process_logits: bias, min_tokens, penalties; truncated_logits: temperature, min_p, top_k, top_p),
and the penalty state advanced by every token emitted so far in the window:

- greedy rows accept d_{i+1} iff it equals the argmax of the processed logits, and emit that
  argmax at the first mismatch (or as the bonus token after the last draft);
- sampled rows accept d_{i+1} with probability min(1, p(d)/q(d)) (u * q(d) < p(d), u ~ U(0, 1)) and,
  at the first rejection, draw from the residual norm(max(0, p - q)) and stop; after the last draft
  they draw the bonus token from p. With q a point mass (every drafter here is deterministic) this
  is: accept with probability p(d), else draw from p with d removed. The emitted tokens are then
  distributed exactly as plain sampling would draw them (Leviathan et al. 2023, Chen et al. 2023).

A row also stops at a stop token (as the decode program does). Random numbers come from
`row_keys(seed, index of the token being decided)`, so a row's stream does not depend on the batch.

Letters: b rows, w window (= drafts + 1), v vocabulary, k top logprobs.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp

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


@dataclass(frozen=True)
class VerifyOutput:
    """What one verification emitted per row: counts[b] tokens (accepted drafts + 1)."""

    tokens: jax.Array  # i32 [w, b]: emitted tokens, the first counts[b] of each row are valid
    counts: jax.Array  # i32 [b]: tokens emitted (accepted + 1; 0 on inactive rows)
    accepted: jax.Array  # i32 [b]: drafts accepted
    logprobs: jax.Array  # f32 [w, b]: raw-model logprob of each emitted token
    top_ids: jax.Array  # i32 [w, b, k]
    top_logprobs: jax.Array  # f32 [w, b, k]
    penalties: PenaltyState  # advanced by the emitted tokens


jax.tree_util.register_dataclass(
    VerifyOutput,
    data_fields=["tokens", "counts", "accepted", "logprobs", "top_ids", "top_logprobs", "penalties"],
    meta_fields=[],
)


def greedy_accepted_length(target_tokens: jax.Array, drafts: jax.Array, num_drafts: jax.Array) -> jax.Array:
    """i32 [b]: the longest prefix of drafts [b, w-1] equal to target_tokens[:, :w-1] (the target's
    argmax after each window position), within each row's num_drafts [b]."""
    w1 = drafts.shape[1]
    ok = (drafts == target_tokens[:, :w1]) & (jnp.arange(w1)[None, :] < num_drafts[:, None])
    return jnp.sum(jnp.cumprod(ok.astype(jnp.int32), axis=1), axis=1).astype(jnp.int32)


def verify_window(
    logits: jax.Array,
    drafts: jax.Array,
    num_drafts: jax.Array,
    arrays: SamplingArrays,
    penalties: PenaltyState,
    active: jax.Array,
    draft_probs: jax.Array | None = None,
    masks: jax.Array | None = None,
    *,
    num_top_logprobs: int = 0,
    search_bits: int | None = None,
    plan: SamplingPlan | None = None,
) -> VerifyOutput:
    """Accept or reject the drafts of each row and emit accepted + 1 tokens.

    logits f32 [b, w, v] (target, window positions), drafts i32 [b, w-1], num_drafts i32 [b]
    (<= w-1; drafts past it are ignored), active bool [b] (False: padding row, emits nothing),
    draft_probs f32 [b, w-1, v] the drafter's distributions (already transformed like the target's),
    or None for deterministic drafters (q one-hot at the draft). masks i32 [b, w, ceil(v / 32)]: the
    packed structured-output mask of each window position (the grammar's state after the drafts
    before it), applied to the target like `sample` applies it; None: no constraint. plan
    (static): the sampling branches compiled in, covering the rows (`sample`); None chooses them on
    the device at every window position.
    """
    b, w, v = logits.shape
    drafts = jnp.concatenate([drafts, jnp.zeros((b, 1), drafts.dtype)], axis=1).astype(jnp.int32)  # [b, w]
    if draft_probs is not None:
        draft_probs = jnp.concatenate([draft_probs, jnp.zeros((b, 1, v), draft_probs.dtype)], axis=1)
    rows = jnp.arange(b)

    def step(carry, i):
        penalties, live, count = carry
        raw = logits[:, i].astype(jnp.float32)
        draft = drafts[:, i]
        has_draft = i < num_drafts
        processed = process_logits(raw, arrays, penalties, None if masks is None else masks[:, i])
        target_argmax = jnp.argmax(processed, axis=1).astype(jnp.int32)
        keys = jax.vmap(lambda key: jax.random.split(key, 2))(row_keys(arrays, penalties.num_generated))

        def greedy_only():
            return draft == target_argmax, target_argmax

        def with_sampling():
            final = truncated_logits(processed, arrays, search_bits=search_bits, plan=plan)
            p = jax.nn.softmax(final, axis=1)
            if draft_probs is None:
                q = jax.nn.one_hot(draft, v, dtype=jnp.float32)
            else:
                q = draft_probs[:, i].astype(jnp.float32)
            q = jnp.where(has_draft[:, None], q, 0.0)
            u = jax.vmap(lambda key: jax.random.uniform(key[0], (), jnp.float32))(keys)
            accept = u * q[rows, draft] < p[rows, draft]
            residual = jnp.maximum(p - q, 0.0)  # = p where there is no draft (the bonus token)
            noise = jax.vmap(lambda key: jax.random.gumbel(key[1], (v,), jnp.float32))(keys)
            drawn = jnp.argmax(jnp.where(residual > 0, jnp.log(residual), -jnp.inf) + noise, axis=1)
            accept = jnp.where(arrays.greedy, draft == target_argmax, accept)
            return accept, jnp.where(arrays.greedy, target_argmax, drawn.astype(jnp.int32))

        accept, correction = planned_branch(
            None if plan is None else not plan.draws, jnp.all(arrays.greedy), greedy_only, with_sampling
        )
        accept = accept & has_draft
        token = jnp.where(accept, draft, correction)
        penalties = update_penalty_state(penalties, token, live)
        log_probs = jax.nn.log_softmax(raw, axis=1)
        token_logprob = log_probs[rows, token]
        top_logprobs, top_ids = top_alternatives(log_probs, num_top_logprobs)
        count = count + live.astype(jnp.int32)
        live_next = live & accept & ~stop_token_hit(arrays, token)
        return (penalties, live_next, count), (token, token_logprob, top_ids, top_logprobs)

    carry = (penalties, active, jnp.zeros(b, jnp.int32))
    (penalties, _, counts), (tokens, logprobs, top_ids, top_logprobs) = jax.lax.scan(
        step, carry, jnp.arange(w)
    )
    accepted = jnp.maximum(counts - 1, 0)
    return VerifyOutput(tokens, counts, accepted, logprobs, top_ids, top_logprobs, penalties)
