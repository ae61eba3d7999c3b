"""Shared fixtures for the chat tests: the real Qwen3 tokenizer, loaded once per session."""

from __future__ import annotations

import json
import pathlib

import pytest

from infernix_jax.chat import Tokenizer
from tests.chat.qwen3_files import qwen3_tokenizer_dir

FIXTURES = pathlib.Path(__file__).resolve().parent.parent / "fixtures" / "chat"


def load_fixture(name: str) -> dict:
    """A JSON file written by tests/fixtures/make_chat_fixtures.py."""
    with open(FIXTURES / name, encoding="utf-8") as handle:
        return json.load(handle)


@pytest.fixture(scope="session")
def qwen3_dir() -> pathlib.Path:
    return qwen3_tokenizer_dir()


@pytest.fixture(scope="session")
def qwen3(qwen3_dir: pathlib.Path) -> Tokenizer:
    return Tokenizer.from_dir(qwen3_dir)
