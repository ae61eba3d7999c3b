"""Streaming detokenization: pieces are whole characters, and together they are the full decode."""

from __future__ import annotations

import pytest
import tokenizers
from tokenizers import decoders, models, normalizers

from infernix_jax.chat import IncrementalDetokenizer, Tokenizer
from tests.chat.conftest import load_fixture

ENCODINGS = load_fixture("qwen3_encodings.json")["cases"]
REPLACEMENT = "\ufffd"


def stream(
    tokenizer: Tokenizer, ids: list[int], chunk: int = 1, skip_special_tokens: bool = False
) -> list[str]:
    """Feed ``ids`` ``chunk`` at a time; the pieces returned, the flush last."""
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
    pieces = [detokenizer.add(ids[start : start + chunk]) for start in range(0, len(ids), chunk)]
    pieces.append(detokenizer.flush())
    return pieces


@pytest.mark.parametrize("skip_special_tokens", [False, True])
@pytest.mark.parametrize("chunk", [1, 3])
def test_stream_concatenates_to_the_full_decode(
    qwen3: Tokenizer, chunk: int, skip_special_tokens: bool
) -> None:
    for case in ENCODINGS:
        pieces = stream(qwen3, case["ids"], chunk, skip_special_tokens)
        assert "".join(pieces) == qwen3.decode(case["ids"], skip_special_tokens=skip_special_tokens), case[
            "text"
        ]
        assert not any(REPLACEMENT in piece for piece in pieces), case["text"]


def test_characters_split_over_tokens_are_held_until_complete(qwen3: Tokenizer) -> None:
    for text in ["𪚥", "𠀀", "🧑‍💻", "🇯🇵"]:
        ids = qwen3.encode(text)
        pieces = stream(qwen3, ids)
        assert "".join(pieces) == text
        # Each piece ends on a character boundary of the text.
        emitted = ""
        for piece in pieces:
            emitted += piece
            assert text.startswith(emitted) and REPLACEMENT not in piece
    assert len(qwen3.encode("𪚥")) > 1, "the test needs a character that Qwen3 splits into byte tokens"
    assert stream(qwen3, qwen3.encode("𪚥"))[0] == ""


def test_incomplete_bytes_are_released_as_replacement_when_text_follows(qwen3: Tokenizer) -> None:
    partial = qwen3.encode("𪚥")[:1]
    ids = partial + qwen3.encode("abc")
    pieces = stream(qwen3, ids)
    assert "".join(pieces) == qwen3.decode(ids)
    assert REPLACEMENT in "".join(pieces) and "".join(pieces).endswith("abc")


def test_flush_releases_bytes_that_never_completed(qwen3: Tokenizer) -> None:
    detokenizer = IncrementalDetokenizer(qwen3)
    assert detokenizer.add(qwen3.encode("ok ")) == "ok "
    assert detokenizer.add(qwen3.encode("𪚥")[:1]) == ""
    assert detokenizer.flush() == REPLACEMENT
    assert detokenizer.flush() == ""
    assert detokenizer.add([]) == ""


def test_literal_replacement_character_is_emitted(qwen3: Tokenizer) -> None:
    ids = qwen3.encode("a\ufffdb\ufffd")
    pieces = stream(qwen3, ids)
    assert "".join(pieces) == "a\ufffdb\ufffd"


def test_special_tokens_stream_as_text_or_are_skipped(qwen3: Tokenizer) -> None:
    ids = qwen3.encode("<think>\nhmm\n</think>\n\nYes.<|im_end|>")
    assert stream(qwen3, ids)[-2:] == ["<|im_end|>", ""]
    assert "".join(stream(qwen3, ids, skip_special_tokens=True)) == "<think>\nhmm\n</think>\n\nYes."


def test_text_mostly_arrives_token_by_token(qwen3: Tokenizer) -> None:
    ids = qwen3.encode("The quick brown fox jumps over the lazy dog.")
    pieces = stream(qwen3, ids)
    assert pieces[:-1] == [qwen3.decode([token]) for token in ids]


# --- a SentencePiece-style tokenizer: "▁" for spaces, byte-fallback tokens, leading space stripped ---


def byte_fallback_tokenizer() -> Tokenizer:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for byte in range(256):
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for piece in ["▁", "H", "e", "l", "o", "w", "r", "d", "!", "▁Hello", "▁world"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "H"), ("▁H", "e"), ("l", "l"), ("▁He", "ll"), ("▁Hell", "o")]
    for merge in merges:
        vocab.setdefault("".join(merge), len(vocab))
    backend = tokenizers.Tokenizer(
        models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True)
    )
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    backend.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.add_special_tokens(
        [tokenizers.AddedToken("<s>", special=True), tokenizers.AddedToken("</s>", special=True)]
    )
    return Tokenizer(backend, {"bos_token": "<s>", "eos_token": "</s>"})


@pytest.mark.parametrize(
    "text", ["Hello 😀 世界 world!  x", "  two leading spaces", "世", "Hello\u00e9 ▁ done", "😀😀 😀"]
)
@pytest.mark.parametrize("chunk", [1, 2])
def test_byte_fallback_stream(text: str, chunk: int) -> None:
    tokenizer = byte_fallback_tokenizer()
    ids = tokenizer.encode(text)
    assert any(tokenizer.id_to_token(token).startswith("<0x") for token in ids)
    pieces = stream(tokenizer, ids, chunk)
    assert "".join(pieces) == tokenizer.decode(ids)
    assert not any(REPLACEMENT in piece for piece in pieces)


def test_byte_fallback_stream_skips_special_tokens() -> None:
    tokenizer = byte_fallback_tokenizer()
    ids = [tokenizer.bos_token_id, *tokenizer.encode("Hello 世界"), tokenizer.eos_token_ids[0]]
    assert "".join(stream(tokenizer, ids, skip_special_tokens=True)) == "Hello 世界"
    assert "".join(stream(tokenizer, ids)) == tokenizer.decode(ids)
