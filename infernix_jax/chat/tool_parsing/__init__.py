"""Tool-call parsing for Qwen chat output (Qwen3-Coder XML and Hermes JSON forms).

Public interface:
- `parse_tool_calls(text, tools, parser, tolerant)` -> `ParsedOutput` (whole output)
- `StreamingToolCallParser(tools, parser, tolerant).feed(delta)` / `.finish()` -> events
- `detect_tool_parser(chat_template_text)` -> "qwen3_coder" | "hermes"
- `parse_chat_output` / `StreamingChatOutputParser`: reasoning split + tool calls together
See docs/tool_calls.md for the rules.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from infernix_jax.chat.tool_parsing.blocks import HERMES, PARSER_NAMES, QWEN3_CODER
from infernix_jax.chat.tool_parsing.detect import detect_tool_parser
from infernix_jax.chat.tool_parsing.streaming import StreamingToolCallParser
from infernix_jax.chat.tool_parsing.types import (
    ContentDelta,
    Event,
    IdFactory,
    ParsedOutput,
    ReasoningDelta,
    ToolCall,
    ToolCallDelta,
    collect_events,
    random_call_id,
)


def parse_tool_calls(
    text: str,
    tools: Sequence[Mapping[str, Any]] | None,
    parser: str = QWEN3_CODER,
    tolerant: bool = False,
    id_factory: IdFactory | None = None,
) -> ParsedOutput:
    """Splits a complete answer (reasoning already removed) into content and tool calls.

    Same rules as `StreamingToolCallParser`, which it runs over the whole text; `reasoning` of
    the result is always None.
    """
    streaming = StreamingToolCallParser(tools, parser=parser, tolerant=tolerant, id_factory=id_factory)
    return collect_events([*streaming.feed(text), *streaming.finish()])


__all__ = [
    "HERMES",
    "PARSER_NAMES",
    "QWEN3_CODER",
    "ContentDelta",
    "Event",
    "IdFactory",
    "ParsedOutput",
    "ReasoningDelta",
    "StreamingToolCallParser",
    "ToolCall",
    "ToolCallDelta",
    "collect_events",
    "detect_tool_parser",
    "parse_tool_calls",
    "random_call_id",
]
