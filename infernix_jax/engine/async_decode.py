"""Asynchronous decode: the next decode dispatch is enqueued before the last one is read back.

A plain decode step is: dispatch `steps` forwards, wait, read the tokens, run the stop rules, emit
events, schedule again. The device idles while the host does everything after the wait and the
launch of the next dispatch (about 14 ms per dispatch on the 27B shape on an H200: 9.5% of decode
time; 23% on the MoE shape at batch 1; docs/engine.md). When the batch is steady (every running
request is decoding, none waits, nothing needs the host between tokens), the next dispatch does not
need the host at all: its inputs are the last one's device outputs (each row's last token, its
position + tokens generated, its budget - tokens generated). `follow` enqueues it at once, so the
host's work overlaps the device's.

What keeps this exact:
- a row that sampled a stop token or used its budget gets max_steps 0 in the follow-up dispatch,
  which then leaves its KV and recurrent state untouched (the decode program writes nothing at
  position -1), so the sequence and the state the prefix cache snapshots at its end are right;
- a row the host ends for a reason the device does not see (a stop string, an abort) while a
  follow-up dispatch runs it has its state advanced past its end: it is marked not cacheable
  (`RequestState.cacheable_state`), its KV blocks still are, and its extra tokens are dropped;
- blocks for both dispatches are reserved before the follow-up is enqueued (never by evicting or
  preempting: then the engine waits and schedules normally); blocks freed while a dispatch is in
  flight are only reused by programs enqueued after it, which the device runs after it;
- the scheduler runs only when nothing is in flight, so admission, preemption and the prefix
  cache's copies see settled state. A new request waits at most one dispatch for it.
Sampling is unchanged: each row's random keys and penalties live in its slot on the device.

The check way of constrained decoding ("sample free, check after", core.py) runs the same program
and follows the same way: each of its dispatches carries device copies of its constrained rows'
states (`CheckCopies`, taken just before it), so whichever dispatch's tokens a grammar refuses, its
rows can be put back as they were before it. When the dispatch read back had a refusal, the one
already enqueued after it ran those rows on tokens that are dropped: its outputs for them are
void (`InFlight.void`: the restore and the masked window run after it on the device, so their state
is right), and it is not followed in turn.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from infernix_jax.cache.allocators import BLOCK_SIZE
from infernix_jax.engine.mask_feed import MaskFeed
from infernix_jax.engine.request_state import Status
from infernix_jax.engine.runner import FORCED_WINDOW, DecodeBatch, next_decode_inputs

if TYPE_CHECKING:
    from infernix_jax.engine.scheduler import DecodeRow


@dataclass
class CheckCopies:
    """A check-way dispatch's device copies of its constrained rows' recurrent states and penalty
    rows, taken just before it (`Runner.save_slots`), and the slots they came from (0: none)."""

    saved: Any
    slots: np.ndarray


@dataclass
class InFlight:
    """A decode dispatch on the device, not read back yet."""

    rows: list[DecodeRow]  # the requests of rows 0..len-1 (the rest of the batch is padding)
    batch: DecodeBatch
    # the device's packed output (runner.pack_decode): per row its count, last token and stop flag
    # (the next dispatch's inputs), then its tokens, logprobs and top alternatives
    out: Any
    budget: Any  # i32 [b]: tokens each row could generate when the dispatch started (host or device)
    budget_bound: np.ndarray  # i32 [b]: the same on the host, or an upper bound of it
    mask_feed: MaskFeed | None = None  # constrained rows: the host side of the dispatch's masks
    check: CheckCopies | None = None  # a check-way dispatch (core._read_check)
    # bool [b]: rows whose outputs are dropped (see the module doc); a dispatch with void rows is
    # read back before anything else is enqueued
    void: np.ndarray | None = None


class AsyncDecode:
    """Decides whether a decode dispatch can be followed by the next one before it is read, and
    enqueues that one (EngineCore owns it)."""

    def __init__(self, core) -> None:
        self.core = core
        config = core.config
        # speculation and n-gram memory rows need the host between dispatches. Offloaded experts
        # whose misses the programs copy themselves need no host inside or between dispatches: the
        # slot swaps planned between steps queue behind the dispatch in flight, which keeps the
        # slots it was enqueued with. With fetch callbacks the host serves each dispatch, so the
        # engine reads one back before it enqueues the next.
        experts = core.experts
        self.enabled = (
            config.async_decode
            and core.speculation is None
            and core.ngram is None
            and (experts is None or experts.cache.reads_in_program)
        )

    def follow(self, flight: InFlight) -> InFlight | None:
        """Enqueue the dispatch after `flight` from its device outputs; None when the batch is not
        steady or the blocks for it are not free."""
        if not self.enabled or flight.void is not None:
            return None
        # a check dispatch's rows generate at most FORCED_WINDOW tokens (a refused row's window
        # re-feeds the ones it kept), whatever the program's steps
        steps = flight.batch.steps
        if flight.check is not None:
            steps = min(steps, FORCED_WINDOW)
        bound = np.maximum(flight.budget_bound - steps, 0)  # exact unless a row stops early
        if not bound.any():  # every row ends in this dispatch (max_tokens, max_context)
            return None
        if not self._steady(flight) or not self._reserve(flight.rows, 2 * steps):
            return None
        tokens, positions, max_steps, budget = next_decode_inputs(
            flight.out, flight.batch.positions, flight.budget, steps=steps
        )
        block_table = flight.batch.block_table.copy()
        for i, row in enumerate(flight.rows):
            blocks = row.request.blocks
            block_table[i, : len(blocks)] = blocks
        batch = dataclasses.replace(
            flight.batch, tokens=tokens, positions=positions, max_steps=max_steps, block_table=block_table
        )
        runner, check = self.core.runner, None
        if flight.check is not None:  # the states this dispatch starts from, before it moves them
            check = CheckCopies(runner.save_slots(flight.check.slots), flight.check.slots)
        out = runner.decode(batch)
        return InFlight(flight.rows, batch, out, budget, bound, check=check)

    def _steady(self, flight: InFlight) -> bool:
        """Every running request is decoding in this batch, none waits, nothing needs the host (a
        check dispatch: its constrained rows may go on being checked, core._checks_on)."""
        core = self.core
        scheduler = core.scheduler
        if scheduler.waiting or core.scorer.jobs or len(flight.rows) != len(scheduler.running):
            return False
        members = {id(row.request) for row in flight.rows}
        for state in scheduler.running:
            if id(state) not in members or state.status != Status.RUNNING:
                return False
            if flight.check is None and (
                core._needs_host_each_token(state) or state.request_id in core.constraints
            ):
                return False
        return flight.check is None or core._checks_on(flight.rows, len(flight.batch.slots))

    def _reserve(self, rows: list[DecodeRow], tokens_ahead: int) -> bool:
        """Blocks for `tokens_ahead` more tokens per row (both dispatches), from the free list only."""
        blocks = self.core.scheduler.blocks
        needs = []
        for row in rows:
            state = row.request
            target = min(state.num_computed + tokens_ahead, state.max_total)
            needs.append(max(0, -(-target // BLOCK_SIZE) - len(state.blocks)))
        if sum(needs) > blocks.num_free:
            return False
        for row, need in zip(rows, needs, strict=True):
            if need:
                row.request.blocks.extend(blocks.allocate(need))
        return True


def runs_on(ahead: InFlight | None) -> np.ndarray | None:
    """Per row of the dispatch before `ahead`: whether `ahead` advances it (it did not stop and has
    budget left). Read from the device; None when nothing follows."""
    if ahead is None:
        return None
    return np.asarray(ahead.batch.max_steps) > 0
