"""Constrained decoding composed with speculative decoding (linear windows, also for a tree
drafter's constrained batches): the grammar cuts the drafts it refuses and masks every window
position, so greedy output equals constrained decoding without speculation token for token,
sampled output is valid, and the matcher is left where it was."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from infernix_jax.engine.constrained import ConstrainedOutput, allow_all
from infernix_jax.engine.protocol import FINISH_LENGTH, FINISH_STOP, GenerationRequest, SamplingParams
from infernix_jax.structured import ConstraintSpec, RequestConstraint
from tests.structured.run import generate, sampled_requests

SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "count": {"type": "integer", "minimum": 0}},
    "required": ["name", "count"],
    "additionalProperties": False,
}
EXAMPLE = '{"name": "lamp", "count": 3}'


@pytest.fixture(scope="module")
def spec_llm(tiny_model_dir):
    from infernix_jax.engine.llm import LLM
    from tests.structured.tiny_model import ENGINE_OPTIONS

    # one small decode bucket: the verify program over the 151k vocabulary is the costly compile
    options = {**ENGINE_OPTIONS, "max_concurrency": 4, "decode_batch_sizes": (4,)}
    return LLM(tiny_model_dir, **options, spec="ngram", ngram_draft_tokens=4)


@pytest.fixture(scope="module")
def prompt(qwen3_tokenizer) -> list[int]:
    """A prompt that quotes a valid answer, so prompt-lookup drafts exist and some obey the grammar."""
    return qwen3_tokenizer.encode(f"Reply with JSON like {EXAMPLE} or {EXAMPLE}.")


def test_window_masks_cut_refused_drafts_and_restore_the_matcher(backend, qwen3_tokenizer):
    spec = ConstraintSpec.regex(r"ab[0-9]{2}z")
    out = ConstrainedOutput(RequestConstraint(backend.compile(spec)), SamplingParams())
    words = out.matcher.mask_words
    encode = qwen3_tokenizer.encode
    good, bad = encode("ab")[0], encode("q")[0]
    before = allow_all(1, words)[0]
    out.fill_mask(before)
    rows = allow_all(4, words)
    kept = out.fill_window_masks([good, bad, good], rows)
    assert kept == 1
    np.testing.assert_array_equal(rows[0], before)  # position 0: the grammar as it is
    assert out.advance(good) == "ok"  # the matcher was rolled back: "ab" is accepted again
    after = allow_all(1, words)[0]
    out.fill_mask(after)
    np.testing.assert_array_equal(rows[1], after)  # position 1: the grammar after the kept draft


def test_greedy_with_speculation_equals_greedy_without(llm, spec_llm, backend, prompt):
    grammar = RequestConstraint(backend.compile(ConstraintSpec.json_schema(SCHEMA)))

    def requests():
        return [
            GenerationRequest(f"g{i}", prompt[i:], SamplingParams(max_tokens=40), constraint=grammar)
            for i in range(3)
        ]

    plain = generate(llm.core, requests())
    before = spec_llm.core.metrics.drafted_tokens
    speculative = generate(spec_llm.core, requests())
    assert spec_llm.core.metrics.drafted_tokens > before, "no drafts were verified"
    for rid, output in plain.items():
        assert speculative[rid].token_ids == output.token_ids, rid
        assert speculative[rid].finish_reason == output.finish_reason


def test_a_tree_drafter_verifies_constrained_batches_in_linear_windows(llm, tiny_model_dir, backend, prompt):
    from infernix_jax.engine.llm import LLM
    from tests.structured.tiny_model import ENGINE_OPTIONS

    options = {**ENGINE_OPTIONS, "max_concurrency": 4, "decode_batch_sizes": (4,)}
    tree_llm = LLM(tiny_model_dir, **options, spec="ngram", ngram_draft_tokens=4, spec_tree_width=2)
    grammar = RequestConstraint(backend.compile(ConstraintSpec.json_schema(SCHEMA)))

    def requests(free: bool):  # constrained rows, and a free one batched with them
        constrained = [
            GenerationRequest(f"t{i}", prompt[i:], SamplingParams(max_tokens=30), constraint=grammar)
            for i in range(2)
        ]
        return constrained + [GenerationRequest("free", prompt, SamplingParams(max_tokens=30))] * free

    for free in (False, True):
        plain = generate(llm.core, requests(free))
        drafted = tree_llm.core.metrics.drafted_tokens
        speculative = generate(tree_llm.core, requests(free))
        assert tree_llm.core.metrics.drafted_tokens > drafted, "constrained batches were not speculated"
        for rid, output in plain.items():
            assert speculative[rid].token_ids == output.token_ids, rid


def test_sampled_output_with_speculation_is_valid_json(spec_llm, backend, prompt):
    grammar = RequestConstraint(backend.compile(ConstraintSpec.json_schema(SCHEMA)))
    metrics = spec_llm.core.metrics
    drafted, accepted = metrics.drafted_tokens, metrics.accepted_tokens
    outputs = generate(spec_llm.core, sampled_requests("s", prompt, grammar, 12, max_tokens=40))
    completed = 0
    for output in outputs.values():
        assert output.finish_reason in (FINISH_STOP, FINISH_LENGTH), output.error
        if output.finish_reason == FINISH_STOP:
            jsonschema.validate(json.loads(output.text), SCHEMA)
            completed += 1
    assert completed >= 1  # a random model writes long strings: many samples end on max_tokens
    assert metrics.drafted_tokens > drafted and metrics.accepted_tokens > accepted


def test_tokens_the_grammar_forces_are_drafted_and_verified_in_windows(spec_llm, backend, prompt):
    # Qwen3 writes each digit as its own token, so this regex allows exactly one token at every step:
    # all of it is forced. Forced tokens go into the verify window as drafts: the 10 digits and the
    # end come out of the prefill's sample plus two windows of 5, not one token per round trip.
    grammar = RequestConstraint(backend.compile(ConstraintSpec.regex("1234567890")))
    metrics = spec_llm.core.metrics
    dispatches, forced = metrics.spec_dispatches, metrics.forced_draft_tokens
    outputs = generate(
        spec_llm.core,
        [
            GenerationRequest(
                "digits", prompt, SamplingParams(max_tokens=20, temperature=1.0, seed=1), constraint=grammar
            )
        ],
    )
    assert outputs["digits"].text == "1234567890" and outputs["digits"].finish_reason == FINISH_STOP
    assert metrics.forced_draft_tokens - forced >= 8
    assert metrics.spec_dispatches - dispatches <= 3


def test_forced_drafts_follow_the_grammar_and_leave_the_matcher_where_it_was(backend, qwen3_tokenizer):
    spec = ConstraintSpec.json_schema(SCHEMA)
    out = ConstrainedOutput(RequestConstraint(backend.compile(spec)), SamplingParams())
    forced = out.forced_drafts(16)
    assert qwen3_tokenizer.decode(forced).startswith('{"name')  # the object and its first key
    assert out.forced_drafts(2) == forced[:2]
    for token in forced:
        assert out.advance(token) == "ok"
    assert out.forced_drafts(16)[:1] != forced[:1]  # it moved on with the consumed tokens
