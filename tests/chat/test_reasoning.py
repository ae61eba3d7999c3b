"""Reasoning split: `<think>` handling, implicit end at a tool call, streaming == whole text."""

from __future__ import annotations

import random

import pytest

from infernix_jax.chat.reasoning import StreamingReasoningParser, prompt_starts_in_thinking, split_reasoning
from infernix_jax.chat.tool_parsing import ContentDelta, ReasoningDelta

# (text, starts_in_thinking, tolerant, expected reasoning, expected content)
CASES = [
    ("Plan: add them.\n</think>\n\n4", True, False, "Plan: add them.\n", "4"),
    ("Just an answer.", False, False, None, "Just an answer."),
    ("<think>\nhmm\n</think>\n\nok", False, False, "\nhmm\n", "ok"),
    ("  \n<think>x</think>y", False, False, "x", "y"),
    ("<think>x</think>y", True, False, "x", "y"),
    ("cut off while thinking", True, False, "cut off while thinking", ""),
    ("</think>\n\nno reasoning", True, False, None, "no reasoning"),
    (
        "I will call.\n<tool_call>\n<function=f>\n</function>\n</tool_call>",
        True,
        False,
        "I will call.\n",
        "<tool_call>\n<function=f>\n</function>\n</tool_call>",
    ),
    (
        'Calling.\n<tool_call>\n{"name": "f"}\n</tool_call>',
        True,
        False,
        "Calling.\n",
        '<tool_call>\n{"name": "f"}\n</tool_call>',
    ),
    (
        "Tags like <tool_call> are for calls.\n</think>\nDone",
        True,
        False,
        "Tags like <tool_call> are for calls.\n",
        "Done",
    ),
    ("The tag is <tool_call>", True, False, "The tag is <tool_call>", ""),
    ("Then <function=f>\n</function>", True, False, "Then <function=f>\n</function>", ""),
    ("Then <function=f>\n</function>", True, True, "Then ", "<function=f>\n</function>"),
    ("a < b, and <thinking> is not a tag </think>c", True, False, "a < b, and <thinking> is not a tag ", "c"),
    ("text </think> more", False, False, None, "text </think> more"),
    ("", True, False, None, ""),
    ("second </think> stays: </think>", True, False, "second ", "stays: </think>"),
]


@pytest.mark.parametrize("text,starts,tolerant,reasoning,content", CASES)
def test_split_reasoning(text, starts, tolerant, reasoning, content):
    assert split_reasoning(text, starts, tolerant=tolerant) == (reasoning, content)


def _stream(text: str, starts: bool, tolerant: bool, pieces: list[str]) -> tuple[str | None, str]:
    parser = StreamingReasoningParser(starts, tolerant=tolerant)
    events = [event for piece in pieces for event in parser.feed(piece)] + parser.finish()
    assert all(event.text for event in events)
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta)) or None
    return reasoning, "".join(e.text for e in events if isinstance(e, ContentDelta))


@pytest.mark.parametrize("text,starts,tolerant,reasoning,content", CASES)
def test_streaming_matches_whole_text_for_any_chunking(text, starts, tolerant, reasoning, content):
    rng = random.Random(text)
    chunkings = [list(text)]
    for max_len in (2, 3, 5, 8):
        pieces, pos = [], 0
        while pos < len(text):
            size = rng.randint(1, max_len)
            pieces.append(text[pos : pos + size])
            pos += size
        chunkings.append(pieces)
    for pieces in chunkings:
        assert _stream(text, starts, tolerant, pieces) == (reasoning, content), pieces


def test_partial_close_tag_is_held_back():
    parser = StreamingReasoningParser(starts_in_thinking=True)
    assert parser.feed("thinking </thi") == [ReasoningDelta("thinking ")]
    assert parser.in_reasoning
    assert parser.feed("nk>\n\nAnswer") == [ContentDelta("Answer")]
    assert not parser.in_reasoning


def test_tool_call_tag_waits_for_the_function_tag():
    parser = StreamingReasoningParser(starts_in_thinking=True)
    assert parser.feed("ok <tool_call>\n") == [ReasoningDelta("ok ")]
    assert parser.feed("<func") == []
    assert parser.feed("tion=f>") == [ContentDelta("<tool_call>\n<function=f>")]


def test_tool_call_mention_is_released_as_reasoning():
    parser = StreamingReasoningParser(starts_in_thinking=True)
    assert parser.feed("use <tool_call>") == [ReasoningDelta("use ")]
    assert parser.feed(" tags") == [ReasoningDelta("<tool_call> tags")]


def test_prompt_starts_in_thinking():
    assert prompt_starts_in_thinking("<|im_start|>assistant\n<think>\n")
    assert not prompt_starts_in_thinking("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_starts_in_thinking("<|im_start|>assistant\n")
