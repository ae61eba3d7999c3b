"""The speculative decoding benchmark's replay: the accepted length it measures on a model shape is
the one it was asked to replay, and the record shows the plain and verify step times.

One quick run of the tiny shape in bfloat16 (the GPU's dtype; with plain random bf16 weights the
verify forward picks other greedy tokens than decode, and the replay measured far less than asked),
batch 1, replaying two accepted lengths, run once for the module.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.engine_setup import build_model
from bench.record import read_records
from bench.speculative import decisive_params, main

TARGETS = (1.5, 3.0)


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    out = tmp_path_factory.mktemp("speculative") / "speculative.json"
    main(["--quick", "--batches", "1", "--dtype", "bfloat16", "--out", str(out),
          "--accepted-length", ",".join(str(t) for t in TARGETS)])  # fmt: skip
    return read_records(out)


def test_the_measured_accepted_length_follows_the_replayed_target(records):
    assert [r["details"]["target_accepted_length"] for r in records] == list(TARGETS)
    for record in records:
        details = record["details"]
        assert details["params_dtype"] == "bfloat16"
        assert details["replay_continuation_decisive"] == 1.0
        assert details["measured_accepted_length"] == pytest.approx(
            details["target_accepted_length"], rel=0.05
        )


def test_the_record_shows_the_plain_and_verify_step_times_beside_the_speedup(records):
    for record in records:
        d = record["details"]
        assert record["figure"] == pytest.approx(d["speedup"] * d["plain_tok_s"])
        assert record["ceiling"] == pytest.approx(d["plain_tok_s"] * d["target_accepted_length"])
        assert d["plain_step_ms"] == pytest.approx(d["plain_dispatch_ms"] / d["plain_steps_per_dispatch"])
        assert d["verify_step_ms"] > 0 and d["verify_dispatches"] > 0
        # One verify step yields the accepted length per row: its cost per token is the step over it.
        per_step = d["timed_tokens_per_row_per_verify_step"]
        assert d["verify_ms_per_row_token"] == pytest.approx(d["verify_step_ms"] / per_step)
        assert d["verify_step_in_plain_steps"] == pytest.approx(d["verify_step_ms"] / d["plain_step_ms"])
        # Batch 1: the speculative tok/s is one row's tokens over the verify time.
        assert record["figure"] == pytest.approx(1e3 / d["verify_ms_per_row_token"])


def test_decisive_weights_keep_shapes_and_dtypes_and_make_the_current_token_win_by_far():
    cfg, params = build_model("tiny", jnp.bfloat16)
    decisive = decisive_params(params)
    shapes = [[(x.shape, x.dtype) for x in jax.tree_util.tree_leaves(p)] for p in (params, decisive)]
    assert shapes[0] == shapes[1]  # the same reads per decode step
    # The output embedding is the scaled input embedding, so a hidden state along a token's
    # embedding (what the final norm gives when the embedding dominates the residual) scores that
    # token far above any other.
    table = np.asarray(decisive.output_embedding, np.float32)
    assert table.shape[0] == cfg.vocab_size
    rows = table[:64]
    logits = (rows / np.sqrt(np.mean(rows**2, axis=1, keepdims=True))) @ table.T
    runner_up, top = np.sort(logits, axis=1)[:, -2:].T
    assert (logits.argmax(axis=1) == np.arange(64)).all()
    assert (top - runner_up > 0.5 * top).all()
