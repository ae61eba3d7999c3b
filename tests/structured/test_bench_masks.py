"""bench.structured's mask timing runs on the CPU and its sample outputs match their own schemas."""

from __future__ import annotations

import json

import jsonschema

from bench.structured import MASK_CASES, time_masks


def test_mask_timing_walks_valid_outputs_of_every_case(backend, qwen3_tokenizer):
    results = time_masks(backend, qwen3_tokenizer, repeats=1)
    assert set(results) == set(MASK_CASES)
    for name, (schema, text) in MASK_CASES.items():
        if schema is not None:
            jsonschema.validate(json.loads(text), schema)
        assert results[name]["tokens"] == len(qwen3_tokenizer.encode(text)) + 1
        assert 0 < results[name]["us_per_token"] < 1e5
