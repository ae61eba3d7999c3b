"""Scoring: the logprob of each token of several candidate continuations of one prompt.

A `ScoreRequest` (engine/protocol.py) goes through the scheduler as a request whose tokens are the
prompt without its last token, P - 1 of them, and which generates nothing. The scheduler admits it
like any request (FIFO, `max_concurrency`, a state slot, KV blocks, prefix-cache hits) and prefills
it in the ordinary prefill programs, batched with other requests; it may be preempted and
recomputed like them. The token those programs sample for it is ignored.

Once its P - 1 tokens are in the cache it is *ready*, and in the same engine step the `Scorer`
runs one scoring dispatch for it (and every other ready score request): `score_program`, whose
rows each feed the prompt's last token followed by a candidate path, reading the prompt's KV
blocks and recurrent state, and return log_softmax(logits)[token] at the queried (row, position,
token) triples.

Rows. A row that feeds `last + path` yields the next-token distribution after `prompt + path[:j]`
for every j <= len(path). Candidate c is read from any row whose path starts with c[:-1], so the
rows are the longest distinct `c[:-1]` (one row with an empty path when every candidate is one
token: one next-token distribution serves all of them). Yes/no and single-token choices take one
row; "1".."10" on a digit-split tokenizer takes one row ("1" then its continuation "0").

Rows never write the pools: each row attends over a private copy of its prompt KV (the blocks
gathered into a contiguous view, as paged attention does anyway) and its own new keys, and starts
from a copy of the prompt's recurrent state. So candidates are independent and the prompt's blocks
and slot are untouched; when the request ends they go to the prefix cache as usual (a repeated
prompt skips its prefill). With an int8/fp8 KV pool the prompt's keys are dequantized
into the copy and the rows' own keys stay in the model dtype (a prefill would store them
quantized): the scores can differ from a generation's logprobs by that rounding.

Device programs for one score request: the prefill programs of its first P - 1 tokens (none
beyond what the prefix cache already holds; one when the prompt fits a chunk; a one-token
remainder runs as a decode step), then one `score_program` dispatch — more only when the rows
exceed SCORE_ROWS (several requests ready in the same step share dispatches) or `QUERY_WIDTH`
queries. `score_program` is compiled at warm-up for (rows, length) shapes at one prefill chunk
length (see `score_shapes`), so scoring compiles nothing afterwards. A candidate may have at most
length - 1 tokens (63 with the default buckets).

Letters: r rows, t row length, m blocks per row, q queries, v vocabulary.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from infernix_jax.cache import NULL_BLOCK, SCRATCH_SLOT, ContiguousKV, KVPool, StatePool, cache_view
from infernix_jax.cache.kv_pool import PagedKV
from infernix_jax.cache.sequence import SequenceCache
from infernix_jax.config import ModelConfig
from infernix_jax.engine.config import EngineConfig
from infernix_jax.engine.protocol import (
    FINISH_ERROR,
    FINISH_STOP,
    GenerationRequest,
    SamplingParams,
    ScoreRequest,
    ScoreResult,
    TokenEvent,
)
from infernix_jax.engine.request_state import OutputTracker, RequestState, Status
from infernix_jax.jit import jit
from infernix_jax.model.forward import forward
from infernix_jax.model.params import Params

QUERY_WIDTH = 1024  # (row, position, token) logprobs one scoring dispatch returns (a static shape)
PREFERRED_SCORE_LENGTH = 64  # score rows use the smallest prefill chunk bucket of at least this
SCORE_ROWS = 8  # rows of the widest scoring program (distinct multi-token option paths per dispatch)


# ---------------------------------------------------------------------------------------------
# The program


@partial(jit, static_argnames=("cfg",))
def score_program(
    params: Params,
    kv_pool: KVPool,
    state_pool: StatePool,
    tokens: jax.Array,  # i32 [r, t]: the prompt's last token, then the row's path
    positions: jax.Array,  # i32 [r, t]: -1 after a row's tokens (and on padding rows)
    block_table: jax.Array,  # i32 [r, m]: the prompt's blocks
    slots: jax.Array,  # i32 [r]: the slot holding the recurrent state after the prompt's first P - 1 tokens
    query_rows: jax.Array,  # i32 [q]
    query_steps: jax.Array,  # i32 [q]: index into the row (0: the distribution after the prompt)
    query_tokens: jax.Array,  # i32 [q]
    *,
    cfg: ModelConfig,
) -> jax.Array:
    """log P(query_tokens | the row's context up to query_steps) [q], float32. Reads the pools only."""
    view = cache_view(kv_pool, state_pool, block_table, slots, cfg)
    dtype = params.final_norm.dtype
    layers = tuple(
        ContiguousKV(*entry.gather(dtype)) if isinstance(entry, PagedKV) else entry for entry in view.layers
    )
    logits, _, _ = forward(params, tokens, positions, SequenceCache(layers=layers), cfg)  # [r, t, v]
    picked = logits[query_rows, query_steps]  # [q, v]
    logprobs = jax.nn.log_softmax(picked.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logprobs, query_tokens[:, None], axis=1)[:, 0]


# ---------------------------------------------------------------------------------------------
# Host side: rows, queries, shapes


@dataclass(frozen=True)
class RowPlan:
    """How a set of candidates is laid out in rows."""

    paths: tuple[tuple[int, ...], ...]  # tokens each row feeds after the prompt's last token
    row_of: tuple[int, ...]  # per candidate, the row it is read from


def plan_rows(candidates: Sequence[Sequence[int]]) -> RowPlan:
    """The fewest rows that hold every candidate: the longest distinct c[:-1] (see the module doc)."""
    prefixes = sorted({tuple(c[:-1]) for c in candidates}, key=len, reverse=True)
    paths: list[tuple[int, ...]] = []
    for prefix in prefixes:
        if not any(path[: len(prefix)] == prefix for path in paths):
            paths.append(prefix)
    row_of = tuple(
        next(i for i, path in enumerate(paths) if path[: len(c) - 1] == tuple(c[:-1])) for c in candidates
    )
    return RowPlan(tuple(paths), row_of)


def _most_queries_in_a_row(candidates: Sequence[Sequence[int]]) -> int:
    plan = plan_rows(candidates)
    counts = [0] * len(plan.paths)
    for candidate, row in zip(candidates, plan.row_of):
        counts[row] += len(candidate)
    return max(counts)


def score_shapes(config: EngineConfig) -> tuple[tuple[int, int], ...]:
    """(rows, length) of the scoring programs: the prefill bucket shapes at one chunk length (the
    smallest of at least PREFERRED_SCORE_LENGTH, or the longest there is), and SCORE_ROWS rows at
    that length, so that a choice among several multi-token options still fits one dispatch."""
    lengths = sorted({t for _, t in config.prefill_shapes})
    length = next((t for t in lengths if t >= PREFERRED_SCORE_LENGTH), lengths[-1])
    rows = {r for r, t in config.prefill_shapes if t == length} | {SCORE_ROWS}
    return tuple((r, length) for r in sorted(rows))


@dataclass
class _Row:
    job: ScoreJob
    path: tuple[int, ...]
    queries: list[tuple[int, int, int]]  # (step, token, flat index into the job's logprobs)


@dataclass
class ScoreJob:
    """One score request in the engine: its scheduler record and its results so far."""

    request: ScoreRequest
    state: RequestState
    plan: RowPlan
    values: list[float] = field(default_factory=list)  # flat logprobs, candidate by candidate
    offsets: list[int] = field(default_factory=list)  # where each candidate starts in `values`
    dispatches: int = 0


class Scorer:
    """Score requests of one EngineCore: admission through its scheduler, the scoring dispatches."""

    def __init__(self, core) -> None:
        self.core = core
        self.shapes = score_shapes(core.config)
        self.max_rows = max(r for r, _ in self.shapes)
        self.length = self.shapes[0][1]
        self.jobs: dict[str, ScoreJob] = {}
        self.dispatches = 0  # score_program dispatches since start
        self.unsupported = None
        if not core.config.scoring:
            self.unsupported = "scoring is off in this engine (EngineConfig.scoring=False)"
        elif core.cfg.ngram_memory:  # the scoring rows would need n-gram memory rows for their paths too
            self.unsupported = "scoring is not supported for a model with an n-gram memory"

    def owns(self, request_id: str) -> bool:
        return request_id in self.jobs

    def forget(self, request_id: str) -> None:
        self.jobs.pop(request_id, None)

    # ---- admission -----------------------------------------------------------------------------
    def add(self, request: ScoreRequest) -> list[TokenEvent]:
        """Queue a score request; returns its final event at once when it is invalid."""
        core = self.core
        prompt, candidates = list(request.prompt_token_ids), [tuple(c) for c in request.candidates]
        vocab = core.cfg.vocab_size
        longest = max((len(c) for c in candidates), default=0)
        error = self.unsupported
        if error:
            pass
        elif request.request_id in core.requests:
            error = f"request id {request.request_id!r} is already running"
        elif not prompt:
            error = "the prompt is empty"
        elif not candidates or any(not c for c in candidates):
            error = "give at least one candidate, each of at least one token"
        elif any(not 0 <= t < vocab for t in prompt) or any(
            not 0 <= t < vocab for c in candidates for t in c
        ):
            error = f"token ids must be in [0, {vocab})"
        elif longest > self.length - 1:
            error = f"a candidate has {longest} tokens; at most {self.length - 1} can be scored"
        elif len(prompt) + longest - 1 > core.config.max_context:
            error = f"the prompt and its longest candidate exceed the context of {core.config.max_context}"
        elif (queries := _most_queries_in_a_row(candidates)) > QUERY_WIDTH:
            error = f"the candidates need {queries} logprobs from one row, more than {QUERY_WIDTH}"
        if error:
            return [TokenEvent.refused(request.request_id, error, len(prompt))]
        head = GenerationRequest(
            request.request_id, prompt[:-1], SamplingParams(max_tokens=0), arrival_time=request.arrival_time
        )
        state = RequestState(head, 0, core._arrivals, max_total=len(prompt) - 1)
        core._arrivals += 1
        state.tracker = OutputTracker(state, None, set())
        plan = plan_rows(candidates)
        offsets = np.cumsum([0] + [len(c) for c in candidates]).tolist()
        self.jobs[request.request_id] = ScoreJob(request, state, plan, [0.0] * offsets[-1], offsets[:-1])
        core.requests[request.request_id] = state
        core.scheduler.add(state)
        return []

    # ---- the scoring dispatch ------------------------------------------------------------------
    def ready(self) -> list[ScoreJob]:
        """Jobs whose first P - 1 prompt tokens are in the cache (the scheduler left them running)."""
        for request_id in [i for i, job in self.jobs.items() if job.state.status == Status.FINISHED]:
            del self.jobs[request_id]  # failed or aborted elsewhere
        return [
            job
            for job in self.jobs.values()
            if job.state.status == Status.RUNNING and job.state.num_pending == 0
        ]

    def run(self, events: list[TokenEvent]) -> float:
        """Score every ready job (as few dispatches as the shapes allow); returns seconds waited."""
        jobs = self.ready()
        if not jobs:
            return 0.0
        rows = [row for job in jobs for row in self._rows(job)]
        wait = 0.0
        failed: set[int] = set()
        for group in self._groups(rows):
            try:
                wait += self._dispatch(group)
            except Exception as exc:  # noqa: BLE001 - a failed dispatch fails its requests only
                for row in group:
                    if id(row.job) not in failed:
                        failed.add(id(row.job))
                        events.append(self._end(row.job, f"{type(exc).__name__}: {exc}"))
        for job in jobs:
            if id(job) not in failed:
                events.append(self._end(job, None))
        return wait

    def _rows(self, job: ScoreJob) -> list[_Row]:
        rows = [_Row(job, path, []) for path in job.plan.paths]
        for index, (candidate, row) in enumerate(zip(job.request.candidates, job.plan.row_of)):
            for step, token in enumerate(candidate):
                rows[row].queries.append((step, int(token), job.offsets[index] + step))
        return rows

    def _groups(self, rows: list[_Row]) -> list[list[_Row]]:
        """Rows packed into dispatches of at most max_rows rows and QUERY_WIDTH queries."""
        groups: list[list[_Row]] = []
        current: list[_Row] = []
        queries = 0
        for row in rows:
            if current and (len(current) == self.max_rows or queries + len(row.queries) > QUERY_WIDTH):
                groups.append(current)
                current, queries = [], 0
            current.append(row)
            queries += len(row.queries)
        if current:
            groups.append(current)
        return groups

    def _dispatch(self, group: list[_Row]) -> float:
        rows = min(r for r, _ in self.shapes if r >= len(group))
        batch = self.empty_batch(rows)
        tokens, positions, block_table, slots, q_rows, q_steps, q_tokens = batch
        n = 0
        for i, row in enumerate(group):
            state = row.job.state
            start = state.num_computed  # = P - 1
            feed = [row.job.request.prompt_token_ids[-1], *row.path]
            tokens[i, : len(feed)] = feed
            positions[i, : len(feed)] = np.arange(start, start + len(feed))
            block_table[i, : len(state.blocks)] = state.blocks
            slots[i] = state.slot
            for step, token, _ in row.queries:
                q_rows[n], q_steps[n], q_tokens[n] = i, step, token
                n += 1
        out = self._call(batch)
        self.dispatches += 1
        t0 = time.perf_counter()
        values = np.asarray(jax.device_get(out))
        wait = time.perf_counter() - t0
        for job in {id(row.job): row.job for row in group}.values():
            job.dispatches += 1
        n = 0
        for row in group:
            for _, _, flat in row.queries:
                row.job.values[flat] = float(values[n])
                n += 1
        return wait

    def empty_batch(self, rows: int) -> tuple[np.ndarray, ...]:
        """Host arrays of one scoring dispatch: padding rows feed nothing and read zeros."""
        return (
            np.zeros((rows, self.length), np.int32),
            np.full((rows, self.length), -1, np.int32),
            np.full((rows, self.core.config.max_blocks_per_sequence), NULL_BLOCK, np.int32),
            np.full(rows, SCRATCH_SLOT, np.int32),
            np.zeros(QUERY_WIDTH, np.int32),
            np.zeros(QUERY_WIDTH, np.int32),
            np.zeros(QUERY_WIDTH, np.int32),
        )

    def _call(self, batch: tuple[np.ndarray, ...]) -> jax.Array:
        runner = self.core.runner
        return score_program(runner.params, runner.kv_pool, runner.state_pool, *batch, cfg=self.core.cfg)

    def _end(self, job: ScoreJob, error: str | None) -> TokenEvent:
        """Finish a job: its blocks and slot go back (to the prefix cache when it succeeded)."""
        core, state = self.core, job.state
        self.jobs.pop(job.request.request_id, None)
        core.requests.pop(job.request.request_id, None)
        core.scheduler.finish(state, cache=error is None)
        prompt = len(job.request.prompt_token_ids)
        if error is not None:
            return TokenEvent(
                job.request.request_id, [], "", finish_reason=FINISH_ERROR, error=error, prompt_tokens=prompt
            )
        values = tuple(
            tuple(job.values[start : start + len(c)]) for start, c in zip(job.offsets, job.request.candidates)
        )
        result = ScoreResult(job.request.request_id, values, prompt, state.cached_tokens, job.dispatches)
        return TokenEvent(
            job.request.request_id,
            [],
            "",
            finish_reason=FINISH_STOP,
            prompt_tokens=prompt,
            cached_tokens=state.cached_tokens,
            score=result,
        )

    # ---- warm-up -------------------------------------------------------------------------------
    def warmup(self) -> None:
        """Compile every scoring shape on padding rows."""
        if self.unsupported:
            return
        for rows, _ in self.shapes:
            jax.block_until_ready(self._call(self.empty_batch(rows)))
