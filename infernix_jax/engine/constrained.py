"""The engine's side of constrained decoding: one `ConstrainedOutput` per constrained request.

It follows the request's generated tokens through its grammar's `Matcher` and writes the packed
mask of the next token into a row of the dispatch's mask array. With `starts_after_token` (thinking
on) the output is free until that token (</think>) is generated; the matcher starts after it. With
`may_open_token` as well, the first token decides: <think> opens the free part, anything else is
the grammar's (the first mask allows both).

The engine asks `needs_host_each_token()` to choose a request's decode path: a row whose next token
is constrained cannot run several decode steps on the device per dispatch (its mask depends on the
token before), so its batch decodes one host round trip per sampled token, the tokens its grammar
forces taken without a sample of their own (`take_forced`; EngineCore._run_decode_constrained and
docs/structured_output.md). A free row of a constrained request (still thinking) runs the normal
multi-step program with `starts_after_token` added to its stop ids, so the device stops it right
after </think> and the next dispatch is constrained.
"""

from __future__ import annotations

import numpy as np

from infernix_jax.engine.protocol import SamplingParams

OK = "ok"  # the token was allowed; generation goes on
DONE = "done"  # the grammar is complete and an end token was generated: the request ends
FAILED = "failed"  # the token broke the grammar (see `error`)


class ConstrainedOutput:
    """One request's position in its constraint (duck-typed `structured.RequestConstraint`)."""

    def __init__(self, constraint, sampling: SamplingParams):
        self.constraint = constraint
        self.sampling = sampling
        may_open = getattr(constraint, "may_open_token", None)
        free_first = constraint.starts_after_token is not None and may_open is None
        self.matcher = None if free_first else constraint.new_matcher()
        self.undecided = constraint.starts_after_token is not None and may_open is not None
        self.error: str | None = None

    @property
    def active(self) -> bool:
        """The next token is constrained (the free part, if any, is over)."""
        return self.matcher is not None

    def needs_host_each_token(self) -> bool:
        """The row must come back to the host after every token: its mask changes per token, or
        (min_tokens) the device cannot be told to stop it at the end of the free part."""
        return self.active or self.sampling.min_tokens > 0

    def slot_sampling(self) -> SamplingParams:
        """The sampling installed in the request's slot: the free part stops at its closing token."""
        close = self.constraint.starts_after_token
        if close is None or self.sampling.min_tokens > 0 or close in self.sampling.stop_token_ids:
            return self.sampling
        return self.sampling.replace(stop_token_ids=(*self.sampling.stop_token_ids, close))

    def fill_mask(self, row: np.ndarray) -> None:
        """Write the next token's packed mask into row (int32 [model words]); free rows allow all."""
        if self.matcher is None:
            row[:] = -1
            return
        words = self.matcher.mask_words
        row[words:] = 0  # model rows beyond the tokenizer's vocabulary are never allowed
        self.matcher.fill_mask(row[:words])
        if self.undecided:
            token = self.constraint.may_open_token
            row[token // 32] |= np.int32(np.uint32(1 << (token % 32)).view(np.int32))

    def advance(self, token: int) -> str:
        """Follow one generated token: OK, DONE or FAILED."""
        if self.undecided:
            self.undecided = False
            if token == self.constraint.may_open_token:
                self.matcher = None  # the model opened its thinking: free until it closes
                return OK
        if self.matcher is None:
            if token == self.constraint.starts_after_token:
                self.matcher = self.constraint.new_matcher()
            return OK
        if not self.matcher.consume(token):
            self.error = (
                f"the output left its constraint ({self.constraint.describe()}): {self.matcher.error}"
            )
            return FAILED
        return DONE if self.matcher.finished else OK

    def follow_allowed(self, tokens) -> tuple[int, str]:
        """Follow the longest prefix of `tokens` the constraint allows: (its length, OK or DONE).
        The first token it refuses is not consumed, so the matcher stays where a masked sample
        would continue from (the "check" way: free samples checked after the dispatch)."""
        n = 0
        while n < len(tokens):
            token = int(tokens[n])
            if self.undecided and token != self.constraint.may_open_token:  # the grammar's first token
                if self.matcher.consume_allowed([token]) == 0:
                    return n, OK
                self.undecided = False
                n += 1
            elif self.matcher is None or self.undecided:  # the free part, or <think> opening it
                self.advance(token)
                n += 1
                continue
            else:
                n += self.matcher.consume_allowed(tokens[n:])
                if n < len(tokens) and not self.matcher.finished:
                    return n, OK  # stopped before a refused token
            if self.matcher.finished:
                return n, DONE
        return n, OK

    def fill_window_masks(self, drafts: list[int], rows: np.ndarray) -> int:
        """The masks of a speculative window [pending token, drafts..]: rows[j] (int32 [w, words])
        gets the mask of the token after window position j, the grammar advanced by drafts[:j].
        Drafts are cut at the first one the grammar refuses; in the free part, before the token
        that starts the constraint (what follows it needs the grammar, so it may only be the last
        token emitted); while the first token decides between thinking and the grammar, there are
        none. Returns the drafts kept. The matcher ends where it started."""
        if self.undecided:
            self.fill_mask(rows[0])
            return 0
        if self.matcher is None:
            close = self.constraint.starts_after_token
            kept = next((j for j, token in enumerate(drafts) if token == close), len(drafts))
            rows[: kept + 1] = -1
            return kept
        consumed = 0
        for j, token in enumerate(drafts):
            self.fill_mask(rows[j])
            if not _allows(rows[j], token) or not self.matcher.consume(token):
                break
            consumed += 1
        self.fill_mask(rows[consumed])
        self.matcher.rollback(consumed)
        return consumed

    def forced_drafts(self, limit: int) -> list[int]:
        """Up to `limit` tokens the grammar forces next, as speculative drafts (verified under the
        window's masks like any other draft, so the output is unchanged); [] in the free part and
        while the first token decides between thinking and the grammar."""
        if self.matcher is None or self.undecided or limit <= 0:
            return []
        return self.matcher.forced_tokens()[:limit]

    def take_forced(self, limit: int, stop_ids, scratch: np.ndarray) -> list[int]:
        """Follow up to `limit` tokens the grammar forces and return them: each must be the only
        token its mask allows, so sampling would pick it whatever the logits (the output is
        unchanged; a forced token that is a stop id is left to the sampler). The matcher advances
        past them. `scratch`: an int32 [model words] row to fill masks into."""
        taken: list[int] = []
        for token in self.forced_drafts(limit):
            if token in stop_ids:
                break
            self.fill_mask(scratch)
            if not _only(scratch, token):
                break
            if self.advance(token) != OK:  # it completes the grammar (an end token kept by
                self.matcher.rollback(1)  # ignore_eos): left to the sampler and the stop rules
                break
            taken.append(token)
        return taken

    def rollback(self, num_tokens: int) -> None:
        """Undo the last num_tokens constrained tokens (rejected speculative drafts)."""
        if self.matcher is not None:
            self.matcher.rollback(num_tokens)


def _allows(row: np.ndarray, token: int) -> bool:
    """Whether a packed mask row allows `token`."""
    return 0 <= token < 32 * len(row) and bool((int(row[token // 32]) >> (token % 32)) & 1)


def _only(row: np.ndarray, token: int) -> bool:
    """Whether a packed mask row allows `token` and nothing else."""
    if not _allows(row, token):
        return False
    word = token // 32
    others = np.count_nonzero(row[:word]) + np.count_nonzero(row[word + 1 :])
    return others == 0 and int(row[word]) == int(np.uint32(1 << (token % 32)).view(np.int32))


def allow_all(batch: int, words: int) -> np.ndarray:
    """A packed mask int32 [batch, words] allowing every token (rows without a constraint)."""
    return np.full((batch, words), -1, np.int32)
