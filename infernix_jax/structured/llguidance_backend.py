"""`GrammarBackend` over llguidance: JSON Schema, regex, Lark and GBNF grammars, choices.

llguidance (no torch; Rust under a thin Python layer) compiles a grammar lazily against the
tokenizer's vocabulary and fills a packed int32 token mask in ~0.05-1 ms per token. A compiled
grammar is kept as a pristine `LLMatcher`, cached by spec; each request gets a deep copy.

JSON is generated compactly by default (", " and ": " separators, no free whitespace): a model can
otherwise spend its budget on newlines inside JSON mode, and the output equals `json.dumps` of the
value. A schema may override this with llguidance's own "x-guidance" options.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import llguidance
import numpy as np
from llguidance.gbnf_to_lark import any_to_lark

from infernix_jax.structured.spec import (
    CHOICE,
    GRAMMAR,
    JSON_OBJECT,
    JSON_SCHEMA,
    REGEX,
    ConstraintError,
    ConstraintSpec,
)

JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 256  # compiled grammars kept (least recently used dropped)


def grammar_text(spec: ConstraintSpec) -> str:
    """llguidance's grammar definition for a spec (not yet checked against a tokenizer)."""
    if spec.kind == JSON_OBJECT:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
    if spec.kind == JSON_SCHEMA:
        defaults = {**JSON_DEFAULTS, "lenient": not spec.strict}
        return llguidance.LLMatcher.grammar_from_json_schema(spec.source, defaults=defaults)
    if spec.kind == REGEX:
        return llguidance.LLMatcher.grammar_from_regex(spec.source)
    if spec.kind == CHOICE:
        options = json.loads(spec.source)
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(o) for o in options))
    if spec.kind == GRAMMAR:
        try:
            lark = any_to_lark(spec.source)  # GBNF is converted; Lark passes through
        except Exception as exc:  # noqa: BLE001 - the converter raises several types
            raise ConstraintError(f"the grammar is not valid GBNF or Lark: {exc}") from None
        return llguidance.LLMatcher.grammar_from_lark(lark)
    raise ConstraintError(f"unknown constraint kind {spec.kind!r}")


class LLGuidanceMatcher:
    """`Matcher` over one llguidance LLMatcher."""

    def __init__(self, inner: Any, mask_words: int, end_tokens: frozenset[int]):
        self._inner = inner
        self._mask_words = mask_words
        self._end_tokens = end_tokens
        self._finished = False

    @property
    def mask_words(self) -> int:
        return self._mask_words

    def fill_mask(self, row: np.ndarray) -> None:
        if row.dtype != np.int32 or row.shape != (self._mask_words,) or not row.flags["C_CONTIGUOUS"]:
            raise ValueError(f"the mask row must be C-contiguous int32 [{self._mask_words}]")
        self._inner.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def consume(self, token: int) -> bool:
        ok = bool(self._inner.consume_token(int(token)))
        if ok and int(token) in self._end_tokens:
            self._finished = True
        return ok

    def consume_allowed(self, tokens: Sequence[int]) -> int:
        tokens = [int(t) for t in tokens]
        n = int(self._inner.try_consume_tokens(tokens))
        # A grammar with nothing left to match takes an end token through consume_token only
        # (llguidance 1.9: try_consume_tokens and validate_tokens stop before it, the mask allows it).
        end = n < len(tokens) and tokens[n] in self._end_tokens
        if end and not self._inner.is_error() and self._inner.is_accepting():
            n += bool(self._inner.consume_token(tokens[n]))
        if n and tokens[n - 1] in self._end_tokens:
            self._finished = True
        return n

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            self._inner.rollback(num_tokens)
            self._finished = False

    def forced_tokens(self) -> list[int]:
        if self._finished or self._inner.is_error():
            return []
        return [int(t) for t in self._inner.compute_ff_tokens()]

    @property
    def finished(self) -> bool:
        return self._finished

    @property
    def error(self) -> str | None:
        return self._inner.get_error() if self._inner.is_error() else None


class LLGuidanceGrammar:
    """A compiled spec: a pristine matcher that requests copy."""

    def __init__(self, spec: ConstraintSpec, pristine: Any, mask_words: int, end_tokens: frozenset[int]):
        self.spec = spec
        self._pristine = pristine
        self._mask_words = mask_words
        self._end_tokens = end_tokens

    def new_matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._pristine.deep_copy(), self._mask_words, self._end_tokens)


class LLGuidanceBackend:
    """Compiles specs for one tokenizer; thread-safe (the server compiles, the engine thread matches)."""

    def __init__(self, tokenizer_json: str, end_token_ids: Sequence[int]):
        """tokenizer_json: the HF tokenizers serialisation (tokenizer.json's content, special tokens
        included); end_token_ids: the ids that end generation (what a finished grammar allows)."""
        if not end_token_ids:
            raise ValueError("structured output needs at least one end-of-sequence token id")
        # A list of end tokens needs llguidance >= 1.9 (1.6 takes one int): pyproject pins it.
        self.tokenizer = llguidance.LLTokenizer(tokenizer_json, eos_token=list(end_token_ids))
        self.mask_words = (self.tokenizer.vocab_size + 31) // 32
        self.end_tokens = frozenset(int(t) for t in end_token_ids)
        self._cache: OrderedDict[ConstraintSpec, LLGuidanceGrammar] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def for_tokenizer(cls, tokenizer: Any) -> LLGuidanceBackend:
        """From a `chat.tokenizer.Tokenizer` (its `backend` and `eos_token_ids`)."""
        return cls(tokenizer.backend.to_str(), tokenizer.eos_token_ids)

    def compile(self, spec: ConstraintSpec) -> LLGuidanceGrammar:
        with self._lock:
            cached = self._cache.get(spec)
            if cached is not None:
                self._cache.move_to_end(spec)
                return cached
        try:
            text = grammar_text(spec)
        except ValueError as exc:
            raise ConstraintError(str(exc)) from None
        pristine = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        if pristine.is_error():
            raise ConstraintError(_first_lines(pristine.get_error()))
        compiled = LLGuidanceGrammar(spec, pristine, self.mask_words, self.end_tokens)
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled

    def cache_size(self) -> int:
        return len(self._cache)


def _first_lines(message: str, limit: int = 6) -> str:
    """llguidance errors end with a source excerpt; keep the reason and a short excerpt."""
    lines = [line for line in message.strip().splitlines() if line.strip()]
    return "\n".join(lines[:limit])
