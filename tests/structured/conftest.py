"""Fixtures for constrained decoding: the llguidance backend over the real Qwen3 tokenizer, and an
engine over a tiny random-weight model with that tokenizer (built once per test process)."""

from __future__ import annotations

import pytest

from infernix_jax.chat.tokenizer import Tokenizer
from tests.chat.qwen3_files import qwen3_tokenizer_dir


@pytest.fixture(scope="session")
def qwen3_tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(qwen3_tokenizer_dir())


@pytest.fixture(scope="session")
def backend(qwen3_tokenizer):
    from infernix_jax.structured import default_backend

    return default_backend(qwen3_tokenizer)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from tests.structured.tiny_model import write_tiny_qwen3

    return write_tiny_qwen3(tmp_path_factory.mktemp("tiny_qwen3_structured"))


@pytest.fixture(scope="session")
def llm(tiny_model_dir):
    from infernix_jax.engine.llm import LLM
    from tests.structured.tiny_model import ENGINE_OPTIONS

    return LLM(tiny_model_dir, **ENGINE_OPTIONS)
