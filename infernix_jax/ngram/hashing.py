"""Hashed n-gram ids: which table rows a token position reads (Engram's deterministic addressing).

For a memory layer l, an order n and a hash head j, the row read at position t is

    offset[l, n, j] + (x_t*m_0 XOR x_{t-1}*m_1 XOR ... XOR x_{t-n+1}*m_{n-1}) mod P[l, n, j]

with x the token ids (positions before the sequence start read `pad = vocab_size`, an id no real
token has), m the odd 64-bit multipliers of layer l (drawn from a generator seeded with
seed + 10007 * layer, as in DeepSeek's Engram demo; products wrap around in uint64), and P a
prime: every head of every layer gets its own distinct prime, the largest ones at or below its
share of the layer's row budget (table_rows // heads). Head slices are laid out layer-major, then
order, then head, so the table is one [total_rows, row_width] array.

The ids at a position depend on that token and the n-1 before it only, so a prefill chunk or a
decode token needs a short history (`max_order - 1` tokens) besides its own tokens.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from functools import cached_property

import numpy as np

from infernix_jax.config import NgramMemoryConfig


def is_prime(n: int) -> bool:
    """Deterministic Miller-Rabin for n < 3.3e24 (all table sizes)."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    for p in small:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


class NgramHasher:
    """Maps token windows to global table rows for every memory layer, order and head."""

    def __init__(self, spec: NgramMemoryConfig, vocab_size: int):
        self.spec = spec
        self.vocab_size = vocab_size
        self.pad = vocab_size
        self.history = spec.max_order - 1  # tokens before a window that its ids depend on
        layers, orders, heads = len(spec.layers), len(spec.orders), spec.heads_per_order
        budget = spec.table_rows // spec.num_heads
        primes = np.zeros((layers, orders, heads), np.int64)
        used: set[int] = set()
        candidate = budget
        for index in np.ndindex(primes.shape):
            while not is_prime(candidate) or candidate in used:
                candidate -= 1
                if candidate < 2:
                    raise ValueError(f"table_rows {spec.table_rows} leaves too few rows per head")
            primes[index] = candidate
            used.add(candidate)
            candidate -= 1
        self.primes = primes  # [L, O, K]
        flat = primes.reshape(-1)
        self.offsets = (np.cumsum(flat) - flat).reshape(primes.shape)  # [L, O, K]
        self.total_rows = int(flat.sum())
        self.multipliers = np.stack(
            [
                np.random.default_rng(spec.seed + 10007 * layer)
                .integers(0, 2**62, size=spec.max_order, dtype=np.int64)
                .astype(np.uint64)
                * np.uint64(2)
                + np.uint64(1)
                for layer in spec.layers
            ]
        )  # [L, max_order] odd uint64

    @cached_property
    def fingerprint(self) -> str:
        """A digest of everything that decides which row a token window reads (checked against a volume)."""
        blob = json.dumps(
            {
                "orders": list(self.spec.orders),
                "heads_per_order": self.spec.heads_per_order,
                "layers": list(self.spec.layers),
                "seed": self.spec.seed,
                "pad": self.pad,
                "primes": self.primes.reshape(-1).tolist(),
                "multipliers": [str(m) for m in self.multipliers.reshape(-1).tolist()],
            },
            sort_keys=True,
        )
        return hashlib.sha256(blob.encode()).hexdigest()

    def context(self, tokens: Sequence[int], start: int, stop: int) -> np.ndarray:
        """tokens[start - history : stop] as int64, left-padded with `pad` before the sequence start."""
        lo = start - self.history
        window = np.asarray(tokens[max(lo, 0) : stop], np.int64)
        if lo < 0:
            window = np.concatenate([np.full(-lo, self.pad, np.int64), window])
        return window

    def ids(self, context: np.ndarray) -> np.ndarray:
        """Global row ids [L, T, O*K] (int64) for a context of `history` + T tokens."""
        context = np.asarray(context, np.int64)
        t = len(context) - self.history
        if t < 0:
            raise ValueError(f"a context needs at least {self.history} history tokens, got {len(context)}")
        x = context.astype(np.uint64)
        spec = self.spec
        out = np.empty((len(spec.layers), t, len(spec.orders), spec.heads_per_order), np.int64)
        h = self.history
        for li in range(len(spec.layers)):
            m = self.multipliers[li]
            mix = np.zeros(t, np.uint64)
            done = 0
            for oi, n in sorted(enumerate(spec.orders), key=lambda item: item[1]):
                for k in range(done, n):  # fold in x_{t-k}: orders share their common shorter suffix
                    mix ^= x[h - k : h - k + t] * m[k]
                done = n
                rows = mix[:, None] % self.primes[li, oi].astype(np.uint64)[None, :]
                out[li, :, oi, :] = rows.astype(np.int64) + self.offsets[li, oi][None, :]
        return out.reshape(len(spec.layers), t, spec.num_heads)
