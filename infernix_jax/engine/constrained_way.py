"""Choosing, per decode step, between checking free samples and sampling under masks.

With `EngineConfig.constrained_decode = "check"` a constrained batch can run the free multi-step
program and check its tokens against the grammars afterwards (one dispatch per
`decode_steps_per_dispatch` tokens while the model keeps to its grammar), or decode the "split"
way (two dispatches per token, never a wasted step). Which is faster depends on how often the
model's free choice is one its grammar allows: a trained model writing the JSON it was asked for
keeps most of its tokens, a random-weight model almost none, and then every refusal wastes the
rest of the dispatch's steps. The tokens are the same either way (docs/structured_output.md; on
a GPU up to rounding), so the choice is only about speed, made from two measurements per batch
size:

- the seconds per generated token each way took lately (decayed sums of seconds over decayed sums
  of tokens);
- the keep share: how often a constrained row's free choice was one its grammar allows. A check
  step counts its kept tokens and refusals; a split step learns it at no cost, since its sample
  program also returns the token each row would have taken unmasked.

Split runs first, so a model that leaves its grammar never pays for a check dispatch; check is
tried once the keep share reaches `first_try_share`. Then the faster way runs, check's speed
predicted at today's keep share: its measured seconds per token scaled by the tokens a dispatch
keeps at the share it was measured at over those at today's. The slower way is tried again after
twice as many steps each time it loses, check only while that prediction beats split or, at the
longest interval, while the share is at least `first_try_share` (one slow measurement, say a step
that compiled, must not rule check out for good).
"""

from __future__ import annotations

from dataclasses import dataclass, field

CHECK, SPLIT = "check", "split"


def tokens_per_check(keep_share: float, window: int) -> float:
    """Expected tokens a constrained row gets from one check dispatch of `window` steps when each
    free choice is allowed with probability `keep_share`: its kept run, plus the refused position,
    sampled again under the mask (sum of keep_share ** j for j < window)."""
    p = min(max(keep_share, 0.0), 1.0)
    return float(window) if p == 1.0 else (1.0 - p**window) / (1.0 - p)


@dataclass
class _BatchTimes:
    """At one batch size: decayed sums of each way's seconds and tokens, the keep evidence (all
    steps', and check steps' own), and when to try the slower way again."""

    seconds: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, float] = field(default_factory=dict)
    steps_since: dict[str, int] = field(default_factory=lambda: {CHECK: 0, SPLIT: 0})
    retry_after: int = 0
    kept: float = 0.0  # constrained tokens whose free choice the grammar allowed (decayed)
    seen: float = 0.0  # constrained tokens judged (decayed)
    check_kept: float = 0.0  # the same over check steps, decayed as check's seconds are
    check_seen: float = 0.0

    def seconds_per_token(self, way: str) -> float:
        return self.seconds[way] / max(self.tokens[way], 1e-9)


def _share(kept: float, seen: float) -> float:
    """Keep share with one kept and one refused token of prior (Laplace): 0.5 before evidence."""
    return (kept + 1.0) / (seen + 2.0)


def _ratio(kept: float, seen: float) -> float:
    """Keep share as measured (the prior's 0.5 before evidence)."""
    return kept / seen if seen > 0 else 0.5


class ConstrainedWayChooser:
    """Picks "check" or "split" for a constrained decode step of a given batch size.

    Starts with split, whose steps also measure the keep share; tries check once that share is at
    least `first_try_share`; then runs the way with fewer seconds per token, retrying the other
    after `retry_steps` steps, doubled (up to `max_retry_steps`) each time the retry loses. Check's
    retries also wait until its predicted seconds per token beat split's, or `max_retry_steps`
    passed with the keep share at least `first_try_share`. A way's seconds per token is the ratio
    of its decayed sums of seconds and tokens (each step's weight falls by `decay` per later step
    of that way), so a slow step that yields few tokens (a request's last, where the model writes
    on and its grammar ends) weighs by its tokens, not as one step in many. A retry first shrinks
    the stale sums of its way by `stale` (drops them after `max_retry_steps`). The keep evidence
    decays by `evidence_decay` per step of either way. `window`: decode steps of one check dispatch."""

    def __init__(
        self,
        retry_steps: int = 8,
        max_retry_steps: int = 512,
        decay: float = 0.95,
        stale: float = 0.25,
        window: int = 8,
        first_try_share: float = 0.5,
        evidence_decay: float = 0.9,
    ):
        if retry_steps < 1 or max_retry_steps < retry_steps:
            raise ValueError("need 1 <= retry_steps <= max_retry_steps")
        if not (0 < decay < 1 and 0 <= stale <= 1 and 0 < evidence_decay < 1):
            raise ValueError("need 0 < decay < 1, 0 <= stale <= 1 and 0 < evidence_decay < 1")
        if window < 1 or not 0 <= first_try_share <= 1:
            raise ValueError("need window >= 1 and 0 <= first_try_share <= 1")
        self.retry_steps, self.max_retry_steps = retry_steps, max_retry_steps
        self.decay, self.stale, self.evidence_decay = decay, stale, evidence_decay
        self.window, self.first_try_share = window, first_try_share
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

    def keep_share(self, batch: int) -> float:
        """How often constrained rows' free choices were allowed lately at this batch size."""
        at = self._at(batch)
        return _share(at.kept, at.seen)

    def dispatch_keep_chance(self, batch: int) -> float:
        """The chance a constrained row keeps every token of one check dispatch at this batch size:
        the keep share as measured lately, to the power of `window` (0 before a dispatch's worth of
        tokens was judged)."""
        at = self._at(batch)
        if at.seen < self.window:
            return 0.0
        return _ratio(at.kept, at.seen) ** self.window

    def predicted_check(self, batch: int) -> float | None:
        """Check's seconds per token at today's keep share: its measured rate scaled by the tokens
        a dispatch keeps at the share it was measured at over those at today's (None before it
        ran)."""
        at = self._at(batch)
        if CHECK not in at.seconds:
            return None
        # plain ratios here (the prior would pull a share of few tokens further than one of many)
        then = tokens_per_check(_ratio(at.check_kept, at.check_seen), self.window)
        now = tokens_per_check(_ratio(at.kept, at.seen), self.window)
        return at.seconds_per_token(CHECK) * then / now

    def best(self, batch: int) -> str | None:
        """The way with fewer seconds per token at this batch size, check's as predicted at today's
        keep share (None before both ran)."""
        at = self._at(batch)
        if len(at.seconds) < 2:
            return None
        return CHECK if self.predicted_check(batch) <= at.seconds_per_token(SPLIT) else SPLIT

    def choose(self, batch: int) -> str:
        """The way the next constrained step of `batch` rows should take."""
        at = self._at(batch)
        if SPLIT not in at.seconds:
            return SPLIT
        if CHECK not in at.seconds:
            return CHECK if self.keep_share(batch) >= self.first_try_share else SPLIT
        if self.best(batch) == CHECK:
            return SPLIT if at.steps_since[SPLIT] >= at.retry_after else CHECK
        due = at.steps_since[CHECK] >= at.retry_after
        if not due:
            return SPLIT
        if self.predicted_check(batch) < at.seconds_per_token(SPLIT):
            return CHECK
        # a measurement can mislead (a step that compiled): while the share says the model keeps to
        # its grammar, check is retried at the longest interval anyway
        old = at.steps_since[CHECK] >= self.max_retry_steps
        return CHECK if old and self.keep_share(batch) >= self.first_try_share else SPLIT

    def record(
        self, batch: int, way: str, seconds: float, tokens: int, kept: int = 0, judged: int = 0
    ) -> None:
        """A step of `way` at `batch` rows took `seconds` and generated `tokens` (all rows'); of
        `judged` constrained tokens, the grammars allowed the free choice of `kept`."""
        if way not in (CHECK, SPLIT):
            raise ValueError(f"unknown constrained decode way {way!r}")
        if not 0 <= kept <= judged:
            raise ValueError("need 0 <= kept <= judged")
        at = self._at(batch)
        at.kept = self.evidence_decay * at.kept + kept
        at.seen = self.evidence_decay * at.seen + judged
        retried = len(at.seconds) == 2 and way != self.best(batch)
        keep = self.stale if retried else self.decay
        if retried and at.steps_since[way] >= self.max_retry_steps:
            keep = 0.0  # measured that long ago, the old sums say nothing of today
        at.seconds[way] = keep * at.seconds.get(way, 0.0) + seconds
        at.tokens[way] = keep * at.tokens.get(way, 0.0) + tokens
        if way == CHECK:
            at.check_kept = keep * at.check_kept + kept
            at.check_seen = keep * at.check_seen + judged
        if retried:  # the slower way's retry: keep it rarer while it keeps losing
            won = self.best(batch) == way
            at.retry_after = self.retry_steps if won else min(2 * at.retry_after, self.max_retry_steps)
        at.steps_since[way] = 0
        for other in at.steps_since:
            if other != way:
                at.steps_since[other] += 1
        self.chosen[way] += 1
