"""The phaseless scheduler: each step, how many tokens each running request advances.

Pure host logic (no JAX). A request is a list of tokens (prompt + generated) of which the first
`num_computed` are in the cache. When more than one token is pending the request gets a *prefill
chunk* of up to `prefill_chunk` tokens; when exactly one is pending (the last sampled token) it
gets *decode steps*. Resuming a preempted request, a long prompt and a fresh prompt are the same
thing: pending tokens. Every step carries at most one prefill dispatch and one decode dispatch, so
a long prompt delays the running decodes by one chunk at most, and decodes never wait for a
prompt to finish.

Admission is FIFO up to `max_concurrency`. Blocks are allocated just ahead of what a step writes.
When they run out, the newest running request is preempted by *recompute*: its blocks and slot are
freed and it goes back to the head of the queue with prompt + output as pending tokens. Recompute
rather than swap-to-host because (a) the recurrent state summarises the whole prefix and cannot be
split by block, so a swap would have to move every KV block and the slot through host memory and
back, (b) recomputing a prefix is one batched prefill (compute-bound, fast) while the swap is
bounded by PCIe, and (c) it needs no extra programs or host buffers. The resumed request keeps its
output so far and its random stream (the sampler keys on the count of generated tokens), so it
continues exactly where it stopped.

With the prefix cache (cache/prefix_cache.py) admission first looks the tokens up: a hit shares the
cached blocks, restores the snapshot's recurrent state into the request's slot and starts the
request at the hit. Each prefill chunk may take recurrent-state snapshots at chosen positions
(`PrefillChunk.snapshots`), and a request that stops (finished or preempted) leaves its blocks and
final state in the cache, so a preempted request usually resumes from its own snapshot. Blocks
held only by the cache are evicted (to the host tier) before any request is preempted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from infernix_jax.cache.allocators import BLOCK_SIZE, BlockAllocator, SlotAllocator
from infernix_jax.cache.prefix_cache import PrefixCache
from infernix_jax.cache.prefix_index import Match
from infernix_jax.engine.config import EngineConfig
from infernix_jax.engine.request_state import RequestState, Status


@dataclass
class PrefillChunk:
    """One request's share of a prefill dispatch."""

    request: RequestState  # whose tokens
    start: int  # position of the chunk's first token (= request.num_computed when scheduled)
    num_tokens: int  # tokens fed (<= the bucket's chunk length; the rest of the row is padding)
    sample: bool  # the chunk reaches the end of the pending tokens: sample the next token from it
    snapshots: list[tuple[int, int | None]] = field(default_factory=list)  # (position, snapshot slot)


@dataclass
class DecodeRow:
    """One request's share of a decode dispatch."""

    request: RequestState  # whose token
    position: int  # position of the token fed first (= request.num_computed)
    max_steps: int  # tokens it may generate in this dispatch (its remaining budget, <= steps)


@dataclass
class SchedulerOutput:
    """What the runner executes this step: at most one prefill dispatch, then one decode dispatch."""

    prefill: list[PrefillChunk] = field(default_factory=list)  # rows of the prefill dispatch, in row order
    prefill_shape: tuple[int, int] | None = None  # (rows, chunk length) bucket; None: no prefill
    decode: list[DecodeRow] = field(default_factory=list)  # rows of the decode dispatch, in row order
    decode_batch: int = 0  # decode batch bucket (rows beyond len(decode) are padding); 0: no decode
    decode_steps: int = 0  # decode steps run on the device in this dispatch
    preempted: list[RequestState] = field(default_factory=list)  # sent back to the queue this step
    rejected: list[RequestState] = field(default_factory=list)  # cannot ever fit: finish with an error

    @property
    def empty(self) -> bool:
        return not self.prefill and not self.decode


class Scheduler:
    """Owns the waiting queue, the running set, and the block and slot allocators."""

    def __init__(
        self,
        config: EngineConfig,
        blocks: BlockAllocator,
        slots: SlotAllocator,
        prefix_cache: PrefixCache | None = None,
        snapshots_per_chunk: int = 0,
    ):
        self.config = config
        self.blocks = blocks
        self.slots = slots
        self.prefix_cache = prefix_cache
        self.snapshots_per_chunk = snapshots_per_chunk
        self.waiting: deque[RequestState] = deque()
        self.running: list[RequestState] = []  # in admission order (oldest first)
        self.num_preemptions = 0

    # ---- queue ---------------------------------------------------------------------------------
    def add(self, state: RequestState) -> None:
        state.status = Status.WAITING
        self.waiting.append(state)

    def finish(self, state: RequestState, cache: bool = True) -> None:
        """Remove a request (finished, aborted or failed) and free its blocks and slot at once.
        With `cache` its blocks and final state go to the prefix cache first."""
        if state.status == Status.RUNNING:
            self.running.remove(state)
        elif state.status == Status.WAITING and state in self.waiting:
            self.waiting.remove(state)
        self._release(state, cache)
        state.status = Status.FINISHED

    def _release(self, state: RequestState, cache: bool = True) -> None:
        exact = state.cacheable_state and state.num_computed <= state.num_tokens  # slot state is at num_computed
        if cache and self.prefix_cache is not None and state.blocks and exact:
            tokens = state.tokens(0, state.num_computed)
            self.prefix_cache.snapshot_request(tokens, state.num_computed, state.slot, state.blocks)
        if state.blocks:
            self.blocks.free(state.blocks)
            state.blocks = []
        if state.slot is not None:
            self.slots.free(state.slot)
            state.slot = None
        state.num_computed = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        self._admit(out)
        self._schedule_prefill(out)
        self._schedule_decode(out)
        self._plan_snapshots(out)
        return out

    def _plan_snapshots(self, out: SchedulerOutput) -> None:
        """Choose where each prefill chunk snapshots the recurrent state, in this order of preference
        (skipping positions already cached; at most `snapshots_per_chunk` a chunk):

        1. just before the prompt's last token: a repeat or an extension of the prompt hits there;
        2. `RequestState.snapshot_hints` (set at admission): where the prompt leaves other prompts
           (the end of a shared system prompt, which the next session on it then hits), then just
           after its first end-of-message token (the end of the system message);
        3. the prompt's last block boundary;
        4. every `prefix_cache_snapshot_blocks` blocks (latest first)."""
        cache = self.prefix_cache
        if cache is None:
            return
        interval = self.config.prefix_cache_snapshot_blocks * BLOCK_SIZE
        limit = self.snapshots_per_chunk if cache.stateful else 1
        for chunk in out.prefill:
            state = chunk.request
            start, end = chunk.start, chunk.start + chunk.num_tokens
            last = len(state.prompt) - 1
            wanted = [last, *state.snapshot_hints, last // BLOCK_SIZE * BLOCK_SIZE]
            if interval:
                wanted += range(end // interval * interval, start, -interval)
            tokens = state.tokens(0, end)
            chosen: list[int] = []
            for p in wanted:
                if len(chosen) == limit:
                    break
                if start < p <= end and p not in chosen and cache.wants_snapshot(tokens, p):
                    chosen.append(p)
            for p in chosen:
                slot = cache.reserve_slot() if cache.stateful else None
                if cache.stateful and slot is None:
                    break
                chunk.snapshots.append((p, slot))

    def _note_divergence(self, state: RequestState, match: Match, hit: int) -> None:
        """Record where a newly admitted prompt leaves the prompts before it: the end of the indexed
        prefix it shares (`match.shared`), and the prefix it shares with each running request still
        in prefill (admitted together, neither is indexed yet; that request snapshots there too).
        Without a snapshot at such a point a hybrid model cannot reuse the shared part; with one,
        every later prompt that shares it does (a third session on the same system prompt). Then the
        end of the prompt's first message, so that even the second session on a system prompt hits."""
        last = len(state.prompt) - 1
        points = {match.shared}
        for other in self.running:
            if other is state or other.num_computed >= len(other.prompt):
                continue
            shared = _common_prefix(state.prompt, other.prompt)
            points.add(shared)
            if other.num_computed < shared < len(other.prompt) - 1 and shared not in other.snapshot_hints:
                other.snapshot_hints.append(shared)
        hints = sorted((p for p in points if hit < p < last), reverse=True)
        turn_end = _first_turn_end(state)
        if hit < turn_end < last and turn_end not in hints:
            hints.append(turn_end)
        state.snapshot_hints = hints

    def _admit(self, out: SchedulerOutput) -> None:
        while self.waiting and len(self.running) < self.config.max_concurrency and self.slots.num_free:
            state = self.waiting[0]
            if self._blocks_for(state.num_tokens) > self.blocks.num_total:
                self.waiting.popleft()
                out.rejected.append(state)
                continue
            cache = self.prefix_cache
            match = cache.match(state.tokens(0, state.num_tokens)) if cache is not None else None
            hit = match.length if match is not None else 0
            first = min(state.num_tokens - hit, self.config.prefill_chunk)
            shared = sum(1 for e in match.blocks if e.gpu is not None) if match is not None else 0
            if self._blocks_for(hit + first) - shared > self._available_blocks():
                break  # wait for blocks; never preempt to admit
            self.waiting.popleft()
            state.slot = self.slots.allocate()
            state.status = Status.RUNNING
            state.fresh_slot = True
            self.running.append(state)
            if cache is not None:
                owned = cache.acquire(match, state.slot) if hit else []
                if owned is None:  # no room to restore after all: prefill from the start
                    owned, hit = [], 0
                state.blocks, state.num_computed = owned, hit
                self._note_divergence(state, match, hit)
                if state.preemptions == 0:
                    state.cached_tokens = hit
                    cache.record_query(state.num_tokens, hit)

    def _available_blocks(self) -> int:
        """Free blocks plus those only the prefix cache holds (evictable)."""
        free = self.blocks.num_free
        return free + self.prefix_cache.evictable_blocks() if self.prefix_cache is not None else free

    def _schedule_prefill(self, out: SchedulerOutput) -> None:
        shapes = self.config.prefill_shapes
        max_rows = max(r for r, _ in shapes)
        budget = self.config.prefill_chunk
        chosen: list[PrefillChunk] = []
        for state in list(self.running):
            if len(chosen) == max_rows or budget <= 0:
                break
            if state.status != Status.RUNNING or state.num_pending <= 1:
                continue
            n = min(state.num_pending, budget)
            if not self._reserve(state, state.num_computed + n, out):
                continue  # preempted itself
            chosen.append(PrefillChunk(state, state.num_computed, n, sample=n == state.num_pending))
            budget -= n
        chosen = [c for c in chosen if c.request.status == Status.RUNNING]  # a later reserve may preempt
        if not chosen:
            return
        longest = max(c.num_tokens for c in chosen)
        fitting = [(r, t) for r, t in shapes if t >= longest and r >= len(chosen)]
        if not fitting:  # too many rows for the chunk length: keep the oldest rows that fit a bucket
            rows = max(r for r, t in shapes if t >= longest)
            chosen = chosen[:rows]
            fitting = [(r, t) for r, t in shapes if t >= longest and r >= len(chosen)]
        out.prefill = chosen
        out.prefill_shape = min(fitting, key=lambda s: (s[0] * s[1], s[1]))

    def _schedule_decode(self, out: SchedulerOutput) -> None:
        steps = self.config.decode_steps_per_dispatch
        if self.config.spec != "none":  # a verify window: the pending token and up to window - 1 drafts
            steps = self.config.spec_window
        in_prefill = {id(c.request) for c in out.prefill}
        rows: list[DecodeRow] = []
        for state in list(self.running):
            if state.status != Status.RUNNING or state.num_pending != 1 or id(state) in in_prefill:
                continue
            n = max(1, min(steps, state.remaining))
            if not self._reserve(state, state.num_computed + n, out):
                continue
            rows.append(DecodeRow(state, state.num_computed, n))
        rows = [r for r in rows if r.request.status == Status.RUNNING]
        if out.prefill:
            out.prefill = [c for c in out.prefill if c.request.status == Status.RUNNING]
            if not out.prefill:
                out.prefill_shape = None
        if rows:
            out.decode = rows
            out.decode_batch = min(b for b in self.config.decode_buckets if b >= len(rows))
            out.decode_steps = steps

    # ---- blocks and preemption ---------------------------------------------------------------
    @staticmethod
    def _blocks_for(num_tokens: int) -> int:
        return -(-num_tokens // BLOCK_SIZE)

    def _reserve(self, state: RequestState, num_tokens: int, out: SchedulerOutput) -> bool:
        """Give `state` blocks for its first num_tokens tokens, preempting the newest running
        requests while short. False when `state` itself had to be preempted."""
        need = self._blocks_for(num_tokens) - len(state.blocks)
        if need > self.blocks.num_free:
            while need > self._available_blocks():
                victim = self.running[-1]
                self.preempt(victim, out)
                if victim is state:
                    return False
            if need > self.blocks.num_free:
                self.prefix_cache.evict_blocks(need - self.blocks.num_free)
        if need > 0:
            state.blocks.extend(self.blocks.allocate(need))
        return True

    def preempt(self, state: RequestState, out: SchedulerOutput | None = None, cache: bool = True) -> None:
        """Free a running request's blocks and slot; it waits at the head of the queue to be recomputed
        (from its own prefix-cache snapshot when it is still cached)."""
        self.running.remove(state)
        self._release(state, cache)
        state.status = Status.WAITING
        state.preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(state)
        if out is not None:
            out.preempted.append(state)


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if diff.size else n


def _first_turn_end(state: RequestState) -> int:
    """The position just after the prompt's first end-of-message (stop) token, or -1: the end of the
    system message in a chat template, which every session and every compaction on it shares."""
    stops = state.tracker.stop_token_ids if state.tracker is not None else ()
    if not stops:
        return -1
    found = np.flatnonzero(np.isin(np.asarray(state.prompt), list(stops)))
    return int(found[0]) + 1 if found.size else -1
