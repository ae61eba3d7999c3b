"""The contract between the API server and the engine.

The server depends on these types only, never on model modules: an `Engine` takes a
`GenerationRequest` and streams `TokenEvent`s back. The offline `LLM` API and the tests use the
same types, so a fake engine that honours this protocol can stand in for the real one.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol

FINISH_STOP = "stop"  # an end-of-sequence token, a stop token id or a stop string
FINISH_LENGTH = "length"  # max_tokens or the context limit was reached
FINISH_ABORT = "abort"  # the client went away or the request was cancelled
FINISH_ERROR = "error"  # the request failed; the engine and other requests go on


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token and when to stop. Defaults are greedy decoding."""

    max_tokens: int = 256  # tokens to generate at most (the context limit also applies)
    temperature: float = 0.0  # 0 means greedy (argmax)
    top_p: float = 1.0  # nucleus: keep the smallest set whose probability reaches top_p
    top_k: int = 0  # keep the k most likely tokens; 0 turns it off
    min_p: float = 0.0  # drop tokens whose probability is below min_p * the top probability
    repetition_penalty: float = 1.0  # CTRL-style: divide positive / multiply negative logits of seen tokens
    presence_penalty: float = 0.0  # OpenAI: subtract once for every token already generated
    frequency_penalty: float = 0.0  # OpenAI: subtract per occurrence in the generated tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias added to its logit)
    seed: int | None = None  # the same seed gives the same tokens, whatever else is batched
    stop: tuple[str, ...] = ()  # stop strings (not included in the output text)
    stop_token_ids: tuple[int, ...] = ()  # extra token ids that end generation
    ignore_eos: bool = False  # keep going past the end-of-sequence tokens
    logprobs: int | None = None  # None: no logprobs; k >= 0: the sampled token's and k alternatives
    min_tokens: int = 0  # stop tokens are suppressed until this many tokens were generated

    def __post_init__(self) -> None:
        errors = []
        if self.max_tokens < 0:
            errors.append(f"max_tokens must be >= 0, got {self.max_tokens}")
        if self.temperature < 0:
            errors.append(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            errors.append(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            errors.append(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            errors.append(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repetition_penalty <= 0:
            errors.append(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.logprobs is not None and self.logprobs < 0:
            errors.append(f"logprobs must be >= 0, got {self.logprobs}")
        if errors:
            raise ValueError("; ".join(errors))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def replace(self, **changes) -> SamplingParams:
        return dataclasses.replace(self, **changes)


@dataclass
class GenerationRequest:
    """One request as the engine sees it: token ids in, sampling rules, optional constraint."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams = field(default_factory=SamplingParams)
    constraint: object | None = None  # a compiled structured-output constraint (structured/)
    arrival_time: float = 0.0  # time.monotonic() when the server received it (for metrics)


@dataclass
class ScoreRequest:
    """Score continuations of a prompt: the logprob of every token of every candidate.

    Each candidate is a sequence of token ids that would follow the prompt; the engine reports
    log P(candidate[j] | prompt + candidate[:j]) under the model's raw distribution (no sampling
    settings apply). Candidates are alternatives: none of them sees another.
    """

    request_id: str
    prompt_token_ids: list[int]
    candidates: tuple[tuple[int, ...], ...]
    arrival_time: float = 0.0  # time.monotonic() when the server received it (for metrics)


@dataclass(frozen=True)
class ScoreResult:
    """What a `ScoreRequest` gives back."""

    request_id: str
    logprobs: tuple[tuple[float, ...], ...]  # per candidate, one logprob per token, in order
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    score_dispatches: int = 0  # scoring programs its candidate rows ran in (1 unless it had many rows)

    def totals(self) -> list[float]:
        """log P(candidate | prompt) of each candidate: the sum of its tokens' logprobs."""
        return [sum(values) for values in self.logprobs]


class ScoreError(ValueError):
    """A score request the engine could not serve (bad candidates, too long, aborted, failed)."""


@dataclass(frozen=True)
class TokenLogprob:
    """The log-probability of one generated token, with the most likely alternatives."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first


@dataclass
class TokenEvent:
    """What the engine streams back: new tokens since the last event, and the end when it comes."""

    request_id: str
    token_ids: list[int]  # newly generated token ids (may be empty on the final event)
    text: str  # newly decoded text, UTF-8 safe (a partial character waits for the next event)
    logprobs: list[TokenLogprob] | None = None  # one per token in token_ids when requested
    finish_reason: str | None = None  # FINISH_* on the last event, else None
    stop_reason: str | int | None = None  # the stop string or token id that ended it, if any
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    completion_tokens: int = 0  # generated so far, including this event
    error: str | None = None  # a readable message when finish_reason is FINISH_ERROR
    score: ScoreResult | None = None  # the result, on the final event of a ScoreRequest

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @classmethod
    def refused(cls, request_id: str, error: str, prompt_tokens: int) -> TokenEvent:
        """The one event of a request refused before it ran (invalid prompt, options or candidates)."""
        return cls(request_id, [], "", finish_reason=FINISH_ERROR, error=error, prompt_tokens=prompt_tokens)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for /metrics and /health."""

    running: int = 0  # requests being advanced
    waiting: int = 0  # requests queued for admission
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0  # held by requests
    max_context: int = 0
    kv_blocks_cached: int = 0  # held only by the prefix cache (evictable)
    prefix_cache: object | None = None  # PrefixCacheStats (hits per tier) when the cache is on
    # speculative decoding, cumulative (all 0 without it; docs/speculative.md)
    spec_verify_steps: int = 0  # verify dispatches
    spec_rows: int = 0  # row-steps verified (one per row per verify dispatch)
    spec_drafted_tokens: int = 0  # draft tokens (tree nodes) verified
    spec_accepted_tokens: int = 0  # draft tokens accepted
    spec_forced_draft_tokens: int = 0  # drafts a grammar forced (structured output)
    structured_forced_tokens: int = 0  # outputs a grammar forced, fed without a sample of their own
    experts: object | None = None  # ExpertCacheReport when experts live beyond device memory


class Engine(Protocol):
    """What the server needs from an engine. Implementations own all device state."""

    @property
    def max_context(self) -> int: ...

    def submit(self, request: GenerationRequest) -> AsyncIterator[TokenEvent]:
        """Queue a request and stream its events; the last event has finish_reason set.

        Invalid requests (empty prompt, prompt longer than the context) end with one
        FINISH_ERROR event rather than an exception, so the server can answer with a 400.
        """
        ...

    async def abort(self, request_id: str) -> None:
        """Cancel a request: its blocks and state slot are freed at once; its stream ends with FINISH_ABORT."""
        ...

    async def score(self, request: ScoreRequest) -> ScoreResult:
        """Score a prompt's candidate continuations (see ScoreRequest) through the scheduler, like
        any request; raises ScoreError when the request cannot be served."""
        ...

    def stats(self) -> EngineStats: ...
