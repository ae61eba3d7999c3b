"""The shipped demo tokenizer: Qwen's special tokens, Qwen's pre-tokenization, exact round trips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from infernix_jax.demo import MANIFEST_PATH, MODEL_DIR, load_heldout_text
from infernix_jax.demo.special_tokens import (
    BPE_VOCAB_SIZE,
    ENDOFTEXT,
    IM_END,
    QWEN_ADDED_TOKENS,
    VOCAB_SIZE,
    added_token_id,
)
from infernix_jax.demo.tokenizer import (
    TOKENIZER_CONFIG_FILE,
    TOKENIZER_FILE,
    bytes_per_token,
    load_chat_template,
    load_tokenizer,
    qwen_tokenizer_files_dir,
    round_trips,
    train_tokenizer,
    write_tokenizer,
)


@pytest.fixture(scope="module")
def shipped() -> Tokenizer:
    return Tokenizer.from_file(str(MODEL_DIR / TOKENIZER_FILE))


@pytest.fixture(scope="module")
def shipped_config() -> dict:
    return json.loads((MODEL_DIR / TOKENIZER_CONFIG_FILE).read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def qwen_files() -> Path:
    """The real Qwen3 tokenizer files (read as data: the package itself does not import cleanly)."""
    return qwen_tokenizer_files_dir()


def test_shipped_tokenizer_has_the_full_vocabulary(shipped: Tokenizer) -> None:
    assert shipped.get_vocab_size(with_added_tokens=True) == VOCAB_SIZE
    assert shipped.get_vocab_size(with_added_tokens=False) == BPE_VOCAB_SIZE


@pytest.mark.parametrize("spec", QWEN_ADDED_TOKENS, ids=lambda spec: spec.content)
def test_each_added_token_is_one_token_with_its_id(shipped: Tokenizer, spec) -> None:
    expected = added_token_id(spec.content)
    assert shipped.token_to_id(spec.content) == expected
    assert shipped.encode(f"x{spec.content}y", add_special_tokens=False).ids[1] == expected
    assert shipped.encode(spec.content, add_special_tokens=False).ids == [expected]


def test_special_tokens_are_dropped_on_skip_and_think_markers_are_kept(shipped: Tokenizer) -> None:
    ids = shipped.encode("<|im_start|>assistant\n<think>\nhm\n</think>\n\nHi.<|im_end|>").ids
    assert shipped.decode(ids, skip_special_tokens=True) == "assistant\n<think>\nhm\n</think>\n\nHi."


def test_added_tokens_follow_qwen3_order_and_flags(shipped_config: dict, qwen_files) -> None:
    qwen = json.loads((qwen_files / TOKENIZER_CONFIG_FILE).read_text(encoding="utf-8"))
    qwen_tokens = [
        (a["content"], a["special"])
        for _, a in sorted(qwen["added_tokens_decoder"].items(), key=lambda i: int(i[0]))
    ]
    assert [(s.content, s.special) for s in QWEN_ADDED_TOKENS] == qwen_tokens
    ours = {int(i): (a["content"], a["special"]) for i, a in shipped_config["added_tokens_decoder"].items()}
    assert ours == {BPE_VOCAB_SIZE + n: token for n, token in enumerate(qwen_tokens)}


def test_pipeline_components_are_qwen3s(qwen_files) -> None:
    ours = json.loads((MODEL_DIR / TOKENIZER_FILE).read_text(encoding="utf-8"))
    qwen = json.loads((qwen_files / TOKENIZER_FILE).read_text(encoding="utf-8"))
    for component in ("normalizer", "pre_tokenizer", "post_processor", "decoder"):
        assert ours[component] == qwen[component], component
    settings = lambda model: {k: v for k, v in model.items() if k not in ("vocab", "merges")}
    assert settings(ours["model"]) == settings(qwen["model"])


def test_config_carries_qwen3_chat_template_and_eos_pad(shipped_config: dict, qwen_files) -> None:
    qwen = json.loads((qwen_files / TOKENIZER_CONFIG_FILE).read_text(encoding="utf-8"))
    assert load_chat_template() == qwen["chat_template"]
    assert shipped_config["eos_token"] == IM_END
    assert shipped_config["pad_token"] == ENDOFTEXT
    assert shipped_config["tokenizer_class"] == "Qwen2Tokenizer"


def test_heldout_text_round_trips_exactly(shipped: Tokenizer) -> None:
    text = load_heldout_text()
    assert round_trips(shipped, text)
    ids = shipped.encode(text, add_special_tokens=False).ids
    assert ids.count(added_token_id(ENDOFTEXT)) == text.count(ENDOFTEXT) > 10


def test_shipped_tokenizer_compresses_code_and_prose(shipped: Tokenizer) -> None:
    paths = json.loads(MANIFEST_PATH.read_text(encoding="utf-8"))["heldout_sample"]["paths"]
    documents = load_heldout_text().split(ENDOFTEXT)
    assert len(documents) == len(paths)
    code = [d for p, d in zip(paths, documents) if p.startswith("stdlib/")]
    prose = [d for p, d in zip(paths, documents) if p.startswith("kjv/")]
    # Held-out code is a quarter codec tables (escaped characters), hence the lower figure.
    assert bytes_per_token(shipped, code) > 3.0
    assert bytes_per_token(shipped, prose) > 4.0


def test_chat_tokenizer_loads_the_shipped_folder() -> None:
    from infernix_jax.chat.tokenizer import Tokenizer as ChatTokenizer

    chat = ChatTokenizer.from_dir(MODEL_DIR)
    assert chat.vocab_size == VOCAB_SIZE
    assert added_token_id(IM_END) in chat.eos_token_ids


def test_train_tokenizer_places_added_tokens_after_a_small_vocabulary(tmp_path, qwen_files) -> None:
    texts = ["def add(a, b):\n    return a + b\n", "In the beginning was the Word.\n"] * 50
    tokenizer = train_tokenizer(texts, bpe_vocab_size=280)
    assert tokenizer.get_vocab_size() == 280 + len(QWEN_ADDED_TOKENS)
    assert tokenizer.token_to_id(IM_END) == added_token_id(IM_END, 280)
    assert round_trips(tokenizer, "naïve café — ☃ 𝔘 \t\r\n text")  # bytes never seen in training
    write_tokenizer(tokenizer, tmp_path, qwen_files)
    assert load_tokenizer(tmp_path).token_to_id(ENDOFTEXT) == 280
    config = json.loads((tmp_path / TOKENIZER_CONFIG_FILE).read_text(encoding="utf-8"))
    assert config["added_tokens_decoder"]["280"]["content"] == ENDOFTEXT


def test_train_tokenizer_refuses_text_too_small_for_the_vocabulary() -> None:
    with pytest.raises(ValueError, match="too small"):
        train_tokenizer(["tiny text"], bpe_vocab_size=2000)
