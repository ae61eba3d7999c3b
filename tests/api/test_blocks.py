"""BlockTracker: parser events grouped into the blocks Anthropic and Responses streams send."""

from __future__ import annotations

from infernix_jax.api.blocks import REASONING, TEXT, TOOL, BlockTracker
from infernix_jax.chat.tool_parsing.types import ContentDelta, ReasoningDelta, ToolCallDelta


def test_blocks_open_on_kind_change_and_close_at_the_end():
    tracker = BlockTracker()
    steps = tracker.feed([ReasoningDelta("think"), ContentDelta("Hi"), ContentDelta(" there")])
    steps += tracker.feed([ToolCallDelta(0, "call_1", "f", ""), ToolCallDelta(0, None, None, '{"a": 1}')])
    steps += tracker.feed([ToolCallDelta(1, "call_2", "g", ""), ToolCallDelta(1, None, None, "{}")])
    steps += tracker.close()
    assert [(b.kind, b.text) for b in tracker.blocks] == [
        (REASONING, "think"),
        (TEXT, "Hi there"),
        (TOOL, '{"a": 1}'),
        (TOOL, "{}"),
    ]
    assert [b.name for b in tracker.blocks if b.kind == TOOL] == ["f", "g"]
    assert [s.action for s in steps].count("open") == [s.action for s in steps].count("close") == 4


def test_whitespace_only_text_opens_no_block_but_is_kept_before_real_text():
    tracker = BlockTracker()
    tracker.feed([ReasoningDelta("r"), ContentDelta("\n\n"), ToolCallDelta(0, "c", "f", "{}")])
    tracker.feed([ContentDelta(" "), ContentDelta("After.")])
    tracker.close()
    assert [(b.kind, b.text) for b in tracker.blocks] == [(REASONING, "r"), (TOOL, "{}"), (TEXT, " After.")]
