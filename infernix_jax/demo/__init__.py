"""The bundled demo model: a small Qwen3-Next-layout model trained by the project on an offline corpus.

``corpus`` builds the corpus (stdlib code + King James Bible prose), ``tokenizer`` trains the
byte-level BPE tokenizer with Qwen's special tokens and chat template, ``data`` turns the corpus into
a token file and training batches. The shipped checkpoint lives in ``MODEL_DIR``; the held-out text
every perplexity figure is measured on ships as ``HELDOUT_TEXT_PATH``.
"""

from __future__ import annotations

from pathlib import Path

DEMO_DIR = Path(__file__).resolve().parent
MODEL_DIR = DEMO_DIR / "model"  # Hugging Face layout: config.json, model.safetensors, tokenizer files
HELDOUT_TEXT_PATH = DEMO_DIR / "heldout.txt"  # held-out documents joined by <|endoftext|>
MANIFEST_PATH = DEMO_DIR / "corpus_manifest.json"
# Token counts of the training split (uint32 [vocab]), written by `python -m infernix_jax.demo.data`:
# the add-one unigram baseline that held-out perplexity is compared with.
UNIGRAM_COUNTS_PATH = DEMO_DIR / "unigram_counts.npy"  # the corpus build's file list, hashes and split


def load_heldout_text() -> str:
    """The shipped held-out sample (code and prose documents separated by ``<|endoftext|>``)."""
    return HELDOUT_TEXT_PATH.read_text(encoding="utf-8")
