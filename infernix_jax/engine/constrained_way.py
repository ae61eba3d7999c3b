"""Choosing, per decode step, between checking free samples and sampling under masks.

With `EngineConfig.constrained_decode = "check"` a constrained batch can run the free multi-step
program and check its tokens against the grammars afterwards (one dispatch per
`decode_steps_per_dispatch` tokens while the model keeps to its grammar), or decode the "split"
way (two dispatches per token, never a wasted step). Which is faster depends on how often the
model's free choice is one its grammar allows: a trained model writing the JSON it was asked for
keeps most of its tokens, a random-weight model almost none, and then every refusal wastes the
rest of the dispatch's steps. The tokens are the same either way (docs/structured_output.md), so
the choice is only about speed, and it is made from measurements: the seconds per generated token
each way took lately, for each batch size. The slower way is tried again now and then, after
twice as many steps each time it loses, so a change of workload is noticed at a small cost.
"""

from __future__ import annotations

from dataclasses import dataclass, field

CHECK, SPLIT = "check", "split"


@dataclass
class _BatchTimes:
    """The seconds per token of each way at one batch size, and when to try the slower again."""

    seconds_per_token: dict[str, float] = field(default_factory=dict)
    steps_since: dict[str, int] = field(default_factory=lambda: {CHECK: 0, SPLIT: 0})
    retry_after: int = 0


class ConstrainedWayChooser:
    """Picks "check" or "split" for a constrained decode step of a given batch size.

    Starts with check (the fast way for a model that follows its grammar), then measures split
    once, then runs the way with fewer seconds per token, retrying the other after `retry_steps`
    steps, doubled (up to `max_retry_steps`) each time the retry loses. `smoothing` weights the
    newest measurement in the running average of the way being run; a retry's measurement
    replaces the other's average (it was stale)."""

    def __init__(self, retry_steps: int = 8, max_retry_steps: int = 512, smoothing: float = 0.3):
        if retry_steps < 1 or max_retry_steps < retry_steps or not 0 < smoothing <= 1:
            raise ValueError("need 1 <= retry_steps <= max_retry_steps and 0 < smoothing <= 1")
        self.retry_steps, self.max_retry_steps, self.smoothing = retry_steps, max_retry_steps, smoothing
        self._times: dict[int, _BatchTimes] = {}
        self.chosen = {CHECK: 0, SPLIT: 0}  # steps each way ran (for metrics and tests)

    def _at(self, batch: int) -> _BatchTimes:
        if batch not in self._times:
            self._times[batch] = _BatchTimes(retry_after=self.retry_steps)
        return self._times[batch]

    def best(self, batch: int) -> str | None:
        """The way with fewer seconds per token at this batch size (None before both ran)."""
        times = self._at(batch).seconds_per_token
        if len(times) < 2:
            return None
        return CHECK if times[CHECK] <= times[SPLIT] else SPLIT

    def choose(self, batch: int) -> str:
        """The way the next constrained step of `batch` rows should take."""
        at = self._at(batch)
        if CHECK not in at.seconds_per_token:
            return CHECK
        if SPLIT not in at.seconds_per_token:
            return SPLIT
        best = self.best(batch)
        other = SPLIT if best == CHECK else CHECK
        return other if at.steps_since[other] >= at.retry_after else best

    def record(self, batch: int, way: str, seconds: float, tokens: int) -> None:
        """A step of `way` at `batch` rows took `seconds` and generated `tokens` (all rows')."""
        if way not in (CHECK, SPLIT):
            raise ValueError(f"unknown constrained decode way {way!r}")
        at = self._at(batch)
        retried = len(at.seconds_per_token) == 2 and way != self.best(batch)
        rate = seconds / max(tokens, 1)
        old = at.seconds_per_token.get(way)  # a retry's own measurement replaces a stale average
        at.seconds_per_token[way] = rate if old is None or retried else old + self.smoothing * (rate - old)
        if retried:  # the slower way's retry: keep it rarer while it keeps losing
            won = self.best(batch) == way
            at.retry_after = self.retry_steps if won else min(2 * at.retry_after, self.max_retry_steps)
        at.steps_since[way] = 0
        for other in at.steps_since:
            if other != way:
                at.steps_since[other] += 1
        self.chosen[way] += 1
