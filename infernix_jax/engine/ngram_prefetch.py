"""The engine's side of the n-gram memory: turn a scheduler plan into the rows its dispatches feed.

`NgramFeeder.prepare(plan)` runs at the start of a step, as soon as the plan is known: it submits
the lookups of every prefill chunk and decode token of the step (their ids depend only on tokens
the request already has: RequestState keeps the history that chunk boundaries and decode need)
and warms the host cache with the chunk that follows each partly prefilled prompt, which the next
step will feed; those reads overlap this step's host work and device dispatches.
`prefill_rows` / `decode_rows` then collect the rows into the [L, rows, tokens, heads, width]
arrays the programs take (zeros for padding rows and positions).

Decode with a memory runs one step per dispatch: the rows of a token are known only once the
token is sampled and read back (docs/ngram_memory.md).
"""

from __future__ import annotations

import numpy as np

from infernix_jax.config import ModelConfig
from infernix_jax.engine.config import EngineConfig
from infernix_jax.engine.scheduler import SchedulerOutput
from infernix_jax.ngram.memory import NgramTable, table_from_volume
from infernix_jax.ngram.prefetch import RowPrefetcher


class NgramFeeder:
    """Prefetches and assembles the n-gram rows of each dispatch."""

    def __init__(self, table: NgramTable, config: EngineConfig, workers: int = 2):
        self.table = table
        self.config = config
        self.prefetcher = RowPrefetcher(table, workers)

    @staticmethod
    def _key(state, start: int, stop: int) -> tuple:
        return (state.request_id, state.arrival, start, stop)

    def prepare(self, plan: SchedulerOutput) -> None:
        """Submit every lookup this step's dispatches need, and warm the cache for the next chunk."""
        for chunk in plan.prefill:
            state = chunk.request
            stop = chunk.start + chunk.num_tokens
            tokens = state.tokens(0, state.num_tokens)
            self.prefetcher.submit(self._key(state, chunk.start, stop), tokens, chunk.start, stop)
            if stop < state.num_tokens - 1:  # more prompt after this chunk: the next step feeds it
                self.prefetcher.warm(tokens, stop, min(state.num_tokens, stop + self.config.prefill_chunk))
        for row in plan.decode:
            state = row.request
            tokens = state.tokens(0, row.position + 1)
            self.prefetcher.submit(
                self._key(state, row.position, row.position + 1), tokens, row.position, row.position + 1
            )

    def prefill_rows(self, plan: SchedulerOutput) -> np.ndarray:
        """[L, rows, chunk, heads, width] for the plan's prefill dispatch."""
        rows, length = plan.prefill_shape
        out = self.table.empty(rows, length)
        for i, chunk in enumerate(plan.prefill):
            state = chunk.request
            stop = chunk.start + chunk.num_tokens
            got = self.prefetcher.take(
                self._key(state, chunk.start, stop), state.tokens(0, stop), chunk.start, stop
            )
            out[:, i, : chunk.num_tokens] = got
        return out

    def decode_rows(self, plan: SchedulerOutput) -> np.ndarray:
        """[L, batch, 1, heads, width] for the plan's (one-step) decode dispatch."""
        out = self.table.empty(plan.decode_batch, 1)
        for i, row in enumerate(plan.decode):
            state = row.request
            p = row.position
            out[:, i] = self.prefetcher.take(self._key(state, p, p + 1), state.tokens(0, p + 1), p, p + 1)
        return out

    def close(self) -> None:
        self.prefetcher.close()


def memory_engine_config(config: EngineConfig) -> EngineConfig:
    """What an engine with an n-gram memory runs: one decode step per dispatch (the next token's rows
    need the token), no structured-output programs (not supported yet). Speculation works with the
    n-gram (prompt lookup) drafter and linear windows, whose drafts are known on the host, so the
    window's rows are looked up with it; MTP drafts (made on the device) and trees are refused."""
    if config.spec not in ("none", "ngram") or config.spec_tree:
        raise ValueError(
            "with an n-gram memory, speculative decoding supports --spec ngram with linear windows only "
            "(docs/ngram_memory.md)"
        )
    return config.replace(decode_steps_per_dispatch=1, structured_output=False)


def build_ngram_feeder(
    cfg: ModelConfig, config: EngineConfig, table: NgramTable | None = None
) -> tuple[NgramFeeder | None, EngineConfig]:
    """The engine's feeder and the engine config it runs with (unchanged for a model without a memory).

    The table comes from `table` or else from `config.ngram_volume` (checked against the model:
    NgramVolumeError names what differs). A model with a memory and no table, or a table for a model
    without one, is a ValueError that says which flag to give.
    """
    if cfg.ngram_memory is None:
        if table is not None or config.ngram_volume:
            raise ValueError(
                "an n-gram volume was given but this model has no ngram_memory in its config.json"
            )
        return None, config
    if table is None:
        if not config.ngram_volume:
            raise ValueError(
                "this model has an n-gram memory (ngram_memory in config.json): give its table volume "
                "with --ngram-volume PATH (ngram_volume=...)"
            )
        from infernix_jax.cache.capacity import parse_bytes

        cache = config.ngram_cache_mem
        table = table_from_volume(
            cfg, config.ngram_volume, parse_bytes(cache) if isinstance(cache, str) else int(cache)
        )
    return NgramFeeder(table, config), memory_engine_config(config)
