"""Result and event types shared by the tool-call and reasoning parsers.

The non-streaming parsers return a `ParsedOutput`; the streaming parsers return lists of events
(`ContentDelta`, `ReasoningDelta`, `ToolCallDelta`) whose concatenation rebuilds that same
`ParsedOutput` (see `collect_events`). The API layer maps these events onto each protocol's own
stream shape (OpenAI chunks, Responses events, Anthropic content-block deltas).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

# Makes the id of the tool call with the given index (0, 1, ... within one response).
IdFactory = Callable[[int], str]


def random_call_id(index: int) -> str:
    """An OpenAI-style tool-call id, `call_` followed by 24 random hex digits."""
    del index
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    """One parsed tool call.

    `arguments` is always the JSON text of an object (as OpenAI's `function.arguments`), with
    values typed by the tool's JSON schema.
    """

    id: str
    name: str
    arguments: str


@dataclass
class ParsedOutput:
    """A whole model output split into visible text, reasoning and tool calls."""

    content: str
    # None when the output had no reasoning text at all.
    reasoning: str | None
    tool_calls: list[ToolCall] = field(default_factory=list)


@dataclass(frozen=True)
class ContentDelta:
    """A piece of visible answer text, safe to send to the client now."""

    text: str


@dataclass(frozen=True)
class ReasoningDelta:
    """A piece of reasoning (thinking) text."""

    text: str


@dataclass(frozen=True)
class ToolCallDelta:
    """A piece of one tool call, in the shape of an OpenAI streaming `delta.tool_calls[i]`.

    The first delta of a call carries `id` and `name` (and `arguments == ""`); later deltas
    carry only argument text (`id` and `name` None). Concatenating the `arguments` of all
    deltas with one `index` gives the call's complete JSON arguments.
    """

    index: int
    id: str | None
    name: str | None
    arguments: str


Event = ContentDelta | ReasoningDelta | ToolCallDelta


def collect_events(events: Iterable[Event]) -> ParsedOutput:
    """Folds a stream of events back into the `ParsedOutput` it describes."""
    content: list[str] = []
    reasoning: list[str] = []
    saw_reasoning = False
    calls: dict[int, list[str]] = {}  # index -> [id, name, arguments]
    for event in events:
        if isinstance(event, ContentDelta):
            content.append(event.text)
        elif isinstance(event, ReasoningDelta):
            saw_reasoning = True
            reasoning.append(event.text)
        else:
            if event.index not in calls:
                calls[event.index] = [event.id or "", event.name or "", ""]
            calls[event.index][2] += event.arguments
    reasoning_text = "".join(reasoning) if saw_reasoning else None
    return ParsedOutput(
        content="".join(content),
        reasoning=reasoning_text or None,
        tool_calls=[ToolCall(id=i, name=n, arguments=a) for i, n, a in (calls[k] for k in sorted(calls))],
    )
