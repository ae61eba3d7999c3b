"""`EngineCore`: the synchronous heart of the engine — schedule, run, turn tokens into events.

One `step()` asks the scheduler what to advance, builds the host arrays of (at most) one prefill
and one decode dispatch, runs them, reads the sampled tokens back once per dispatch, applies the
host-side stop rules, and returns the `TokenEvent`s produced. It owns all device state and is not
thread-safe: the async `Engine` runs it on one thread; `LLM` calls it directly.

Host time is measured per step (`EngineMetrics`): the time spent waiting for the device's results
versus everything the host does around them (scheduling, packing arrays, dispatch, detokenizing).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass

import jax
import numpy as np

from infernix_jax.cache import BLOCK_SIZE, SCRATCH_SLOT, BlockAllocator, SlotAllocator
from infernix_jax.config import ModelConfig
from infernix_jax.engine.async_decode import AsyncDecode, CheckCopies, InFlight, runs_on
from infernix_jax.engine.config import EngineConfig
from infernix_jax.engine.constrained import DONE, FAILED, OK, ConstrainedOutput, allow_all
from infernix_jax.engine.constrained_way import CHECK, ConstrainedWayChooser
from infernix_jax.engine.mask_feed import MaskFeed
from infernix_jax.engine.memory_plan import auto_expert_budget, plan_blocks
from infernix_jax.engine.ngram_prefetch import build_ngram_feeder
from infernix_jax.engine.prefix import (
    build_prefix_cache,
    load_prefix_cache,
    save_prefix_cache,
    weights_fingerprint,
)
from infernix_jax.engine.protocol import (
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    EngineStats,
    GenerationRequest,
    ScoreRequest,
    TokenEvent,
    TokenLogprob,
)
from infernix_jax.engine.request_state import OutputTracker, RequestState, Status
from infernix_jax.engine.runner import FORCED_WINDOW, Runner, Sampled, enable_compilation_cache
from infernix_jax.engine.sampling import engine_plan, resolve_seed, wants_top
from infernix_jax.engine.scheduler import DecodeRow, Scheduler, SchedulerOutput
from infernix_jax.engine.scoring import Scorer
from infernix_jax.engine.speculative.step import Speculation
from infernix_jax.model.params import Params


@dataclass
class EngineMetrics:
    """Cumulative counters since start (for /metrics, benchmarks and the host-overhead target)."""

    steps: int = 0  # scheduler steps that ran a dispatch
    prefill_tokens: int = 0  # prompt (and recomputed) tokens fed
    generated_tokens: int = 0  # tokens sampled and kept
    preemptions: int = 0
    decode_dispatches: int = 0
    decode_wall_s: float = 0.0  # wall time of steps that ran only a decode dispatch
    decode_device_wait_s: float = 0.0  # of which the host waited for the device's results
    decode_enqueue_s: float = 0.0  # host time enqueuing decode dispatches (returns before they run)
    expert_rebalance_s: float = 0.0  # host time planning and enqueuing expert slot swaps between steps
    warmup_s: float = 0.0  # compile time at start
    async_dispatches: int = 0  # decode dispatches enqueued before the last one was read back
    spec_rows: int = 0  # speculative: row-steps verified (one per row per verify dispatch)
    drafted_tokens: int = 0  # speculative: draft tokens proposed and verified
    accepted_tokens: int = 0  # speculative: draft tokens accepted
    spec_dispatches: int = 0  # speculative: verify dispatches (steps)
    forced_draft_tokens: int = 0  # speculative: drafts a grammar forced (structured output)
    forced_tokens: int = 0  # structured output: tokens a grammar forced, fed without a sample of their own
    constrained_host_s: float = 0.0  # structured output ("callback" way): host time inside decode programs
    check_kept_tokens: int = 0  # structured output ("check" way): free samples their grammar allowed
    check_refusals: int = 0  # ("check" way): free samples refused, each replaced by a masked sample

    @property
    def mean_accepted_length(self) -> float:
        """Tokens per row per verify step (accepted drafts + the bonus/correction token); 0 when idle."""
        return (self.accepted_tokens + self.spec_rows) / self.spec_rows if self.spec_rows else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Share of drafted tokens accepted (0 when nothing was drafted)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def decode_host_fraction(self) -> float:
        """Share of decode time the host spent outside waiting for the device (0 when idle)."""
        if self.decode_wall_s <= 0:
            return 0.0
        return 1.0 - self.decode_device_wait_s / self.decode_wall_s


class _ConstrainedRun:
    """What one constrained decode (`EngineCore._run_decode_constrained`) collects, step by step:
    each row's kept tokens, logprobs and alternatives, its constraint status, whether it still
    decodes, and whether its slot was fed past its last kept token (the split path feeds a stopped
    row once more; the check path runs on past a grammar's end)."""

    def __init__(self, plan: SchedulerOutput, steps: int, num_top: int, with_top: bool):
        b = plan.decode_batch
        self.plan, self.steps, self.with_top = plan, steps, with_top
        self.live = np.zeros(b, bool)
        self.live[: len(plan.decode)] = True
        self.fed_after_stop = np.zeros(b, bool)
        self.statuses = [OK] * len(plan.decode)
        self.counts = np.zeros(b, np.int32)
        self.tokens = np.zeros((steps, b), np.int32)
        self.logprobs = np.zeros((steps, b), np.float32)
        self.top_ids = np.zeros((steps, b, num_top), np.int32)
        self.top_logprobs = np.zeros((steps, b, num_top), np.float32)
        # constrained tokens judged, and those whose free choice the grammar allowed (the chooser's
        # keep share, engine/constrained_way.py)
        self.judged = self.kept_free = 0


class EngineCore:
    """Scheduler + runner + the host side of every request."""

    def __init__(
        self,
        cfg: ModelConfig,
        params: Params,
        config: EngineConfig,
        tokenizer=None,
        eos_token_ids: Sequence[int] = (),
        ngram_table=None,
    ):
        """ngram_table: an infernix_jax.ngram.memory.NgramTable for a model with an n-gram memory
        (else the engine opens config.ngram_volume)."""
        enable_compilation_cache(config.compilation_cache_dir)
        self.ngram, config = build_ngram_feeder(cfg, config, ngram_table)
        self.cfg = cfg
        self.config = config
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.experts = None  # ExpertOffload when routed experts live in device slots + host/disk tiers
        # the prefix cache's salt: from the loaded weights, before experts move to slots and tiers
        fingerprint = weights_fingerprint(params) if config.prefix_cache else ""
        budget = config.gpu_expert_budget
        if budget == "auto":
            budget = auto_expert_budget(cfg, config, params.final_norm.dtype, params)
        if budget == "all" and config.gpu_expert_budget == "auto":  # they all fit: the plain model
            from infernix_jax.experts.offload import experts_on_device

            params, budget = experts_on_device(params, config.expert_artifact), None
        if budget is not None:
            from infernix_jax.experts.offload import ExpertOffload

            self.experts = ExpertOffload.build(
                cfg,
                params,
                budget,
                config.host_expert_budget,
                artifact=config.expert_artifact,
                profile=config.expert_profile,
                host_reads=config.expert_host_reads,
                host_copy=config.expert_host_copy,
                prefetch=config.expert_prefetch,
                prefetch_blocks=config.expert_prefetch_blocks,
                prefetch_guesses=config.expert_prefetch_guesses,
                cpu_share=config.expert_cpu_share,
                payback=config.expert_swap_payback,
            )
            params = self.experts.params
        num_blocks = plan_blocks(cfg, config, params.final_norm.dtype, params)
        num_slots = config.max_concurrency + 1
        stateful = bool(cfg.linear_attention_layers)
        self.runner = Runner(
            cfg,
            params,
            config,
            num_blocks,
            num_slots,
            self.eos_token_ids,
            num_snapshot_slots=config.num_snapshot_slots if stateful else 0,
            # MTP drafting prefills through its own program, which takes no snapshots: those requests
            # are cached when they stop (finish or preemption) only
            snapshots_per_chunk=config.snapshots_per_chunk if config.prefix_cache and not config.spec_uses_mtp else 0,
            ngram_table=self.ngram.table if self.ngram is not None else None,
        )
        blocks = BlockAllocator(num_blocks)
        self.prefix_cache = (
            build_prefix_cache(cfg, fingerprint, params.final_norm.dtype, config, blocks, self.runner)
            if config.prefix_cache
            else None
        )
        self.scheduler = Scheduler(
            config, blocks, SlotAllocator(num_slots), self.prefix_cache, self.runner.snapshots_per_chunk
        )
        self._last_save = time.monotonic()
        if self.prefix_cache is not None and config.prefix_cache_file:
            load_prefix_cache(self.prefix_cache, config.prefix_cache_file)
        self.requests: dict[str, RequestState] = {}
        self.constraints: dict[str, ConstrainedOutput] = {}  # request id -> its structured-output state
        # "check" or "split" per step (constrained_decode "check"); a check dispatch runs at most
        # FORCED_WINDOW steps (a refused row's window re-feeds what it kept)
        self.way_chooser = ConstrainedWayChooser(window=min(config.decode_steps_per_dispatch, FORCED_WINDOW))
        self.metrics = EngineMetrics()
        self._arrivals = 0
        self.scorer = Scorer(self)  # score requests (engine/scoring.py)
        self.speculation = None
        if config.spec != "none":
            self.speculation = Speculation(self)
        self.async_decode = AsyncDecode(self)  # engine/async_decode.py
        self.ahead: InFlight | None = None  # a decode dispatch enqueued before the last was read back
        if config.warmup:
            self.metrics.warmup_s = self.runner.warmup(config.progress)
            start = time.perf_counter()
            self.scorer.warmup()
            self.metrics.warmup_s += time.perf_counter() - start
            if self.speculation is not None:
                start = time.perf_counter()
                self.speculation.warmup()
                self.metrics.warmup_s += time.perf_counter() - start
            if self.experts is not None:  # warm-up's padding rows routed arbitrary experts
                self.experts.warmup()
                self.runner.params = self.experts.params
                self.experts.reset_stats()

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, request: GenerationRequest) -> list[TokenEvent]:
        """Queue a request. Returns events at once only when it ends at once (invalid, or no room)."""
        prompt = request.prompt_token_ids
        error = None
        if request.request_id in self.requests:
            error = f"request id {request.request_id!r} is already running"
        elif not prompt:
            error = "the prompt is empty"
        elif len(prompt) > self.config.max_context:
            error = f"the prompt has {len(prompt)} tokens, more than the context of {self.config.max_context}"
        elif any(not 0 <= t < self.cfg.vocab_size for t in prompt):
            error = f"prompt token ids must be in [0, {self.cfg.vocab_size})"
        if error:
            return [TokenEvent.refused(request.request_id, error, len(prompt))]
        params = request.sampling
        max_total = min(self.config.max_context, len(prompt) + params.max_tokens)
        state = RequestState(request, resolve_seed(params), self._arrivals, max_total)
        self._arrivals += 1
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        state.tracker = OutputTracker(state, self.tokenizer, stops)
        if state.remaining <= 0:
            state.finish_reason = FINISH_LENGTH
            state.status = Status.FINISHED
            return [self._final_event(state)]
        self.requests[request.request_id] = state
        if request.constraint is not None:
            self.constraints[request.request_id] = ConstrainedOutput(request.constraint, params)
        self.scheduler.add(state)
        return []

    def add_score_request(self, request: ScoreRequest) -> list[TokenEvent]:
        """Queue a score request (engine/scoring.py); its final event carries the ScoreResult."""
        return self.scorer.add(request)

    def abort(self, request_id: str) -> list[TokenEvent]:
        """Cancel a request: its blocks and slot are freed now. Returns its final event (if it was live)."""
        self.scorer.forget(request_id)
        state = self.requests.pop(request_id, None)
        if state is None:
            return []
        if self.ahead is not None and any(row.request is state for row in self.ahead.rows):
            state.cacheable_state = False  # the dispatch in flight may move its state past its end
        self.scheduler.finish(state)
        state.finish_reason = FINISH_ABORT
        return [self._final_event(state)]

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def save_prefix_cache(self) -> int:
        """Write the prefix cache to `prefix_cache_file` (atomically). Returns entries written (0: none)."""
        self._last_save = time.monotonic()
        if self.prefix_cache is None or not self.config.prefix_cache_file:
            return 0
        return save_prefix_cache(self.prefix_cache, self.config.prefix_cache_file)

    def maybe_save_prefix_cache(self) -> None:
        """Save when `prefix_cache_save_mins` have passed since the last save."""
        minutes = self.config.prefix_cache_save_mins
        if minutes > 0 and time.monotonic() - self._last_save >= minutes * 60:
            self.save_prefix_cache()

    def stats(self) -> EngineStats:
        blocks = self.scheduler.blocks
        cached = self.prefix_cache.evictable_blocks() if self.prefix_cache is not None else 0
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            kv_blocks_total=blocks.num_total,
            kv_blocks_used=blocks.num_total - blocks.num_free - cached,
            max_context=self.config.max_context,
            kv_blocks_cached=cached,
            prefix_cache=self.prefix_cache.stats if self.prefix_cache is not None else None,
            spec_verify_steps=self.metrics.spec_dispatches,
            spec_rows=self.metrics.spec_rows,
            spec_drafted_tokens=self.metrics.drafted_tokens,
            spec_accepted_tokens=self.metrics.accepted_tokens,
            spec_forced_draft_tokens=self.metrics.forced_draft_tokens,
            structured_forced_tokens=self.metrics.forced_tokens,
            experts=None
            if self.experts is None
            else self.experts.report(self.metrics.prefill_tokens + self.metrics.generated_tokens),
        )

    # ---- one step ------------------------------------------------------------------------------
    def step(self) -> list[TokenEvent]:
        """Advance every scheduled request once; returns the events produced."""
        start = time.perf_counter()
        if self.ahead is not None:
            return self._step_ahead(start)
        plan = self.scheduler.schedule()
        events: list[TokenEvent] = []
        for state in plan.rejected:
            state.finish_reason = FINISH_ERROR
            events.append(
                self._fail(
                    state,
                    f"the request needs more KV memory than the pool holds "
                    f"({self.scheduler.blocks.num_total} blocks of {BLOCK_SIZE} tokens)",
                )
            )
        self.metrics.preemptions += len(plan.preempted)
        if plan.empty:
            self.scorer.run(events)  # score requests whose prompt the prefix cache held whole
            return events
        self.metrics.steps += 1
        if self.ngram is not None:  # start the memory-row lookups now; they overlap what follows
            self.ngram.prepare(plan)
        for state in self._newly_scheduled(plan):
            constrained = self.constraints.get(state.request_id)
            sampling = constrained.slot_sampling() if constrained else state.request.sampling
            self.runner.set_slot(state.slot, sampling, state.seed, state.prompt, state.output)
        wait = 0.0
        if plan.prefill:
            wait += self._run_prefill(plan, events)
        if plan.decode:
            constrained = any(self._needs_host_each_token(r.request) for r in plan.decode)
            # only linear verify windows carry a grammar mask per position
            if self.speculation is not None and (not constrained or self.speculation.verifies_constrained):
                wait += self.speculation.run(plan, events, linear=constrained)
            else:
                wait += self._run_decode(plan, events)
        wait += self.scorer.run(events)
        if plan.decode and not plan.prefill:
            self.metrics.decode_dispatches += 1
            self.metrics.decode_wall_s += time.perf_counter() - start
            self.metrics.decode_device_wait_s += wait
        self._rebalance_experts()
        return events

    def _newly_scheduled(self, plan: SchedulerOutput) -> list[RequestState]:
        """Requests whose slot has no sampling state yet: admitted (or resumed) since the last step."""
        fresh = [c.request for c in plan.prefill if c.request.fresh_slot]
        fresh += [r.request for r in plan.decode if r.request.fresh_slot]
        for state in fresh:
            state.fresh_slot = False
        return fresh

    def _run_prefill(self, plan: SchedulerOutput, events: list[TokenEvent]) -> float:
        rows, length = plan.prefill_shape
        batch = self.runner.empty_prefill(rows, length)
        for i, chunk in enumerate(plan.prefill):
            state = chunk.request
            batch.tokens[i, : chunk.num_tokens] = state.tokens(chunk.start, chunk.start + chunk.num_tokens)
            batch.positions[i, : chunk.num_tokens] = np.arange(chunk.start, chunk.start + chunk.num_tokens)
            batch.block_table[i, : len(state.blocks)] = state.blocks
            batch.slots[i] = state.slot
            batch.sample_rows[i] = chunk.sample
            for j, (position, slot) in enumerate(chunk.snapshots):
                if batch.snapshot_at is not None and slot is not None:
                    batch.snapshot_at[i, j] = position - chunk.start
                    batch.snapshot_slots[i, j] = slot
            constrained = self.constraints.get(state.request_id)
            if chunk.sample and constrained is not None:
                constrained.fill_mask(batch.mask[i])
            self.metrics.prefill_tokens += chunk.num_tokens
        try:
            if self.ngram is not None:
                batch.ngram_rows = self.ngram.prefill_rows(plan)
            if self.speculation is not None and self.speculation.uses_mtp:
                out = self.speculation.prefill(batch, plan)
            else:
                out = self.runner.prefill(batch)
            t0 = time.perf_counter()
            sampled = self.runner.read_prefill(out, rows)
            wait = time.perf_counter() - t0
        except Exception as exc:  # noqa: BLE001 - one failed dispatch fails its requests, not the engine
            for chunk in plan.prefill:
                for _, slot in chunk.snapshots:
                    if slot is not None:
                        self.prefix_cache.release_slot(slot)
            self._fail_step([c.request for c in plan.prefill], exc, events)
            return 0.0
        for i, chunk in enumerate(plan.prefill):
            chunk.request.num_computed += chunk.num_tokens
            self._cache_chunk(chunk)
            if chunk.sample:
                status, count = self._follow_constraint(chunk.request, sampled.tokens[:1, i])
                self._accept(chunk.request, sampled, i, count, events)
                self._settle_constraint(chunk.request, status, events)
        return wait

    def _run_decode(
        self, plan: SchedulerOutput, events: list[TokenEvent], feed: MaskFeed | None = None
    ) -> float:
        """One multi-step decode dispatch over the plan's rows, read back (with `feed`: under the
        masks of its constrained rows, `_constrained_callback`)."""
        if feed is None and any(self._needs_host_each_token(r.request) for r in plan.decode):
            return self._run_decode_constrained(plan, events)
        batch = self.runner.empty_decode(plan.decode_batch, plan.decode_steps)
        params = [row.request.request.sampling for row in plan.decode]
        batch.sampling, batch.with_top = engine_plan(params), wants_top(params)
        for i, row in enumerate(plan.decode):
            state = row.request
            batch.tokens[i] = state.token_at(row.position)
            batch.positions[i] = row.position
            batch.block_table[i, : len(state.blocks)] = state.blocks
            batch.slots[i] = state.slot
            batch.max_steps[i] = row.max_steps
        budget = np.zeros(plan.decode_batch, np.int32)  # tokens each row may still generate
        for i, row in enumerate(plan.decode):
            budget[i] = row.request.remaining
        try:
            if self.ngram is not None:
                batch.ngram_rows = self.ngram.decode_rows(plan)
            t0 = time.perf_counter()
            out = self.runner.decode(batch, feed)
            self.metrics.decode_enqueue_s += time.perf_counter() - t0
            flight = InFlight(plan.decode, batch, out, budget, budget, feed)
        except Exception as exc:  # noqa: BLE001
            self._fail_step([r.request for r in plan.decode], exc, events)
            return 0.0
        return self._read_decode(flight, events)

    def _step_ahead(self, start: float) -> list[TokenEvent]:
        """A step while a decode dispatch is in flight (asynchronous decode): enqueue the next one
        if the batch is still steady, then read this one back."""
        events: list[TokenEvent] = []
        flight, self.ahead = self.ahead, None
        self.metrics.steps += 1
        if flight.check is not None:
            wait = self._read_check_ahead(flight, events, start)
        else:
            wait = self._read_decode(flight, events)
        self.metrics.decode_dispatches += 1
        self.metrics.decode_wall_s += time.perf_counter() - start
        self.metrics.decode_device_wait_s += wait
        self._rebalance_experts()
        return events

    def _rebalance_experts(self) -> None:
        """Move experts between slots and tiers after a step. A dispatch still in flight (async
        decode) keeps the slots it was enqueued with: the swaps' programs run after it on the
        device, and the next dispatch gets the new slots."""
        if self.experts is not None:
            t0 = time.perf_counter()
            self.runner.params = self.experts.rebalance()
            self.metrics.expert_rebalance_s += time.perf_counter() - t0

    def _read_decode(self, flight: InFlight, events: list[TokenEvent]) -> float:
        """Enqueue the dispatch after `flight` when the batch is steady, then read `flight` back and
        feed each row's tokens through its constraint and stop rules. Returns the device wait."""
        try:
            t0 = time.perf_counter()
            ahead = self.async_decode.follow(flight)
            self.metrics.decode_enqueue_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            sampled = self.runner.read_decode(flight.out, flight.batch.steps)
            runs = runs_on(ahead)
            wait = time.perf_counter() - t0
        except Exception as exc:  # noqa: BLE001 - one failed dispatch fails its requests, not the engine
            self.ahead = None
            self._fail_step([r.request for r in flight.rows], exc, events)
            return 0.0
        self.ahead = ahead
        self.metrics.async_dispatches += ahead is not None
        for i, row in enumerate(flight.rows):
            state = row.request
            if state.status != Status.RUNNING:  # ended (aborted) while the dispatch ran
                continue
            count = int(sampled.counts[i])
            state.num_computed += count
            if runs is not None and runs[i]:  # the next dispatch moves its state on: if the host
                state.cacheable_state = False  # ends it now (a stop string), that state is not its own
            if flight.mask_feed is not None:  # its host callback followed the tokens already
                status, count = flight.mask_feed.outcome(i, count)
            else:
                status, count = self._follow_constraint(state, sampled.tokens[:count, i])
            self._accept(state, sampled, i, count, events)
            self._settle_constraint(state, status, events)
            if state.status == Status.RUNNING:
                state.cacheable_state = True
        if ahead is not None and all(row.request.status != Status.RUNNING for row in ahead.rows):
            self.ahead = None  # all its rows stopped (on stop tokens): nothing to read; it runs inert
        return wait

    # ---- structured output ---------------------------------------------------------------------
    def _needs_host_each_token(self, state: RequestState) -> bool:
        constrained = self.constraints.get(state.request_id)
        return constrained is not None and constrained.needs_host_each_token()

    def _follow_constraint(self, state: RequestState, tokens: np.ndarray) -> tuple[str, int]:
        """Feed a row's new tokens to its constraint: (status, tokens to keep). A token the grammar
        refuses is dropped, and so is everything after it."""
        constrained = self.constraints.get(state.request_id)
        if constrained is None:
            return OK, len(tokens)
        for n, token in enumerate(tokens):
            status = constrained.advance(int(token))
            if status == FAILED:
                return FAILED, n
            if status == DONE:
                return DONE, n + 1
        return OK, len(tokens)

    def _settle_constraint(self, state: RequestState, status: str, events: list[TokenEvent]) -> None:
        """End a request whose constraint completed (stop) or broke (error) if its tokens did not."""
        if status == OK or state.status != Status.RUNNING:
            return
        if status == FAILED:
            events.append(self._fail(state, self.constraints[state.request_id].error or "constraint failed"))
            return
        state.finish_reason, state.stop_reason = FINISH_STOP, state.output[-1] if state.output else None
        self.requests.pop(state.request_id, None)
        self.scheduler.finish(state)
        events.append(self._final_event(state))

    def _run_decode_constrained(self, plan: SchedulerOutput, events: list[TokenEvent]) -> float:
        """Decode a batch holding constrained rows, one device round trip per token: the host needs
        each row's last token to fill its next mask. Free rows of the batch sample with an all-ones
        mask: the same keys, penalties and stops as in decode_program, so their tokens are the ones
        the multi-step program would give. `EngineConfig.constrained_decode` picks the programs
        (`_constrained_fused`, `_constrained_split`, `_constrained_check`)."""
        if self.config.constrained_decode == "callback":
            return self._constrained_callback(plan, events)
        b = plan.decode_batch
        way, timed, started = self.config.constrained_decode, False, time.perf_counter()
        if way == CHECK:  # timed, for the chooser; a batch the check way cannot serve exactly, or one
            # larger than check_max_batch, splits
            timed = b in self.config.check_buckets and self._checkable(plan.decode)
            way = self.way_chooser.choose(b) if timed else "split"
        batch = self.runner.empty_decode(b, 1)
        params = [row.request.request.sampling for row in plan.decode]
        batch.sampling, batch.with_top = engine_plan(params), wants_top(params)
        for i, row in enumerate(plan.decode):
            state = row.request
            batch.tokens[i] = state.token_at(row.position)
            batch.positions[i] = row.position
            batch.block_table[i, : len(state.blocks)] = state.blocks
            batch.slots[i] = state.slot
            batch.max_steps[i] = row.max_steps
        steps = int(batch.max_steps.max())
        run = _ConstrainedRun(plan, steps, self.runner.num_top, batch.with_top)
        try:
            if way == "split":
                wait = self._constrained_split(run, batch)
            elif way == CHECK:
                wait = self._constrained_check(run, batch)
            else:
                wait = self._constrained_fused(run, batch)
        except Exception as exc:  # noqa: BLE001 - as in _run_decode
            self.ahead = None  # a check dispatch enqueued after the failed one runs inert
            self._fail_step([r.request for r in plan.decode], exc, events)
            return 0.0
        if timed:
            seconds = time.perf_counter() - started
            self.way_chooser.record(b, way, seconds, int(run.counts.sum()), run.kept_free, run.judged)
        self._accept_run(run, events)
        return wait

    def _accept_run(self, run: _ConstrainedRun, events: list[TokenEvent]) -> None:
        """Take a constrained decode's kept tokens into its requests. A row whose slot was fed past
        its last kept token (split, check), or that the check dispatch in flight runs on, keeps no
        state snapshot if it ends here."""
        sampled = Sampled(run.tokens, run.counts, run.logprobs, run.top_ids, run.top_logprobs)
        runs = runs_on(self.ahead)
        for i, row in enumerate(run.plan.decode):
            state = row.request
            ahead_runs = runs is not None and bool(runs[i])
            if run.fed_after_stop[i] or ahead_runs:  # its slot is past num_computed
                state.cacheable_state = False
            count = int(run.counts[i])
            state.num_computed += count
            self._accept(state, sampled, i, count, events)
            self._settle_constraint(state, run.statuses[i], events)
            if ahead_runs and not run.fed_after_stop[i] and state.status == Status.RUNNING:
                state.cacheable_state = True  # the next read settles it again
        if self.ahead is not None and all(row.request.status != Status.RUNNING for row in self.ahead.rows):
            self.ahead = None  # all its rows ended: nothing to read; it runs inert

    def _constrained_callback(self, plan: SchedulerOutput, events: list[TokenEvent]) -> float:
        """The plain multi-step decode under masks: after each sample the program calls the host,
        which follows the sampled tokens through the rows' constraints and returns the next masks
        (engine/mask_feed.py). Free rows of the batch get all-ones masks, so their tokens are the
        ones of the unmasked program."""
        # A dispatch still in flight (one left to run inert by async decode) finishes first: with
        # one running, a program with a host callback has hung on the CPU backend (jax 0.10.2).
        jax.block_until_ready(self.runner.kv_pool)
        outputs = [self.constraints.get(row.request.request_id) for row in plan.decode]
        feed = MaskFeed(outputs, plan.decode_batch, self.runner.mask_words)
        try:
            wait = self._run_decode(plan, events, feed)
        finally:
            feed.close()
        self.metrics.constrained_host_s += feed.host_s
        return wait

    def _constrained_masks(self, run: _ConstrainedRun, rows: np.ndarray) -> np.ndarray:
        """The packed masks of a constrained step: each constrained row's from its matcher, all
        ones elsewhere."""
        mask = allow_all(len(run.live), self.runner.mask_words)
        for i in np.flatnonzero(rows):
            constrained = self.constraints.get(run.plan.decode[i].request.request_id)
            if constrained is not None:
                constrained.fill_mask(mask[i])
        return mask

    def _record_constrained_step(self, run: _ConstrainedRun, rows: np.ndarray, read) -> None:
        """Feed one step's tokens (`read`: read_step's StepRead) of the rows that sampled to
        their constraints and stop rules; a row that stops or breaks its grammar leaves `run.live`."""
        step_tokens, step_logprobs = read.tokens, read.logprobs
        step_top_ids, step_top_logprobs = read.top_ids, read.top_logprobs
        run.live = run.live.copy()
        for i in np.flatnonzero(rows):
            state = run.plan.decode[i].request
            status, kept = self._follow_constraint(state, step_tokens[i : i + 1])
            if kept:
                n = run.counts[i]
                run.tokens[n, i], run.logprobs[n, i] = step_tokens[i], step_logprobs[i]
                if run.with_top and step_top_ids.shape[-1]:  # the window program has no top-k
                    run.top_ids[n, i], run.top_logprobs[n, i] = step_top_ids[i], step_top_logprobs[i]
                run.counts[i] += 1
            run.statuses[i] = status
            if status != OK or int(step_tokens[i]) in state.tracker.stop_token_ids:
                run.live[i] = False

    def _constrained_fused(self, run: _ConstrainedRun, batch) -> float:
        """One masked forward+sample dispatch per sampled token (`masked_decode_step_program`):
        the host reads step t's tokens, advances the matchers and fills the masks of step t + 1,
        then dispatches it. The device idles for that host work, but a token costs one dispatch, and
        on a GPU the launches of a one-step program are what a token costs
        (docs/structured_output.md). Where a row's grammar forces its next tokens (each the only
        one its mask allows), they are taken as outputs at once and fed with the pending token in
        one `masked_window_program` dispatch, which samples the token after them. A row that stops
        is not fed again. Per step the host uploads the masks; the tokens and positions stay on the
        device from one plain step to the next."""
        b, runner = len(run.live), self.runner
        block_table, slots = jax.device_put((batch.block_table, batch.slots))
        pending = batch.tokens.copy()  # host view: each row's next token to feed, and its position
        position = batch.positions.copy()
        generated = np.zeros(b, np.int32)
        current = positions = fed = None  # device tokens / positions of a plain step, the rows they feed
        scratch = np.zeros(runner.mask_words, np.int32)
        wait = 0.0
        while True:
            feed = run.live & (generated < batch.max_steps)
            if not feed.any():
                break
            room = batch.max_steps - generated
            forced = {} if run.with_top else self._take_forced(run, feed, room, scratch)
            mask = self._constrained_masks(run, feed)
            if forced:
                window = np.zeros((b, FORCED_WINDOW), np.int32)
                window_positions = np.full((b, FORCED_WINDOW), -1, np.int32)
                for i in np.flatnonzero(feed):
                    row = [int(pending[i]), *forced.get(i, ())]
                    window[i, : len(row)] = row
                    window_positions[i, : len(row)] = position[i] + np.arange(len(row))
                current, positions, packed = runner.decode_step_masked(
                    window, window_positions, block_table, slots, mask
                )
                fed = None  # the next plain step uploads its positions
            else:
                if fed is None or not np.array_equal(feed, fed):
                    current = jax.device_put(pending)
                    positions = jax.device_put(np.where(feed, position, -1).astype(np.int32))
                    fed = feed
                current, positions, packed = runner.decode_step_masked(
                    current, positions, block_table, slots, mask, run.with_top
                )
            t0 = time.perf_counter()
            read = runner.read_step(packed)
            wait += time.perf_counter() - t0
            for i in np.flatnonzero(feed):
                taken = len(forced.get(i, ()))
                position[i] += 1 + taken
                generated[i] += 1 + taken
                pending[i] = read[0][i]
            self._record_constrained_step(run, feed, read)
        return wait

    def _take_forced(self, run: _ConstrainedRun, feed: np.ndarray, room: np.ndarray, scratch) -> dict:
        """{row: tokens its grammar forces next}, recorded as the row's outputs (logprob 0, the only
        token allowed), for the fed rows that did not ask for logprobs; each row keeps room for the
        token sampled after them. Empty when no row has any. (Not called while a row of the batch
        wants top alternatives: the window program has no top-k.)"""
        forced: dict[int, list[int]] = {}
        for i in np.flatnonzero(feed):
            state = run.plan.decode[i].request
            constrained = self.constraints.get(state.request_id)
            if constrained is None or state.request.sampling.logprobs is not None:
                continue
            limit = min(FORCED_WINDOW - 1, int(room[i]) - 1)
            tokens = constrained.take_forced(limit, state.tracker.stop_token_ids, scratch)
            for token in tokens:
                run.tokens[run.counts[i], i] = token
                run.logprobs[run.counts[i], i] = 0.0
                run.counts[i] += 1
            if tokens:
                forced[i] = tokens
                self.metrics.forced_tokens += len(tokens)
        return forced

    def _constrained_split(self, run: _ConstrainedRun, batch) -> float:
        """Two dispatches per token, pipelined with the host: step t dispatches the forward of the
        tokens sampled at t - 1 straight from the device (JAX dispatch is asynchronous), then, while
        the device runs it, reads those tokens back, feeds them to the matchers, checks stop tokens
        and fills the masks of step t; then it dispatches the masked sample. A row that stopped at
        t - 1 is fed once more (the request has ended, so what the extra token writes is never read)
        but does not sample. Per step the host uploads only the masks: the block table and slots go
        up once, the positions come from the forward before (re-uploaded only when a row stops
        feeding), which rows sample only when that changes."""
        pending, sampling_rows = None, run.live  # the last dispatched sample, read one step later
        wait = 0.0
        current, block_table, slots = jax.device_put((batch.tokens, batch.block_table, batch.slots))
        positions, fed = None, None  # device positions of the next forward; the rows they feed
        active, active_rows = None, None  # device copy of sampling_rows, and the rows it holds
        for step in range(run.steps + 1):
            feed = run.live & (step < batch.max_steps)  # may still hold a row the pending sample stops
            logits = None
            if step < run.steps and feed.any():
                if fed is None or not np.array_equal(feed, fed):
                    positions = jax.device_put(np.where(feed, batch.positions + step, -1).astype(np.int32))
                    fed = feed
                logits, positions = self.runner.decode_forward(current, positions, block_table, slots)
            if pending is not None:  # read the previous step's tokens while this forward runs
                t0 = time.perf_counter()
                read = self.runner.read_step(pending)
                wait += time.perf_counter() - t0
                if self.config.constrained_decode == CHECK:  # evidence for the chooser
                    self._judge_free_choices(run, sampling_rows, read)
                self._record_constrained_step(run, sampling_rows, read)
            if logits is None:
                break
            run.fed_after_stop |= feed & ~run.live
            sampling_rows = run.live & feed
            if active_rows is None or not np.array_equal(sampling_rows, active_rows):
                active, active_rows = jax.device_put(sampling_rows), sampling_rows
            mask = self._constrained_masks(run, sampling_rows)  # host work overlapped with the forward
            current, pending = self.runner.sample_masked(logits, slots, active, mask, run.with_top)
        return wait

    def _judge_free_choices(self, run: _ConstrainedRun, rows: np.ndarray, read) -> None:
        """Count the constrained rows of a masked sample whose unmasked choice was the masked one,
        i.e. one their grammar allows: what the check way would have kept."""
        for i in np.flatnonzero(rows):
            if run.plan.decode[i].request.request_id in self.constraints:
                run.judged += 1
                run.kept_free += int(read.unmasked[i] == read.tokens[i])

    def _checkable(self, rows: Sequence[DecodeRow]) -> bool:
        """Whether the check way gives this batch split's very tokens: each constrained row greedy
        or sampling from the whole distribution (top-k, top-p or min-p over the allowed tokens can
        keep tokens the free cut dropped), without top alternatives (the replacement's program has
        none), and no n-gram memory (docs/structured_output.md)."""
        if self.ngram is not None:
            return False
        for row in rows:
            if row.request.request_id not in self.constraints:
                continue
            sampling = row.request.request.sampling
            if (sampling.logprobs or 0) > 0:
                return False
            truncated = sampling.top_k > 0 or sampling.top_p < 1.0 or sampling.min_p > 0
            if sampling.temperature > 0 and truncated:
                return False
        return True

    def _constrained_check(self, run: _ConstrainedRun, batch) -> float:
        """Sample free, check after: the plain multi-step program (one dispatch for up to
        `decode_steps_per_dispatch` tokens, no masks), then each constrained row's tokens are
        followed through its grammar up to the first one it refuses. That one and those after it
        are dropped; the row's recurrent state and penalty row, copied on the device before the
        dispatch, are put back, and one `masked_window_program` dispatch feeds the kept tokens and
        samples the refused position under its mask, with the key split would use there. A kept
        token is the one split samples (greedy or Gumbel-max: when the free argmax is allowed it
        is the masked argmax), so the output is split's while the model keeps to its grammar at
        the cost of free decoding. The KV written past the kept tokens is never read: the row's
        next tokens overwrite it. While the batch is steady the next check dispatch is enqueued
        before this one is read (asynchronous decode, engine/async_decode.py)."""
        runner, b = self.runner, len(run.live)
        rows = run.plan.decode
        constrained = np.zeros(b, bool)
        constrained[: len(rows)] = [row.request.request_id in self.constraints for row in rows]
        saved_slots = np.where(constrained, batch.slots, SCRATCH_SLOT).astype(np.int32)
        copies = CheckCopies(runner.save_slots(saved_slots), saved_slots)
        # a refused row's window re-feeds its pending token and the kept ones: at most FORCED_WINDOW
        steps = np.minimum(batch.max_steps, FORCED_WINDOW)
        batch = dataclasses.replace(batch, max_steps=steps, steps=self.config.decode_steps_per_dispatch)
        budget = np.zeros(b, np.int32)  # tokens each row may still generate
        budget[: len(rows)] = [row.request.remaining for row in rows]
        out = runner.decode(batch)
        flight = InFlight(rows, batch, out, budget, budget, check=copies)
        return self._read_check(flight, run)

    def _checks_on(self, rows: Sequence[DecodeRow], batch: int) -> bool:
        """Whether the check dispatch after one of these rows may be enqueued before that one is
        read (asynchronous decode): the way is check, the batch checkable, the chooser would pick
        check for the next step, and a row keeps a whole dispatch often enough that the work a
        refusal voids costs less than the host's time it saves (`check_ahead_min_keep`)."""
        return (
            self.config.constrained_decode == CHECK
            and batch in self.config.check_buckets
            and self._checkable(rows)
            and self.way_chooser.dispatch_keep_chance(batch) >= self.config.check_ahead_min_keep
            and self.way_chooser.choose(batch) == CHECK
        )

    def _read_check_ahead(self, flight: InFlight, events: list[TokenEvent], start: float) -> float:
        """A step that reads the check dispatch enqueued by the step before (`_step_ahead`)."""
        b = len(flight.batch.slots)
        plan = SchedulerOutput(decode=flight.rows, decode_batch=b)
        run = _ConstrainedRun(plan, FORCED_WINDOW, self.runner.num_top, flight.batch.with_top)
        try:
            wait = self._read_check(flight, run)
        except Exception as exc:  # noqa: BLE001 - as in _run_decode
            self.ahead = None
            self._fail_step([row.request for row in flight.rows], exc, events)
            return 0.0
        seconds = time.perf_counter() - start  # from the last read: the device's pace
        self.way_chooser.record(b, CHECK, seconds, int(run.counts.sum()), run.kept_free, run.judged)
        self._accept_run(run, events)
        return wait

    def _read_check(self, flight: InFlight, run: _ConstrainedRun) -> float:
        """Enqueue the check dispatch after `flight` when the batch is steady, then read `flight`,
        keep each row's tokens up to the first its grammar refuses and replace that one
        (`_replace_refused`). Returns the device wait."""
        runner, b = self.runner, len(run.live)
        t0 = time.perf_counter()
        ahead = self.async_decode.follow(flight)
        self.metrics.decode_enqueue_s += time.perf_counter() - t0
        t0 = time.perf_counter()
        sampled = runner.read_decode(flight.out, flight.batch.steps)
        wait = time.perf_counter() - t0
        self.ahead = ahead
        self.metrics.async_dispatches += ahead is not None
        refused = np.zeros(b, bool)
        for i, row in enumerate(flight.rows):
            if row.request.status != Status.RUNNING or (flight.void is not None and flight.void[i]):
                run.live[i] = False  # ended while it ran, or fed on tokens a refusal dropped
                continue
            count = int(sampled.counts[i])
            output = self.constraints.get(row.request.request_id)
            kept, status = (count, OK) if output is None else output.follow_allowed(sampled.tokens[:count, i])
            run.tokens[:kept, i] = sampled.tokens[:kept, i]
            run.logprobs[:kept, i] = sampled.logprobs[:kept, i]
            if run.with_top:
                run.top_ids[:kept, i] = sampled.top_ids[:kept, i]
                run.top_logprobs[:kept, i] = sampled.top_logprobs[:kept, i]
            run.counts[i], run.statuses[i] = kept, status
            if output is not None:
                self.metrics.check_kept_tokens += kept
                run.kept_free += kept
                run.judged += kept
            if kept < count and status == DONE:  # the grammar ended; the slot ran on past it
                run.fed_after_stop[i] = True
            elif kept < count:
                refused[i] = True
                run.judged += 1
        if refused.any():
            self.metrics.check_refusals += int(refused.sum())
            wait += self._replace_refused(run, flight.batch, refused, flight.check)
            if self.ahead is not None:  # it ran the refused rows on dropped tokens
                self.ahead = dataclasses.replace(self.ahead, void=refused)
        return wait

    def _replace_refused(self, run: _ConstrainedRun, batch, refused, copies: CheckCopies) -> float:
        """The check way's second dispatch: restore the refused rows' slots, feed each its pending
        token and kept tokens, and sample its next token under its grammar's mask."""
        b = len(run.live)
        restored = np.where(refused, copies.slots, SCRATCH_SLOT).astype(np.int32)
        self.runner.restore_slots(restored, copies.saved)
        window = np.zeros((b, FORCED_WINDOW), np.int32)
        positions = np.full((b, FORCED_WINDOW), -1, np.int32)
        pending, start = np.asarray(batch.tokens), np.asarray(batch.positions)  # device after a follow
        for i in np.flatnonzero(refused):
            fed = [int(pending[i]), *run.tokens[: run.counts[i], i]]
            window[i, : len(fed)] = fed
            positions[i, : len(fed)] = start[i] + np.arange(len(fed))
        mask = self._constrained_masks(run, refused)
        _, _, packed = self.runner.decode_step_masked(window, positions, batch.block_table, batch.slots, mask)
        t0 = time.perf_counter()
        read = self.runner.read_step(packed)
        wait = time.perf_counter() - t0
        self._record_constrained_step(run, refused, read)
        return wait

    def _cache_chunk(self, chunk) -> None:
        """Index a prefilled chunk's full blocks and the snapshots it took."""
        cache, state = self.prefix_cache, chunk.request
        if cache is None:
            return
        tokens = state.tokens(0, state.num_computed)
        cache.insert_blocks(tokens, state.blocks, state.num_computed)
        for position, slot in chunk.snapshots:
            cache.add_snapshot(tokens, position, slot, state.blocks)

    # ---- host-side output ----------------------------------------------------------------------
    def _accept(
        self, state: RequestState, sampled: Sampled, row: int, count: int, events: list[TokenEvent]
    ) -> None:
        """Feed a row's sampled tokens through the stop rules; emit one event; finish if stopped."""
        if state.status != Status.RUNNING or self.scorer.owns(state.request_id):
            return  # a score request's prefill samples a token nobody reads
        tracker = state.tracker
        want = state.request.sampling.logprobs
        alive = True
        for n in range(count):
            logprob = None
            if want is not None:
                top = tuple(
                    (int(t), float(lp))
                    for t, lp in zip(sampled.top_ids[n, row, :want], sampled.top_logprobs[n, row, :want])
                )
                logprob = TokenLogprob(int(sampled.tokens[n, row]), float(sampled.logprobs[n, row]), top)
            alive = tracker.add(int(sampled.tokens[n, row]), logprob)
            if not alive:
                break
        self.metrics.generated_tokens += count
        if alive:
            tokens, text, logprobs = tracker.take(final=False)
            if tokens or text:
                events.append(self._event(state, tokens, text, logprobs))
            return
        self.requests.pop(state.request_id, None)
        self.scheduler.finish(state)
        events.append(self._final_event(state))

    def _event(self, state: RequestState, tokens, text, logprobs, **final) -> TokenEvent:
        want = state.request.sampling.logprobs is not None
        return TokenEvent(
            state.request_id,
            tokens,
            text,
            logprobs=list(logprobs) if want else None,
            prompt_tokens=len(state.prompt),
            cached_tokens=state.cached_tokens,
            completion_tokens=state.tracker.generated,
            **final,
        )

    def _final_event(self, state: RequestState) -> TokenEvent:
        self.constraints.pop(state.request_id, None)
        tokens, text, logprobs = state.tracker.take(final=True) if state.tracker else ([], "", [])
        return self._event(
            state, tokens, text, logprobs, finish_reason=state.finish_reason, stop_reason=state.stop_reason
        )

    def _fail(self, state: RequestState, message: str) -> TokenEvent:
        self.requests.pop(state.request_id, None)
        if state.status != Status.FINISHED:
            self.scheduler.finish(state, cache=False)
        state.finish_reason = FINISH_ERROR
        event = self._final_event(state)
        event.error = message
        return event

    def _pools_lost(self) -> bool:
        """Whether the runner's pools can no longer be used after a failed dispatch: donated to it
        (deleted), or the outputs of the failed program itself. Dispatch is asynchronous, so a
        program that fails while running (an expert read in its host callback) has already handed
        its outputs to the runner; reading them raises the program's error."""
        runner = self.runner
        leaves = jax.tree.leaves((runner.kv_pool, runner.state_pool, runner.slot_sampling))
        if any(x.is_deleted() for x in leaves if hasattr(x, "is_deleted")):
            return True
        try:
            jax.block_until_ready(leaves)
        except Exception:  # noqa: BLE001 - any error of the failed program poisons its outputs
            return True
        return False

    def _fail_step(self, states: list[RequestState], exc: Exception, events: list[TokenEvent]) -> None:
        """A dispatch raised: end its requests with an error. The pools were donated to the failed
        call, so they are rebuilt empty and every other running request is recomputed."""
        message = f"{type(exc).__name__}: {exc}"
        for state in states:
            if state.status != Status.FINISHED:
                events.append(self._fail(state, message))
        if self._pools_lost():
            self.runner.reset_pools()
            if self.prefix_cache is not None:
                self.prefix_cache.on_pools_reset()
            for state in list(self.scheduler.running):
                self.scheduler.preempt(state, cache=False)
