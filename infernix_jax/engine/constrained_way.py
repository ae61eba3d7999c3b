"""Choosing, per decode step, between checking free samples and sampling under masks.

With `EngineConfig.constrained_decode = "check"` a constrained batch can run the free multi-step
program and check its tokens against the grammars afterwards (one dispatch per
`decode_steps_per_dispatch` tokens while the model keeps to its grammar), or decode the "split"
way (two dispatches per token, never a wasted step). Which is faster depends on how often the
model's free choice is one its grammar allows: a trained model writing the JSON it was asked for
keeps most of its tokens, a random-weight model almost none, and then every refusal wastes the
rest of the dispatch's steps. The tokens are the same either way (docs/structured_output.md), so
the choice is only about speed, and it is made from measurements: the seconds per generated token
each way took lately (decayed sums of seconds over decayed sums of tokens), for each batch size.
The slower way is tried again now and then, after twice as many steps each time it loses, so a
change of workload is noticed at a small cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field

CHECK, SPLIT = "check", "split"


@dataclass
class _BatchTimes:
    """Decayed sums of each way's seconds and tokens at one batch size, and when to try the
    slower way again."""

    seconds: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, float] = field(default_factory=dict)
    steps_since: dict[str, int] = field(default_factory=lambda: {CHECK: 0, SPLIT: 0})
    retry_after: int = 0

    def seconds_per_token(self, way: str) -> float:
        return self.seconds[way] / max(self.tokens[way], 1e-9)


class ConstrainedWayChooser:
    """Picks "check" or "split" for a constrained decode step of a given batch size.

    Starts with check (the fast way for a model that follows its grammar), then measures split
    once, then runs the way with fewer seconds per token, retrying the other after `retry_steps`
    steps, doubled (up to `max_retry_steps`) each time the retry loses. A way's seconds per token
    is the ratio of its decayed sums of seconds and tokens (each step's weight falls by `decay`
    per later step of that way), so a slow step that yields few tokens (a request's last, where
    the model writes on and its grammar ends) weighs by its tokens, not as one step in many. A
    retry first shrinks the stale sums of its way by `stale`."""

    def __init__(
        self, retry_steps: int = 8, max_retry_steps: int = 512, decay: float = 0.95, stale: float = 0.25
    ):
        if retry_steps < 1 or max_retry_steps < retry_steps:
            raise ValueError("need 1 <= retry_steps <= max_retry_steps")
        if not (0 < decay < 1 and 0 <= stale <= 1):
            raise ValueError("need 0 < decay < 1 and 0 <= stale <= 1")
        self.retry_steps, self.max_retry_steps = retry_steps, max_retry_steps
        self.decay, self.stale = decay, stale
        self._times: dict[int, _BatchTimes] = {}
        self.chosen = {CHECK: 0, SPLIT: 0}  # steps each way ran (for metrics and tests)

    def _at(self, batch: int) -> _BatchTimes:
        if batch not in self._times:
            self._times[batch] = _BatchTimes(retry_after=self.retry_steps)
        return self._times[batch]

    def seconds_per_token(self, batch: int, way: str) -> float | None:
        """The way's measured seconds per token at this batch size (None before it ran)."""
        at = self._at(batch)
        return at.seconds_per_token(way) if way in at.seconds else None

    def best(self, batch: int) -> str | None:
        """The way with fewer seconds per token at this batch size (None before both ran)."""
        at = self._at(batch)
        if len(at.seconds) < 2:
            return None
        return CHECK if at.seconds_per_token(CHECK) <= at.seconds_per_token(SPLIT) else SPLIT

    def choose(self, batch: int) -> str:
        """The way the next constrained step of `batch` rows should take."""
        at = self._at(batch)
        if CHECK not in at.seconds:
            return CHECK
        if SPLIT not in at.seconds:
            return SPLIT
        best = self.best(batch)
        other = SPLIT if best == CHECK else CHECK
        return other if at.steps_since[other] >= at.retry_after else best

    def record(self, batch: int, way: str, seconds: float, tokens: int) -> None:
        """A step of `way` at `batch` rows took `seconds` and generated `tokens` (all rows')."""
        if way not in (CHECK, SPLIT):
            raise ValueError(f"unknown constrained decode way {way!r}")
        at = self._at(batch)
        retried = len(at.seconds) == 2 and way != self.best(batch)
        keep = self.stale if retried else self.decay
        at.seconds[way] = keep * at.seconds.get(way, 0.0) + seconds
        at.tokens[way] = keep * at.tokens.get(way, 0.0) + tokens
        if retried:  # the slower way's retry: keep it rarer while it keeps losing
            won = self.best(batch) == way
            at.retry_after = self.retry_steps if won else min(2 * at.retry_after, self.max_retry_steps)
        at.steps_since[way] = 0
        for other in at.steps_since:
            if other != way:
                at.steps_since[other] += 1
        self.chosen[way] += 1
