"""The runner: device state and one jitted program per bucket.

Programs (module-level `jax.jit`s, so engines with the same shapes share compiled code):

- `prefill_program` [rows, chunk]: feed one chunk per row, sample one token from each row's last
  valid token (used only for rows whose chunk ends the pending tokens).
- `decode_program` [batch, steps]: a `lax.fori_loop` of `steps` decode steps (forward T=1, sampling,
  stop-token and length checks, cache writes) entirely on the device; a row that stops feeds
  padding (position -1) for the remaining steps, so nothing more is written for it. Its sampling
  branches are chosen on the host (`SamplingPlan`), and it returns one packed array written after
  the loop (`pack_decode`) into a donated buffer: the loop touches no output buffer (new at every
  dispatch), so its CUDA graph is not re-recorded because the outputs moved (docs/engine.md).
- `set_slot_program`: install one request's sampling settings and penalty state in its slot.
- `masked_decode_step_program` [batch]: one decode step (forward and sample) under a packed token
  mask, for batches holding constrained rows (structured output): the host fills each row's mask
  from the token before, so these rows advance one token per dispatch. Prefill always takes a
  packed mask (all ones for rows without a constraint).
- `masked_window_program` [batch, 8]: the same with each row's pending token followed by up to 7
  tokens its grammar forces (a fixed key, a closing bracket), which are outputs already: a
  constrained row advances several tokens in one dispatch where its grammar leaves no choice.
- `decode_forward_program` [batch] and `masked_sample_program` [batch]: the same step split in two
  (`EngineConfig.constrained_decode = "split"`): the host computes the masks while the forward
  runs, at the cost of a second dispatch per token.
- `save_rows_program` and `restore_rows_program` [batch]: device copies of a decode batch's state
  slots and penalty rows, put back for the rows whose free sample a grammar refused
  (`constrained_decode = "check"`: the plain `decode_program`, its tokens checked afterwards).

The pools (KV pages, GDN state slots) and the per-slot sampling state are donated (on accelerators, see infernix_jax/jit.py) to every
program and updated in place. Per-slot sampling state lives on the device so that a dispatch
gathers its rows by slot instead of re-uploading settings every step.

Letters: r prefill rows, t chunk length, b decode batch, m blocks per row, s slots, v vocabulary,
k top logprobs, n steps.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from infernix_jax.cache import (
    NULL_BLOCK,
    SCRATCH_SLOT,
    KVPool,
    StatePool,
    cache_view,
    commit_view,
    create_kv_pool,
    create_state_pool,
    scatter_snapshots,
)
from infernix_jax.cache.prefix_host import HostMemory
from infernix_jax.cache.prefix_index import HostData
from infernix_jax.config import ModelConfig
from infernix_jax.engine.config import EngineConfig
from infernix_jax.engine.constrained import allow_all
from infernix_jax.engine.mask_feed import MaskFeed, host_mask_step
from infernix_jax.engine.protocol import SamplingParams
from infernix_jax.engine.sampling import (
    ANY_PLAN,
    GREEDY_PLAN,
    PenaltyState,
    SamplingArrays,
    SamplingPlan,
    row_keys,
    sample,
    stop_token_hit,
    update_penalty_state,
)
from infernix_jax.jit import jit
from infernix_jax.model.forward import forward
from infernix_jax.model.params import Params


def _register(cls, fields: Sequence[str]):
    return jax.tree_util.register_dataclass(cls, data_fields=list(fields), meta_fields=[])


@dataclass(frozen=True)
class SlotSampling:
    """Sampling settings and penalty state of every slot, on the device (row = slot)."""

    arrays: SamplingArrays  # [s, ...]
    penalties: PenaltyState  # [s, v]

    def rows(self, slots: jax.Array) -> tuple[SamplingArrays, PenaltyState]:
        take = lambda x: x[slots]
        return jax.tree.map(take, self.arrays), jax.tree.map(take, self.penalties)

    def with_penalties(self, slots: jax.Array, penalties: PenaltyState) -> SlotSampling:
        """Scatter the rows' penalty state back; rows aimed at the scratch slot are dropped."""
        num_slots = self.penalties.num_generated.shape[0]
        target = jnp.where(slots == SCRATCH_SLOT, num_slots, slots)
        merged = jax.tree.map(
            lambda full, rows: full.at[target].set(rows, mode="drop"), self.penalties, penalties
        )
        return SlotSampling(self.arrays, merged)


_register(SlotSampling, ["arrays", "penalties"])


@dataclass(frozen=True)
class Sampled:
    """Tokens a program sampled, read back to the host."""

    tokens: np.ndarray  # i32 [n, b] (prefill: n = 1)
    counts: np.ndarray  # i32 [b]: valid tokens per row (the rest are discarded)
    logprobs: np.ndarray  # f32 [n, b]
    top_ids: np.ndarray  # i32 [n, b, k]
    top_logprobs: np.ndarray  # f32 [n, b, k]


# ---------------------------------------------------------------------------------------------
# Programs


@partial(jit, static_argnames=("cfg", "num_top"), donate_argnames=("kv_pool", "state_pool", "slot_sampling"))
def prefill_program(
    params: Params,
    kv_pool: KVPool,
    state_pool: StatePool,
    slot_sampling: SlotSampling,
    tokens: jax.Array,  # i32 [r, t]
    positions: jax.Array,  # i32 [r, t], -1 after a row's tokens
    block_table: jax.Array,  # i32 [r, m]
    slots: jax.Array,  # i32 [r]
    sample_rows: jax.Array,  # bool [r]: the chunk ends the row's pending tokens; sample from it
    snapshot_at: jax.Array | None = None,  # i32 [r, S]: recurrent-state snapshots after that many tokens
    snapshot_slots: jax.Array | None = None,  # i32 [r, S]: the state-pool slots they go to (0: none)
    mask: jax.Array | None = None,  # i32 [r, ceil(v / 32)]: packed allowed tokens (structured output)
    ngram_rows: jax.Array | None = None,  # [L, r, t, heads, width]: n-gram memory rows (model with a memory)
    *,
    cfg: ModelConfig,
    num_top: int,
):
    cache = cache_view(kv_pool, state_pool, block_table, slots, cfg, slotted=True)
    last = jnp.maximum(jnp.sum(positions >= 0, axis=1) - 1, 0).astype(jnp.int32)
    logits, _, cache = forward(
        params,
        tokens,
        positions,
        cache,
        cfg,
        logit_indices=last[:, None],
        snapshot_at=snapshot_at,
        ngram_rows=ngram_rows,
    )
    kv_pool, state_pool = commit_view(kv_pool, state_pool, cache, slots, cfg)
    if snapshot_at is not None:
        state_pool = scatter_snapshots(state_pool, cache.snapshots, snapshot_slots)
    arrays, penalties = slot_sampling.rows(slots)
    out = sample(
        logits[:, 0],
        arrays,
        penalties,
        row_keys(arrays, penalties.num_generated),
        mask,
        num_top_logprobs=num_top,
    )
    penalties = update_penalty_state(penalties, out.tokens, sample_rows)
    slot_sampling = slot_sampling.with_penalties(jnp.where(sample_rows, slots, SCRATCH_SLOT), penalties)
    return (
        kv_pool,
        state_pool,
        slot_sampling,
        (out.tokens[None], out.logprobs[None], out.top_ids[None], out.top_logprobs[None]),
    )


@partial(
    jit,
    static_argnames=("cfg", "steps", "num_top", "plan"),
    donate_argnames=("kv_pool", "state_pool", "slot_sampling", "out_buffer"),
)
def decode_program(
    params: Params,
    kv_pool: KVPool,
    state_pool: StatePool,
    slot_sampling: SlotSampling,
    tokens: jax.Array,  # i32 [b]: the token each row feeds first
    positions: jax.Array,  # i32 [b]: its position
    block_table: jax.Array,  # i32 [b, m]
    slots: jax.Array,  # i32 [b]
    max_steps: jax.Array,  # i32 [b]: tokens each row may generate (0 on padding rows)
    ngram_rows: jax.Array | None = None,  # [L, b, 1, heads, width]: n-gram memory rows (then steps == 1)
    mask: jax.Array | None = None,  # i32 [b, ceil(v / 32)]: the first step's packed masks (then feed_id)
    feed_id: jax.Array | None = None,  # i32 []: the engine/mask_feed.py MaskFeed of the later masks
    out_buffer: jax.Array | None = None,  # i32 [b, decode_width(steps, num_top)]: donated, see below
    *,
    cfg: ModelConfig,
    steps: int,
    num_top: int,
    plan: SamplingPlan | None = None,
):
    """`steps` decode steps on the device. With `mask`, every sample is masked and followed by a
    host callback (`mask_feed.host_mask_step`) that follows the sampled tokens through the rows'
    grammars and returns the next step's masks and the rows it stops (constrained decoding).
    plan: the sampling branches compiled in (covering the rows), or None to choose them on the
    device every step (EngineConfig.sampling_plans)."""
    if ngram_rows is not None and steps != 1:
        raise ValueError("with an n-gram memory a decode dispatch runs one step (the next rows need the token)")
    b = tokens.shape[0]
    arrays, penalties = slot_sampling.rows(slots)
    if mask is not None:
        host_step = partial(host_mask_step, words=mask.shape[1])
        host_shapes = (jax.ShapeDtypeStruct(mask.shape, jnp.int32), jax.ShapeDtypeStruct((b,), jnp.bool_))

    def step(i, carry):
        kv_pool, state_pool, penalties, current, done, count, out, step_mask = carry
        active = (i < max_steps) & ~done
        pos = jnp.where(active, positions + i, -1)
        cache = cache_view(kv_pool, state_pool, block_table, slots, cfg, slotted=True)
        logits, _, cache = forward(params, current[:, None], pos[:, None], cache, cfg, ngram_rows=ngram_rows)
        kv_pool, state_pool = commit_view(kv_pool, state_pool, cache, slots, cfg)
        sampled = sample(
            logits[:, 0],
            arrays,
            penalties,
            row_keys(arrays, penalties.num_generated),
            step_mask,
            num_top_logprobs=num_top,
            plan=plan,
        )
        penalties = update_penalty_state(penalties, sampled.tokens, active)
        done = done | (active & stop_token_hit(arrays, sampled.tokens))
        if step_mask is not None:  # the host follows the tokens: next masks, rows it ends
            step_mask, halt = io_callback(host_step, host_shapes, feed_id, sampled.tokens, active)
            done = done | (active & halt)
        current = jnp.where(active, sampled.tokens, current)
        out = tuple(
            o.at[i].set(x)
            for o, x in zip(out, (sampled.tokens, sampled.logprobs, sampled.top_ids, sampled.top_logprobs))
        )
        return kv_pool, state_pool, penalties, current, done, count + active.astype(jnp.int32), out, step_mask

    out = (
        jnp.zeros((steps, b), jnp.int32),
        jnp.zeros((steps, b), jnp.float32),
        jnp.zeros((steps, b, num_top), jnp.int32),
        jnp.zeros((steps, b, num_top), jnp.float32),
    )
    carry = (kv_pool, state_pool, penalties, tokens, jnp.zeros(b, bool), jnp.zeros(b, jnp.int32), out, mask)
    kv_pool, state_pool, penalties, current, done, count, out, _ = jax.lax.fori_loop(0, steps, step, carry)
    slot_sampling = slot_sampling.with_penalties(slots, penalties)
    # One packed output, written after the loop by a concatenate, into `out_buffer` (donated: the
    # output aliases it). The loop's CUDA graph is re-recorded whenever a buffer its kernels touch
    # moves, and the program's own output buffers are new at every dispatch: had the loop carried
    # its values in them (before 82c16fa), or had XLA placed the loop's small temporaries in the
    # output's allocation (it does, their live ranges being disjoint), the graph was updated at the
    # first step of every dispatch: ~5 ms of host time for the 80B-A3B's ~600 kernels against ~14
    # ms of device time for its 8 steps (docs/engine.md). A donated parameter's allocation holds
    # nothing else. The read-back is one transfer too.
    packed = pack_decode(count, current, done, *out)
    if out_buffer is not None:
        if out_buffer.shape != packed.shape:
            raise ValueError(f"out_buffer {out_buffer.shape} must be {packed.shape} (decode_width)")
        # written into it (an unused argument would be pruned, and its donation with it)
        packed = jax.lax.dynamic_update_slice(out_buffer, packed, (0, 0))
    return kv_pool, state_pool, slot_sampling, packed


DECODE_HEAD = 3  # packed decode output: count, current, done, then each row's steps


def decode_width(steps: int, num_top: int) -> int:
    """Columns of decode_program's packed output (pack_decode) for `steps` steps and `num_top`
    alternatives a step."""
    return DECODE_HEAD + steps * (2 + 2 * num_top)


def pack_decode(count, current, done, tokens, logprobs, top_ids, top_logprobs) -> jax.Array:
    """decode_program's outputs as one i32 [b, 3 + s (2 + 2 k)]: per row its count, last token,
    stop flag, then its s tokens, logprob bits, s x k top ids and top logprob bits."""
    b = count.shape[0]
    bits = lambda x: jax.lax.bitcast_convert_type(x, jnp.int32)
    rows = lambda x: jnp.moveaxis(x, 0, 1).reshape(b, -1)  # [s, b, ...] -> [b, s ...]
    head = jnp.stack([count, current, done.astype(jnp.int32)], axis=1)
    return jnp.concatenate(
        [head, rows(tokens), rows(bits(logprobs)), rows(top_ids), rows(bits(top_logprobs))], axis=1
    )


def unpack_decode(packed: np.ndarray, steps: int) -> Sampled:
    """decode_program's packed output, read back to the host."""
    packed = np.asarray(packed, np.int32)
    b, k = packed.shape[0], (packed.shape[1] - DECODE_HEAD - 2 * steps) // (2 * steps)
    cut = np.cumsum([DECODE_HEAD, steps, steps, steps * k])
    as_float = lambda x: np.ascontiguousarray(x).view(np.float32)
    steps_first = lambda x, *tail: np.ascontiguousarray(np.moveaxis(x.reshape(b, steps, *tail), 1, 0))
    return Sampled(
        steps_first(packed[:, cut[0] : cut[1]]),
        packed[:, 0].copy(),
        steps_first(as_float(packed[:, cut[1] : cut[2]])),
        steps_first(packed[:, cut[2] : cut[3]], k),
        steps_first(as_float(packed[:, cut[3] :]), k),
    )


@partial(jit, static_argnames=("steps",))
def next_decode_inputs(
    packed: jax.Array,  # i32 [b, ...]: that dispatch's output (pack_decode): count, last token, stop flag
    positions: jax.Array,  # i32 [b]: where that dispatch started
    budget: jax.Array,  # i32 [b]: tokens the row could still generate when that dispatch started
    *,
    steps: int,
):
    """The inputs of the decode dispatch that follows one still running on the device: (tokens,
    positions, max_steps, budget). A row that stopped or used up its budget gets max_steps 0, so the
    next dispatch leaves its KV and state untouched (asynchronous decode, core.py)."""
    count, current, done = packed[:, 0], packed[:, 1], packed[:, 2] != 0
    budget = budget - count
    max_steps = jnp.where(done, 0, jnp.clip(budget, 0, steps)).astype(jnp.int32)
    return current, positions + count, max_steps, budget


def _forward_one(params, kv_pool, state_pool, tokens, positions, block_table, slots, cfg):
    """One decode forward (T = 1): (pools, f32 logits [b, v], next positions: each fed row one
    further, -1 stays -1)."""
    cache = cache_view(kv_pool, state_pool, block_table, slots, cfg, slotted=True)
    logits, _, cache = forward(params, tokens[:, None], positions[:, None], cache, cfg)
    kv_pool, state_pool = commit_view(kv_pool, state_pool, cache, slots, cfg)
    next_positions = jnp.where(positions >= 0, positions + 1, -1).astype(jnp.int32)
    return kv_pool, state_pool, logits[:, 0].astype(jnp.float32), next_positions


def _sample_packed(slot_sampling, logits, slots, active, mask, num_top, forced=None, with_unmasked=False):
    """Sample one token per row under its mask, record it in the active rows' penalty state:
    (slot_sampling, tokens i32 [b], packed i32 [b, 3 + 2 k]: token, logprob bits, the token the
    row would take unmasked (`sample`'s with_unmasked; the token itself without it), k top ids,
    k top logprob bits; read in one transfer with `unpack_step`). `forced` (tokens i32 [b, f],
    valid bool [b, f]): outputs the grammar forced before this sample, recorded first (penalties,
    and the token index that keys the sample)."""
    arrays, penalties = slot_sampling.rows(slots)
    if forced is not None:
        for tokens, valid in zip(forced[0].T, forced[1].T):
            penalties = update_penalty_state(penalties, tokens, valid)
    keys = row_keys(arrays, penalties.num_generated)
    out = sample(logits, arrays, penalties, keys, mask, num_top_logprobs=num_top, with_unmasked=with_unmasked)
    unmasked = out.unmasked if with_unmasked else out.tokens
    penalties = update_penalty_state(penalties, out.tokens, active)
    slot_sampling = slot_sampling.with_penalties(jnp.where(active, slots, SCRATCH_SLOT), penalties)
    as_int = lambda x: jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
    packed = jnp.concatenate(
        [out.tokens[:, None], as_int(out.logprobs)[:, None], unmasked[:, None], out.top_ids,
         as_int(out.top_logprobs)],
        axis=1,
    )  # fmt: skip
    return slot_sampling, out.tokens, packed


@partial(jit, static_argnames=("cfg", "num_top"), donate_argnames=("kv_pool", "state_pool", "slot_sampling"))
def masked_decode_step_program(
    params: Params,
    kv_pool: KVPool,
    state_pool: StatePool,
    slot_sampling: SlotSampling,
    tokens: jax.Array,  # i32 [b]: the token each row feeds
    positions: jax.Array,  # i32 [b]: its position; -1 for rows that feed nothing (and do not sample)
    block_table: jax.Array,  # i32 [b, m]
    slots: jax.Array,  # i32 [b]
    mask: jax.Array,  # i32 [b, ceil(v / 32)]: packed allowed tokens (all ones for free rows)
    *,
    cfg: ModelConfig,
    num_top: int,
):
    """One decode step under a mask: (pools, slot_sampling, the tokens each row feeds next (its
    sample, or its input when it fed nothing), next positions, packed outputs as
    `masked_sample_program`'s). Free rows sample with the same keys, penalties and stops as in
    decode_program, so they give the tokens the multi-step program would."""
    kv_pool, state_pool, logits, next_positions = _forward_one(
        params, kv_pool, state_pool, tokens, positions, block_table, slots, cfg
    )
    active = positions >= 0
    slot_sampling, sampled, packed = _sample_packed(slot_sampling, logits, slots, active, mask, num_top)
    return kv_pool, state_pool, slot_sampling, jnp.where(active, sampled, tokens), next_positions, packed


FORCED_WINDOW = 8  # tokens a masked window step feeds per row: the pending one + up to 7 forced


@partial(jit, static_argnames=("cfg",), donate_argnames=("kv_pool", "state_pool", "slot_sampling"))
def masked_window_program(
    params: Params,
    kv_pool: KVPool,
    state_pool: StatePool,
    slot_sampling: SlotSampling,
    tokens: jax.Array,  # i32 [b, w]: the pending token, then the tokens the grammar forced after it
    positions: jax.Array,  # i32 [b, w]: their positions; -1 past a row's tokens (all -1: idle row)
    block_table: jax.Array,  # i32 [b, m]
    slots: jax.Array,  # i32 [b]
    mask: jax.Array,  # i32 [b, ceil(v / 32)]: the allowed tokens after the row's last fed token
    *,
    cfg: ModelConfig,
):
    """A masked decode step that feeds several tokens per row: each row's pending token and the
    tokens its grammar forced after it (outputs already, recorded in the penalty state here), then
    one sample after the last of them. Returns what `masked_decode_step_program` returns (no top
    alternatives: rows that want logprobs are never fed forced tokens)."""
    cache = cache_view(kv_pool, state_pool, block_table, slots, cfg, slotted=True)
    fed = jnp.sum(positions >= 0, axis=1).astype(jnp.int32)
    last = jnp.maximum(fed - 1, 0)
    logits, _, cache = forward(params, tokens, positions, cache, cfg, logit_indices=last[:, None])
    kv_pool, state_pool = commit_view(kv_pool, state_pool, cache, slots, cfg)
    active = fed > 0
    forced = (tokens[:, 1:], positions[:, 1:] >= 0)
    slot_sampling, sampled, packed = _sample_packed(
        slot_sampling, logits[:, 0].astype(jnp.float32), slots, active, mask, 0, forced
    )
    next_positions = jnp.where(active, positions[:, 0] + fed, -1).astype(jnp.int32)
    tokens = jnp.where(active, sampled, tokens[:, 0])
    return kv_pool, state_pool, slot_sampling, tokens, next_positions, packed


@partial(jit, static_argnames=("cfg",), donate_argnames=("kv_pool", "state_pool"))
def decode_forward_program(
    params: Params,
    kv_pool: KVPool,
    state_pool: StatePool,
    tokens: jax.Array,  # i32 [b]: the token each row feeds
    positions: jax.Array,  # i32 [b]: its position; -1 for rows that feed nothing
    block_table: jax.Array,  # i32 [b, m]
    slots: jax.Array,  # i32 [b]
    *,
    cfg: ModelConfig,
):
    """One decode forward without sampling: f32 logits [b, v] stay on the device for the sample.
    Also returns the positions of the next step (each fed row one further, -1 stays -1), so that a
    run of steps over the same rows uploads its positions once."""
    return _forward_one(params, kv_pool, state_pool, tokens, positions, block_table, slots, cfg)


@partial(jit, static_argnames=("num_top",), donate_argnames=("slot_sampling",))
def masked_sample_program(
    slot_sampling: SlotSampling,
    logits: jax.Array,  # f32 [b, v] from decode_forward_program
    slots: jax.Array,  # i32 [b]
    active: jax.Array,  # bool [b]: rows that sample (padding and stopped rows do not)
    mask: jax.Array,  # i32 [b, ceil(v / 32)]: packed allowed tokens (all ones for free rows)
    *,
    num_top: int,
):
    """Sample one token per row under its mask and record it in the row's penalty state.

    Returns the tokens (i32 [b], for the next forward; they stay on the device) and everything the
    host reads packed into one i32 [b, 3 + 2 k] array, so reading a step is one transfer: columns
    token, logprob (f32 bits), the unmasked choice (what the check way's chooser learns from split's
    steps), k top ids, k top logprobs (f32 bits). num_top 0 skips the top-k over the vocabulary (no
    row of the batch asked for alternatives)."""
    return _sample_packed(slot_sampling, logits, slots, active, mask, num_top, with_unmasked=True)


class StepRead(NamedTuple):
    """One masked sample read back to the host (`unpack_step`)."""

    tokens: np.ndarray  # i32 [b]
    logprobs: np.ndarray  # f32 [b]
    top_ids: np.ndarray  # i32 [b, k]
    top_logprobs: np.ndarray  # f32 [b, k]
    unmasked: np.ndarray  # i32 [b]: the token each row would have taken with no mask (split's reads)


def unpack_step(packed: np.ndarray) -> StepRead:
    """masked_sample_program's packed i32 [b, 3 + 2 k] output, read back to the host."""
    packed = np.asarray(packed, np.int32)
    k = (packed.shape[1] - 3) // 2
    as_float = lambda x: np.ascontiguousarray(x).view(np.float32)
    return StepRead(
        packed[:, 0], as_float(packed[:, 1]), packed[:, 3 : 3 + k], as_float(packed[:, 3 + k :]), packed[:, 2]
    )


@partial(jit, donate_argnames=("slot_sampling",))
def set_slot_program(
    slot_sampling: SlotSampling,
    slot: jax.Array,  # i32 []
    arrays: SamplingArrays,  # one row
    seen: jax.Array,  # bool [1, v]: tokens of the prompt and output so far
    output_counts: jax.Array,  # i32 [1, v]
    num_generated: jax.Array,  # i32 [1]
) -> SlotSampling:
    put = lambda full, row: full.at[slot].set(row[0])
    penalties = PenaltyState(seen=seen, output_counts=output_counts, num_generated=num_generated)
    return SlotSampling(
        jax.tree.map(put, slot_sampling.arrays, arrays), jax.tree.map(put, slot_sampling.penalties, penalties)
    )


@jit
def save_rows_program(state_pool: StatePool, slot_sampling: SlotSampling, slots: jax.Array):
    """Copies of the slots' recurrent states and penalty rows (i32 slots [b]), kept on the device:
    the "check" way restores a row whose free sample its grammar refused (core.py)."""
    take = lambda x: x[slots]
    return jax.tree.map(take, state_pool), jax.tree.map(take, slot_sampling.penalties)


@partial(jit, donate_argnames=("state_pool", "slot_sampling"))
def restore_rows_program(state_pool: StatePool, slot_sampling: SlotSampling, slots: jax.Array, saved):
    """Put `save_rows_program`'s copies back into slots [b]; rows whose slot is 0 (the scratch
    slot) are left as they are."""
    states, penalties = saved
    put = lambda x, rows: x.at[_drop_target(slots, x.shape[0])].set(rows, mode="drop")
    merged = jax.tree.map(put, slot_sampling.penalties, penalties)
    return jax.tree.map(put, state_pool, states), SlotSampling(slot_sampling.arrays, merged)


def _drop_target(dst: jax.Array, n: int) -> jax.Array:
    return jnp.where(dst == 0, n, dst)  # row 0 (null block / scratch slot): out of range, dropped


@partial(jit, donate_argnames=("pool",))
def copy_rows_program(pool, src: jax.Array, dst: jax.Array):
    """pool leaves[dst] = leaves[src] along the leading (block or slot) axis; dst 0 is dropped."""
    return jax.tree.map(lambda x: x.at[_drop_target(dst, x.shape[0])].set(x[src], mode="drop"), pool)


@jit
def gather_rows_program(pool, ids: jax.Array):
    """One pytree per id (a row of every leaf's leading axis), so that each row moves to the host
    tier on its own (cache/prefix_host.py)."""
    return tuple(jax.tree.map(lambda x, j=j: x[ids[j]], pool) for j in range(ids.shape[0]))


@partial(jit, donate_argnames=("pool",))
def scatter_rows_program(pool, ids: jax.Array, rows):
    """pool leaves[ids[j]] = rows[j] (a tuple of per-row pytrees on the device); id 0 is dropped."""
    stacked = jax.tree.map(lambda *r: jnp.stack(r), *rows)
    return jax.tree.map(
        lambda x, r: x.at[_drop_target(ids, x.shape[0])].set(r.astype(x.dtype), mode="drop"), pool, stacked
    )


ROW_PROGRAM_WIDTH = 8  # rows per copy / gather / scatter dispatch (one compiled shape)


def _padded(ids, width: int = ROW_PROGRAM_WIDTH) -> list[np.ndarray]:
    """ids in fixed-width int32 batches padded with 0 (the reserved row)."""
    ids = np.asarray(ids, np.int32)
    out = []
    for i in range(0, len(ids), width):
        batch = np.zeros(width, np.int32)
        part = ids[i : i + width]
        batch[: len(part)] = part
        out.append(batch)
    return out


# ---------------------------------------------------------------------------------------------
# The runner


def enable_compilation_cache(directory: str | None) -> None:
    """Turn on JAX's persistent compilation cache so that a restart loads programs instead of compiling."""
    if not directory:
        return
    path = os.path.expanduser(directory)
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@dataclass
class PrefillBatch:
    """Host arrays of one prefill dispatch."""

    tokens: np.ndarray  # i32 [r, t]
    positions: np.ndarray  # i32 [r, t]
    block_table: np.ndarray  # i32 [r, m]
    slots: np.ndarray  # i32 [r]
    sample_rows: np.ndarray  # bool [r]
    snapshot_at: np.ndarray | None = None  # i32 [r, S] or None (no snapshots in this engine)
    snapshot_slots: np.ndarray | None = None  # i32 [r, S]
    mask: np.ndarray | None = None  # i32 [r, mask_words]: packed allowed tokens; None: all
    ngram_rows: np.ndarray | None = (
        None  # [L, r, t, heads, width]: n-gram memory rows (engine/ngram_prefetch.py)
    )


@dataclass
class DecodeBatch:
    """Host arrays of one decode dispatch (tokens, positions and max_steps are device arrays when
    the dispatch is fed from the one before it: asynchronous decode)."""

    tokens: np.ndarray  # i32 [b]
    positions: np.ndarray  # i32 [b]
    block_table: np.ndarray  # i32 [b, m]
    slots: np.ndarray  # i32 [b]
    max_steps: np.ndarray  # i32 [b]
    steps: int
    ngram_rows: np.ndarray | None = None  # [L, b, 1, heads, width]: n-gram memory rows (steps == 1)
    sampling: SamplingPlan = ANY_PLAN  # the sampling branches the rows need (engine_plan of their settings)
    with_top: bool = True  # a row wants top alternatives (wants_top); False: no top-k (Runner.top_count)


class Runner:
    """Owns the parameters, the pools and the per-slot sampling state; runs bucketed programs."""

    def __init__(
        self,
        cfg: ModelConfig,
        params: Params,
        config: EngineConfig,
        num_blocks: int,
        num_slots: int,
        eos_token_ids: Sequence[int] = (),
        num_snapshot_slots: int = 0,
        snapshots_per_chunk: int = 0,
        ngram_table=None,
    ):
        self.cfg = cfg
        self.ngram_table = ngram_table  # infernix_jax.ngram.memory.NgramTable of a model with a memory
        self.params = params
        self.config = config
        self.eos_token_ids = tuple(eos_token_ids)
        self.dtype = params.final_norm.dtype
        self.num_top = config.max_top_logprobs
        self.max_blocks = config.max_blocks_per_sequence
        self.mask_words = -(-cfg.vocab_size // 32)  # int32 words of one packed token mask
        self.num_blocks, self.num_slots = num_blocks, num_slots
        self.num_snapshot_slots = num_snapshot_slots
        self.snapshots_per_chunk = snapshots_per_chunk if cfg.linear_attention_layers else 0
        self.reset_pools()
        self.static_sampling_plans = config.sampling_plans == "static" or (
            config.sampling_plans == "auto" and self.device.platform != "cpu"
        )
        # the prefix cache's host tier: pinned host memory beside the pools' device where it exists
        self.host_memory = (
            HostMemory.for_device(self.device) if config.prefix_cache else HostMemory(self.device, False)
        )

    @property
    def snapshot_slots(self) -> range:
        """State-pool slots reserved for prefix-cache snapshots (after the requests' slots)."""
        return range(self.num_slots, self.num_slots + self.num_snapshot_slots)

    def reset_pools(self) -> None:
        """Fresh, empty pools and slot state (at start, and after a failed dispatch consumed them)."""
        self.kv_pool = create_kv_pool(
            self.cfg, self.num_blocks, self.config.kv_dtype, self.dtype, with_mtp=self.config.spec_uses_mtp
        )
        self.state_pool = create_state_pool(self.cfg, self.num_slots + self.num_snapshot_slots, self.dtype)
        self.slot_sampling = SlotSampling(
            arrays=self._sampling_arrays([], [], self.num_slots),
            penalties=PenaltyState.zeros(self.num_slots, self.cfg.vocab_size),
        )
        # Committed to their device from the start. A program's outputs are committed when any input
        # is (the prefix cache's uploads are: docs/prefix_cache.md), and jit compiles a program anew
        # for committed inputs: pools committed only after warm-up would compile every bucket again.
        # (For the same reason `decode` commits what it feeds: host arrays or the last dispatch's.)
        self.device = next(iter(jax.tree.leaves(self.kv_pool)[0].devices()))
        self.kv_pool, self.state_pool, self.slot_sampling = jax.device_put(
            (self.kv_pool, self.state_pool, self.slot_sampling), self.device
        )

    def _sampling_arrays(self, params, seeds, batch: int) -> SamplingArrays:
        return SamplingArrays.build(
            params,
            seeds,
            batch,
            eos_token_ids=self.eos_token_ids,
            max_logit_bias=self.config.max_logit_bias,
            max_stop_ids=self.config.max_stop_ids,
        )

    # ---- slots ---------------------------------------------------------------------------------
    def set_slot(
        self, slot: int, params: SamplingParams, seed: int, prompt: Sequence[int], output: Sequence[int]
    ) -> None:
        """Install a request's sampling settings and its penalty state (prompt + output so far)."""
        vocab = self.cfg.vocab_size
        seen = np.zeros((1, vocab), bool)
        counts = np.zeros((1, vocab), np.int32)
        seen[0, np.asarray(prompt, np.int64)] = True
        if output:
            np.add.at(counts[0], np.asarray(output, np.int64), 1)
            seen |= counts > 0
        self.slot_sampling = set_slot_program(
            self.slot_sampling,
            jnp.int32(slot),
            self._sampling_arrays([params], [seed], 1),
            jnp.asarray(seen),
            jnp.asarray(counts),
            jnp.asarray([len(output)], jnp.int32),
        )

    # ---- dispatches ----------------------------------------------------------------------------
    def prefill(self, batch: PrefillBatch):
        """Dispatch a prefill program; returns device outputs (read them with `read`)."""
        self.kv_pool, self.state_pool, self.slot_sampling, out = prefill_program(
            self.params,
            self.kv_pool,
            self.state_pool,
            self.slot_sampling,
            batch.tokens,
            batch.positions,
            batch.block_table,
            batch.slots,
            batch.sample_rows,
            batch.snapshot_at,
            batch.snapshot_slots,
            batch.mask if batch.mask is not None else allow_all(len(batch.slots), self.mask_words),
            batch.ngram_rows,
            cfg=self.cfg,
            num_top=self.num_top,
        )
        return out

    def decode_step_masked(
        self,
        tokens: jax.Array,
        positions: jax.Array,
        block_table: jax.Array,
        slots: jax.Array,
        mask: np.ndarray,
        with_top: bool = True,
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Dispatch one masked decode step (returns at once): (the tokens each row feeds next and the
        next positions, both left on the device for the next step; the packed outputs, read them
        with `read_step`). Rows at position -1 feed nothing and do not sample. tokens and positions
        [b]: one token per row (`masked_decode_step_program`); [b, FORCED_WINDOW]: a row's pending
        token and the tokens its grammar forced (`masked_window_program`, no top alternatives).
        Pass device arrays where the caller can: each numpy argument is a host-to-device copy."""
        if self.ngram_table is not None:
            raise ValueError(
                "structured output with an n-gram memory is not supported yet (docs/ngram_memory.md)"
            )
        args = [jax.device_put(a, self.device) for a in (tokens, positions, block_table, slots, mask)]
        if np.ndim(tokens) == 2:
            program = partial(self._one_step(masked_window_program), cfg=self.cfg)
        else:
            num_top = self.num_top if with_top else 0
            program = partial(self._one_step(masked_decode_step_program), cfg=self.cfg, num_top=num_top)
        self.kv_pool, self.state_pool, self.slot_sampling, tokens, positions, packed = program(
            self.params, self.kv_pool, self.state_pool, self.slot_sampling, *args
        )
        return tokens, positions, packed

    def decode_forward(
        self, tokens: jax.Array, positions: jax.Array, block_table: jax.Array, slots: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        """Dispatch one decode forward (returns at once): (logits, next positions), both left on the
        device. Pass device arrays where the caller can (what stays the same over a run of steps):
        each numpy argument is a host-to-device copy per call."""
        if self.ngram_table is not None:
            raise ValueError(
                "structured output with an n-gram memory is not supported yet (docs/ngram_memory.md)"
            )
        # committed to the device, as the pools are: host ids or the last sample's, one program
        tokens, positions, block_table, slots = (
            jax.device_put(a, self.device) for a in (tokens, positions, block_table, slots)
        )
        self.kv_pool, self.state_pool, logits, next_positions = self._one_step(decode_forward_program)(
            self.params, self.kv_pool, self.state_pool, tokens, positions, block_table, slots, cfg=self.cfg
        )
        return logits, next_positions

    def sample_masked(
        self, logits: jax.Array, slots: jax.Array, active: jax.Array, mask: np.ndarray, with_top: bool = True
    ) -> tuple[jax.Array, jax.Array]:
        """Dispatch the masked sample of `decode_forward`'s logits: (tokens on the device, for the
        next forward; the packed outputs, read them with `read_step`). with_top False: no top
        alternatives (every row's top ids and logprobs come back empty)."""
        slots, active, mask = (jax.device_put(a, self.device) for a in (slots, active, mask))
        self.slot_sampling, tokens, packed = self._one_step(masked_sample_program)(
            self.slot_sampling, logits, slots, active, mask, num_top=self.num_top if with_top else 0
        )
        return tokens, packed

    def save_slots(self, slots: np.ndarray):
        """Device copies of the slots' recurrent states and penalty rows (i32 [b]; 0 on rows that
        need none), for `restore_slots`. Returns at once."""
        return save_rows_program(self.state_pool, self.slot_sampling, jax.device_put(slots, self.device))

    def restore_slots(self, slots: np.ndarray, saved) -> None:
        """Put the states and penalty rows `save_slots` copied back into slots (i32 [b], in the
        order they were saved; 0 leaves a row as it is)."""
        self.state_pool, self.slot_sampling = restore_rows_program(
            self.state_pool, self.slot_sampling, jax.device_put(slots, self.device), saved
        )

    def _one_step(self, program):
        """A program dispatched once per constrained token, with or without command buffers
        (EngineConfig.one_step_command_buffers)."""
        return program if self.config.one_step_command_buffers else program.without_command_buffers

    @staticmethod
    def read_step(packed: jax.Array) -> StepRead:
        """One masked sample's tokens, logprobs, top alternatives (k is 0 when it ran without
        them) and unmasked choices, in one device-to-host transfer."""
        return unpack_step(jax.device_get(packed))

    def decode(self, batch: DecodeBatch, feed: MaskFeed | None = None):
        """Dispatch a decode; returns its packed output (read with read_decode; on the device it
        gives next_decode_inputs each row's count, last sampled token and stop flag). With
        `feed` (constrained rows), every step samples under the masks the feed gives (its first
        ones now, the later ones from the program's host callback)."""
        # host arrays, or device ones from the dispatch before (asynchronous decode): one program
        # with the buffer the packed output is written into (decode_program: a fresh parameter
        # each dispatch keeps the step loop's graph where it was)
        num_top = self.top_count(batch.with_top)
        out_buffer = np.zeros((len(batch.slots), decode_width(batch.steps, num_top)), np.int32)
        fed = jax.device_put((batch.tokens, batch.positions, batch.max_steps, out_buffer), self.device)
        masked = {}
        if feed is not None:
            if self.ngram_table is not None:
                raise ValueError(
                    "structured output with an n-gram memory is not supported yet (docs/ngram_memory.md)"
                )
            masked = dict(
                zip(("mask", "feed_id"), jax.device_put((feed.masks(), np.int32(feed.id)), self.device))
            )
        program = decode_program.with_loop_graphs if self.config.decode_loop_graphs else decode_program
        self.kv_pool, self.state_pool, self.slot_sampling, out = program(
            self.params,
            self.kv_pool,
            self.state_pool,
            self.slot_sampling,
            fed[0],
            fed[1],
            batch.block_table,
            batch.slots,
            fed[2],
            batch.ngram_rows,
            **masked,
            out_buffer=fed[3],
            cfg=self.cfg,
            steps=batch.steps,
            num_top=num_top,
            # constrained rows wait for the host every step anyway (the callback): no plan
            plan=batch.sampling if self.static_sampling_plans and feed is None else None,
        )
        return out

    @staticmethod
    def read_prefill(out, rows: int) -> Sampled:
        tokens, logprobs, top_ids, top_logprobs = jax.device_get(out)
        return Sampled(tokens, np.ones(rows, np.int32), logprobs, top_ids, top_logprobs)

    @staticmethod
    def read_decode(out, steps: int) -> Sampled:
        return unpack_decode(jax.device_get(out), steps)

    # ---- host arrays ---------------------------------------------------------------------------
    def empty_prefill(self, rows: int, length: int) -> PrefillBatch:
        return PrefillBatch(
            tokens=np.zeros((rows, length), np.int32),
            positions=np.full((rows, length), -1, np.int32),
            block_table=np.full((rows, self.max_blocks), NULL_BLOCK, np.int32),
            slots=np.full(rows, SCRATCH_SLOT, np.int32),
            sample_rows=np.zeros(rows, bool),
            snapshot_at=np.full((rows, self.snapshots_per_chunk), -1, np.int32)
            if self.snapshots_per_chunk
            else None,
            snapshot_slots=np.zeros((rows, self.snapshots_per_chunk), np.int32)
            if self.snapshots_per_chunk
            else None,
            mask=allow_all(rows, self.mask_words),
            ngram_rows=self.ngram_table.empty(rows, length) if self.ngram_table is not None else None,
        )

    def empty_decode(self, batch: int, steps: int) -> DecodeBatch:
        return DecodeBatch(
            tokens=np.zeros(batch, np.int32),
            positions=np.zeros(batch, np.int32),
            block_table=np.full((batch, self.max_blocks), NULL_BLOCK, np.int32),
            slots=np.full(batch, SCRATCH_SLOT, np.int32),
            max_steps=np.zeros(batch, np.int32),
            steps=steps,
            ngram_rows=self.ngram_table.empty(batch, 1) if self.ngram_table is not None else None,
        )

    # ---- pool rows for the prefix cache (implements cache.prefix_cache.PoolDevice) --------------
    def copy_blocks(self, src: Sequence[int], dst: Sequence[int]) -> None:
        for s, d in zip(_padded(src), _padded(dst)):
            self.kv_pool = copy_rows_program(self.kv_pool, s, d)

    def copy_states(self, src: Sequence[int], dst: Sequence[int]) -> None:
        for s, d in zip(_padded(src), _padded(dst)):
            self.state_pool = copy_rows_program(self.state_pool, s, d)

    def read_blocks(self, ids: Sequence[int]) -> list[HostData]:
        return self._read_rows(self.kv_pool, ids)

    def read_states(self, slots: Sequence[int]) -> list[HostData]:
        return self._read_rows(self.state_pool, slots)

    def write_blocks(self, ids: Sequence[int], data: Sequence[HostData]) -> None:
        self.kv_pool = self._write_rows(self.kv_pool, ids, data)

    def write_states(self, slots: Sequence[int], data: Sequence[HostData]) -> None:
        self.state_pool = self._write_rows(self.state_pool, slots, data)

    def to_host(self, data: HostData) -> HostData:
        return self.host_memory.adopt(data)

    def _read_rows(self, pool, ids: Sequence[int]) -> list[HostData]:
        """Host copies of pool rows (pinned host memory: the copies are still in flight on return)."""
        out = []
        for start, batch in zip(range(0, len(ids), ROW_PROGRAM_WIDTH), _padded(ids)):
            rows = gather_rows_program(pool, batch)[: len(ids) - start]
            out.extend(self.host_memory.store(rows))
        return out

    def _write_rows(self, pool, ids: Sequence[int], data: Sequence[HostData]):
        """Upload host rows (either kind) into pool rows `ids`; padding repeats the first row (to id 0:
        dropped), so every dispatch has the one compiled shape and uploads only real rows."""
        treedef = jax.tree.structure(pool)
        for start, batch in zip(range(0, len(ids), ROW_PROGRAM_WIDTH), _padded(ids)):
            part = self.host_memory.load(data[start : start + ROW_PROGRAM_WIDTH])
            part += [part[0]] * (ROW_PROGRAM_WIDTH - len(part))
            rows = tuple(jax.tree.unflatten(treedef, list(row)) for row in part)
            pool = scatter_rows_program(pool, batch, rows)
        return pool

    # ---- warm-up -------------------------------------------------------------------------------
    def warmup(self, progress: bool = True) -> float:
        """Compile every bucket by running it on padding rows (their writes are dropped). Returns seconds."""
        start = time.perf_counter()
        work = [("prefill", shape) for shape in self.config.prefill_shapes]
        if self.config.spec_uses_mtp:  # its prefill is speculative.programs.mtp_prefill_program
            work = []
        if self.config.spec == "none":  # with speculation every decode row runs the verify program
            work += [("decode", (b, self.config.decode_steps_per_dispatch)) for b in self.config.decode_buckets]
        if self.config.structured_output:
            callback = self.config.constrained_decode == "callback"
            steps = self.config.decode_steps_per_dispatch if callback else 1
            work += [("constrained decode", (b, steps)) for b in self.config.decode_buckets]
        bar = _progress(len(work), "compiling", progress)
        self.set_slot(SCRATCH_SLOT, SamplingParams(), 0, [0], [])
        if self.config.prefix_cache:  # the prefix cache's row programs (all writes go to row 0: dropped)
            self.copy_blocks([0], [0])
            self.copy_states([0], [0])
            self.write_blocks([0], self.read_blocks([0]))
            self.write_states([0], self.read_states([0]))
        for kind, (a, b) in work:
            bar.set_postfix_str(f"{kind} {a}x{b}")
            if kind == "prefill":
                out = self.prefill(self.empty_prefill(a, b))
            elif kind == "constrained decode":  # with and without top alternatives
                out = self.warm_constrained(a)
            else:
                for sampling, with_top in self.decode_variants():
                    empty = dataclasses.replace(self.empty_decode(a, b), sampling=sampling, with_top=with_top)
                    out = self.warm_decode(empty)
            jax.block_until_ready(out)
            bar.update(1)
        bar.close()
        return time.perf_counter() - start

    def decode_variants(self) -> list[tuple[SamplingPlan, bool]]:
        """The (plan, with_top) pairs the engine dispatches a decode bucket with (engine_plan,
        wants_top), one program each. Without static plans (the CPU: every compile is slow there,
        and neither a branch nor a top-k costs a wait) one program serves every batch. (Giving top
        alternatives ANY_PLAN would save a program, but a greedy batch with them would then run
        both threshold searches every step.)"""
        if not self.static_sampling_plans:
            return [(ANY_PLAN, True)]
        return [(plan, top) for plan in (GREEDY_PLAN, ANY_PLAN) for top in (False, True)]

    def top_count(self, with_top: bool) -> int:
        """The K of a dispatch's program: max_top_logprobs where a row wants top alternatives (or
        where programs are not specialised on the rows: `decode_variants`), else 0 (no top-k)."""
        return self.num_top if with_top or not self.static_sampling_plans else 0

    def warm_decode(self, empty: DecodeBatch):
        """Compile one decode bucket's program on idle rows, fed as the engine feeds it."""
        out = self.decode(empty)
        a, b = empty.tokens.shape[0], empty.steps
        if self.config.async_decode and self.ngram_table is None:  # fed from the last one's outputs
            # as async_decode.py feeds it: the first follow-up from host positions and budget,
            # later ones from device arrays (jit keys its programs on which are committed)
            positions, budget = empty.positions, np.zeros(a, np.int32)
            for _ in range(2):
                tokens, positions, max_steps, budget = next_decode_inputs(out, positions, budget, steps=b)
                fed = dataclasses.replace(empty, tokens=tokens, positions=positions, max_steps=max_steps)
                out = self.decode(fed)
        return out

    def warm_constrained(self, batch: int) -> list:
        """Compile the constrained decode programs of one batch bucket on idle rows (position -1: no
        writes, no samples), fed as core.py feeds them: host arrays first, then the device arrays
        the step before returned."""
        if self.config.constrained_decode == "callback":  # the multi-step program with masks
            feed = MaskFeed([], batch, self.mask_words)
            try:
                empty = self.empty_decode(batch, self.config.decode_steps_per_dispatch)
                out = []
                for with_top in dict.fromkeys(top for _, top in self.decode_variants()):  # one at a time:
                    fed = dataclasses.replace(empty, with_top=with_top)  # see core._constrained_callback
                    out.append(jax.block_until_ready(self.decode(fed, feed)))
                return out
            finally:
                feed.close()
        empty = self.empty_decode(batch, 1)
        idle = np.full(batch, -1, np.int32)
        mask = allow_all(batch, self.mask_words)
        out = []
        way = self.config.constrained_decode
        for top in (True, False):
            if way in ("split", "check"):  # check splits what it cannot check
                logits, _ = self.decode_forward(empty.tokens, idle, empty.block_table, empty.slots)
                out.append(self.sample_masked(logits, empty.slots, np.zeros(batch, bool), mask, top))
                continue
            tokens, positions, _ = self.decode_step_masked(
                empty.tokens, idle, empty.block_table, empty.slots, mask, top
            )
            out.append(self.decode_step_masked(tokens, positions, empty.block_table, empty.slots, mask, top))
        if way == "fused" or batch in self.config.check_buckets:  # forced tokens / a refusal's replacement
            window = np.zeros((batch, FORCED_WINDOW), np.int32)
            idle_window = np.full_like(window, -1)
            out.append(self.decode_step_masked(window, idle_window, empty.block_table, empty.slots, mask))
        if batch in self.config.check_buckets:  # the copies of the states it restores after a refusal
            self.restore_slots(empty.slots, self.save_slots(empty.slots))
            out.append(self.state_pool)
        return out


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, file=sys.stderr, leave=False)
