"""Constrained decoding: JSON Schema, regex, GBNF/Lark grammars and choices, through llguidance.

`ConstraintSpec` says what a request asks for; a `GrammarBackend` (llguidance here) compiles it,
cached by content; a `RequestConstraint` rides on the `GenerationRequest`; the engine keeps one
`Matcher` per constrained request and applies its token mask inside sampling. See
docs/structured_output.md.
"""

from infernix_jax.structured.backend import CompiledGrammar, GrammarBackend, Matcher
from infernix_jax.structured.constraint import RequestConstraint
from infernix_jax.structured.spec import KINDS, ConstraintError, ConstraintSpec

__all__ = [
    "KINDS",
    "CompiledGrammar",
    "ConstraintError",
    "ConstraintSpec",
    "GrammarBackend",
    "Matcher",
    "RequestConstraint",
    "default_backend",
]


def default_backend(tokenizer) -> GrammarBackend:
    """The llguidance backend for a `chat.tokenizer.Tokenizer` (building it takes ~1 s: keep it)."""
    from infernix_jax.structured.llguidance_backend import LLGuidanceBackend

    return LLGuidanceBackend.for_tokenizer(tokenizer)
