"""Incremental detokenization for streaming: text as tokens arrive, never half a character.

A token is not a unit of text. In a byte-level BPE (Qwen, GPT) an emoji or a rare CJK character is
often split over several tokens, each holding some of its UTF-8 bytes; decoding a prefix that ends
inside such a character yields U+FFFD. SentencePiece-style tokenizers (``▁`` for a space, byte
fallback ``<0xE2>`` tokens) have the same problem, and also drop a word's leading space when its token
is decoded alone. So the streamer decodes a short *window* of recent tokens and emits only the part
of the window's text that is past what was already sent and cannot change any more: the text is
held back while it ends in U+FFFD (bytes still incomplete). This is the prefix-offset scheme of
vLLM's detokenizer and HF's TextStreamer.

State (token indices into all ids seen):

* ``prefix_offset``: where the decode window starts (one step of context before ``read_offset``,
  so that leading spaces decode as they do mid-text);
* ``read_offset``: the tokens before it are fully emitted; their window text is ``prefix_text``;
* ``held_chars``: how much of the text after ``prefix_text`` was emitted early, when the window ended
  in an incomplete character but had complete text before it.

The concatenation of everything :meth:`IncrementalDetokenizer.add` and :meth:`flush` return equals
``tokenizer.decode(all_ids, skip_special_tokens, clean_up_tokenization_spaces=False)``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

REPLACEMENT_CHARACTER = "\ufffd"


class Decoder(Protocol):
    """What the detokenizer needs from a tokenizer."""

    def decode(
        self,
        ids: list[int],
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
    ) -> str: ...


class IncrementalDetokenizer:
    """Turns a stream of token ids into a stream of complete text pieces, for one sequence."""

    def __init__(self, tokenizer: Decoder, skip_special_tokens: bool = False) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.prefix_text = ""
        self.held_chars = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def add(self, token_ids: Iterable[int]) -> str:
        """Append tokens; return the text they completed (possibly ``""``)."""
        self.ids.extend(int(token_id) for token_id in token_ids)
        if len(self.ids) == self.read_offset:
            return ""
        text = self._decode(self.ids[self.prefix_offset :])
        start = len(self.prefix_text) + self.held_chars
        if not text.endswith(REPLACEMENT_CHARACTER):
            # Everything decoded is final: emit it and slide the window forward.
            piece = text[start:]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            # Decoded on its own, not cut from ``text``: a window's first token may decode differently
            # (SentencePiece drops its leading space), and the next window starts with it.
            self.prefix_text = self._decode(self.ids[self.prefix_offset : self.read_offset])
            self.held_chars = 0
            return piece
        # The window ends inside a character; the text before its trailing U+FFFD run cannot change.
        stable_end = len(text.rstrip(REPLACEMENT_CHARACTER))
        if stable_end <= start:
            return ""
        self.held_chars = stable_end - len(self.prefix_text)
        return text[start:stable_end]

    def flush(self) -> str:
        """Return whatever is still held back (e.g. bytes that never completed, as U+FFFD)."""
        if len(self.ids) == self.read_offset:
            return ""
        text = self._decode(self.ids[self.prefix_offset :])
        piece = text[len(self.prefix_text) + self.held_chars :]
        self.prefix_offset = self.read_offset = len(self.ids)
        self.prefix_text = ""
        self.held_chars = 0
        return piece
