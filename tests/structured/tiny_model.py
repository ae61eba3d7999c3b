"""A tiny random-weight Qwen3 whose vocabulary is the real Qwen3 tokenizer's, for constrained decoding.

The tests' qwen3_dense fixture (4 layers, hidden 64) with its tied embedding widened to Qwen3's
151,936 rows, so every id the real tokenizer (and the grammar library's view of it) can produce
exists in the model. Random weights give near-uniform, long-winded output: the constraint alone
shapes it, which is what these tests check.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

from tests.chat.qwen3_files import qwen3_tokenizer_dir

FIXTURE = Path(__file__).parents[1] / "fixtures" / "hf" / "qwen3_dense"
QWEN3_VOCAB = 151936
EOS_IDS = [151645, 151643]

# Small buckets: a chat prompt is a few 64-token chunks; a batch of samples fits one decode batch of
# 32, and its last few rows (the long tail) run at batch 8.
ENGINE_OPTIONS = {
    "max_context": 512,
    "max_concurrency": 32,
    "warmup": False,
    "progress": False,
    "prefill_chunk": 64,
    "prefill_buckets": (64,),
    "prefill_batch_sizes": (1, 4),
    "decode_batch_sizes": (8, 32),
    "decode_steps_per_dispatch": 4,
    "compilation_cache_dir": None,
}


def write_tiny_qwen3(folder: Path) -> Path:
    """Write the model folder (weights, config, Qwen3 tokenizer files) into folder."""
    from safetensors.numpy import load_file, save_file

    weights = load_file(FIXTURE / "model.safetensors")
    hidden = weights["model.embed_tokens.weight"].shape[1]
    rng = np.random.default_rng(0)
    weights["model.embed_tokens.weight"] = (rng.standard_normal((QWEN3_VOCAB, hidden)) * 0.5).astype(
        np.float32
    )
    save_file(weights, folder / "model.safetensors")
    config = json.loads((FIXTURE / "config.json").read_text())
    config.update(vocab_size=QWEN3_VOCAB, eos_token_id=EOS_IDS[0])
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": EOS_IDS}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(qwen3_tokenizer_dir() / name, folder / name)
    return folder
