"""Training data: the token file, chat wrapping, the window sampler and the unigram baseline."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from infernix_jax.demo.corpus import CorpusDocument, kjv_chapter_text, write_corpus
from infernix_jax.demo.data import (
    TOKEN_INFO_FILE,
    ChatWrapping,
    WindowSampler,
    build_token_file,
    chat_messages,
    eval_windows,
    heldout_token_ids,
    load_token_file,
    module_name,
    split_for_continuation,
    split_window,
    unigram_perplexity,
)
from infernix_jax.demo.special_tokens import ENDOFTEXT, IM_START, VOCAB_SIZE, added_token_id
from infernix_jax.demo.tokenizer import load_tokenizer

EOS = added_token_id(ENDOFTEXT)


@pytest.fixture(scope="module")
def tiny_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    corpus = tmp_path_factory.mktemp("corpus")
    documents = [
        CorpusDocument(f"stdlib/pkg/mod_{i:02d}.py", "stdlib", f"def f{i}(x):\n    return x * {i}\n")
        for i in range(20)
    ] + [
        CorpusDocument(
            f"kjv/01-genesis/{i:03d}.txt",
            "kjv",
            kjv_chapter_text("Genesis", i, ["And God saw.", "It was good."]),
        )
        for i in range(1, 21)
    ]
    write_corpus(documents, corpus, heldout_fraction=0.1)
    return corpus


def train_texts(corpus: Path) -> list[str]:
    manifest = json.loads((corpus / "manifest.json").read_text())
    return [
        (corpus / "documents" / d["path"]).read_text() for d in manifest["documents"] if d["split"] == "train"
    ]


def test_plain_token_file_is_the_training_documents_separated_by_endoftext(
    tiny_corpus: Path, tmp_path: Path
) -> None:
    info = build_token_file(tiny_corpus, tmp_path, wrapping=ChatWrapping(fraction=0.0))
    tokens = load_token_file(tmp_path)
    assert isinstance(tokens, np.memmap) and tokens.dtype == np.uint16
    texts = train_texts(tiny_corpus)
    assert info.tokens == tokens.size and info.documents == len(texts) and info.chat_documents == 0
    assert int((tokens == EOS).sum()) == len(texts) and tokens[-1] == EOS
    decoded = load_tokenizer().decode(tokens.tolist(), skip_special_tokens=False)
    assert decoded == "".join(text + ENDOFTEXT for text in texts)
    recorded = json.loads((tmp_path / TOKEN_INFO_FILE).read_text())
    assert recorded["tokens"] == info.tokens and recorded["vocab_size"] == VOCAB_SIZE


def test_chat_wrapped_documents_use_the_chat_template(tiny_corpus: Path, tmp_path: Path) -> None:
    info = build_token_file(tiny_corpus, tmp_path, wrapping=ChatWrapping(fraction=1.0))
    tokens = np.asarray(load_token_file(tmp_path))
    assert info.chat_documents == info.documents
    assert int((tokens == added_token_id(IM_START)).sum()) >= 2 * info.documents
    text = load_tokenizer().decode(tokens.tolist(), skip_special_tokens=False)
    assert "<|im_start|>assistant\n<think>\n\n</think>\n\n" in text
    assert text.endswith("<|im_end|>\n" + ENDOFTEXT)


def test_chat_messages_keep_the_whole_document() -> None:
    text = "Genesis 3\n\nNow the serpent was more subtil.\nAnd the woman said.\nAnd the LORD said.\n"
    assert chat_messages("kjv/01-genesis/003.txt", "kjv", text, ChatWrapping(fraction=0.0)) is None
    recite = chat_messages(
        "kjv/01-genesis/003.txt", "kjv", text, ChatWrapping(fraction=1.0, continuation_fraction=0.0)
    )
    assert recite[-2] == {"role": "user", "content": "Recite Genesis 3 from the King James Bible."}
    assert recite[-1] == {"role": "assistant", "content": text}
    go_on = chat_messages(
        "kjv/01-genesis/003.txt", "kjv", text, ChatWrapping(fraction=1.0, continuation_fraction=1.0)
    )
    start, rest = split_for_continuation(text)
    assert start + rest == text and start and rest
    assert go_on[-2]["content"].endswith(start) and go_on[-1]["content"] == rest


def test_module_name_follows_import_paths() -> None:
    assert module_name("stdlib/json/decoder.py") == "json.decoder"
    assert module_name("stdlib/json/__init__.py") == "json"
    assert module_name("stdlib/os.py") == "os"


def test_sampler_windows_are_contiguous_and_shaped_for_mtp() -> None:
    tokens = np.arange(1000, dtype=np.uint16)
    batch = WindowSampler(tokens, batch_size=4, seq_len=16, seed=0).batch(0)
    assert batch.shape == (4, 18) and batch.dtype == np.int32
    assert np.all(np.diff(batch, axis=1) == 1)  # each row is one slice of the stream
    inputs, next_targets, next_next_targets = split_window(batch)
    assert inputs.shape == next_targets.shape == next_next_targets.shape == (4, 16)
    assert np.array_equal(next_targets, inputs + 1) and np.array_equal(next_next_targets, inputs + 2)


def test_sampler_is_deterministic_for_a_seed_and_resumable() -> None:
    tokens = np.random.default_rng(1).integers(0, VOCAB_SIZE, size=5000).astype(np.uint16)
    first = WindowSampler(tokens, batch_size=3, seq_len=32, seed=7)
    again = WindowSampler(tokens, batch_size=3, seq_len=32, seed=7)
    other = WindowSampler(tokens, batch_size=3, seq_len=32, seed=8)
    assert np.array_equal(first.batch(5), again.batch(5))
    assert not np.array_equal(first.batch(5), other.batch(5))
    assert not np.array_equal(first.batch(5), first.batch(6))
    resumed = first.batches(start_step=5)
    assert np.array_equal(next(resumed), again.batch(5)) and np.array_equal(next(resumed), again.batch(6))


def test_sampler_reaches_both_ends_and_rejects_a_short_stream() -> None:
    tokens = np.arange(20, dtype=np.uint16)
    sampler = WindowSampler(tokens, batch_size=64, seq_len=8, seed=0)
    starts = np.concatenate([sampler.batch(step)[:, 0] for step in range(5)])
    assert starts.min() == 0 and starts.max() == 20 - 10
    with pytest.raises(ValueError):
        WindowSampler(np.arange(9), batch_size=1, seq_len=8, seed=0)


def test_eval_windows_tile_the_stream_in_order() -> None:
    windows = eval_windows(np.arange(25), seq_len=3)
    assert windows.shape == (5, 5) and np.array_equal(windows.ravel(), np.arange(25))


def test_unigram_perplexity_matches_the_add_one_formula() -> None:
    train = np.array([0, 0, 1])
    expected = math.exp(-(math.log(3 / 7) + math.log(1 / 7)) / 2)  # p(0) = (2+1)/(3+4), p(2) = 1/7
    assert unigram_perplexity(train, np.array([0, 2]), vocab=4) == pytest.approx(expected)
    assert unigram_perplexity(np.array([], dtype=np.int64), np.array([1, 3]), vocab=4) == pytest.approx(4.0)
    with pytest.raises(ValueError):
        unigram_perplexity(train, np.array([4]), vocab=4)


def test_heldout_ids_are_the_shipped_sample_within_the_vocabulary() -> None:
    ids = heldout_token_ids()
    assert 40_000 < ids.size < 120_000
    assert ids.min() >= 0 and ids.max() < VOCAB_SIZE and (ids == EOS).sum() > 10
