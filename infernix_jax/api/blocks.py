"""Parser events grouped into content blocks, for the protocols whose streams open and close blocks.

Anthropic Messages (content blocks) and OpenAI Responses (output items) both stream a sequence of
blocks, each reasoning, text or one tool call, opened, filled by deltas and closed. `BlockTracker`
turns the flat parser events into those steps; each protocol only formats them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from infernix_jax.api.chat_support import ContentDelta, Event, ReasoningDelta, ToolCallDelta

REASONING = "reasoning"
TEXT = "text"
TOOL = "tool"


@dataclass
class Block:
    """One block as it grows: its position, kind, text so far, and for a tool call its id and name."""

    index: int
    kind: str
    text: str = ""
    call_id: str | None = None
    name: str | None = None
    call_index: int | None = None


@dataclass(frozen=True)
class Step:
    """open: a block starts; delta: `text` is appended to it; close: it is complete."""

    action: str
    block: Block
    text: str = ""


@dataclass
class BlockTracker:
    """Groups events into blocks. Whitespace-only text never opens a text block on its own: it is
    held until real text follows (and then sent with it) and dropped when another kind of block
    comes first, so no empty-looking blocks appear."""

    blocks: list[Block] = field(default_factory=list)
    _open: Block | None = None
    _held_space: str = ""

    def feed(self, events: list[Event]) -> list[Step]:
        steps: list[Step] = []
        for event in events:
            if isinstance(event, ToolCallDelta):
                kind, key = TOOL, event.index
            elif isinstance(event, ReasoningDelta):
                kind, key = REASONING, None
            elif isinstance(event, ContentDelta):
                kind, key = TEXT, None
            else:
                continue
            text = event.arguments if kind == TOOL else event.text
            current = self._open
            opens = current is None or current.kind != kind or current.call_index != key
            if kind == TEXT and opens:
                if not text.strip():
                    self._held_space += text
                    continue
                text, self._held_space = self._held_space + text, ""
            elif opens:
                self._held_space = ""  # whitespace between two non-text blocks is dropped
            if opens:
                if current is not None:
                    steps.append(Step("close", current))
                current = Block(index=len(self.blocks), kind=kind, call_index=key)
                if kind == TOOL:
                    current.call_id, current.name = event.id, event.name
                self.blocks.append(current)
                self._open = current
                steps.append(Step("open", current))
            if text:
                current.text += text
                steps.append(Step("delta", current, text))
        return steps

    def close(self) -> list[Step]:
        if self._open is None:
            return []
        block, self._open = self._open, None
        return [Step("close", block)]
