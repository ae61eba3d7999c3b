"""Thinking control: a reasoning-token budget and a repetition (loop) detector.

`ThinkingWatch` follows one generation's text through chat's reasoning parser and counts the
tokens generated while the model is thinking. When the budget is spent, or the thinking keeps
repeating the same span, it says so; `Generation` then stops the engine request and continues it
from prompt + generated tokens + a wrap-up message that closes the thinking block, so the model
goes on to answer. The engine protocol needs nothing more than abort and submit for this (the
prefix cache makes the continuation cheap).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from infernix_jax.chat.reasoning import THINK_CLOSE, StreamingReasoningParser

DEFAULT_WRAP_UP = "\n\nI have thought about this enough; time to write the answer.\n"

# reasoning_effort levels as thinking budgets in tokens (None: unlimited)
EFFORT_BUDGETS = {"none": 0, "minimal": 0, "low": 1024, "medium": 8192, "high": None, "xhigh": None}


@dataclass(frozen=True)
class ThinkingPolicy:
    """How one request's thinking is limited."""

    budget: int | None = None  # reasoning tokens allowed; None: unlimited
    detect_loops: bool = False  # wrap up when the thinking repeats itself
    wrap_up: str = DEFAULT_WRAP_UP  # reasoning text inserted before the thinking is closed
    loop_window: int = 32  # tokens in the span that must recur
    loop_repeats: int = 3  # how often the same span must occur to count as a loop

    @property
    def active(self) -> bool:
        return self.budget is not None or self.detect_loops

    def closing_text(self) -> str:
        return f"{self.wrap_up}{THINK_CLOSE}\n\n"


class ThinkingWatch:
    """Counts reasoning tokens of one generation and decides when to wrap the thinking up."""

    def __init__(self, policy: ThinkingPolicy, starts_in_thinking: bool) -> None:
        self.policy = policy
        self._reasoning = StreamingReasoningParser(starts_in_thinking)
        self.reasoning_tokens = 0
        self._window: list[int] = []
        self._spans: Counter[tuple[int, ...]] = Counter()
        self.reason: str | None = None  # "budget" or "loop" once triggered

    @property
    def in_reasoning(self) -> bool:
        return self._reasoning.in_reasoning

    def observe(self, token_ids: list[int], text: str) -> bool:
        """Take one event's tokens and text; True when the thinking must be wrapped up now."""
        was_reasoning = self.in_reasoning
        self._reasoning.feed(text)
        if not (was_reasoning or self.in_reasoning) or self.reason is not None:
            return False
        if not self.in_reasoning:
            return False  # the model closed its thinking itself
        self.reasoning_tokens += len(token_ids)
        budget = self.policy.budget
        if budget is not None and self.reasoning_tokens >= budget:
            self.reason = "budget"
            return True
        if self.policy.detect_loops and self._repeats(token_ids):
            self.reason = "loop"
            return True
        return False

    def _repeats(self, token_ids: list[int]) -> bool:
        size = self.policy.loop_window
        for token in token_ids:
            self._window.append(token)
            if len(self._window) > size:
                del self._window[0]
            if len(self._window) == size:
                span = tuple(self._window)
                self._spans[span] += 1
                if self._spans[span] >= self.policy.loop_repeats:
                    return True
        return False
