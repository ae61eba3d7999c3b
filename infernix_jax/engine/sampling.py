"""Next-token sampling on the device, for a batch of requests with different settings.

Everything here is pure and jittable, so it runs inside the decode program (several steps per
dispatch, no host round trip). The host builds a `SamplingArrays` once per batch composition from
the requests' `SamplingParams`; the device carries a `PenaltyState` per row and updates it after
every sampled token.

Order of operations (vLLM v1's order, so that the same settings give the same distribution):

  raw logits -> logit bias -> min_tokens suppression of stop tokens -> structured-output mask
  -> repetition penalty (prompt + output) -> frequency / presence penalties (output only)
  -> greedy rows: argmax here (exact; nothing below changes it)
  -> temperature -> min_p -> top_k -> top_p (on what min_p and top_k kept) -> Gumbel-max sample.

Truncation is exact and sort-free: top-k and top-p thresholds are found by a search over an
order-preserving integer image of the float32 logits (32 / search_bits reductions over [b, v]
each, no sort of the 151k vocabulary). See docs/sampling.md for the cost and the alternatives.

Logprobs are by default those of the *raw* model distribution (log_softmax of the logits the
model produced), as vLLM returns by default and as the OpenAI API documents them: they describe the
model, do not depend on the sampling knobs, and stay meaningful for greedy rows. The processed
distribution (the one actually sampled from) is available with `logprobs_mode="processed"`.

Letters: b batch rows, v vocabulary, k top alternatives, n logit-bias entries, s stop ids.
"""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from infernix_jax.engine.protocol import SamplingParams
from infernix_jax.switches import env_mode, switched

# Temperatures below this are treated as greedy (dividing by them would overflow float32).
GREEDY_TEMPERATURE = 1e-5

# Threshold search: bits of the 32-bit key settled per reduction pass over the vocabulary. 1 (a
# bisection, 32 passes) gives plain row reductions; 4 (8 passes of 15 candidates) makes a quarter
# of the launches, but was 16x slower on the CPU, where the comparisons are the cost, and 1.7%
# slower a step at eight rows on an H100 (faster by ~10% at one row). `search_bits_for_backend`
# picks per backend and batch (docs/sampling.md).
CPU_SEARCH_BITS, ACCELERATOR_SEARCH_BITS = 1, 4
WIDE_SEARCH_MAX_ROWS = 4  # accelerators: 4 bits a pass up to this many rows, 1 past it
SEARCH_BITS = ("auto", "1", "2", "4", "8")
# read while tracing: "auto" (4 on accelerators, 1 on the CPU) or a width; INFERNIX_SEARCH_BITS,
# or a `search_width` block
_modes = {"search_bits": env_mode("INFERNIX_SEARCH_BITS", "auto", SEARCH_BITS)}


def search_width_mode() -> str:
    """The threshold searches' width in programs traced now (SEARCH_BITS)."""
    return _modes["search_bits"]


def search_width(way: str) -> contextlib.AbstractContextManager[None]:
    """The top-k / top-p threshold searches' bits a pass in programs traced inside this block
    (SEARCH_BITS; default: INFERNIX_SEARCH_BITS, "auto"). The thresholds are the same at every
    width, up to the float32 rounding of a top-p mass that lands on its limit."""
    return switched(_modes, "search_bits", way, SEARCH_BITS, "search bits")


def search_bits_for_backend(rows: int = 1) -> int:
    """The width the mode gives on the backend tracing now, for a batch of `rows` (static). "auto"
    on accelerators: 4 up to WIDE_SEARCH_MAX_ROWS rows, where each pass is a launch whatever its
    arithmetic (the 80B-A3B's sampled step on an H100: 1.87-1.92 ms of device time against
    2.06-2.07 with 1 bit at one row), and 1 past it, where the 15 comparisons a key begin to
    cost (5.40 against 5.30-5.32 ms at eight rows; docs/sampling.md). On the CPU 1."""
    mode = _modes["search_bits"]
    if mode != "auto":
        return int(mode)
    if jax.default_backend() == "cpu" or rows > WIDE_SEARCH_MAX_ROWS:
        return CPU_SEARCH_BITS
    return ACCELERATOR_SEARCH_BITS

_KEY_IMPL = "threefry2x32"  # fixed so seeds reproduce whatever the default PRNG implementation is


@dataclass(frozen=True)
class SamplingPlan:
    """Which of `sample`'s branches a program compiles in, chosen on the host from the settings of
    the rows it serves (a static jit argument). Without a plan, `sample` picks its branches on the
    device (`lax.cond` on "every row greedy", "some row uses top_k / top_p"); XLA's GPU runtime
    runs such a branch by copying the predicate to the host and waiting for the device, once per
    cond and decode step, so the host cannot enqueue ahead of the device and every later launch of
    the step shows as idle device time (docs/sampling.md, "Branches chosen on the host").

    A plan must cover its rows: `draws` False only if every row is greedy, `top_k` / `top_p` False
    only if no row uses them. A plan that includes more than its rows need gives the same tokens
    (a search whose limit keeps every token cuts nothing), at the cost of that work."""

    draws: bool = True  # some row samples (temperature > 0): truncation and the Gumbel draw
    top_k: bool = True  # some sampled row has top_k > 0: its threshold search
    top_p: bool = True  # some sampled row has top_p < 1: its threshold search

    @staticmethod
    def covering(params: Sequence[SamplingParams | None]) -> SamplingPlan:
        """The smallest plan that covers these rows (None: padding)."""
        sampled = [p for p in params if p is not None and p.temperature >= GREEDY_TEMPERATURE]
        return SamplingPlan(
            draws=bool(sampled),
            top_k=any(p.top_k > 0 for p in sampled),
            top_p=any(p.top_p < 1.0 for p in sampled),
        )


GREEDY_PLAN = SamplingPlan(draws=False, top_k=False, top_p=False)
ANY_PLAN = SamplingPlan()  # covers every row


def engine_plan(params: Sequence[SamplingParams | None]) -> SamplingPlan:
    """The engine's plan for a batch: GREEDY_PLAN when every row is greedy, else ANY_PLAN. Two
    plans, not the eight `covering` could give, so that warm-up compiles each decode bucket twice
    (four times with the programs for top alternatives, `wants_top`) and a request's settings never
    wait for a compile; a sampled batch pays both threshold searches even where no row truncates."""
    return GREEDY_PLAN if not SamplingPlan.covering(params).draws else ANY_PLAN


def wants_top(params: Sequence[SamplingParams | None]) -> bool:
    """Whether some row asks for top alternatives (logprobs > 0). A dispatch whose rows do not is
    compiled without the top-k over the vocabulary: past k = 16 XLA's GPU top-k is a sort of the
    whole vocabulary, every decode step (docs/sampling.md)."""
    return any(p is not None and (p.logprobs or 0) > 0 for p in params)


def _register(cls, data_fields: Sequence[str]):
    return jax.tree_util.register_dataclass(cls, data_fields=list(data_fields), meta_fields=[])


@dataclass(frozen=True)
class SamplingArrays:
    """Per-row sampling settings for one batch, as device arrays padded to the batch bucket.

    Built on the host by `SamplingArrays.build`; rows without a request are greedy padding.
    """

    greedy: jax.Array  # bool [b]: argmax rows (temperature 0)
    temperature: jax.Array  # f32 [b]: > 0; 1.0 on greedy rows (unused there)
    top_k: jax.Array  # i32 [b]: 0 = off
    top_p: jax.Array  # f32 [b]: in (0, 1]; 1 = off
    min_p: jax.Array  # f32 [b]: in [0, 1]; 0 = off
    repetition_penalty: jax.Array  # f32 [b]: 1 = off
    presence_penalty: jax.Array  # f32 [b]: 0 = off
    frequency_penalty: jax.Array  # f32 [b]: 0 = off
    bias_ids: jax.Array  # i32 [b, n]: sparse logit bias token ids (padding: id 0 with value 0)
    bias_values: jax.Array  # f32 [b, n]: added to the logit of bias_ids
    stop_ids: jax.Array  # i32 [b, s]: stop token ids incl. EOS unless ignore_eos (padding: -1)
    min_tokens: jax.Array  # i32 [b]: stop_ids are suppressed until this many tokens were generated
    seed: jax.Array  # u32 [b, 2]: the request's 64-bit seed as (high, low) words

    @property
    def batch_size(self) -> int:
        return self.greedy.shape[0]

    @staticmethod
    def build(
        params: Sequence[SamplingParams | None],
        seeds: Sequence[int | None],
        batch_size: int,
        *,
        eos_token_ids: Sequence[int] = (),
        max_logit_bias: int = 300,
        max_stop_ids: int = 16,
    ) -> SamplingArrays:
        """Pack one SamplingParams per running request into padded arrays.

        params[i] / seeds[i] describe row i; None (or rows past len(params)) is padding. Seeds must
        be the request's resolved seed (`resolve_seed` at admission), so that a request keeps its
        random stream when the batch around it changes. max_logit_bias and max_stop_ids fix the
        widths of the sparse arrays (static shapes: keep them constant across an engine's life).
        """
        if len(params) > batch_size or len(seeds) != len(params):
            raise ValueError(
                f"need len(seeds) == len(params) <= batch_size, got {len(seeds)}, {len(params)}, {batch_size}"
            )
        b = batch_size
        greedy = np.ones(b, bool)
        temperature = np.ones(b, np.float32)
        top_k = np.zeros(b, np.int32)
        top_p = np.ones(b, np.float32)
        min_p = np.zeros(b, np.float32)
        repetition = np.ones(b, np.float32)
        presence = np.zeros(b, np.float32)
        frequency = np.zeros(b, np.float32)
        bias_ids = np.zeros((b, max_logit_bias), np.int32)
        bias_values = np.zeros((b, max_logit_bias), np.float32)
        stop_ids = np.full((b, max_stop_ids), -1, np.int32)
        min_tokens = np.zeros(b, np.int32)
        seed_words = np.zeros((b, 2), np.uint32)
        for row, (p, seed) in enumerate(zip(params, seeds)):
            if p is None:
                continue
            if p.temperature >= GREEDY_TEMPERATURE:
                greedy[row] = False
                temperature[row] = p.temperature
            top_k[row] = p.top_k
            top_p[row] = p.top_p
            min_p[row] = p.min_p
            repetition[row] = p.repetition_penalty
            presence[row] = p.presence_penalty
            frequency[row] = p.frequency_penalty
            if len(p.logit_bias) > max_logit_bias:
                raise ValueError(
                    f"row {row}: {len(p.logit_bias)} logit_bias entries, at most {max_logit_bias}"
                )
            if any(token < 0 for token, _ in p.logit_bias):
                raise ValueError(f"row {row}: logit_bias token ids must be >= 0, got {p.logit_bias}")
            for j, (token, bias) in enumerate(p.logit_bias):
                bias_ids[row, j] = token
                bias_values[row, j] = bias
            stops = list(
                dict.fromkeys(list(p.stop_token_ids) + ([] if p.ignore_eos else list(eos_token_ids)))
            )
            if len(stops) > max_stop_ids:
                raise ValueError(f"row {row}: {len(stops)} stop token ids, at most {max_stop_ids}")
            stop_ids[row, : len(stops)] = stops
            min_tokens[row] = p.min_tokens
            if seed is None:
                raise ValueError(f"row {row}: seed is None; resolve it with resolve_seed() at admission")
            seed_words[row] = _seed_words(seed)
        return SamplingArrays(
            greedy=jnp.asarray(greedy),
            temperature=jnp.asarray(temperature),
            top_k=jnp.asarray(top_k),
            top_p=jnp.asarray(top_p),
            min_p=jnp.asarray(min_p),
            repetition_penalty=jnp.asarray(repetition),
            presence_penalty=jnp.asarray(presence),
            frequency_penalty=jnp.asarray(frequency),
            bias_ids=jnp.asarray(bias_ids),
            bias_values=jnp.asarray(bias_values),
            stop_ids=jnp.asarray(stop_ids),
            min_tokens=jnp.asarray(min_tokens),
            seed=jnp.asarray(seed_words),
        )


_register(SamplingArrays, [f.name for f in dataclasses.fields(SamplingArrays)])


@dataclass(frozen=True)
class PenaltyState:
    """What the penalties and min_tokens need to know about each row's tokens so far (on device)."""

    seen: jax.Array  # bool [b, v]: token occurs in the prompt or the output (repetition penalty)
    output_counts: jax.Array  # i32 [b, v]: occurrences in the output (presence / frequency)
    num_generated: jax.Array  # i32 [b]: output tokens so far = the index of the next token

    @staticmethod
    def zeros(batch_size: int, vocab_size: int) -> PenaltyState:
        return PenaltyState(
            seen=jnp.zeros((batch_size, vocab_size), bool),
            output_counts=jnp.zeros((batch_size, vocab_size), jnp.int32),
            num_generated=jnp.zeros((batch_size,), jnp.int32),
        )


_register(PenaltyState, ["seen", "output_counts", "num_generated"])


@dataclass(frozen=True)
class SampleOutput:
    """One sampled token per row, with its logprob and the K most likely alternatives."""

    tokens: jax.Array  # i32 [b]
    logprobs: jax.Array  # f32 [b]: logprob of tokens (see logprobs_mode)
    top_ids: jax.Array  # i32 [b, k]: most likely first
    top_logprobs: jax.Array  # f32 [b, k]
    # i32 [b]: the token each row would have taken with no mask (sample's with_unmasked), else None
    unmasked: jax.Array | None = None


_register(SampleOutput, ["tokens", "logprobs", "top_ids", "top_logprobs", "unmasked"])


# ---------------------------------------------------------------------------------------------
# Host helpers


def resolve_seed(params: SamplingParams) -> int:
    """The seed a request samples with: its own, or a random 64-bit one drawn once at admission."""
    return params.seed if params.seed is not None else secrets.randbits(64)


def _seed_words(seed: int) -> tuple[int, int]:
    seed %= 1 << 64  # negative or larger seeds wrap to 64 bits
    return (seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF


# ---------------------------------------------------------------------------------------------
# Penalty state on the device


def set_penalty_rows(
    state: PenaltyState, rows: jax.Array, prompt_ids: jax.Array, output_ids: jax.Array
) -> PenaltyState:
    """Reset rows [r] to a request's prompt and output so far (admission, resume after preemption).

    prompt_ids i32 [r, l] and output_ids i32 [r, m] are padded with -1. num_generated becomes the
    count of output ids, so a resumed request continues its own random stream.
    """
    vocab = state.seen.shape[1]
    r = rows.shape[0]
    row_index = jnp.broadcast_to(jnp.arange(r)[:, None], prompt_ids.shape)
    prompt_cols = jnp.where(prompt_ids < 0, vocab, prompt_ids)  # out of range -> dropped
    out_row_index = jnp.broadcast_to(jnp.arange(r)[:, None], output_ids.shape)
    out_cols = jnp.where(output_ids < 0, vocab, output_ids)
    counts = jnp.zeros((r, vocab), jnp.int32).at[out_row_index, out_cols].add(1, mode="drop")
    seen = jnp.zeros((r, vocab), bool).at[row_index, prompt_cols].set(True, mode="drop") | (counts > 0)
    return PenaltyState(
        seen=state.seen.at[rows].set(seen),
        output_counts=state.output_counts.at[rows].set(counts),
        num_generated=state.num_generated.at[rows].set(jnp.sum(output_ids >= 0, axis=1).astype(jnp.int32)),
    )


def update_penalty_state(state: PenaltyState, tokens: jax.Array, active: jax.Array) -> PenaltyState:
    """Record one sampled token per row (tokens i32 [b]); rows with active (bool [b]) False are unchanged."""
    b = tokens.shape[0]
    rows = jnp.arange(b)
    inc = active.astype(jnp.int32)
    return PenaltyState(
        seen=state.seen.at[rows, tokens].set(state.seen[rows, tokens] | active),
        output_counts=state.output_counts.at[rows, tokens].add(inc),
        num_generated=state.num_generated + inc,
    )


def stop_token_hit(arrays: SamplingArrays, tokens: jax.Array) -> jax.Array:
    """bool [b]: the token just sampled is one of the row's stop ids (EOS included unless ignore_eos)."""
    return jnp.any(arrays.stop_ids == tokens[:, None], axis=1)


def row_keys(arrays: SamplingArrays, token_index: jax.Array) -> jax.Array:
    """Random keys [b] for the next token of each row: a function of (seed, token index) only.

    token_index i32 [b] is the request's own count of generated tokens (PenaltyState.num_generated),
    so the stream does not depend on the row's slot or on the other rows.
    """
    base = jax.random.wrap_key_data(arrays.seed, impl=_KEY_IMPL)
    return jax.vmap(jax.random.fold_in)(base, token_index.astype(jnp.uint32))


def unpack_token_mask(words: jax.Array, vocab_size: int) -> jax.Array:
    """bool [b, v] from a packed bitmask [b, ceil(v / 32)] (bit j of word i allows token 32 i + j).

    This is the layout llguidance and xgrammar fill; int32 and uint32 words are both accepted.
    """
    words = jax.lax.bitcast_convert_type(words, jnp.uint32) if words.dtype == jnp.int32 else words
    ids = jnp.arange(vocab_size, dtype=jnp.uint32)
    bits = words[:, ids // 32] >> (ids % 32)[None, :]
    return (bits & 1).astype(bool)


# ---------------------------------------------------------------------------------------------
# Logit processing


def process_logits(
    logits: jax.Array,
    arrays: SamplingArrays,
    state: PenaltyState,
    mask: jax.Array | None = None,
) -> jax.Array:
    """Bias, min_tokens suppression, the structured-output mask and the penalties: f32 [b, v].

    This is what greedy rows take the argmax of. mask is bool [b, v] (True = allowed) or packed
    bits [b, ceil(v / 32)]; rows without a constraint pass all-True. Disallowed tokens get -inf.
    """
    b, vocab = logits.shape
    logits = logits.astype(jnp.float32)
    rows = jnp.arange(b)[:, None]
    logits = logits.at[rows, arrays.bias_ids].add(arrays.bias_values, mode="drop")
    suppress = state.num_generated < arrays.min_tokens  # [b]
    stop_cols = jnp.where((arrays.stop_ids >= 0) & suppress[:, None], arrays.stop_ids, vocab)
    logits = logits.at[rows, stop_cols].set(-jnp.inf, mode="drop")
    if mask is not None:
        logits = jnp.where(_bool_mask(mask, vocab), logits, -jnp.inf)
    rep = arrays.repetition_penalty[:, None]
    penalised = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where(state.seen, penalised, logits)
    counts = state.output_counts.astype(jnp.float32)
    logits = logits - arrays.frequency_penalty[:, None] * counts
    logits = logits - arrays.presence_penalty[:, None] * (counts > 0)
    return logits


def _bool_mask(mask: jax.Array, vocab: int) -> jax.Array:
    """bool [b, v] of a bool or packed-bits mask."""
    return mask if mask.dtype == jnp.bool_ else unpack_token_mask(mask, vocab)


def _order_key(x: jax.Array) -> jax.Array:
    """u32 with the same order as the float32 x (a < b  <=>  key(a) < key(b)); -0.0 is +0.0."""
    x = jnp.where(x == 0, 0.0, x).astype(jnp.float32)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
    negative = (bits >> 31) == 1
    return jnp.where(negative, ~bits, bits | jnp.uint32(0x80000000))


def _smallest_key_with_mass_above_below(
    keys: jax.Array, weights: jax.Array | None, limit: jax.Array, search_bits: int
) -> jax.Array:
    """u32 [b]: the smallest t with sum(weights[key > t]) < limit, per row (limit > 0).

    The sum is non-increasing in t, so t is found digit by digit from the top: each pass tests
    the 2^search_bits - 1 candidates of the next digit in one fused reduction over the vocabulary.
    weights None counts tokens (top-k); float weights sum probability mass (top-p).
    """
    radix = 1 << search_bits
    digits = jnp.arange(radix - 1, dtype=jnp.uint32)  # the largest digit needs no test
    prefix = jnp.zeros(keys.shape[:1], jnp.uint32)
    for p in range(32 // search_bits):
        shift = 32 - search_bits * (p + 1)
        low = jnp.uint32((1 << shift) - 1)
        candidates = prefix[:, None] | (digits[None, :] << shift) | low  # [b, radix - 1]
        above = keys[:, :, None] > candidates[:, None, :]  # [b, v, radix - 1], fused, not stored
        if weights is None:
            mass = jnp.sum(above, axis=1, dtype=jnp.float32)
        else:
            mass = jnp.sum(jnp.where(above, weights[:, :, None], 0.0), axis=1)
        digit = jnp.sum(mass >= limit[:, None], axis=1).astype(jnp.uint32)  # failing candidates
        prefix = prefix | (digit << shift)
    return prefix


def truncated_logits(
    processed: jax.Array,
    arrays: SamplingArrays,
    *,
    search_bits: int | None = None,
    plan: SamplingPlan | None = None,
) -> jax.Array:
    """Temperature, then min_p, top_k and top_p (exact): f32 [b, v], -inf outside the kept set.

    softmax of the result is the distribution a sampled row draws from (greedy rows: meaningless,
    they take the argmax of `processed`). Ties at a threshold are all kept, as in vLLM and HF.
    The top-k and top-p searches run where `plan` includes them; without a plan they are skipped
    (lax.cond) when no row of the batch uses them. search_bits: the searches' bits a pass (None:
    `search_bits_for_backend` of the batch's rows).
    """
    b, vocab = processed.shape
    if search_bits is None:
        search_bits = search_bits_for_backend(b)
    if search_bits not in (1, 2, 4, 8):
        raise ValueError(f"search_bits must be 1, 2, 4 or 8, got {search_bits}")
    scaled = processed / arrays.temperature[:, None]
    top = jnp.max(scaled, axis=1, keepdims=True)
    keep = scaled >= top + jnp.log(arrays.min_p)[:, None]  # p >= min_p * p_max; log 0 = -inf keeps all
    keys = _order_key(scaled)
    no_cut = jnp.zeros((b,), jnp.uint32)

    k_limit = jnp.where(arrays.top_k > 0, arrays.top_k, vocab + 1).astype(jnp.float32)
    top_k_cut = planned_branch(
        None if plan is None else plan.top_k,
        jnp.any(arrays.top_k > 0),
        lambda: _smallest_key_with_mass_above_below(keys, None, k_limit, search_bits),
        lambda: no_cut,
    )
    keep &= keys >= top_k_cut[:, None]
    # Top-p over what min_p and top_k kept: keep x iff the kept mass above x < top_p * kept mass.
    weights = jnp.where(keep, jnp.exp(scaled - top), 0.0)
    p_limit = jnp.where(arrays.top_p < 1.0, arrays.top_p * jnp.sum(weights, axis=1), jnp.inf)
    top_p_cut = planned_branch(
        None if plan is None else plan.top_p,
        jnp.any(arrays.top_p < 1.0),
        lambda: _smallest_key_with_mass_above_below(keys, weights, p_limit, search_bits),
        lambda: no_cut,
    )
    keep &= keys >= top_p_cut[:, None]
    return jnp.where(keep, scaled, -jnp.inf)


def planned_branch(static: bool | None, dynamic: jax.Array, if_true, if_false):
    """if_true() or if_false(): as a plan says (static), else chosen on the device by `dynamic`
    (lax.cond; on a GPU the host then waits for the device here: SamplingPlan)."""
    if static is None:
        return jax.lax.cond(dynamic, if_true, if_false)
    return if_true() if static else if_false()


def sample(
    logits: jax.Array,
    arrays: SamplingArrays,
    state: PenaltyState,
    step_keys: jax.Array,
    mask: jax.Array | None = None,
    *,
    num_top_logprobs: int = 0,
    logprobs_mode: str = "raw",
    search_bits: int | None = None,
    with_unmasked: bool = False,
    plan: SamplingPlan | None = None,
) -> SampleOutput:
    """Pick one token per row from logits f32 [b, v].

    step_keys [b] come from `row_keys(arrays, state.num_generated)`. num_top_logprobs (static) is
    the K of SampleOutput.top_ids; the host slices each row to its request's own count.
    logprobs_mode "raw": log_softmax of the model's logits; "processed": of the distribution
    sampled from (greedy rows: log_softmax of the processed logits at temperature 1).
    search_bits (static) tunes the top-k / top-p threshold search (see truncated_logits; None:
    `search_bits_for_backend`).
    plan (static) says which branches to compile in (SamplingPlan: it must cover the rows);
    without one, the truncation and the random draw are skipped on the device (lax.cond) when
    every row is greedy, and each threshold search when no row uses it.
    with_unmasked (static) also returns, in SampleOutput.unmasked, the token each row would take
    with no mask: the same processing and Gumbel noise, without top-k, top-p or min-p (rows that
    truncate never take the check way). Where the mask allows that token it is the masked sample
    too (Gumbel-max), so a constrained split step learns at the cost of one argmax how often the
    check way would keep its free samples (engine/constrained_way.py).
    """
    if logprobs_mode not in ("raw", "processed"):
        raise ValueError(f"logprobs_mode must be 'raw' or 'processed', got {logprobs_mode!r}")
    logits = logits.astype(jnp.float32)
    if with_unmasked:
        # the mask's -inf passes through the penalties unchanged, so masking after them is the same
        free = process_logits(logits, arrays, state, None)
        processed = free if mask is None else jnp.where(_bool_mask(mask, free.shape[1]), free, -jnp.inf)
    else:
        free = processed = process_logits(logits, arrays, state, mask)
    greedy_tokens = jnp.argmax(processed, axis=1).astype(jnp.int32)
    free_greedy = jnp.argmax(free, axis=1).astype(jnp.int32) if with_unmasked else greedy_tokens

    def with_sampling() -> tuple[jax.Array, jax.Array, jax.Array]:
        final = truncated_logits(processed, arrays, search_bits=search_bits, plan=plan)
        noise = jax.vmap(lambda key: jax.random.gumbel(key, final.shape[1:], jnp.float32))(step_keys)
        drawn = jnp.argmax(final + noise, axis=1).astype(jnp.int32)
        tokens = jnp.where(arrays.greedy, greedy_tokens, drawn)
        unmasked = tokens
        if with_unmasked:
            free_drawn = jnp.argmax(free / arrays.temperature[:, None] + noise, axis=1).astype(jnp.int32)
            unmasked = jnp.where(arrays.greedy, free_greedy, free_drawn)
        return tokens, jnp.where(arrays.greedy[:, None], processed, final), unmasked

    def greedy_only() -> tuple[jax.Array, jax.Array, jax.Array]:
        return greedy_tokens, processed, free_greedy

    tokens, distribution, unmasked = planned_branch(
        None if plan is None else not plan.draws, jnp.all(arrays.greedy), greedy_only, with_sampling
    )
    source = logits if logprobs_mode == "raw" else distribution
    log_probs = jax.nn.log_softmax(source, axis=1)
    token_logprobs = jnp.take_along_axis(log_probs, tokens[:, None], axis=1)[:, 0]
    top_logprobs, top_ids = top_alternatives(log_probs, num_top_logprobs)
    return SampleOutput(tokens, token_logprobs, top_ids, top_logprobs, unmasked if with_unmasked else None)


TOP_K_KERNEL_MAX = 16  # XLA's GPU TopK kernel takes k <= 16; past that lax.top_k sorts the whole row


def top_alternatives(log_probs: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """`lax.top_k(log_probs, k)` over the last axis of [b, v] (values f32 [b, k], ids i32 [b, k];
    k 0: empty), in passes of at most TOP_K_KERNEL_MAX: on a GPU each pass is XLA's TopK kernel,
    where one top-k of 20 would be a radix sort of the whole vocabulary (docs/sampling.md). A pass sets
    the ids it took to -inf, and -inf entries of the input count as the lowest finite float, so a
    later pass never takes an id twice; ties keep lax.top_k's order (lower id first)."""
    b = log_probs.shape[0]
    if k <= 0:
        return jnp.zeros((b, 0), jnp.float32), jnp.zeros((b, 0), jnp.int32)
    if k <= TOP_K_KERNEL_MAX:
        values, ids = jax.lax.top_k(log_probs, k)
        return values, ids.astype(jnp.int32)
    lowest = jnp.finfo(log_probs.dtype).min
    rest = jnp.where(log_probs == -jnp.inf, lowest, log_probs)
    rows = jnp.arange(b)[:, None]
    taken = []
    for start in range(0, k, TOP_K_KERNEL_MAX):
        _, ids = jax.lax.top_k(rest, min(TOP_K_KERNEL_MAX, k - start))
        taken.append(ids.astype(jnp.int32))
        if start + TOP_K_KERNEL_MAX < k:
            rest = rest.at[rows, ids].set(-jnp.inf)
    ids = jnp.concatenate(taken, axis=1)
    return jnp.take_along_axis(log_probs, ids, axis=1), ids
