"""python -m infernix_jax.perplexity: reproducible perplexity of a model on a text file.

    python -m infernix_jax.perplexity --model DIR --text FILE --context 2048 --stride 1024

Sliding windows of `--context` tokens advance by `--stride`; each window scores only the tokens
no earlier window scored (the first window scores all but its first token), so every token after
the first is scored once, with up to context - stride tokens of history. Log-probabilities are
accumulated in float64 on the host, so the same run on the same machine prints the same value.
Without --model the bundled demo model and its held-out text are used.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from infernix_jax.demo import HELDOUT_TEXT_PATH, UNIGRAM_COUNTS_PATH
from infernix_jax.demo.data import unigram_perplexity_from_counts
from infernix_jax.loaded_model import Model, load


@dataclass
class PerplexityResult:
    tokens_evaluated: int
    mean_nll: float
    perplexity: float
    context: int
    stride: int


def window_plan(n_tokens: int, context: int, stride: int) -> list[tuple[int, int, int]]:
    """(start, end, first scored index) per window; together they score tokens 1..n-1 exactly once."""
    if stride <= 0 or stride > context:
        raise ValueError(f"stride must be in [1, context], got {stride} for context {context}")
    plan, scored_to, start = [], 1, 0
    while scored_to < n_tokens:
        end = min(start + context, n_tokens)
        plan.append((start, end, scored_to))
        scored_to = end
        start = max(0, end - max(context - stride, 1))  # keep >= 1 token of history
        if end == n_tokens:
            break
    return plan


def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """Negative log-likelihood of each target under float32 logits, computed in float64."""
    z = logits.astype(np.float64)
    m = z.max(axis=-1, keepdims=True)
    log_norm = m[:, 0] + np.log(np.exp(z - m).sum(axis=-1))
    return log_norm - z[np.arange(len(targets)), targets]


def perplexity(model: Model, ids: list[int], context: int, stride: int, progress: bool = True) -> PerplexityResult:
    total, count = 0.0, 0
    plan = window_plan(len(ids), context, stride)
    for start, end, first in tqdm(plan, desc="perplexity", unit="window", disable=not progress):
        logits = model.logits(ids[start:end])  # logits[i] predicts token start + i + 1
        rows = np.arange(first - 1 - start, end - 1 - start)
        nll = token_nll(logits[rows], np.asarray(ids[first:end]))
        total += float(nll.sum())
        count += len(nll)
    mean = total / max(count, 1)
    return PerplexityResult(count, mean, math.exp(mean), context, stride)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m infernix_jax.perplexity", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: the bundled demo model)")
    p.add_argument("--text", default=None, help="UTF-8 text file (default with the demo model: its held-out text)")
    p.add_argument("--context", type=int, default=1024, help="tokens per window")
    p.add_argument("--stride", type=int, default=None, help="window advance (default: context / 2)")
    p.add_argument("--max-tokens", type=int, default=None, help="evaluate only the first N tokens of the text")
    p.add_argument("--json", action="store_true", help="also print the result as one JSON line")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    demo = args.model is None
    if args.text is None:
        if not demo:
            print("--text is required with --model", file=sys.stderr)
            return 2
        args.text = str(HELDOUT_TEXT_PATH)
    text = Path(args.text).read_text(encoding="utf-8")
    model = load(args.model, max_context=args.context)
    if model.tokenizer is None:
        print("this model has no tokenizer.json", file=sys.stderr)
        return 2
    ids = model.tokenizer.encode(text)
    if args.max_tokens:
        ids = ids[: args.max_tokens]
    if len(ids) < 2:
        print("the text has fewer than two tokens", file=sys.stderr)
        return 2
    stride = args.stride or max(1, args.context // 2)
    result = perplexity(model, ids, args.context, stride)
    print(f"tokens evaluated: {result.tokens_evaluated}")
    print(f"mean NLL: {result.mean_nll:.6f}")
    record = asdict(result)
    if demo and UNIGRAM_COUNTS_PATH.exists():
        # the baseline: an add-one unigram model of the demo's training split, on the same tokens
        baseline = unigram_perplexity_from_counts(np.load(UNIGRAM_COUNTS_PATH), np.asarray(ids[1:]))
        record["unigram_perplexity"] = baseline
        print(f"unigram perplexity (training-split counts, same tokens): {baseline:.4f}")
    if args.json:
        print(json.dumps(record))
    print(f"perplexity: {result.perplexity:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
