"""Splitting Qwen output into reasoning (`<think>...</think>`) and the answer.

Qwen3-Next-Thinking and Qwen3.5 templates end the prompt with `<think>\\n`, so the output
starts inside thinking and only `</think>` appears (`prompt_starts_in_thinking` tells). Older
templates let the model write `<think>` itself; a leading `<think>` is accepted either way.
Reasoning ends at `</think>`, or implicitly where a tool call starts inside unclosed thinking:
`<tool_call>` followed by `<function` or `{` (a bare mention of `<tool_call>` in the reasoning
is not enough, as in vLLM's qwen3 reasoning parser), and in tolerant mode also a bare
`<function=`. Output that never leaves thinking is all reasoning (it was cut off).

The answer text after `</think>` loses its leading whitespace (the template writes
`</think>\\n\\n`); the reasoning is kept as written. The streaming parser and `split_reasoning`
are one implementation, so they agree for any chunking.
"""

from __future__ import annotations

from infernix_jax.chat.tool_parsing.types import ContentDelta, ReasoningDelta

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
_TOOL_CALL_OPEN = "<tool_call>"
_FUNCTION_OPEN = "<function="

_START, _THINKING, _CONTENT_START, _CONTENT = "start", "thinking", "content_start", "content"


def prompt_starts_in_thinking(prompt_text: str) -> bool:
    """True when the rendered prompt leaves the model inside an open `<think>` block."""
    return prompt_text.rstrip().endswith(THINK_OPEN)


class StreamingReasoningParser:
    """Feeds on output text deltas; returns `ReasoningDelta` and `ContentDelta` events."""

    def __init__(self, starts_in_thinking: bool, tolerant: bool = False) -> None:
        self._starts_in_thinking = starts_in_thinking
        self._tags = (
            (THINK_CLOSE, _TOOL_CALL_OPEN, _FUNCTION_OPEN) if tolerant else (THINK_CLOSE, _TOOL_CALL_OPEN)
        )
        self._tolerant = tolerant
        self._state = _START
        self._pending = ""
        self._finished = False

    @property
    def in_reasoning(self) -> bool:
        """True while the output is (or may still be) reasoning."""
        return self._state == _THINKING or (self._state == _START and self._starts_in_thinking)

    def feed(self, text: str) -> list[ContentDelta | ReasoningDelta]:
        """Takes the next piece of output; returns the events it makes certain."""
        if self._finished:
            raise RuntimeError("feed() after finish()")
        self._pending += text
        return self._drain(final=False)

    def finish(self) -> list[ContentDelta | ReasoningDelta]:
        """Ends the output and returns whatever was still held back."""
        if self._finished:
            return []
        self._finished = True
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[ContentDelta | ReasoningDelta]:
        out: list[ContentDelta | ReasoningDelta] = []
        while self._step(final, out):
            pass
        return out

    def _step(self, final: bool, out: list[ContentDelta | ReasoningDelta]) -> bool:
        """Advances the state machine once; False when it must wait for more text."""
        if self._state == _START:
            stripped = self._pending.lstrip()
            if stripped.startswith(THINK_OPEN):
                self._pending = stripped[len(THINK_OPEN) :]
                self._state = _THINKING
                return True
            if not final and THINK_OPEN.startswith(stripped):
                return False  # empty so far, or a prefix of "<think>"
            self._state = _THINKING if self._starts_in_thinking else _CONTENT
            return True
        if self._state == _THINKING:
            return self._step_thinking(final, out)
        if self._state == _CONTENT_START:
            stripped = self._pending.lstrip()
            self._pending = stripped
            if not stripped:
                return False
            self._state = _CONTENT
            return True
        if self._pending:
            out.append(ContentDelta(self._pending))
            self._pending = ""
        return False

    def _step_thinking(self, final: bool, out: list[ContentDelta | ReasoningDelta]) -> bool:
        text = self._pending
        pos = 0
        while True:
            tag_at = text.find("<", pos)
            if tag_at == -1:
                self._reason(text, out)
                self._pending = ""
                return False
            rest = text[tag_at:]
            if rest.startswith(THINK_CLOSE):
                self._reason(text[:tag_at], out)
                self._pending = rest[len(THINK_CLOSE) :]
                self._state = _CONTENT_START
                return True
            ends = self._implicit_end(rest, final)
            if ends is None:  # undecided until more text arrives
                self._reason(text[:tag_at], out)
                self._pending = rest
                return False
            if ends:
                self._reason(text[:tag_at], out)
                self._pending = rest
                self._state = _CONTENT
                return True
            if not final and any(tag.startswith(rest) for tag in self._tags):
                self._reason(text[:tag_at], out)
                self._pending = rest
                return False
            pos = tag_at + 1

    def _implicit_end(self, rest: str, final: bool) -> bool | None:
        """Whether a tool call starts at `rest` (None: cannot tell yet)."""
        if self._tolerant and rest.startswith(_FUNCTION_OPEN):
            return True
        if not rest.startswith(_TOOL_CALL_OPEN):
            return False
        after = rest[len(_TOOL_CALL_OPEN) :].lstrip()
        if after.startswith(("<function", "{")):
            return True
        if not final and (not after or "<function".startswith(after)):
            return None
        return False

    @staticmethod
    def _reason(text: str, out: list[ContentDelta | ReasoningDelta]) -> None:
        if text:
            out.append(ReasoningDelta(text))


def split_reasoning(text: str, starts_in_thinking: bool, tolerant: bool = False) -> tuple[str | None, str]:
    """(reasoning, content) of a whole output; reasoning is None when there was none."""
    parser = StreamingReasoningParser(starts_in_thinking, tolerant=tolerant)
    reasoning: list[str] = []
    content: list[str] = []
    for event in [*parser.feed(text), *parser.finish()]:
        (reasoning if isinstance(event, ReasoningDelta) else content).append(event.text)
    return ("".join(reasoning) or None), "".join(content)
