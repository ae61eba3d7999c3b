"""Training data for the demo model: one flat token file, random windows from it, a unigram baseline.

The corpus's training documents are tokenized once into a flat ``uint16`` array (saved as ``.npy``
and read back memory-mapped), each document followed by ``<|endoftext|>``. A fixed share of the
documents (chosen by a hash of their path, so the choice is stable) is first rendered as a chat
exchange with the model's own chat template, so that the model learns ChatML framing: a user asks
for a module's source, a Bible chapter or the rest of a text, and the assistant answers with it.

``WindowSampler`` draws ``[B, T + 2]`` windows: inputs are ``w[:, :T]``, next-token targets
``w[:, 1:T + 1]`` and the MTP head's next-next-token targets ``w[:, 2:T + 2]`` (see
``split_window``). Batch ``k`` depends only on ``(seed, k)``, so a resumed run sees the same data.

    python -m infernix_jax.demo.data --corpus build/demo/corpus --out build/demo/tokens
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from infernix_jax.chat.template import ChatTemplate
from infernix_jax.demo import MODEL_DIR, UNIGRAM_COUNTS_PATH, load_heldout_text
from infernix_jax.demo.corpus import iter_documents, sha256_hex
from infernix_jax.demo.special_tokens import ENDOFTEXT, VOCAB_SIZE
from infernix_jax.demo.tokenizer import TOKENIZER_FILE, load_chat_template, load_tokenizer

TOKEN_FILE = "train_tokens.npy"
TOKEN_INFO_FILE = "train_tokens.json"
TOKEN_DTYPE = np.uint16  # every id of the 16384-entry vocabulary fits
ENCODE_BATCH_DOCUMENTS = 256  # documents per encode_batch call (bounds memory, keeps both cores busy)


@dataclass(frozen=True)
class ChatWrapping:
    """Which training documents become chat exchanges, and how."""

    fraction: float = 0.15  # share of documents rendered as a chat exchange
    system_fraction: float = 0.3  # share of those that open with a system message
    continuation_fraction: float = 0.4  # share of those where the user gives the start of the text
    seed: int = 0  # another seed picks other documents and other prompt forms
    system_prompt: str = "You are a helpful assistant."


@dataclass(frozen=True)
class TokenFileInfo:
    """What a token file holds; written beside it as JSON so a trainer can check it is current."""

    tokens: int
    documents: int
    chat_documents: int
    dtype: str
    vocab_size: int
    tokenizer_sha256: str  # of the tokenizer.json used
    corpus_manifest_sha256: str  # of the corpus's manifest.json
    chat_wrapping: dict


def _uniform(*parts: object) -> float:
    """A number in [0, 1) fixed by ``parts``: stable choices that need no random state."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def module_name(path: str) -> str:
    """ "stdlib/json/decoder.py" -> "json.decoder"; "stdlib/json/__init__.py" -> "json"."""
    parts = path.removeprefix("stdlib/").removesuffix(".py").split("/")
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def split_for_continuation(text: str) -> tuple[str, str]:
    """The text cut at the first line break after its first quarter: (given start, rest)."""
    cut = text.find("\n", len(text) // 4)
    if cut < 0 or cut + 1 >= len(text):
        cut = len(text) // 2
    return text[: cut + 1], text[cut + 1 :]


def chat_messages(path: str, source: str, text: str, wrapping: ChatWrapping) -> list[dict] | None:
    """The chat exchange a document becomes, or None when it stays plain text."""
    if _uniform("chat", wrapping.seed, path) >= wrapping.fraction:
        return None
    messages: list[dict] = []
    if _uniform("system", wrapping.seed, path) < wrapping.system_fraction:
        messages.append({"role": "system", "content": wrapping.system_prompt})
    if _uniform("continue", wrapping.seed, path) < wrapping.continuation_fraction:
        start, rest = split_for_continuation(text)
        kind = "Python code" if source == "stdlib" else "passage"
        messages.append({"role": "user", "content": f"Continue this {kind}:\n\n{start}"})
        messages.append({"role": "assistant", "content": rest})
        return messages
    if source == "stdlib":
        request = f"Show me the source of the Python standard library module `{module_name(path)}`."
    else:
        title = text.split("\n", 1)[0]  # "Genesis 1"
        request = f"Recite {title} from the King James Bible."
    messages.append({"role": "user", "content": request})
    messages.append({"role": "assistant", "content": text})
    return messages


def encode_documents(tokenizer: Tokenizer, texts: list[str]) -> np.ndarray:
    """Token ids of ``texts``, each followed by ``<|endoftext|>``, as one flat array."""
    eos = np.array([tokenizer.token_to_id(ENDOFTEXT)], dtype=TOKEN_DTYPE)
    pieces: list[np.ndarray] = []
    for start in range(0, len(texts), ENCODE_BATCH_DOCUMENTS):
        for encoding in tokenizer.encode_batch(
            texts[start : start + ENCODE_BATCH_DOCUMENTS], add_special_tokens=False
        ):
            pieces.append(np.asarray(encoding.ids, dtype=TOKEN_DTYPE))
            pieces.append(eos)
    return np.concatenate(pieces) if pieces else np.zeros((0,), dtype=TOKEN_DTYPE)


def build_token_file(
    corpus_dir: Path,
    out_dir: Path,
    *,
    model_dir: Path = MODEL_DIR,
    wrapping: ChatWrapping = ChatWrapping(),
) -> TokenFileInfo:
    """Tokenize the corpus's training split into ``out_dir/train_tokens.npy`` (+ ``.json`` info)."""
    corpus_dir, out_dir, model_dir = Path(corpus_dir), Path(out_dir), Path(model_dir)
    tokenizer = load_tokenizer(model_dir)
    if tokenizer.get_vocab_size() > np.iinfo(TOKEN_DTYPE).max + 1:
        raise ValueError(f"a vocabulary of {tokenizer.get_vocab_size()} does not fit {TOKEN_DTYPE.__name__}")
    template = ChatTemplate(load_chat_template(model_dir))
    texts: list[str] = []
    chat_documents = 0
    for entry, text in iter_documents(corpus_dir, split="train"):
        messages = chat_messages(entry["path"], entry["source"], text, wrapping)
        if messages is None:
            texts.append(text)
        else:
            texts.append(template.render(messages, add_generation_prompt=False))
            chat_documents += 1
    tokens = encode_documents(tokenizer, texts)
    out_dir.mkdir(parents=True, exist_ok=True)
    np.save(out_dir / TOKEN_FILE, tokens)
    info = TokenFileInfo(
        tokens=int(tokens.size),
        documents=len(texts),
        chat_documents=chat_documents,
        dtype=np.dtype(TOKEN_DTYPE).name,
        vocab_size=tokenizer.get_vocab_size(),
        tokenizer_sha256=sha256_hex((model_dir / TOKENIZER_FILE).read_bytes()),
        corpus_manifest_sha256=sha256_hex((corpus_dir / "manifest.json").read_bytes()),
        chat_wrapping=asdict(wrapping),
    )
    (out_dir / TOKEN_INFO_FILE).write_text(json.dumps(asdict(info), indent=1) + "\n", encoding="utf-8")
    return info


def load_token_file(token_dir: Path) -> np.ndarray:
    """The flat training tokens, memory-mapped (read-only, nothing loaded until indexed)."""
    return np.load(Path(token_dir) / TOKEN_FILE, mmap_mode="r")


def heldout_token_ids(tokenizer: Tokenizer | None = None) -> np.ndarray:
    """The shipped held-out sample's token ids (documents separated by ``<|endoftext|>``)."""
    tokenizer = tokenizer or load_tokenizer()
    return np.asarray(tokenizer.encode(load_heldout_text(), add_special_tokens=False).ids, dtype=np.int32)


class WindowSampler:
    """Random windows of ``seq_len + 2`` tokens from a flat token array, ``batch_size`` at a time.

    Batch ``k`` is drawn by a generator seeded with ``(seed, k)``: the same seed gives the same
    batches in any order, and a run resumed at step ``k`` continues with the data it would have seen.
    """

    def __init__(self, tokens: np.ndarray, batch_size: int, seq_len: int, seed: int) -> None:
        if batch_size < 1 or seq_len < 1:
            raise ValueError(f"batch_size and seq_len must be positive, got {batch_size} and {seq_len}")
        if tokens.ndim != 1 or tokens.shape[0] < seq_len + 2:
            raise ValueError(f"need a flat array of at least {seq_len + 2} tokens, got shape {tokens.shape}")
        self.tokens = tokens
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed

    @property
    def window(self) -> int:
        return self.seq_len + 2

    def batch(self, step: int) -> np.ndarray:
        """int32 [batch_size, seq_len + 2] windows for training step ``step``."""
        rng = np.random.default_rng([self.seed, step])
        starts = rng.integers(0, self.tokens.shape[0] - self.window + 1, size=self.batch_size)
        starts.sort()  # ascending reads are kinder to a memory-mapped file; rows stay random
        rows = starts[:, None] + np.arange(self.window)[None, :]
        return np.asarray(self.tokens[rows], dtype=np.int32)

    def batches(self, start_step: int = 0) -> Iterator[np.ndarray]:
        """Batches for steps ``start_step``, ``start_step + 1``, ... without end."""
        step = start_step
        while True:
            yield self.batch(step)
            step += 1


def split_window(batch: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """[B, T + 2] windows -> (inputs [B, T], next-token targets [B, T], next-next-token targets [B, T])."""
    return batch[:, :-2], batch[:, 1:-1], batch[:, 2:]


def eval_windows(ids: np.ndarray, seq_len: int) -> np.ndarray:
    """Consecutive, non-overlapping [n, seq_len + 2] windows of ``ids`` (the tail that does not
    fill a window is dropped), for a fixed held-out loss during training."""
    window = seq_len + 2
    count = ids.shape[0] // window
    return np.asarray(ids[: count * window], dtype=np.int32).reshape(count, window)


def unigram_counts(train_ids: np.ndarray, vocab: int = VOCAB_SIZE) -> np.ndarray:
    """How often each token occurs in ``train_ids`` (uint32 [vocab])."""
    train = np.asarray(train_ids)
    if train.size and (int(train.min()) < 0 or int(train.max()) >= vocab):
        raise ValueError(f"train ids must lie in [0, {vocab}), got [{int(train.min())}, {int(train.max())}]")
    return np.bincount(train.astype(np.int64), minlength=vocab).astype(np.uint32)


def unigram_perplexity_from_counts(counts: np.ndarray, heldout_ids: np.ndarray) -> float:
    """Perplexity on ``heldout_ids`` of the add-one smoothed unigram model with these counts:
    p(t) = (count(t) + 1) / (N + vocab); perplexity = exp(-mean log p(heldout))."""
    heldout = np.asarray(heldout_ids)
    if heldout.size == 0:
        raise ValueError("no held-out tokens")
    vocab = counts.shape[0]
    if int(heldout.min()) < 0 or int(heldout.max()) >= vocab:
        raise ValueError(f"held-out ids must lie in [0, {vocab}), got [{int(heldout.min())}, {int(heldout.max())}]")
    log_probs = np.log(counts.astype(np.float64) + 1.0) - math.log(float(counts.sum()) + vocab)
    return float(np.exp(-log_probs[heldout.astype(np.int64)].mean()))


def unigram_perplexity(train_ids: np.ndarray, heldout_ids: np.ndarray, vocab: int = VOCAB_SIZE) -> float:
    """The add-one unigram baseline counted on ``train_ids`` that the demo model's held-out
    perplexity is judged against."""
    return unigram_perplexity_from_counts(unigram_counts(train_ids, vocab), heldout_ids)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--corpus", type=Path, required=True, help="a folder built by infernix_jax.demo.corpus"
    )
    parser.add_argument("--out", type=Path, required=True, help="folder for train_tokens.npy/.json")
    parser.add_argument("--model-dir", type=Path, default=MODEL_DIR, help="where tokenizer.json lives")
    parser.add_argument("--chat-fraction", type=float, default=ChatWrapping.fraction)
    parser.add_argument("--seed", type=int, default=ChatWrapping.seed)
    parser.add_argument("--update-package", action="store_true",
                        help="also write the training split's unigram counts into the package")
    args = parser.parse_args(argv)
    wrapping = ChatWrapping(fraction=args.chat_fraction, seed=args.seed)
    info = build_token_file(args.corpus, args.out, model_dir=args.model_dir, wrapping=wrapping)
    print(
        f"{info.tokens:,d} tokens from {info.documents} documents ({info.chat_documents} as chats) "
        f"-> {args.out / TOKEN_FILE}"
    )
    heldout = heldout_token_ids(load_tokenizer(args.model_dir))
    counts = unigram_counts(load_token_file(args.out), info.vocab_size)
    baseline = unigram_perplexity_from_counts(counts, heldout)
    print(f"held-out sample: {heldout.size:,d} tokens; add-one unigram perplexity {baseline:.2f}")
    if args.update_package:
        np.save(UNIGRAM_COUNTS_PATH, counts)
        print(f"wrote {UNIGRAM_COUNTS_PATH}")


if __name__ == "__main__":
    main()
