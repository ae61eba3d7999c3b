"""`Speculation`: the engine core's speculative decode step (and the MTP-aware prefill).

With `EngineConfig.spec` set, every decode row of a step is verified instead of decoded: the
scheduler gives it a window of up to `spec_window` tokens (the pending token + drafts, capped by its
remaining budget), the drafter proposes drafts on the host, one `verify_program` dispatch scores and
accepts them, and the core takes 1..k+1 tokens per row (each row its own count). With an MTP drafter
the prefill runs `mtp_prefill_program` (the MTP KV of the prompt and the first draft chain) and
each verify returns the next chain, which the host keeps per request until its next step.

With `spec_tree_width` > 1 the drafter proposes several branches, merged into a draft tree of up to
window - 1 nodes, and `tree_verify_program` verifies it (tree.py).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass

import jax
import numpy as np

from infernix_jax.cache import NULL_BLOCK, SCRATCH_SLOT
from infernix_jax.engine.constrained import allow_all
from infernix_jax.engine.runner import PrefillBatch, Sampled
from infernix_jax.engine.sampling import ANY_PLAN, SamplingPlan, engine_plan, wants_top
from infernix_jax.engine.speculative.drafters import make_drafter
from infernix_jax.engine.speculative.programs import mtp_prefill_program, tree_verify_program, verify_program
from infernix_jax.engine.speculative.rollback import verify_state_bytes
from infernix_jax.engine.speculative.tree import build_tree

log = logging.getLogger("infernix_jax.engine")


@dataclass
class VerifyBatch:
    """Host arrays of one verify dispatch."""

    tokens: np.ndarray  # i32 [b, w]: pending token, then drafts (tree: draft nodes)
    positions: np.ndarray  # i32 [b, w]: -1 past the row's drafts and on padding rows (tree: P + depth)
    block_table: np.ndarray  # i32 [b, m]
    slots: np.ndarray  # i32 [b]
    num_drafts: np.ndarray  # i32 [b]
    parents: np.ndarray  # i32 [b, w]: tree windows: each node's parent index (-1: root, padding)
    masks: np.ndarray  # i32 [b, w, words]: linear windows: structured-output mask per position (-1: free)
    ngram_rows: np.ndarray | None = None  # [L, b, w, heads, width]: a model with an n-gram memory
    sampling: SamplingPlan = ANY_PLAN  # the sampling branches the rows need (engine_plan of their settings)
    with_top: bool = True  # a row wants top alternatives (wants_top); False: no top-k (Runner.top_count)


class Speculation:
    """Drafter + verify dispatches for one EngineCore (owns nothing on the device but programs)."""

    def __init__(self, core):
        config = core.config
        self.core = core
        self.window = config.spec_window
        self.drafter = make_drafter(config.spec, config.ngram_draft_tokens, config.ngram_min_match)
        self.mtp_steps = config.draft_tokens if config.spec_uses_mtp else 0
        self.tree_width = config.spec_tree_width if config.spec_tree else 1
        self.mtp_branches = self.tree_width - 1 if self.mtp_steps else 0
        if self.mtp_steps and core.runner.params.mtp is None:
            raise ValueError(f"spec={config.spec!r} needs a checkpoint with MTP weights; this one has none")
        self.device_drafts: dict[str, list[int]] = {}  # request id -> MTP chain for its next window
        log.info(
            "speculative decoding: %s, verify %s %d, per-position GDN states %.1f MiB at batch %d",
            config.spec, f"tree of {self.tree_width} branches," if self.tree else "window", self.window,
            self.state_bytes(max(config.decode_buckets)) / 2**20,
            max(config.decode_buckets),
        )  # fmt: skip

    @property
    def uses_mtp(self) -> bool:
        return self.mtp_steps > 0

    @property
    def tree(self) -> bool:
        return self.tree_width > 1

    @property
    def verifies_constrained(self) -> bool:
        """Whether batches with constrained rows are speculated: windows must carry the grammar's
        masks, which only linear windows do. A tree drafter's batches then verify linear windows
        (its best branch), except with MTP, whose device chains are the tree program's."""
        return not self.tree or not self.uses_mtp

    def state_bytes(self, batch: int) -> int:
        """Transient bytes of the per-position GDN states of a verify dispatch of `batch` rows."""
        runner = self.core.runner
        return verify_state_bytes(runner.cfg, batch, self.window, runner.dtype)

    # ---- prefill (MTP only) --------------------------------------------------------------------
    def prefill(self, batch: PrefillBatch, plan) -> tuple:
        """The MTP-aware prefill: same outputs as Runner.prefill; keeps each sampled row's first chain."""
        runner = self.core.runner
        next_tokens = np.zeros_like(batch.tokens)
        for i, chunk in enumerate(plan.prefill):  # the last one of a sampled row is filled on the device
            following = chunk.request.tokens(chunk.start + 1, chunk.start + chunk.num_tokens + 1)
            next_tokens[i, : len(following)] = following
        runner.kv_pool, runner.state_pool, runner.slot_sampling, out, drafts = mtp_prefill_program(
            runner.params, runner.kv_pool, runner.state_pool, runner.slot_sampling,
            batch.tokens, batch.positions, next_tokens, batch.block_table, batch.slots, batch.sample_rows,
            cfg=runner.cfg, num_top=runner.num_top, mtp_steps=self.mtp_steps, mtp_branches=self.mtp_branches,
        )  # fmt: skip
        drafts = np.asarray(jax.device_get(drafts))
        for i, chunk in enumerate(plan.prefill):
            if chunk.sample:
                self.device_drafts[chunk.request.request_id] = drafts[i].tolist()
        return out

    # ---- verify --------------------------------------------------------------------------------
    def empty_batch(self, batch: int) -> VerifyBatch:
        runner = self.core.runner
        return VerifyBatch(
            tokens=np.zeros((batch, self.window), np.int32),
            positions=np.full((batch, self.window), -1, np.int32),
            block_table=np.full((batch, runner.max_blocks), NULL_BLOCK, np.int32),
            slots=np.full(batch, SCRATCH_SLOT, np.int32),
            num_drafts=np.zeros(batch, np.int32),
            parents=np.full((batch, self.window), -1, np.int32),
            masks=allow_all(batch * self.window, runner.mask_words).reshape(batch, self.window, -1),
            ngram_rows=self.core.ngram.table.empty(batch, self.window) if self.core.ngram is not None else None,
        )

    def dispatch(self, batch: VerifyBatch, tree: bool | None = None):
        """One verify dispatch: the tree program when `tree` (default: this drafter's shape)."""
        runner = self.core.runner
        plan = batch.sampling if runner.static_sampling_plans else None  # EngineConfig.sampling_plans
        num_top = runner.top_count(batch.with_top)
        if self.tree if tree is None else tree:
            runner.kv_pool, runner.state_pool, runner.slot_sampling, out = tree_verify_program(
                runner.params, runner.kv_pool, runner.state_pool, runner.slot_sampling,
                batch.tokens, batch.positions, batch.parents, batch.block_table, batch.slots,
                batch.num_drafts + 1, cfg=runner.cfg, num_top=num_top, mtp_steps=self.mtp_steps,
                mtp_branches=self.mtp_branches, plan=plan,
            )  # fmt: skip
            return out
        runner.kv_pool, runner.state_pool, runner.slot_sampling, out = verify_program(
            runner.params, runner.kv_pool, runner.state_pool, runner.slot_sampling,
            batch.tokens, batch.positions, batch.block_table, batch.slots, batch.num_drafts, batch.masks,
            batch.ngram_rows, cfg=runner.cfg, num_top=num_top, mtp_steps=self.mtp_steps, plan=plan,
        )  # fmt: skip
        return out

    def run(self, plan, events: list, linear: bool = False) -> float:
        """Draft, verify and accept for every decode row of the plan. Returns seconds waited on the device.
        linear: verify linear windows even with a tree drafter (a batch with constrained rows)."""
        core = self.core
        tree = self.tree and not linear
        vocab = core.cfg.vocab_size
        batch = self.empty_batch(plan.decode_batch)
        params = [row.request.request.sampling for row in plan.decode]
        batch.sampling, batch.with_top = engine_plan(params), wants_top(params)
        for i, row in enumerate(plan.decode):
            state = row.request
            limit = min(self.window, row.max_steps) - 1
            context = state.prompt + state.output
            device_drafts = self.device_drafts.get(state.request_id, ())
            batch.tokens[i, 0] = state.token_at(row.position)
            if tree:
                n = self._fill_tree(batch, i, row.position, context, device_drafts, limit, vocab)
            else:
                constrained = core.constraints.get(state.request_id)
                forced = constrained.forced_drafts(limit) if constrained is not None else []
                if forced:  # what the grammar forces, then the drafter's guess past it (not MTP's
                    drafts = forced + self.drafter.propose(context + forced, (), limit - len(forced))
                else:  # chain: that continues the pending token, not the forced ones)
                    drafts = self.drafter.propose(context, device_drafts, limit)
                drafts = [t for t in drafts[:limit] if 0 <= t < vocab][:limit]
                if constrained is not None:  # drafts the grammar refuses are cut; masks per position
                    drafts = drafts[: constrained.fill_window_masks(drafts, batch.masks[i])]
                core.metrics.forced_draft_tokens += min(len(forced), len(drafts))
                n = len(drafts)
                batch.tokens[i, 1 : 1 + n] = drafts
                batch.positions[i, : 1 + n] = np.arange(row.position, row.position + 1 + n)
                if core.ngram is not None:  # the memory rows of the window: its n-grams run through the drafts
                    window = context + drafts
                    batch.ngram_rows[:, i, : 1 + n] = core.ngram.table.rows(window, row.position, row.position + 1 + n)
            batch.block_table[i, : len(state.blocks)] = state.blocks
            batch.slots[i] = state.slot
            batch.num_drafts[i] = n
        try:
            out = self.dispatch(batch, tree)
            t0 = time.perf_counter()
            counts, tokens, logprobs, top_ids, top_logprobs, chains = jax.device_get(out)
            wait = time.perf_counter() - t0
        except Exception as exc:  # noqa: BLE001 - one failed dispatch fails its requests, not the engine
            core._fail_step([r.request for r in plan.decode], exc, events)
            return 0.0
        sampled = Sampled(tokens, counts, logprobs, top_ids, top_logprobs)
        metrics = core.metrics
        metrics.spec_dispatches += 1
        for i, row in enumerate(plan.decode):
            state, count = row.request, int(counts[i])
            state.num_computed += count
            metrics.spec_rows += 1
            metrics.drafted_tokens += int(batch.num_drafts[i])
            metrics.accepted_tokens += count - 1
            if self.uses_mtp:
                self.device_drafts[state.request_id] = chains[i].tolist()
            status, kept = core._follow_constraint(state, tokens[:count, i])
            if kept < count:  # the grammar ended (or broke) inside the window: the rest is dropped,
                state.cacheable_state = False  # so the slot's state is past the request's end
            core._accept(state, sampled, i, kept, events)
            core._settle_constraint(state, status, events)
        for request_id in [r for r in self.device_drafts if r not in core.requests]:
            del self.device_drafts[request_id]
        return wait

    def _fill_tree(
        self, batch: VerifyBatch, i: int, position: int, context, device_drafts, limit: int, vocab: int
    ) -> int:
        """Row i of a tree window: the drafter's branches merged into at most `limit` nodes (the
        scheduler reserved blocks for that many slots past the pending token). Returns the node count."""
        branches = self.drafter.propose_branches(context, device_drafts, limit, self.tree_width)
        branches = [
            list(b[: next((j for j, t in enumerate(b) if not 0 <= t < vocab), len(b))]) for b in branches
        ]
        tree = build_tree(branches, max_nodes=limit, max_depth=limit)
        n = len(tree.tokens)
        depth = [0]
        for parent in tree.parents:
            depth.append(depth[parent] + 1)
        batch.tokens[i, 1 : 1 + n] = tree.tokens
        batch.parents[i, 1 : 1 + n] = tree.parents
        batch.positions[i, : 1 + n] = position + np.asarray(depth)
        return n

    # ---- warm-up -------------------------------------------------------------------------------
    def warmup(self) -> None:
        """Compile the verify program for every decode bucket (and the MTP prefill shapes)."""
        runner = self.core.runner
        linear_too = self.tree and self.verifies_constrained and self.core.config.structured_output
        for b, (sampling, with_top) in itertools.product(self.core.config.decode_buckets, runner.decode_variants()):
            empty = dataclasses.replace(self.empty_batch(b), sampling=sampling, with_top=with_top)
            jax.block_until_ready(self.dispatch(empty))
            if linear_too:  # constrained batches verify linear windows
                jax.block_until_ready(self.dispatch(empty, tree=False))
        if self.uses_mtp:
            for rows, length in self.core.config.prefill_shapes:
                batch = runner.empty_prefill(rows, length)
                runner.kv_pool, runner.state_pool, runner.slot_sampling, out, drafts = mtp_prefill_program(
                    runner.params, runner.kv_pool, runner.state_pool, runner.slot_sampling,
                    batch.tokens, batch.positions, np.zeros_like(batch.tokens), batch.block_table,
                    batch.slots, batch.sample_rows, cfg=runner.cfg, num_top=runner.num_top,
                    mtp_steps=self.mtp_steps, mtp_branches=self.mtp_branches,
                )  # fmt: skip
                jax.block_until_ready((out, drafts))
