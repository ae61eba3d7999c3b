"""Numbers the model writes, read with the probabilities behind each digit (/v1/decide number, point, box).

The model generates greedily under a grammar that only admits the expected form (a number, or
"(x, y)" / "(x1, y1, x2, y2)" with integers in the grid's range), with the top logprobs of the raw
distribution at every step. Each integer it wrote is summarised from the steps of its digits:

* `value`: the integer written;
* `probability` / `logprob`: of its digit tokens, each given the text before it (the greedy path);
* `digits`: per digit position, the distribution over "0".."9" at that step, read from the step's
  top logprobs (digits outside them count as 0) and renormalised over the digits;
* `expected`: sum over positions of place value x the expected digit at that position — the mean
  of the coordinate under the digit distributions, keeping the number of digits written.

Qwen tokenizers write one digit per token; a token holding several digits gives each of them
probability 1 in `digits` (its own logprob still enters `probability`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from infernix_jax.engine.protocol import TokenLogprob

NUMBER_PATTERN = r"-?(0|[1-9][0-9]{0,17})(\.[0-9]{1,6})?"
_INTEGER = re.compile(r"\d+")


def integer_range_pattern(high: int) -> str:
    """A regex matching exactly the decimal integers 0..high (no leading zeros)."""
    if high < 0:
        raise ValueError(f"high must be >= 0, got {high}")
    text = str(high)
    parts = []
    if len(text) > 1:  # every shorter number
        parts = ["0", "[1-9]" if len(text) == 2 else f"[1-9][0-9]{{0,{len(text) - 2}}}"]
    for i, d in enumerate(text):  # numbers of the same length below `high`: equal prefix, a lower digit
        low = 1 if i == 0 and len(text) > 1 else 0
        if int(d) > low:
            parts.append(text[:i] + f"[{low}-{int(d) - 1}]" + "[0-9]" * (len(text) - i - 1))
    parts.append(text)
    return "(" + "|".join(parts) + ")"


def coordinates_pattern(count: int, grid: Sequence[int]) -> str:
    """ "(a, b, ...)" with `count` integers; x values within 0..grid[0], y values within 0..grid[1]."""
    values = [integer_range_pattern(grid[i % 2]) for i in range(count)]
    return r"\(" + ", ".join(values) + r"\)"


@dataclass(frozen=True)
class IntegerReading:
    """One integer the model wrote, with the distribution it came from."""

    value: int
    logprob: float
    digits: tuple[dict[str, float], ...]
    expected: float

    def as_json(self) -> dict:
        return {
            "value": self.value,
            "probability": math.exp(self.logprob),
            "logprob": self.logprob,
            "expected": self.expected,
            "digits": [dict(d) for d in self.digits],
        }


def _digit_distribution(entry: TokenLogprob, decode: Callable[[int], str]) -> dict[str, float]:
    """P(digit) at one step from the chosen token and the top alternatives, renormalised over digits."""
    found: dict[str, float] = {}
    for token, logprob in ((entry.token_id, entry.logprob), *entry.top):
        text = decode(token)
        if len(text) == 1 and text.isdigit() and text not in found:
            found[text] = math.exp(logprob)
    total = sum(found.values())
    return {d: found.get(d, 0.0) / total for d in "0123456789"} if total > 0 else {}


def read_integers(
    token_ids: Sequence[int], logprobs: Sequence[TokenLogprob], decode: Callable[[int], str]
) -> list[IntegerReading]:
    """Every integer in the generated text (digit runs), each summarised from its digit tokens."""
    pieces = [decode(t) for t in token_ids]
    text = "".join(pieces)
    starts, position = [], 0
    for piece in pieces:
        starts.append(position)
        position += len(piece)
    readings = []
    for match in _INTEGER.finditer(text):
        logprob, digits = 0.0, []
        for i, (start, piece) in enumerate(zip(starts, pieces)):
            end = start + len(piece)
            if end <= match.start() or start >= match.end():
                continue
            entry = logprobs[i] if i < len(logprobs) else None
            logprob += entry.logprob if entry is not None else 0.0
            inside = text[max(start, match.start()) : min(end, match.end())]
            distribution = _digit_distribution(entry, decode) if entry is not None and len(piece) == 1 else {}
            for ch in inside:
                digits.append(distribution or {d: float(d == ch) for d in "0123456789"})
        places = len(digits)
        expected = sum(
            10 ** (places - 1 - k) * sum(int(d) * p for d, p in dist.items()) for k, dist in enumerate(digits)
        )
        readings.append(IntegerReading(int(match.group()), logprob, tuple(digits), expected))
    return readings
