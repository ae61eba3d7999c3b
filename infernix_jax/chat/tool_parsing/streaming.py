"""Splitting model output into answer text and tool calls, incrementally.

`StreamingToolCallParser` is the one implementation: `parse_tool_calls` feeds it the whole
text at once. It scans the text, passing answer text through as `ContentDelta`s, and buffers
each tool-call block until the block is complete, then emits the block's calls as
`ToolCallDelta`s (a first delta with id and name, then the JSON arguments) or, when the block
does not parse, re-reads it as answer text. Every decision waits until enough text has
arrived to make it the same way whatever the chunking, so streamed and non-streamed results
are identical.

Rules that users see:
- Text that could still become `<tool_call>` (a trailing `<tool_c`) is held back.
- A `<tool_call>` inside a Markdown code fence or an inline code span is quoted, not called.
- Whitespace between answer text and a call is dropped; text after the calls is kept, separated
  from the text before them by the whitespace that followed the last call.
- Strict mode: a block is `<tool_call>` ... `</tool_call>` in the configured format, naming a
  declared tool; anything else (truncated, malformed, unknown tool) stays text. vLLM instead
  returns calls to undeclared tools as calls (its qwen3_coder parser only logs a warning and its
  hermes parser does not check), and parses truncated XML calls.
- Tolerant mode additionally ends a block at `</function>` or at the end of its JSON object when
  `</tool_call>` is missing, at the next `<tool_call>`, or at the end of the output; it reads a
  bare `<function=...>` without the wrapper, either body format, and repairable JSON.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

from infernix_jax.chat.tool_parsing.blocks import PARSER_NAMES, ParsedCall, parse_block
from infernix_jax.chat.tool_parsing.lenient_json import JsonEndTracker
from infernix_jax.chat.tool_parsing.schema import tool_specs
from infernix_jax.chat.tool_parsing.types import (
    ContentDelta,
    Event,
    IdFactory,
    ToolCallDelta,
    random_call_id,
)

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
FUNCTION_OPEN = "<function="
FUNCTION_CLOSE = "</function>"

_SPECIAL = re.compile(r"[<`\n]")
_FIRST_NON_SPACE = re.compile(r"\s*")
_REJECT = object()  # marks a block that is certainly not a call


class StreamingToolCallParser:
    """Feeds on answer text deltas; returns content and tool-call events (see module doc).

    `tools` is the request's tool list (OpenAI, flat or Anthropic form); None accepts any tool
    name and leaves XML values as strings. `parser` is "qwen3_coder" or "hermes".
    `id_factory(index)` makes call ids (default: `call_` + 24 random hex digits).
    """

    def __init__(
        self,
        tools: Sequence[Mapping[str, Any]] | None,
        parser: str = "qwen3_coder",
        tolerant: bool = False,
        id_factory: IdFactory | None = None,
    ) -> None:
        if parser not in PARSER_NAMES:
            raise ValueError(f"unknown tool-call parser {parser!r}; expected one of {PARSER_NAMES}")
        self._specs = tool_specs(tools)
        self._parser = parser
        self._tolerant = tolerant
        self._id_factory = id_factory or random_call_id
        self._openers = (TOOL_CALL_OPEN, FUNCTION_OPEN) if tolerant else (TOOL_CALL_OPEN,)
        self._pending = ""  # text received and not yet decided
        self._finished = False
        # Inside a block: the opener that started it; the body is self._pending.
        self._block_opener: str | None = None
        self._marks: dict[str, int] = {}  # tag -> first offset in the body, -1 if not yet seen
        self._scanned = 0  # how much of the body has been searched
        self._json_end: JsonEndTracker | None = None
        # Set when rejected block text is re-read: its first "<" must not open a block again.
        self._skip_opener_once = False
        # Markdown state, to tell quoted calls from real ones.
        self._in_fence = False
        self._fence_len = 0
        self._line_start = True
        self._line_backticks = 0
        # Whitespace handling around calls.
        self._held_ws = ""
        self._emitted_content = False
        self._after_call = False
        self._call_count = 0

    @property
    def call_count(self) -> int:
        """How many tool calls have been emitted so far."""
        return self._call_count

    def feed(self, text: str) -> list[Event]:
        """Takes the next piece of answer text; returns the events it makes certain."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._pending += text
        return self._drain(final=False)

    def finish(self) -> list[Event]:
        """Ends the output: decides everything still held back and returns the last events."""
        if self._finished:
            return []
        events = self._drain(final=True)
        self._finished = True
        if self._held_ws and not self._after_call:
            events.append(ContentDelta(self._held_ws))
        self._held_ws = ""
        return events

    # --- scanning -------------------------------------------------------------------------

    def _drain(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while True:
            step = self._step_block if self._block_opener is not None else self._step_text
            if not step(final, out):
                return out

    def _step_text(self, final: bool, out: list[Event]) -> bool:
        """Consumes a prefix of pending answer text; False when it must wait for more."""
        text = self._pending
        if not text:
            return False
        special = _SPECIAL.search(text)
        if special is None or special.start() > 0:
            plain = text if special is None else text[: special.start()]
            self._plain(plain, out)
            self._pending = text[len(plain) :]
            return bool(self._pending)
        ch = text[0]
        if ch == "\n":
            self._content("\n", out)
            self._line_start, self._line_backticks = True, 0
            self._pending = text[1:]
            return True
        if ch == "`":
            run = len(text) - len(text.lstrip("`"))
            if run == len(text) and not final:
                return False  # the run may go on: a fence needs its full length
            self._backticks(run)
            self._content(text[:run], out)
            self._pending = text[run:]
            return True
        # ch == "<"
        if self._skip_opener_once:
            self._skip_opener_once = False
        elif not (self._in_fence or self._line_backticks % 2):
            for opener in self._openers:
                if text.startswith(opener):
                    self._pending = text[len(opener) :]
                    self._start_block(opener)
                    return True
                if opener.startswith(text) and not final:
                    return False  # may still become an opener
        self._line_start = False
        self._content("<", out)
        self._pending = text[1:]
        return True

    def _backticks(self, run: int) -> None:
        if self._line_start and run >= 3:
            if not self._in_fence:
                self._in_fence, self._fence_len = True, run
            elif run >= self._fence_len:
                self._in_fence = False
        elif not self._in_fence:
            self._line_backticks += run
        self._line_start = False

    def _plain(self, text: str, out: list[Event]) -> None:
        if text.strip():
            self._line_start = False
        self._content(text, out)

    def _content(self, text: str, out: list[Event]) -> None:
        core = text.rstrip()
        if not core:
            self._held_ws += text
            return
        trailing = text[len(core) :]
        lead = self._held_ws
        if self._after_call and not self._emitted_content:
            lead, core = "", core.lstrip()  # the output began with calls: no separator
        out.append(ContentDelta(lead + core))
        self._held_ws = trailing
        self._emitted_content = True
        self._after_call = False

    # --- blocks ---------------------------------------------------------------------------

    def _step_block(self, final: bool, out: list[Event]) -> bool:
        """Looks for the end of the current block; False when it must wait for more text."""
        end = self._find_block_end(final)
        if end is None:
            if not final:
                return False
            # Out of text inside the block: strict mode keeps it as text, tolerant mode
            # reads what there is.
            end = _REJECT if not self._tolerant else (len(self._pending), len(self._pending))
        opener = self._block_opener
        assert opener is not None
        self._block_opener = None
        calls = None
        if end is not _REJECT:
            body_end, resume = end
            body = self._pending[:body_end]
            block_text = body if opener == TOOL_CALL_OPEN else opener + body
            calls = parse_block(block_text, self._parser, self._specs, self._tolerant)
        if calls is None:  # not a call: re-read the block as answer text
            self._pending = opener + self._pending
            self._skip_opener_once = True
            return True
        self._pending = self._pending[resume:]
        self._emit_calls(calls, out)
        return True

    def _start_block(self, opener: str) -> None:
        self._block_opener = opener
        self._marks = {}
        self._scanned = 0
        self._json_end = None

    def _mark(self, tag: str) -> int:
        """First offset of `tag` in the block body, searching only text not searched before."""
        found = self._marks.get(tag, -1)
        if found == -1:
            found = self._pending.find(tag, max(0, self._scanned - len(tag) + 1))
            self._marks[tag] = found
        return found

    def _find_block_end(self, final: bool) -> tuple[int, int] | object | None:
        """(end of body, end of consumed text) once the block's end is certain; `_REJECT`
        when the block is certainly not a call; None while undecided."""
        body = self._pending
        close = self._mark(TOOL_CALL_CLOSE)
        reopen = self._mark(TOOL_CALL_OPEN)
        if self._block_opener == FUNCTION_OPEN:
            nested = self._mark(FUNCTION_OPEN)
            if nested != -1 and (reopen == -1 or nested < reopen):
                reopen = nested
        format_end = self._format_end(body) if self._tolerant else None
        self._scanned = len(body)
        if not self._tolerant:
            if reopen != -1 and (close == -1 or reopen < close):
                return _REJECT  # a new call starts before this one closed
            if close != -1:
                return close, close + len(TOOL_CALL_CLOSE)
            return None
        candidates: list[tuple[int, int | None]] = []
        if close != -1:
            candidates.append((close, close + len(TOOL_CALL_CLOSE)))
        if reopen != -1:
            candidates.append((reopen, reopen))
        if format_end is not None:
            candidates.append((format_end, self._skip_stray_close(body, format_end, final)))
        if not candidates:
            return None
        body_end, resume = min(candidates, key=lambda c: c[0])
        if resume is None:
            return None  # waiting to see whether "</tool_call>" follows
        return body_end, resume

    def _format_end(self, body: str) -> int | None:
        """Tolerant mode: where the block's function or JSON object closes, if it has."""
        first = _FIRST_NON_SPACE.match(body)
        head = body[first.end() : first.end() + len(FUNCTION_OPEN)] if first else ""
        if head.startswith(("{", "[")):
            if self._json_end is None:
                self._json_end = JsonEndTracker()
            return self._json_end.advance(body)
        if self._block_opener == FUNCTION_OPEN or head == FUNCTION_OPEN:
            close = self._mark(FUNCTION_CLOSE)
            if close != -1:
                return close + len(FUNCTION_CLOSE)
        return None

    def _skip_stray_close(self, body: str, pos: int, final: bool) -> int | None:
        """After a closed function/object: consume whitespace + "</tool_call>" if it follows.

        None means undecided (only whitespace or a prefix of the tag so far).
        """
        rest = body[pos:]
        stripped = rest.lstrip()
        if stripped.startswith(TOOL_CALL_CLOSE):
            return pos + (len(rest) - len(stripped)) + len(TOOL_CALL_CLOSE)
        if not final and TOOL_CALL_CLOSE.startswith(stripped):
            return None
        return pos

    def _emit_calls(self, calls: list[ParsedCall], out: list[Event]) -> None:
        self._held_ws = ""
        self._after_call = True
        self._line_start, self._line_backticks = False, 0
        for call in calls:
            index = self._call_count
            self._call_count += 1
            out.append(ToolCallDelta(index=index, id=self._id_factory(index), name=call.name, arguments=""))
            out.append(ToolCallDelta(index=index, id=None, name=None, arguments=call.arguments_json()))
