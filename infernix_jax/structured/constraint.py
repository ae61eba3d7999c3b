"""`RequestConstraint`: what a `GenerationRequest` carries to the engine.

A compiled grammar plus where it starts: with thinking on, the thinking block is free and the
grammar applies from the token after `</think>` (`starts_after_token`); when the prompt leaves the
choice to think to the model, the first token may be `<think>` or the grammar's (`may_open_token`).
The engine never imports a
grammar library; it asks the grammar for a `Matcher` when the constrained part begins.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from infernix_jax.structured.backend import CompiledGrammar, Matcher


@dataclass(frozen=True)
class RequestConstraint:
    """One request's output constraint."""

    grammar: CompiledGrammar  # compiled once per spec (cached by content)
    starts_after_token: int | None = None  # generation is free until this token (</think>) is generated
    # With starts_after_token: the free part happens only if the first token is this one (<think>),
    # for templates that let the model open its thinking itself; None: the output starts free.
    may_open_token: int | None = None

    def new_matcher(self) -> Matcher:
        return self.grammar.new_matcher()

    def begun(self) -> RequestConstraint:
        """The same constraint applying from the first generated token (a continuation whose prompt
        already holds the end of the thinking)."""
        return dataclasses.replace(self, starts_after_token=None, may_open_token=None)

    def describe(self) -> str:
        return self.grammar.spec.describe()
