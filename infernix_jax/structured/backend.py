"""The interface between the engine and a grammar library.

A `GrammarBackend` compiles a `ConstraintSpec` once (cached by content) into a `CompiledGrammar`;
each constrained request gets its own `Matcher` from it. The engine sees only `Matcher`: it feeds
the tokens the request generates and asks for the packed token mask of the next position (bit j of
word i allows token 32 i + j, the layout `engine.sampling.unpack_token_mask` reads). Another
library (xgrammar, outlines-core) fits behind the same two protocols.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from infernix_jax.structured.spec import ConstraintSpec


class Matcher(Protocol):
    """One request's position in its grammar."""

    @property
    def mask_words(self) -> int:
        """int32 words of one mask: ceil(tokenizer vocabulary / 32) (the model's may be wider)."""
        ...

    def fill_mask(self, row: np.ndarray) -> None:
        """Write the allowed next tokens into row (int32 [mask_words], C-contiguous)."""
        ...

    def consume(self, token: int) -> bool:
        """Advance by one generated token; False when the grammar does not allow it (then `error`)."""
        ...

    def consume_allowed(self, tokens: Sequence[int]) -> int:
        """Advance by the longest prefix of tokens the grammar allows and return its length. The
        first refused token is not consumed and the matcher stays usable (unlike `consume`): free
        samples are checked this way, and a refused one replaced by a masked sample."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens consumed tokens (rejected speculative drafts)."""
        ...

    def forced_tokens(self) -> list[int]:
        """Tokens the grammar forces from here (a key of a fixed schema, closing brackets), in the
        tokenization the library considers canonical; [] when the next token is a choice. The
        engine only drafts them: sampling under the masks decides what is generated."""
        ...

    @property
    def finished(self) -> bool:
        """An end-of-sequence token completed the grammar: generation must stop."""
        ...

    @property
    def error(self) -> str | None:
        """Why the matcher failed, or None."""
        ...


class CompiledGrammar(Protocol):
    """A compiled constraint; cheap to start matchers from."""

    spec: ConstraintSpec

    def new_matcher(self) -> Matcher: ...


class GrammarBackend(Protocol):
    """Compiles specs for one tokenizer; `compile` raises ConstraintError with the library's reason."""

    def compile(self, spec: ConstraintSpec) -> CompiledGrammar: ...
