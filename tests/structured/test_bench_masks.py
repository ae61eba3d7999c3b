"""bench.structured's mask timing runs on the CPU and its sample outputs match their own schemas."""

from __future__ import annotations

import json

import jsonschema

from bench.structured import MASK_CASES, own_token_grammars, time_masks


def test_mask_timing_walks_valid_outputs_of_every_case(backend, qwen3_tokenizer):
    results = time_masks(backend, qwen3_tokenizer, repeats=1)
    assert set(results) == set(MASK_CASES)
    for name, (schema, text) in MASK_CASES.items():
        if schema is not None:
            jsonschema.validate(json.loads(text), schema)
        assert results[name]["tokens"] == len(qwen3_tokenizer.encode(text)) + 1
        assert 0 < results[name]["us_per_token"] < 1e5


def test_own_token_grammars_allow_exactly_each_rows_tokens(backend):
    # `--workload own`: each row's grammar is the tokens it sampled free, special tokens and
    # bytes that are no text of their own included, so a row that samples them again keeps them all.
    rows = [[9707, 11, 1879, 151643, 220], [151667, 33, 33, 198]]
    grammars = own_token_grammars(backend, rows)
    for row, constraint in zip(rows, grammars):
        matcher = constraint.grammar.new_matcher()
        assert all(matcher.consume(token) for token in row)
    other = grammars[0].grammar.new_matcher()
    assert other.consume(rows[0][0]) and not other.consume(rows[1][1])
