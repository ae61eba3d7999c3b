"""Reasoning split and tool-call parsing together: what the API layer runs on model output.

Output text goes first through the reasoning parser; its answer text then goes through the
tool-call parser (when the request has tools). A call the model starts inside unclosed
thinking ends the reasoning there and is parsed as a call.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from infernix_jax.chat.reasoning import StreamingReasoningParser
from infernix_jax.chat.tool_parsing.streaming import StreamingToolCallParser
from infernix_jax.chat.tool_parsing.types import (
    ContentDelta,
    Event,
    IdFactory,
    ParsedOutput,
    collect_events,
)


class StreamingChatOutputParser:
    """`feed(delta)` / `finish()` -> `ReasoningDelta`, `ContentDelta` and `ToolCallDelta` events.

    `parser` None turns tool-call parsing off (no tools, or tool_choice "none");
    `starts_in_thinking` None turns reasoning splitting off (a model without thinking).
    """

    def __init__(
        self,
        tools: Sequence[Mapping[str, Any]] | None,
        parser: str | None,
        tolerant: bool = False,
        starts_in_thinking: bool | None = None,
        id_factory: IdFactory | None = None,
    ) -> None:
        self._reasoning = (
            StreamingReasoningParser(starts_in_thinking, tolerant=tolerant)
            if starts_in_thinking is not None
            else None
        )
        self._tools = (
            StreamingToolCallParser(tools, parser=parser, tolerant=tolerant, id_factory=id_factory)
            if parser is not None
            else None
        )

    @property
    def tool_call_count(self) -> int:
        """Calls emitted so far (the finish reason is "tool_calls" when this is positive)."""
        return self._tools.call_count if self._tools is not None else 0

    def feed(self, text: str) -> list[Event]:
        stage = self._reasoning.feed(text) if self._reasoning is not None else [ContentDelta(text)]
        return self._route(stage, final=False)

    def finish(self) -> list[Event]:
        stage = self._reasoning.finish() if self._reasoning is not None else []
        return self._route(stage, final=True)

    def _route(self, events: list[Event], final: bool) -> list[Event]:
        out: list[Event] = []
        for event in events:
            if isinstance(event, ContentDelta) and self._tools is not None:
                out.extend(self._tools.feed(event.text))
            else:
                out.append(event)
        if final and self._tools is not None:
            out.extend(self._tools.finish())
        return out


def parse_chat_output(
    text: str,
    tools: Sequence[Mapping[str, Any]] | None,
    parser: str | None,
    tolerant: bool = False,
    starts_in_thinking: bool | None = None,
    id_factory: IdFactory | None = None,
) -> ParsedOutput:
    """The whole output as content, reasoning and tool calls (see StreamingChatOutputParser)."""
    streaming = StreamingChatOutputParser(tools, parser, tolerant, starts_in_thinking, id_factory)
    return collect_events([*streaming.feed(text), *streaming.finish()])
