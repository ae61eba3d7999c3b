"""The one place the API layer touches chat/: prompt rendering, encoding and output parsing.

Protocol modules call only these functions, so a change in chat/'s signatures is fixed here.
"""

from __future__ import annotations

from typing import Any, Sequence

import jinja2

from infernix_jax.api.errors import bad_request
from infernix_jax.chat.tool_parsing.types import (
    ContentDelta,
    Event,
    ParsedOutput,
    ReasoningDelta,
    ToolCallDelta,
    collect_events,
)

__all__ = [
    "ContentDelta", "Event", "OutputParser", "ParsedOutput", "ReasoningDelta", "ToolCallDelta",
    "collect_events", "encode", "decode", "render_prompt", "tool_parser_name", "forced_tool_prefix",
    "prompt_opens_thinking", "limit_tool_calls",
]

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
TOOL_CALL_OPEN = "<tool_call>"


def render_prompt(tokenizer: Any, messages: list[dict], tools: list[dict] | None,
                  template_kwargs: dict | None = None) -> str:
    """The prompt text of a conversation, through the model's chat template; a template error is a 400."""
    get = getattr(tokenizer, "get_chat_template", None)
    template = get(has_tools=bool(tools)) if get else tokenizer.chat_template
    if template is None:
        raise bad_request("this model has no chat template; use /v1/completions")
    try:
        return template.render(messages, tools=tools or None, add_generation_prompt=True,
                               **(template_kwargs or {}))
    except (ValueError, TypeError, jinja2.TemplateError) as exc:
        raise bad_request(f"the conversation does not fit the chat template: {exc}") from None


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text))


def decode(tokenizer: Any, token_ids: Sequence[int]) -> str:
    return tokenizer.decode(list(token_ids))


def template_source(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    return getattr(template, "source", "") or ""


def tool_parser_name(tokenizer: Any, configured: str) -> str:
    """The tool-call format: the configured one, or from the chat template (Qwen3-Coder XML or Hermes JSON)."""
    if configured and configured != "auto":
        return configured
    return "qwen3_coder" if "<function=" in template_source(tokenizer) else "hermes"


def forced_tool_prefix(parser: str, function_name: str | None) -> str:
    """Assistant text that forces a tool call (tool_choice "required" or a named function).

    Until structured output constrains the whole call, the prompt is ended with the opening of the
    call, so the model can only go on with its arguments.
    """
    if function_name is None:
        return TOOL_CALL_OPEN + "\n"
    if parser == "qwen3_coder":
        return f"{TOOL_CALL_OPEN}\n<function={function_name}>\n"
    return f'{TOOL_CALL_OPEN}\n{{"name": "{function_name}", "arguments": '


def prompt_opens_thinking(prompt: str) -> bool:
    """True when the prompt ends inside an open thinking block (templates that start the model thinking)."""
    tail = prompt.rstrip()
    return tail.rfind(THINK_OPEN) > tail.rfind(THINK_CLOSE) and tail.endswith(THINK_OPEN)


def _held_back(text: str, markers: Sequence[str]) -> int:
    """How many trailing characters of `text` could be the start of one of `markers`."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


class OutputParser:
    """Splits generated text, as it streams, into reasoning, content and tool-call events.

    Reasoning is the text inside `<think>...</think>` (or from the start, when the prompt opened the
    block). With tools, the text from the first `<tool_call>` on is held back and parsed at the end
    by chat's tool-call parser, so streamed and non-streamed results are the same by construction:
    a non-streaming response is this parser fed the whole text at once.
    """

    def __init__(self, tools: list[dict] | None, parser: str, tolerant: bool,
                 starts_in_reasoning: bool = False, forced_prefix: str = "") -> None:
        self.tools = tools or None
        self.parser = parser
        self.tolerant = tolerant
        self._in_reasoning = starts_in_reasoning
        self._strip_newlines = starts_in_reasoning  # newlines right after a think marker are dropped
        self._seen_any = False
        self._pending = ""  # text not yet classified (could be the start of a marker)
        self._tool_text: str | None = forced_prefix if forced_prefix else None
        self._emitted_content = False

    def feed(self, text: str) -> list[Event]:
        if self._tool_text is not None:
            self._tool_text += text
            return []
        self._pending += text
        return self._drain(final=False)

    def finish(self) -> list[Event]:
        events = self._drain(final=True)
        if self._tool_text is not None:
            events.extend(self._parse_tool_section(self._tool_text))
            self._tool_text = None
        return events

    def _drain(self, final: bool) -> list[Event]:
        events: list[Event] = []
        while self._pending:
            if self._strip_newlines:
                self._pending = self._pending.lstrip("\n")
                if not self._pending:
                    break
                self._strip_newlines = False
            if not self._seen_any and not self._in_reasoning:
                stripped = self._pending.lstrip()
                if not final and THINK_OPEN.startswith(stripped):
                    break  # could still become <think>
                self._seen_any = True
                if stripped.startswith(THINK_OPEN):
                    self._in_reasoning = True
                    self._pending = stripped[len(THINK_OPEN):]
                    self._strip_newlines = True
                    continue
            self._seen_any = True
            if self._in_reasoning:
                end = self._pending.find(THINK_CLOSE)
                if end >= 0:
                    piece = self._pending[:end].rstrip("\n")
                    if piece:
                        events.append(ReasoningDelta(piece))
                    self._pending = self._pending[end + len(THINK_CLOSE):]
                    self._in_reasoning = False
                    self._strip_newlines = True
                    continue
                keep = 0 if final else _held_back(self._pending, [THINK_CLOSE]) + self._trailing_newlines()
                piece = self._pending[: len(self._pending) - keep]
                if piece:
                    events.append(ReasoningDelta(piece))
                self._pending = self._pending[len(piece):]
                break
            if self.tools:
                start = self._pending.find(TOOL_CALL_OPEN)
                if start >= 0:
                    self._emit_content(events, self._pending[:start])
                    self._tool_text = self._pending[start:]
                    self._pending = ""
                    break
                keep = 0 if final else _held_back(self._pending, [TOOL_CALL_OPEN])
            else:
                keep = 0
            piece = self._pending[: len(self._pending) - keep]
            self._emit_content(events, piece)
            self._pending = self._pending[len(piece):]
            break
        return events

    def _trailing_newlines(self) -> int:
        """Newlines right before a possible `</think>` are held so the reasoning is stripped alike."""
        text = self._pending[: len(self._pending) - _held_back(self._pending, [THINK_CLOSE])]
        return len(text) - len(text.rstrip("\n"))

    def _emit_content(self, events: list[Event], text: str) -> None:
        if text:
            events.append(ContentDelta(text))
            self._emitted_content = True

    def _parse_tool_section(self, text: str) -> list[Event]:
        from infernix_jax.chat.tool_parsing import parse_tool_calls  # lands with the tool-call parsers

        parsed = parse_tool_calls(text, self.tools, self.parser, self.tolerant)
        events: list[Event] = []
        if parsed.reasoning:
            events.append(ReasoningDelta(parsed.reasoning))
        if parsed.content:
            events.append(ContentDelta(parsed.content))
        for index, call in enumerate(parsed.tool_calls):
            events.append(ToolCallDelta(index, call.id, call.name, ""))
            events.append(ToolCallDelta(index, None, None, call.arguments))
        return events


def limit_tool_calls(events: list[Event], parallel: bool) -> list[Event]:
    """With parallel tool calls switched off, only the first call survives."""
    if parallel:
        return events
    return [e for e in events if not isinstance(e, ToolCallDelta) or e.index == 0]


def parse_whole(parser: OutputParser, text: str) -> ParsedOutput:
    """The non-streaming result: the same parser fed the whole text."""
    return collect_events([*parser.feed(text), *parser.finish()])
