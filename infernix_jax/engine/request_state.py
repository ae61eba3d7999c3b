"""What the engine knows about one request on the host: its tokens, its place in the cache, its stops.

`RequestState` is plain bookkeeping shared by the scheduler (token counts, blocks, slot) and the
engine core (output tokens, text, stop rules). `OutputTracker` turns sampled token ids into text
deltas and applies the stop rules that the device cannot check (stop strings) or that must be
re-checked exactly where a dispatch of several decode steps ran past them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from infernix_jax.chat.detokenizer import IncrementalDetokenizer
from infernix_jax.engine.protocol import FINISH_LENGTH, FINISH_STOP, GenerationRequest, TokenLogprob


class Status(enum.Enum):
    WAITING = "waiting"  # queued for admission (new, or preempted and to be recomputed)
    RUNNING = "running"  # holds a state slot and KV blocks
    FINISHED = "finished"  # done; holds nothing


@dataclass
class RequestState:
    """One request's host-side record."""

    request: GenerationRequest
    seed: int  # the resolved sampling seed (the request's own or one drawn at arrival)
    arrival: int  # arrival order: FIFO admission; the newest running request is preempted first
    max_total: int  # prompt + generated tokens may not exceed this (max_context, max_tokens)
    output: list[int] = field(default_factory=list)  # generated token ids kept so far
    num_computed: int = 0  # leading tokens of prompt + output whose KV and state are in the cache
    blocks: list[int] = field(default_factory=list)  # KV block ids, in position order
    slot: int | None = None  # recurrent-state / sampling slot while running
    status: Status = Status.WAITING
    preemptions: int = 0  # times this request was preempted (and recomputed)
    cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    fresh_slot: bool = False  # admitted (or resumed) and its slot's sampling state not yet installed
    cacheable_state: bool = True  # its slot's state is exactly that after num_computed tokens
    snapshot_hints: list[int] = field(default_factory=list)  # where its prompt leaves other prompts
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    tracker: OutputTracker | None = None

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def num_tokens(self) -> int:
        """Prompt + generated tokens."""
        return len(self.request.prompt_token_ids) + len(self.output)

    @property
    def num_pending(self) -> int:
        """Tokens not yet fed to the model; 1 means the next step is a decode step."""
        return self.num_tokens - self.num_computed

    @property
    def remaining(self) -> int:
        """Tokens it may still generate."""
        return self.max_total - self.num_tokens

    def token_at(self, index: int) -> int:
        prompt = self.request.prompt_token_ids
        return prompt[index] if index < len(prompt) else self.output[index - len(prompt)]

    def tokens(self, start: int, stop: int) -> list[int]:
        return (self.request.prompt_token_ids + self.output)[start:stop]


class OutputTracker:
    """Detokenizes one request's output and applies its stop rules on the host.

    `add(token, logprob)` returns False once the request is finished (a stop token, a stop string,
    or the length limit); tokens after that are discarded. Text that could still turn out to be the
    start of a stop string is held back until it cannot.
    """

    def __init__(self, state: RequestState, tokenizer, stop_token_ids: set[int]):
        params = state.request.sampling
        self.state = state
        self.detokenizer = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.stop_token_ids = stop_token_ids
        self.stop_strings = [s for s in params.stop if s]
        self.hold = max((len(s) for s in self.stop_strings), default=1) - 1
        self.min_tokens = params.min_tokens
        self.text = ""  # all text of the kept output
        self.sent_chars = 0  # text already handed out in events
        self.new_tokens: list[int] = []  # kept tokens not yet handed out
        self.new_logprobs: list[TokenLogprob] = []
        self.generated = 0  # tokens sampled, the stop token included

    def add(self, token: int, logprob: TokenLogprob | None = None) -> bool:
        state = self.state
        self.generated += 1
        if token in self.stop_token_ids and len(state.output) >= self.min_tokens:
            state.finish_reason, state.stop_reason = FINISH_STOP, token
            return False
        state.output.append(token)
        self.new_tokens.append(token)
        if logprob is not None:
            self.new_logprobs.append(logprob)
        if self.detokenizer is not None:
            checked = len(self.text)
            self.text += self.detokenizer.add([token])
            if self.stop_strings and len(self.text) > checked:
                # A stop string ending in the new text starts at or after checked - hold, which is
                # never inside text already handed out (that much is always held back).
                start = max(0, checked - self.hold)
                hits = [(i, s) for s in self.stop_strings if (i := self.text.find(s, start)) >= 0]
                if hits:
                    index, stop = min(hits)
                    self.text = self.text[:index]
                    state.finish_reason, state.stop_reason = FINISH_STOP, stop
                    return False
        if state.remaining <= 0:
            state.finish_reason = FINISH_LENGTH
            return False
        return True

    def take(self, final: bool) -> tuple[list[int], str, list[TokenLogprob]]:
        """The tokens, text and logprobs not yet handed out (all of the text when final)."""
        if final and self.detokenizer is not None and self.state.finish_reason == FINISH_LENGTH:
            self.text += self.detokenizer.flush()
        end = len(self.text) if final else max(self.sent_chars, len(self.text) - self.hold)
        text = self.text[self.sent_chars : end]
        self.sent_chars = end
        tokens, logprobs = self.new_tokens, self.new_logprobs
        self.new_tokens, self.new_logprobs = [], []
        return tokens, text, logprobs
