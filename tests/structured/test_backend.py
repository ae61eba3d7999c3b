"""The llguidance backend: every constraint kind compiles, masks and matches; bad specs say why."""

from __future__ import annotations

import json

import numpy as np
import pytest

from infernix_jax.structured import ConstraintError, ConstraintSpec
from infernix_jax.structured.tool_calls import tool_call_grammar

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome"]},
                "days": {"type": "integer"},
            },
            "required": ["city"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    },
}


def accepts(backend, tokenizer, spec: ConstraintSpec, text: str) -> bool:
    """True when the grammar takes every token of text and then the end of sequence."""
    matcher = backend.compile(spec).new_matcher()
    ids = tokenizer.encode(text) + [tokenizer.eos_token_ids[0]]
    return all(matcher.consume(t) for t in ids) and matcher.finished


def allowed(matcher) -> set[int]:
    row = np.zeros(matcher.mask_words, np.int32)
    matcher.fill_mask(row)
    bits = np.unpackbits(row.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


@pytest.mark.parametrize(
    ("spec", "good", "bad"),
    [
        (ConstraintSpec.json_object(), '{"a": [1, 2], "b": null}', "[1, 2]"),
        (
            ConstraintSpec.json_schema(
                {"type": "object", "properties": {"n": {"type": "integer", "maximum": 5}}}
            ),
            '{"n": 5}',
            '{"n": 6}',
        ),
        (ConstraintSpec.regex(r"[a-c]{2}\d"), "ab7", "ab"),
        (ConstraintSpec.choice(["yes", "no"]), "no", "maybe"),
        (ConstraintSpec.grammar('root ::= "(" [0-9]+ ")"'), "(42)", "(4"),
        (ConstraintSpec.grammar('start: "x" NUM\nNUM: /[0-9]+/'), "x12", "y12"),
    ],
)
def test_each_kind_accepts_what_it_describes_and_nothing_else(backend, qwen3_tokenizer, spec, good, bad):
    assert accepts(backend, qwen3_tokenizer, spec, good)
    assert not accepts(backend, qwen3_tokenizer, spec, bad)


def test_json_is_compact_with_single_spaces(backend, qwen3_tokenizer):
    spec = ConstraintSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    assert accepts(backend, qwen3_tokenizer, spec, '{"a": 1}')
    assert not accepts(backend, qwen3_tokenizer, spec, '{ "a": 1}')
    assert not accepts(backend, qwen3_tokenizer, spec, '{"a":1}')


def test_compiled_grammars_are_cached_by_content(backend):
    first = backend.compile(ConstraintSpec.json_schema({"type": "array", "maxItems": 3}))
    again = backend.compile(ConstraintSpec.json_schema('{"type": "array", "maxItems": 3}'))
    assert first is again
    assert backend.compile(ConstraintSpec.regex("a+")) is not backend.compile(ConstraintSpec.regex("a*"))


def test_matchers_of_one_grammar_are_independent(backend, qwen3_tokenizer):
    grammar = backend.compile(ConstraintSpec.choice(["alpha", "beta"]))
    one, two = grammar.new_matcher(), grammar.new_matcher()
    assert one.consume(qwen3_tokenizer.encode("alpha")[0])
    assert allowed(two) != allowed(one)


def test_mask_allows_only_the_end_once_complete(backend, qwen3_tokenizer):
    matcher = backend.compile(ConstraintSpec.choice(["ok"])).new_matcher()
    assert all(matcher.consume(t) for t in qwen3_tokenizer.encode("ok"))
    assert allowed(matcher) <= set(qwen3_tokenizer.eos_token_ids) and allowed(matcher)
    assert not matcher.finished
    assert matcher.consume(qwen3_tokenizer.eos_token_ids[0]) and matcher.finished


def test_a_refused_token_puts_the_matcher_in_error(backend, qwen3_tokenizer):
    matcher = backend.compile(ConstraintSpec.regex("[0-9]+")).new_matcher()
    assert not matcher.consume(qwen3_tokenizer.encode("x")[0])
    assert matcher.error


def test_consume_allowed_stops_before_a_refused_token_and_the_matcher_stays_usable(backend, qwen3_tokenizer):
    # The check way follows a dispatch's free samples this way; the refused one is then replaced
    # by a masked sample, so the matcher must still give masks.
    eos = qwen3_tokenizer.eos_token_ids[0]
    digits = backend.compile(ConstraintSpec.regex("[0-9]+")).new_matcher()
    ids = qwen3_tokenizer.encode("12x3")
    refused = ids.index(qwen3_tokenizer.encode("x")[0])
    assert digits.consume_allowed(ids) == refused and digits.error is None and not digits.finished
    assert allowed(digits) and digits.consume_allowed([eos, 5]) == 1 and digits.finished
    # a grammar with nothing left to match (llguidance's try_consume_tokens stops before its end
    # token there, though the mask allows it): the end token is taken, what follows is not
    done = backend.compile(ConstraintSpec.choice(["ok"])).new_matcher()
    ok = qwen3_tokenizer.encode("ok")
    assert done.consume_allowed([*ok, eos, *ok]) == len(ok) + 1 and done.finished


def test_rollback_undoes_consumed_tokens(backend, qwen3_tokenizer):
    matcher = backend.compile(ConstraintSpec.choice(["red", "blue"])).new_matcher()
    start = allowed(matcher)
    ids = qwen3_tokenizer.encode("blue")
    assert all(matcher.consume(t) for t in ids)
    matcher.rollback(len(ids))
    assert allowed(matcher) == start


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        (ConstraintSpec.regex("a(b"), "unclosed group"),
        (ConstraintSpec.json_schema({"type": "nope"}), "nope"),
        (ConstraintSpec.grammar("root ::= ("), "GBNF"),
        (ConstraintSpec.grammar("start: undefined_rule"), "undefined_rule"),
    ],
)
def test_invalid_specs_fail_with_the_library_reason(backend, spec, reason):
    with pytest.raises(ConstraintError, match=reason):
        backend.compile(spec)


@pytest.mark.parametrize("bad", [lambda: ConstraintSpec.choice([]), lambda: ConstraintSpec.json_schema("{")])
def test_malformed_specs_are_refused_before_compiling(bad):
    with pytest.raises(ConstraintError):
        bad()


def test_forced_call_grammar_accepts_valid_calls_only(backend, qwen3_tokenizer):
    any_call = tool_call_grammar([WEATHER, ADD], None, parallel=True)
    first = json.dumps({"name": "add", "arguments": {"a": 3}})
    second = json.dumps({"name": "get_weather", "arguments": {"city": "Rome"}})
    assert accepts(backend, qwen3_tokenizer, any_call, f"{first}\n</tool_call>")
    assert accepts(
        backend, qwen3_tokenizer, any_call, f"{first}\n</tool_call>\n<tool_call>\n{second}\n</tool_call>"
    )
    wrong_args = json.dumps({"name": "get_weather", "arguments": {"city": "Oslo"}})
    assert not accepts(backend, qwen3_tokenizer, any_call, f"{wrong_args}\n</tool_call>")
    unknown = json.dumps({"name": "nope", "arguments": {}})
    assert not accepts(backend, qwen3_tokenizer, any_call, f"{unknown}\n</tool_call>")
    single = tool_call_grammar([WEATHER, ADD], None, parallel=False)
    assert not accepts(
        backend, qwen3_tokenizer, single, f"{first}\n</tool_call>\n<tool_call>\n{second}\n</tool_call>"
    )


def test_named_call_grammar_continues_after_the_arguments_key(backend, qwen3_tokenizer):
    named = tool_call_grammar([WEATHER, ADD], "get_weather", parallel=True)
    assert accepts(backend, qwen3_tokenizer, named, '{"city": "Paris", "days": 2}}\n</tool_call>')
    assert not accepts(backend, qwen3_tokenizer, named, '{"a": 2}}\n</tool_call>')
