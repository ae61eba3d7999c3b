"""What a protocol module hands to the shared machinery: a prompt plus how to generate and parse."""

from __future__ import annotations

from dataclasses import dataclass, field

from infernix_jax.api.chat_support import OutputParser
from infernix_jax.api.thinking import ThinkingPolicy, ThinkingWatch
from infernix_jax.engine.protocol import SamplingParams


@dataclass
class ChatPlan:
    """A chat-style request made ready for the engine."""

    model: str  # the model name echoed back
    prompt_text: str
    prompt_ids: list[int]
    sampling: SamplingParams
    tools: list[dict] | None  # chat-template form: [{"type": "function", "function": {...}}]
    parser_name: str  # tool-call format
    tolerant: bool
    starts_in_reasoning: bool  # the prompt ended inside an open thinking block
    forced_prefix: str = ""  # assistant text appended to the prompt to force a tool call
    parallel_tool_calls: bool = True
    stop_sequences: tuple[str, ...] = field(default_factory=tuple)
    thinking: ThinkingPolicy = field(default_factory=ThinkingPolicy)

    def new_parser(self) -> OutputParser:
        return OutputParser(
            self.tools,
            self.parser_name,
            self.tolerant,
            starts_in_reasoning=self.starts_in_reasoning,
            forced_prefix=self.forced_prefix,
        )

    def new_thinking_watch(self) -> ThinkingWatch | None:
        """A watch over the thinking of one generation, or None when nothing limits it."""
        if not self.thinking.active or self.forced_prefix:
            return None
        return ThinkingWatch(self.thinking, self.starts_in_reasoning)
