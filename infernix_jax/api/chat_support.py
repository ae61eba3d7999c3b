"""The one place the API layer touches chat/: prompt rendering, encoding and output parsing.

Protocol modules call only these functions, so a change in chat/'s signatures is fixed here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jinja2

from infernix_jax.api.errors import bad_request
from infernix_jax.chat.reasoning import prompt_starts_in_thinking
from infernix_jax.chat.tool_parsing import detect_tool_parser
from infernix_jax.chat.tool_parsing.chat_output import StreamingChatOutputParser
from infernix_jax.chat.tool_parsing.types import (
    ContentDelta,
    Event,
    ParsedOutput,
    ReasoningDelta,
    ToolCallDelta,
    collect_events,
)

__all__ = [
    "ContentDelta",
    "Event",
    "OutputParser",
    "ParsedOutput",
    "ReasoningDelta",
    "ToolCallDelta",
    "collect_events",
    "decode",
    "encode",
    "forced_tool_prefix",
    "limit_tool_calls",
    "prompt_opens_thinking",
    "render_prompt",
    "tool_parser_name",
]

TOOL_CALL_OPEN = "<tool_call>"


def render_prompt(
    tokenizer: Any, messages: list[dict], tools: list[dict] | None, template_kwargs: dict | None = None
) -> str:
    """The prompt text of a conversation, through the model's chat template; a template error is a 400."""
    get = getattr(tokenizer, "get_chat_template", None)
    template = get(has_tools=bool(tools)) if get else tokenizer.chat_template
    if template is None:
        raise bad_request("this model has no chat template; use /v1/completions")
    try:
        return template.render(
            messages, tools=tools or None, add_generation_prompt=True, **(template_kwargs or {})
        )
    except (ValueError, TypeError, jinja2.TemplateError) as exc:
        raise bad_request(f"the conversation does not fit the chat template: {exc}") from None


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text))


def decode(tokenizer: Any, token_ids: Sequence[int]) -> str:
    return tokenizer.decode(list(token_ids))


def template_source(tokenizer: Any) -> str:
    """The source of the template used for requests with tools (a model may ship a tool_use one)."""
    get = getattr(tokenizer, "get_chat_template", None)
    template = get(has_tools=True) if get else getattr(tokenizer, "chat_template", None)
    return getattr(template, "source", "") or ""


def tool_parser_name(tokenizer: Any, configured: str) -> str:
    """The tool-call format: the configured one, or from the chat template (Qwen3-Coder XML or Hermes JSON)."""
    if configured and configured != "auto":
        return configured
    try:
        return detect_tool_parser(template_source(tokenizer))
    except ValueError:
        return "hermes"  # the template teaches no format; Hermes JSON is the common one


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
    return prompt_starts_in_thinking(prompt)


class OutputParser:
    """Splits generated text, as it streams, into reasoning, content and tool-call events.

    A thin wrapper over chat's `StreamingChatOutputParser`; a non-streaming response is the same
    parser fed the whole text at once, so streamed and non-streamed results agree by construction.
    A forced tool-call prefix (appended to the prompt) is fed first, as if the model had written it.
    """

    def __init__(
        self,
        tools: list[dict] | None,
        parser: str,
        tolerant: bool,
        starts_in_reasoning: bool = False,
        forced_prefix: str = "",
    ) -> None:
        self._inner = StreamingChatOutputParser(
            tools or None,
            parser if tools else None,
            tolerant=tolerant,
            starts_in_thinking=False if forced_prefix else starts_in_reasoning,
        )
        self._prefix = forced_prefix

    def feed(self, text: str) -> list[Event]:
        if self._prefix:
            text, self._prefix = self._prefix + text, ""
        return self._inner.feed(text)

    def finish(self) -> list[Event]:
        events = self.feed("") if self._prefix else []
        return events + self._inner.finish()


def limit_tool_calls(events: list[Event], parallel: bool) -> list[Event]:
    """With parallel tool calls switched off, only the first call survives."""
    if parallel:
        return events
    return [e for e in events if not isinstance(e, ToolCallDelta) or e.index == 0]


def parse_whole(parser: OutputParser, text: str) -> ParsedOutput:
    """The non-streaming result: the same parser fed the whole text."""
    return collect_events([*parser.feed(text), *parser.finish()])
