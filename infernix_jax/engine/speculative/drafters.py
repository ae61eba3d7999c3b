"""Drafters: cheap proposers of the next few tokens of a request. Only verification decides output.

One small interface, `Drafter.propose(tokens, device_drafts, limit)`: the request's tokens so far
(prompt + output, the last one being the pending token the next window starts with), the drafts the
previous device program already computed for this request (the MTP chain; empty when none), and the
most tokens wanted. It returns up to `limit` token ids (possibly none).

- `NgramDrafter` (prompt lookup): find the longest suffix of the tokens (between `min_match` and
  `max_match` tokens) that occurred earlier, and copy what followed its latest earlier occurrence.
  Strong on code editing, quoting, retrieval answers; free to run (host only).
- `MtpDrafter`: hands on the chain the device drafted with the checkpoint's MTP layer(s) in the
  previous program (see programs.py): drafting happens on the device, right after verification.
- `CombinedDrafter`: the n-gram proposal when there is one, the MTP chain otherwise.

All three are deterministic proposers (the proposal distribution q is a point mass), which is what
the exact rejection rule in verify.py assumes by default.

For tree verification (`spec_tree_width` > 1) a drafter also proposes several candidate branches,
`propose_branches(tokens, device_drafts, limit, width)`, which tree.build_tree merges into a trie:
the n-gram drafter the continuations of up to `width` earlier matches that differ, the MTP drafter
its chain plus the next most likely first tokens (the device returns them after the chain), the
combined drafter the n-gram branches and then the MTP ones.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

SPEC_METHODS = ("none", "ngram", "mtp", "mtp+ngram")


class Drafter(Protocol):
    """Proposes up to `limit` tokens to follow `tokens`."""

    uses_mtp: bool  # the device programs must run the MTP chain for this drafter

    def propose(self, tokens: Sequence[int], device_drafts: Sequence[int], limit: int) -> list[int]: ...

    def propose_branches(
        self, tokens: Sequence[int], device_drafts: Sequence[int], limit: int, width: int
    ) -> list[list[int]]:
        """Up to `width` candidate continuations of up to `limit` tokens, best first."""
        ...


def ngram_lookup(tokens: Sequence[int], limit: int, min_match: int, max_match: int) -> list[int]:
    """The continuation of the longest earlier match of the tokens' suffix (latest occurrence wins).

    Tries suffix lengths n = max_match .. min_match; for the first n with an earlier occurrence
    tokens[j : j + n] == tokens[-n:] (j + n < len(tokens)), returns tokens[j + n : j + n + limit].
    Vectorised with numpy: O(len(tokens) * n) per length, a few microseconds for a 10k-token context.
    """
    if limit <= 0 or min_match < 1:
        return []
    seq = np.asarray(tokens, np.int64)
    size = len(seq)
    for n in range(min(max_match, size - 1), min_match - 1, -1):
        suffix = seq[size - n :]
        # candidate starts j = 0 .. size - n - 1 (the match must end before the suffix itself starts
        # overlapping the final position: j + n <= size - 1)
        windows = np.lib.stride_tricks.sliding_window_view(seq[: size - 1], n)
        hits = np.flatnonzero(np.all(windows == suffix, axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return seq[start : start + limit].tolist()
    return []


def ngram_branches(
    tokens: Sequence[int], limit: int, min_match: int, max_match: int, width: int, scan: int = 64
) -> list[list[int]]:
    """Up to `width` different continuations of earlier matches of the tokens' suffix: longer
    suffixes first, later occurrences first within a length (the first one is ngram_lookup's).
    A continuation that is a prefix of one already taken adds nothing and is skipped; at most the
    latest `scan` occurrences of each length are looked at."""
    if limit <= 0 or min_match < 1 or width < 1:
        return []
    seq = np.asarray(tokens, np.int64)
    size = len(seq)
    found: list[list[int]] = []
    for n in range(min(max_match, size - 1), min_match - 1, -1):
        windows = np.lib.stride_tricks.sliding_window_view(seq[: size - 1], n)
        hits = np.flatnonzero(np.all(windows == seq[size - n :], axis=1))
        for hit in hits[::-1][:scan]:
            start = int(hit) + n
            branch = seq[start : start + limit].tolist()
            if branch and not any(other[: len(branch)] == branch for other in found):
                found.append(branch)
                if len(found) == width:
                    return found
    return found


@dataclass(frozen=True)
class NgramDrafter:
    """Prompt lookup over prompt + output so far."""

    min_match: int = 2  # shortest suffix that may match (ngram_min_match)
    max_match: int = 8  # longest suffix tried first
    max_tokens: int = 8  # most tokens proposed (ngram_draft_tokens)
    uses_mtp: bool = False

    def propose(self, tokens: Sequence[int], device_drafts: Sequence[int], limit: int) -> list[int]:
        return ngram_lookup(tokens, min(limit, self.max_tokens), self.min_match, self.max_match)

    def propose_branches(
        self, tokens: Sequence[int], device_drafts: Sequence[int], limit: int, width: int
    ) -> list[list[int]]:
        return ngram_branches(tokens, min(limit, self.max_tokens), self.min_match, self.max_match, width)


@dataclass(frozen=True)
class MtpDrafter:
    """The MTP chain the device computed after the previous verification (or prefill)."""

    uses_mtp: bool = True

    def propose(self, tokens: Sequence[int], device_drafts: Sequence[int], limit: int) -> list[int]:
        return list(device_drafts[:limit])

    def propose_branches(
        self, tokens: Sequence[int], device_drafts: Sequence[int], limit: int, width: int
    ) -> list[list[int]]:
        """The chain, then width - 1 single-token branches: the device returns the chain followed
        by the next most likely first tokens (chain_drafts with branches = width - 1)."""
        if not device_drafts or limit <= 0:
            return []
        chain_length = len(device_drafts) - (width - 1)
        chain = list(device_drafts[: min(chain_length, limit)])
        return [chain] + [[int(t)] for t in device_drafts[chain_length:]]


@dataclass(frozen=True)
class CombinedDrafter:
    """N-gram when the context repeats itself, MTP otherwise."""

    ngram: NgramDrafter
    mtp: MtpDrafter = MtpDrafter()
    uses_mtp: bool = True

    def propose(self, tokens: Sequence[int], device_drafts: Sequence[int], limit: int) -> list[int]:
        found = self.ngram.propose(tokens, device_drafts, limit)
        return found if found else self.mtp.propose(tokens, device_drafts, limit)

    def propose_branches(
        self, tokens: Sequence[int], device_drafts: Sequence[int], limit: int, width: int
    ) -> list[list[int]]:
        found = self.ngram.propose_branches(tokens, device_drafts, limit, width)
        return found + self.mtp.propose_branches(tokens, device_drafts, limit, width)


def make_drafter(
    method: str, ngram_draft_tokens: int = 8, ngram_min_match: int = 2, ngram_max_match: int = 8
) -> Drafter | None:
    """The drafter of EngineConfig.spec (None for "none")."""
    if method not in SPEC_METHODS:
        raise ValueError(f"spec must be one of {SPEC_METHODS}, got {method!r}")
    ngram = NgramDrafter(ngram_min_match, max(ngram_max_match, ngram_min_match), ngram_draft_tokens)
    return {"none": None, "ngram": ngram, "mtp": MtpDrafter(), "mtp+ngram": CombinedDrafter(ngram)}[method]
