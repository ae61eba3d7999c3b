"""A forgiving JSON reader for tool-call arguments that a model wrote slightly wrong.

Used only in tolerant mode. It accepts what `json.loads` rejects in typical model output:
trailing or doubled commas, single-quoted strings, raw newlines and other control characters
inside strings, unknown escapes, unquoted keys, Python literals (`True`, `None`), and text cut
off before its closing quotes, brackets or braces (a truncated string keeps what it has; a key
left without a value is dropped). Well-formed JSON reads exactly as `json.loads` reads it.
"""

from __future__ import annotations

import re
from typing import Any

_ESCAPES = {'"': '"', "'": "'", "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_NUMBER = re.compile(r"-?(?:\d+)(?:\.\d*)?(?:[eE][-+]?\d+)?")
_WORD = re.compile(r"[A-Za-z_$][\w$-]*")
_LITERALS = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


class _Truncated(Exception):
    """The text ended inside a value that cannot be completed (a bare `tru`, a lone `-`)."""


class _Reader:
    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def at_end(self) -> bool:
        return self.pos >= len(self.text)

    def skip_space(self) -> None:
        text, pos = self.text, self.pos
        while pos < len(text) and text[pos] in " \t\r\n":
            pos += 1
        self.pos = pos

    def value(self) -> Any:
        self.skip_space()
        if self.at_end():
            raise _Truncated
        ch = self.text[self.pos]
        if ch == "{":
            return self.object()
        if ch == "[":
            return self.array()
        if ch in "\"'":
            return self.string()
        number = _NUMBER.match(self.text, self.pos)
        if number:
            self.pos = number.end()
            literal = number.group()
            if any(c in literal for c in ".eE"):
                return float(literal)
            return int(literal)
        word = _WORD.match(self.text, self.pos)
        if word and word.group() in _LITERALS:
            self.pos = word.end()
            return _LITERALS[word.group()]
        if word and word.end() == len(self.text) and any(w.startswith(word.group()) for w in _LITERALS):
            raise _Truncated
        if ch == "-" and self.pos + 1 == len(self.text):
            raise _Truncated
        raise ValueError(f"unexpected {ch!r} at offset {self.pos}")

    def string(self) -> str:
        quote = self.text[self.pos]
        self.pos += 1
        out: list[str] = []
        text = self.text
        while self.pos < len(text):
            ch = text[self.pos]
            if ch == quote:
                self.pos += 1
                return "".join(out)
            if ch == "\\":
                if self.pos + 1 >= len(text):
                    self.pos += 1
                    break
                esc = text[self.pos + 1]
                if esc == "u" and re.fullmatch(r"[0-9a-fA-F]{4}", text[self.pos + 2 : self.pos + 6]):
                    out.append(chr(int(text[self.pos + 2 : self.pos + 6], 16)))
                    self.pos += 6
                    continue
                out.append(_ESCAPES.get(esc, "\\" + esc))
                self.pos += 2
                continue
            out.append(ch)
            self.pos += 1
        return "".join(out)  # cut off before the closing quote

    def key(self) -> str:
        if self.text[self.pos] in "\"'":
            return self.string()
        word = _WORD.match(self.text, self.pos)
        if not word:
            raise ValueError(f"expected a key at offset {self.pos}")
        self.pos = word.end()
        return word.group()

    def object(self) -> dict[str, Any]:
        self.pos += 1
        result: dict[str, Any] = {}
        while True:
            self.skip_space()
            if self.at_end():
                return result
            ch = self.text[self.pos]
            if ch == "}":
                self.pos += 1
                return result
            if ch == ",":
                self.pos += 1
                continue
            key = self.key()
            self.skip_space()
            if self.at_end():
                return result
            if self.text[self.pos] != ":":
                raise ValueError(f"expected ':' at offset {self.pos}")
            self.pos += 1
            try:
                result[key] = self.value()
            except _Truncated:
                return result

    def array(self) -> list[Any]:
        self.pos += 1
        result: list[Any] = []
        while True:
            self.skip_space()
            if self.at_end():
                return result
            ch = self.text[self.pos]
            if ch == "]":
                self.pos += 1
                return result
            if ch == ",":
                self.pos += 1
                continue
            try:
                result.append(self.value())
            except _Truncated:
                return result


def loads_lenient(text: str) -> Any:
    """Reads one JSON value from `text`, repairing the faults listed in the module docstring.

    Raises ValueError when the text does not start with a value or has something other than
    whitespace after it.
    """
    values = loads_lenient_sequence(text)
    if len(values) != 1:
        raise ValueError(f"expected one JSON value, found {len(values)}")
    return values[0]


def loads_lenient_sequence(text: str) -> list[Any]:
    """Reads consecutive JSON values separated by whitespace or commas (`{..}\\n{..}`)."""
    reader = _Reader(text)
    values: list[Any] = []
    while True:
        reader.skip_space()
        if reader.at_end():
            return values
        if values and reader.text[reader.pos] == ",":
            reader.pos += 1
            continue
        try:
            values.append(reader.value())
        except _Truncated as exc:
            raise ValueError("text ends inside an incomplete literal") from exc


class JsonEndTracker:
    """Finds, incrementally, where a JSON value that starts with `{` or `[` closes.

    Quote-aware for both `"` and `'` strings, so braces inside strings do not count. Feed it
    the text as it grows; `end` becomes the offset just past the closing bracket.
    """

    def __init__(self) -> None:
        self.scanned = 0  # offset of the next character to look at
        self.depth = 0
        self.quote: str | None = None
        self.escaped = False
        self.end: int | None = None

    def advance(self, text: str) -> int | None:
        """Scans `text[self.scanned:]` (text must extend what was seen before)."""
        pos = self.scanned
        while self.end is None and pos < len(text):
            ch = text[pos]
            if self.quote is not None:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == self.quote:
                    self.quote = None
            elif ch in "\"'":
                self.quote = ch
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth <= 0:
                    self.end = pos + 1
            pos += 1
        self.scanned = pos
        return self.end
