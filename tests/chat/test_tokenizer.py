"""Tokenizer: encodes and decodes as transformers does, and reads a model folder's special tokens,
stop ids and chat templates from the files transformers reads."""

from __future__ import annotations

import json
import pathlib

import pytest
import tokenizers

from infernix_jax.chat import Tokenizer
from tests.chat.conftest import load_fixture

ENCODINGS = load_fixture("qwen3_encodings.json")["cases"]
QWEN3_SPECIAL_IDS = frozenset(range(151643, 151657))  # <|endoftext|> ... <|video_pad|>


@pytest.mark.parametrize("case", ENCODINGS, ids=[repr(case["text"][:24]) for case in ENCODINGS])
def test_encode_and_decode_match_transformers(qwen3: Tokenizer, case: dict) -> None:
    assert qwen3.encode(case["text"]) == case["ids"]
    assert qwen3.decode(case["ids"]) == case["decoded"]
    assert qwen3.decode(case["ids"], skip_special_tokens=True) == case["decoded_skip_special"]


def test_qwen3_special_tokens(qwen3: Tokenizer) -> None:
    assert qwen3.vocab_size == 151669
    assert qwen3.eos_token_ids == (151645, 151643)
    assert qwen3.bos_token_id is None
    assert qwen3.pad_token_id == 151643
    assert qwen3.special_token_ids == QWEN3_SPECIAL_IDS
    assert qwen3.token_to_id("<think>") == 151667
    assert qwen3.id_to_token(151668) == "</think>"
    assert qwen3.token_to_id("<not a token>") is None
    assert qwen3.id_to_token(10**6) is None


def test_think_and_tool_tokens_are_single_ids_but_not_special(qwen3: Tokenizer) -> None:
    ids = qwen3.encode("<think>x</think><tool_call>")
    assert ids[0] == 151667 and ids[-1] == 151657
    assert "<think>" in qwen3.decode(ids, skip_special_tokens=True)


def test_decode_ignores_ids_beyond_the_vocabulary(qwen3: Tokenizer) -> None:
    # Model embeddings are padded past the tokenizer's ids (151936 rows for 151669 ids).
    hello = qwen3.encode("Hello")
    assert qwen3.decode([*hello, 151900]) == "Hello"


def test_encode_chat_uses_the_template_and_no_added_tokens(qwen3: Tokenizer) -> None:
    ids = qwen3.encode_chat([{"role": "user", "content": "hi"}])
    assert ids == qwen3.encode("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


# --- model folders, built around a tiny word-level tokenizer -----------------------------------

WORDS = ["<unk>", "<s>", "</s>", "<pad>", "<|im_end|>", "<think>", "hello", "world", ".", "don't"]


def tiny_backend() -> tokenizers.Tokenizer:
    backend = tokenizers.Tokenizer(
        tokenizers.models.WordLevel({word: index for index, word in enumerate(WORDS)}, unk_token="<unk>")
    )
    backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    backend.decoder = tokenizers.decoders.WordPiece(prefix="##", cleanup=False)
    backend.add_special_tokens(
        [tokenizers.AddedToken("<s>", special=True), tokenizers.AddedToken("</s>", special=True)]
    )
    backend.add_tokens([tokenizers.AddedToken("<|im_end|>"), tokenizers.AddedToken("<think>")])
    return backend


def write_model_dir(folder: pathlib.Path, config: dict, files: dict[str, str] | None = None) -> pathlib.Path:
    tiny_backend().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    for name, text in (files or {}).items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return folder


def test_config_special_tokens_become_special(tmp_path: pathlib.Path) -> None:
    config = {
        "bos_token": {"content": "<s>", "special": True},
        "eos_token": "</s>",
        "pad_token": "<pad>",
        "additional_special_tokens": ["<think>"],
    }
    tokenizer = Tokenizer.from_dir(write_model_dir(tmp_path, config))
    think, pad = WORDS.index("<think>"), WORDS.index("<pad>")
    assert tokenizer.bos_token_id == 1 and tokenizer.pad_token_id == pad
    assert tokenizer.special_token_ids == frozenset({1, 2, pad, think})
    assert tokenizer.decode([6, think, 7], skip_special_tokens=True) == "hello world"
    assert tokenizer.special_tokens == {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}


def test_eos_ids_merge_config_generation_config_and_chatml(tmp_path: pathlib.Path) -> None:
    folder = write_model_dir(
        tmp_path, {"eos_token": "</s>"}, {"generation_config.json": '{"eos_token_id": [2, 5]}'}
    )
    assert Tokenizer.from_dir(folder).eos_token_ids == (2, 5, WORDS.index("<|im_end|>"))


def test_generation_config_single_eos_id(tmp_path: pathlib.Path) -> None:
    folder = write_model_dir(tmp_path, {}, {"generation_config.json": '{"eos_token_id": 7}'})
    assert Tokenizer.from_dir(folder).eos_token_ids == (7, WORDS.index("<|im_end|>"))


def test_clean_up_tokenization_spaces_follows_the_config(tmp_path: pathlib.Path) -> None:
    tokenizer = Tokenizer.from_dir(write_model_dir(tmp_path, {"clean_up_tokenization_spaces": True}))
    ids = tokenizer.encode("hello world . don't")
    assert tokenizer.decode(ids) == "hello world. don't"
    assert tokenizer.decode(ids, clean_up_tokenization_spaces=False) == "hello world . don't"


def test_template_from_tokenizer_config(tmp_path: pathlib.Path) -> None:
    tokenizer = Tokenizer.from_dir(
        write_model_dir(tmp_path, {"chat_template": "config:{{ messages[0].content }}"})
    )
    assert tokenizer.chat_template.render([{"role": "user", "content": "x"}]) == "config:x"


def test_template_file_takes_priority_over_config(tmp_path: pathlib.Path) -> None:
    folder = write_model_dir(
        tmp_path, {"chat_template": "config"}, {"chat_template.jinja": "file:{{ messages | length }}"}
    )
    assert Tokenizer.from_dir(folder).chat_template.render([{"role": "user", "content": ""}]) == "file:1"


def test_processor_chat_template_json_is_read(tmp_path: pathlib.Path) -> None:
    folder = write_model_dir(tmp_path, {}, {"chat_template.json": json.dumps({"chat_template": "json"})})
    assert Tokenizer.from_dir(folder).chat_template.render([{"role": "user", "content": ""}]) == "json"


def test_named_templates_and_tool_use_selection(tmp_path: pathlib.Path) -> None:
    config = {
        "chat_template": [{"name": "default", "template": "plain"}, {"name": "tool_use", "template": "tools"}]
    }
    tokenizer = Tokenizer.from_dir(write_model_dir(tmp_path, config))
    message = [{"role": "user", "content": ""}]
    assert tokenizer.chat_template.render(message) == "plain"
    assert tokenizer.get_chat_template(has_tools=True).render(message) == "tools"
    assert tokenizer.get_chat_template("tool_use").render(message) == "tools"
    with pytest.raises(ValueError, match="no chat template named"):
        tokenizer.get_chat_template("missing")


def test_additional_chat_templates_folder(tmp_path: pathlib.Path) -> None:
    folder = write_model_dir(
        tmp_path, {}, {"chat_template.jinja": "main", "additional_chat_templates/rag.jinja": "rag"}
    )
    tokenizer = Tokenizer.from_dir(folder)
    assert tokenizer.get_chat_template("rag").render([{"role": "user", "content": ""}]) == "rag"
    assert tokenizer.chat_template.render([{"role": "user", "content": ""}]) == "main"


def test_folder_without_template(tmp_path: pathlib.Path) -> None:
    tokenizer = Tokenizer.from_dir(write_model_dir(tmp_path, {}))
    assert tokenizer.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.encode_chat([{"role": "user", "content": "x"}])


def test_folder_without_tokenizer_json(tmp_path: pathlib.Path) -> None:
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
