"""What a request asks its output to match: a `ConstraintSpec`, before any library compiled it.

The API layer turns every protocol's fields (OpenAI `response_format`, vLLM `structured_outputs`
and `guided_*`, llama.cpp `grammar` / `json_schema`, tool choice) into one of these; a backend
(`backend.GrammarBackend`) compiles it. Specs are frozen and hashable by content, so a backend
caches compiled grammars by spec.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

JSON_OBJECT = "json_object"  # any JSON object
JSON_SCHEMA = "json_schema"  # JSON matching a schema
REGEX = "regex"  # text that the regular expression fully matches
GRAMMAR = "grammar"  # a context-free grammar: GBNF (llama.cpp) or Lark (llguidance's dialect)
CHOICE = "choice"  # exactly one of a list of strings

KINDS = (JSON_OBJECT, JSON_SCHEMA, REGEX, GRAMMAR, CHOICE)


class ConstraintError(ValueError):
    """The spec cannot be compiled: a bad schema, regex or grammar. The message is the library's reason."""


@dataclass(frozen=True)
class ConstraintSpec:
    """One output constraint, by content.

    `source` is the schema as canonical JSON text (json_schema), the pattern (regex), the grammar
    text (grammar), the choices as a JSON list (choice) or "" (json_object). `strict` (json_schema)
    rejects schema keywords the backend cannot enforce instead of ignoring them.
    """

    kind: str
    source: str = ""
    strict: bool = True

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ConstraintError(f"constraint kind must be one of {', '.join(KINDS)}, got {self.kind!r}")

    @staticmethod
    def json_object() -> ConstraintSpec:
        return ConstraintSpec(JSON_OBJECT)

    @staticmethod
    def json_schema(schema: Any, strict: bool = True) -> ConstraintSpec:
        """From a schema given as a dict (or a bool schema) or as JSON text."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise ConstraintError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise ConstraintError("a JSON schema must be an object")
        return ConstraintSpec(JSON_SCHEMA, json.dumps(schema, sort_keys=False), strict)

    @staticmethod
    def regex(pattern: str) -> ConstraintSpec:
        if not isinstance(pattern, str):
            raise ConstraintError("a regex must be a string")
        return ConstraintSpec(REGEX, pattern)

    @staticmethod
    def grammar(text: str) -> ConstraintSpec:
        if not isinstance(text, str) or not text.strip():
            raise ConstraintError("a grammar must be a non-empty string")
        return ConstraintSpec(GRAMMAR, text)

    @staticmethod
    def choice(options: Any) -> ConstraintSpec:
        if not isinstance(options, list) or not options or not all(isinstance(o, str) for o in options):
            raise ConstraintError("choice must be a non-empty list of strings")
        return ConstraintSpec(CHOICE, json.dumps(options))

    def describe(self) -> str:
        """A short readable name for logs and errors."""
        return self.kind if self.kind == JSON_OBJECT else f"{self.kind} {self.source[:60]!r}"
