"""Tool-call parsing: the corpus of real-world outputs, streaming vs. whole-text, and the API.

The corpus (tool_call_corpus.json) holds well-formed, broken and tricky model outputs with the
content, reasoning and calls a user must get in strict and tolerant mode. Every case is parsed
whole and streamed in random chunkings; both must give the expected result.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from infernix_jax.chat.tool_parsing import (
    ContentDelta,
    ParsedOutput,
    StreamingToolCallParser,
    ToolCallDelta,
    collect_events,
    detect_tool_parser,
    parse_tool_calls,
)
from infernix_jax.chat.tool_parsing.chat_output import StreamingChatOutputParser, parse_chat_output
from tests.chat.qwen3_files import qwen3_tokenizer_dir

CORPUS = json.loads((Path(__file__).parent / "tool_call_corpus.json").read_text())
CASES = {case["id"]: case for case in CORPUS["cases"]}
MODES = ("strict", "tolerant")


def _parse_whole(case: dict, tolerant: bool) -> ParsedOutput:
    tools = CORPUS["tools"][case["tools"]]
    if "starts_in_thinking" in case:
        return parse_chat_output(
            case["text"],
            tools,
            case["parser"],
            tolerant=tolerant,
            starts_in_thinking=case["starts_in_thinking"],
        )
    return parse_tool_calls(case["text"], tools, parser=case["parser"], tolerant=tolerant)


def _stream(case: dict, tolerant: bool, pieces: list[str]) -> list:
    tools = CORPUS["tools"][case["tools"]]
    if "starts_in_thinking" in case:
        parser = StreamingChatOutputParser(
            tools, case["parser"], tolerant=tolerant, starts_in_thinking=case["starts_in_thinking"]
        )
    else:
        parser = StreamingToolCallParser(tools, parser=case["parser"], tolerant=tolerant)
    events = []
    for piece in pieces:
        events.extend(parser.feed(piece))
    events.extend(parser.finish())
    return events


def _random_pieces(text: str, rng: random.Random, max_len: int) -> list[str]:
    pieces, pos = [], 0
    while pos < len(text):
        size = rng.randint(1, max_len)
        pieces.append(text[pos : pos + size])
        pos += size
    return pieces


def _summary(parsed: ParsedOutput) -> dict:
    calls = []
    for call in parsed.tool_calls:
        arguments = json.loads(call.arguments)
        assert isinstance(arguments, dict), call.arguments
        calls.append({"name": call.name, "arguments": arguments})
    return {"content": parsed.content, "reasoning": parsed.reasoning, "calls": calls}


def _check_delta_shapes(events: list) -> None:
    """OpenAI streaming shape: per call, one first delta with id + name + "", then fragments."""
    seen: list[int] = []
    for event in events:
        if not isinstance(event, ToolCallDelta):
            continue
        if event.index not in seen:
            assert event.index == len(seen), "calls are numbered 0, 1, ... in order"
            assert event.id and event.name and event.arguments == ""
            seen.append(event.index)
        else:
            assert event.index == seen[-1], "a call's fragments come before the next call"
            assert event.id is None and event.name is None


def test_corpus_is_large_and_covers_both_formats_and_modes():
    assert len(CASES) >= 40
    assert {case["parser"] for case in CASES.values()} == {"qwen3_coder", "hermes"}
    differing = [case for case in CASES.values() if "tolerant" in case and case["tolerant"] != case["strict"]]
    assert len(differing) >= 15


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case_id", sorted(CASES))
def test_corpus_whole_text(case_id: str, mode: str):
    case = CASES[case_id]
    expected = case.get(mode, case["strict"])
    assert _summary(_parse_whole(case, tolerant=mode == "tolerant")) == expected


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case_id", sorted(CASES))
def test_corpus_streaming_matches_whole_text(case_id: str, mode: str):
    case = CASES[case_id]
    tolerant = mode == "tolerant"
    whole = _summary(_parse_whole(case, tolerant))
    rng = random.Random(f"{case_id}/{mode}")
    chunkings = [list(case["text"])] + [_random_pieces(case["text"], rng, n) for n in (2, 4, 9, 17)]
    for pieces in chunkings:
        events = _stream(case, tolerant, pieces)
        _check_delta_shapes(events)
        assert all(event.text for event in events if isinstance(event, ContentDelta))
        assert _summary(collect_events(events)) == whole, pieces


def test_partial_tag_is_held_back_until_decided():
    parser = StreamingToolCallParser(None, parser="qwen3_coder")
    assert parser.feed("Let me check <tool_") == [ContentDelta("Let me check")]
    assert parser.feed("ca") == []
    events = parser.feed("ll>\n<function=ls>\n</function>\n</tool_call>")
    assert [type(e) for e in events] == [ToolCallDelta, ToolCallDelta]
    assert events[0].name == "ls" and json.loads(events[1].arguments) == {}


def test_text_that_stops_being_a_tag_is_released():
    parser = StreamingToolCallParser(None, parser="hermes")
    assert parser.feed("a <tool") == [ContentDelta("a")]
    assert "".join(e.text for e in parser.feed("bar> b")) == " <toolbar> b"


def test_no_tool_list_accepts_any_name_and_keeps_raw_strings():
    text = "<tool_call>\n<function=anything>\n<parameter=n>\n5\n</parameter>\n</function>\n</tool_call>"
    parsed = parse_tool_calls(text, None)
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("anything", {"n": "5"})]


def test_empty_tool_list_makes_every_call_text():
    text = "<tool_call>\n<function=anything>\n</function>\n</tool_call>"
    assert parse_tool_calls(text, []).tool_calls == []
    assert parse_tool_calls(text, []).content == text


def test_anthropic_tool_shape_types_values():
    tools = [
        {"name": "sleep", "input_schema": {"type": "object", "properties": {"seconds": {"type": "integer"}}}}
    ]
    text = "<tool_call>\n<function=sleep>\n<parameter=seconds>\n3\n</parameter>\n</function>\n</tool_call>"
    assert json.loads(parse_tool_calls(text, tools).tool_calls[0].arguments) == {"seconds": 3}


def test_id_factory_names_calls():
    text = '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call><tool_call>\n{"name": "b", "arguments": {}}\n</tool_call>'
    parsed = parse_tool_calls(text, None, parser="hermes", id_factory=lambda i: f"toolu_{i}")
    assert [c.id for c in parsed.tool_calls] == ["toolu_0", "toolu_1"]


def test_default_ids_are_unique_openai_style():
    text = '<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>' * 2
    ids = [c.id for c in parse_tool_calls(text, None, parser="hermes").tool_calls]
    assert len(set(ids)) == 2 and all(i.startswith("call_") and len(i) == 29 for i in ids)


def test_non_ascii_arguments_stay_readable():
    text = (
        "<tool_call>\n<function=say>\n<parameter=text>\nHéllo 世界\n</parameter>\n</function>\n</tool_call>"
    )
    assert parse_tool_calls(text, None).tool_calls[0].arguments == '{"text": "Héllo 世界"}'


def test_unknown_parser_name_is_rejected():
    with pytest.raises(ValueError, match="unknown tool-call parser"):
        StreamingToolCallParser(None, parser="mistral")


def test_feed_after_finish_is_an_error():
    parser = StreamingToolCallParser(None)
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("x")


def test_chat_output_without_tool_parsing_passes_tags_through():
    text = "<tool_call>\n<function=a>\n</function>\n</tool_call>"
    parsed = parse_chat_output(text, None, parser=None)
    assert parsed.content == text and parsed.tool_calls == []


def test_long_streamed_call_is_linear_enough():
    body = "x = 1\n" * 20000
    text = f"<tool_call>\n<function=write_file>\n<parameter=content>\n{body}\n</parameter>\n</function>\n</tool_call>"
    for tolerant in (False, True):
        parser = StreamingToolCallParser(None, tolerant=tolerant)
        events = []
        for start in range(0, len(text), 3):
            events.extend(parser.feed(text[start : start + 3]))
        events.extend(parser.finish())
        assert json.loads(collect_events(events).tool_calls[0].arguments)["content"] == body


def test_detect_xml_template():
    template = (
        "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}"
        "{{- '<parameter=' + args_name + '>\\n' }}{{- args_value }}{{- '\\n</parameter>\\n' }}"
    )
    assert detect_tool_parser(template) == "qwen3_coder"


def test_detect_hermes_from_real_qwen3_template():
    config = qwen3_tokenizer_dir() / "tokenizer_config.json"
    template = json.loads(config.read_text())["chat_template"]
    assert detect_tool_parser(template) == "hermes"


def test_detect_rejects_template_without_tools():
    with pytest.raises(ValueError, match="--tool-call-parser"):
        detect_tool_parser("{% for m in messages %}<|im_start|>{{ m.role }}{% endfor %}")


FUZZ_PIECES = [
    "<tool_call>",
    "</tool_call>",
    "\n",
    "<function=read_file>",
    "<function=",
    "</function>",
    "<parameter=path>",
    "</parameter>",
    "<parameter=limit>\n5\n",
    "x",
    "`",
    "```",
    "{",
    "}",
    "[",
    "]",
    '"name": "read_file"',
    '"arguments": {',
    "'",
    ",",
    " ",
    "<",
    "<tool_",
    "</think>",
    "<think>",
    "\\",
    '"',
    "read_file>",
    "ab c",
    "\n\n",
]


@pytest.mark.parametrize("seed", range(4))
def test_random_tag_soup_streams_like_whole_text(seed: int):
    """Any output, however garbled, gives the same result for every chunking."""
    rng = random.Random(seed)
    tools = CORPUS["tools"]["coding"]
    for _ in range(150):
        text = "".join(rng.choice(FUZZ_PIECES) for _ in range(rng.randint(1, 25)))
        options = {
            "tools": tools,
            "parser": rng.choice(["qwen3_coder", "hermes"]),
            "tolerant": rng.random() < 0.5,
            "starts_in_thinking": rng.choice([None, True, False]),
        }
        whole = _summary(parse_chat_output(text, **options))
        for max_len in (1, 3, 6):
            parser = StreamingChatOutputParser(**options)
            events = [e for piece in _random_pieces(text, rng, max_len) for e in parser.feed(piece)]
            events += parser.finish()
            assert _summary(collect_events(events)) == whole, (text, options)


@pytest.mark.parametrize("parser", ["qwen3_coder", "hermes"])
@pytest.mark.parametrize("tolerant", [False, True])
def test_deeply_nested_garbage_stays_text(parser: str, tolerant: bool):
    deep = "[" * 50000
    texts = [
        f"<tool_call>\n{deep}\n</tool_call>",
        f'<tool_call>\n{{"name": "search", "arguments": {{"pattern": "a", "paths": {deep}}}}}\n</tool_call>',
        f"<tool_call>\n<function=search>\n<parameter=paths>\n{deep}\n</parameter>\n</function>\n</tool_call>",
    ]
    for text in texts:
        parsed = parse_tool_calls(text, CORPUS["tools"]["coding"], parser=parser, tolerant=tolerant)
        if parsed.tool_calls:  # a call survives only with the garbage kept as a string value
            assert json.loads(parsed.tool_calls[0].arguments)["paths"] == deep
        else:
            assert parsed.content == text
