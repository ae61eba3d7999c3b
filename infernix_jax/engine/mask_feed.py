"""Token masks fed from the host into a multi-step decode program, in the device's own order.

`EngineConfig.constrained_decode = "callback"`: a batch holding constrained rows runs the plain
multi-step `decode_program` (one dispatch per `decode_steps_per_dispatch` tokens) with a mask.
After each step's sample the program calls the host (`jax.experimental.io_callback`) with the
tokens it sampled; the host follows them through each row's grammar and returns the next step's
masks (and which rows must stop: their grammar completed or broke). The split and fused ways pay
a host round trip and a dispatch of a one-step program per token, which on a GPU is the launch of
every kernel of a forward. Here the device waits only for the call, but on the H200 a call cost
2.5-3.6 ms against ~0.05 ms of host work a row, so this way beat split only on the MoE shape at
batch 1 and is not the default (docs/structured_output.md).

A `MaskFeed` holds one dispatch's rows. The program finds it by the integer id it was given as an
argument (the compiled program is shared by every engine and dispatch; the callback is this
module's `host_mask_step`). Every token the device samples is followed here, so when the host
reads the dispatch back the constraints are already where the tokens left them: `outcome` says
what each row kept and how its constraint ended.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence

import numpy as np

from infernix_jax.engine.constrained import FAILED, OK, ConstrainedOutput, allow_all

_FEEDS: dict[int, MaskFeed] = {}
_IDS = itertools.count(1)
_LOCK = threading.Lock()


class MaskFeed:
    """The host side of one masked multi-step decode dispatch (rows without a constraint: None)."""

    def __init__(self, outputs: Sequence[ConstrainedOutput | None], batch: int, words: int):
        self.outputs = list(outputs) + [None] * (batch - len(outputs))
        self.batch, self.words = batch, words
        self.statuses = [OK] * batch
        self.halted = np.zeros(batch, bool)  # the host stopped the row (its grammar ended or broke)
        self.host_s = 0.0  # time spent in host_mask_step (the device waits for it)
        with _LOCK:
            self.id = next(_IDS) % (2**31 - 1)
            _FEEDS[self.id] = self

    def masks(self) -> np.ndarray:
        """int32 [b, words]: each row's mask for the token after the ones followed so far."""
        mask = allow_all(self.batch, self.words)
        for i, output in enumerate(self.outputs):
            if output is not None and not self.halted[i]:
                output.fill_mask(mask[i])
        return mask

    def step(self, tokens: np.ndarray, active: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Follow the tokens the active rows just sampled; return (the next masks, bool [b]: rows to
        stop now). A row whose grammar completes stops after its end token; a token the grammar
        refuses (never under its mask; kept for safety) stops the row and is dropped."""
        start = time.perf_counter()
        for i in np.flatnonzero(active):
            output = self.outputs[i]
            if output is None or self.halted[i]:
                continue
            try:
                status = output.advance(int(tokens[i]))
            except Exception as exc:  # noqa: BLE001 - a matcher error fails its row, not the dispatch
                output.error = f"the constraint failed: {exc}"
                status = FAILED
            if status != OK:
                self.statuses[i] = status
                self.halted[i] = True
        mask = self.masks()
        self.host_s += time.perf_counter() - start
        return mask, self.halted.copy()

    def outcome(self, row: int, count: int) -> tuple[str, int]:
        """(constraint status, tokens to keep) of a row that generated `count` tokens."""
        status = self.statuses[row]
        return status, count - 1 if status == FAILED else count

    def close(self) -> None:
        """Forget the feed (after its dispatch was read back)."""
        with _LOCK:
            _FEEDS.pop(self.id, None)


def host_mask_step(
    feed_id: np.ndarray, tokens: np.ndarray, active: np.ndarray, *, words: int
) -> tuple[np.ndarray, np.ndarray]:
    """The decode program's host callback: (int32 [b, words] masks, bool [b] rows to stop)."""
    feed = _FEEDS.get(int(feed_id))
    if feed is None:  # the dispatch's feed was closed (the dispatch failed and was given up): stop
        return allow_all(len(active), words), np.ones(len(active), bool)
    return feed.step(np.asarray(tokens), np.asarray(active))
