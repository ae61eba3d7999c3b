"""`ConstrainedOutput`: the engine's per-request view of a constraint (phases, masks, stop ids)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from infernix_jax.engine.constrained import DONE, FAILED, OK, ConstrainedOutput
from infernix_jax.engine.protocol import SamplingParams
from infernix_jax.structured import RequestConstraint

THINK_OPEN, THINK_CLOSE, END = 7, 9, 2
WORDS = 2  # a 64-token vocabulary


@dataclass
class Sequence:
    """A matcher for one fixed token sequence followed by END."""

    tokens: list[int]
    consumed: list[int] = field(default_factory=list)
    failed: bool = False

    @property
    def mask_words(self) -> int:
        return WORDS

    def fill_mask(self, row: np.ndarray) -> None:
        row[:] = 0
        n = len(self.consumed)
        token = self.tokens[n] if n < len(self.tokens) else END
        row[token // 32] |= np.int32(1 << (token % 32))

    def consume(self, token: int) -> bool:
        n = len(self.consumed)
        expected = self.tokens[n] if n < len(self.tokens) else END
        self.failed = token != expected
        self.consumed.append(token)
        return not self.failed

    def consume_allowed(self, tokens) -> int:
        n = 0
        for token in tokens:
            if self.finished or token != (self.tokens + [END])[len(self.consumed)]:
                break
            self.consumed.append(int(token))
            n += 1
        return n

    def rollback(self, num_tokens: int) -> None:
        del self.consumed[len(self.consumed) - num_tokens :]

    def forced_tokens(self) -> list[int]:  # one allowed token per step: all of it is forced
        return [] if self.failed else self.tokens[len(self.consumed) :] + [END]

    @property
    def finished(self) -> bool:
        return bool(self.consumed) and self.consumed[-1] == END and not self.failed

    @property
    def error(self) -> str | None:
        return "unexpected token" if self.failed else None


@dataclass
class Grammar:
    tokens: list[int]

    class spec:  # what RequestConstraint.describe reads
        @staticmethod
        def describe() -> str:
            return "test sequence"

    def new_matcher(self) -> Sequence:
        return Sequence(list(self.tokens))


def allowed(output: ConstrainedOutput, model_words: int = WORDS + 1) -> set[int]:
    row = np.zeros(model_words, np.int32)
    output.fill_mask(row)
    return set(np.flatnonzero(np.unpackbits(row.view(np.uint8), bitorder="little")).tolist())


def test_constrained_from_the_first_token_until_done():
    output = ConstrainedOutput(RequestConstraint(Grammar([5, 6])), SamplingParams())
    assert output.active and output.needs_host_each_token()
    assert allowed(output) == {5}  # model words beyond the tokenizer's are masked off
    assert output.advance(5) == OK
    assert allowed(output) == {6}
    assert output.advance(6) == OK
    assert output.advance(END) == DONE


def test_a_refused_token_fails_with_the_matcher_reason():
    output = ConstrainedOutput(RequestConstraint(Grammar([5])), SamplingParams())
    assert output.advance(4) == FAILED
    assert "unexpected token" in output.error and "test sequence" in output.error


def test_thinking_is_free_until_it_closes_and_stops_on_the_device_there():
    constraint = RequestConstraint(Grammar([5]), starts_after_token=THINK_CLOSE)
    output = ConstrainedOutput(constraint, SamplingParams(stop_token_ids=(3,)))
    assert not output.active and not output.needs_host_each_token()
    assert len(allowed(output)) == 96  # free: every bit set
    assert output.slot_sampling().stop_token_ids == (3, THINK_CLOSE)
    assert output.advance(5) == OK and output.advance(11) == OK  # free tokens
    assert output.advance(THINK_CLOSE) == OK
    assert output.active and allowed(output) == {5}
    assert output.advance(5) == OK and output.advance(END) == DONE


def test_min_tokens_keeps_the_free_part_on_the_host_instead_of_a_stop_id():
    constraint = RequestConstraint(Grammar([5]), starts_after_token=THINK_CLOSE)
    output = ConstrainedOutput(constraint, SamplingParams(min_tokens=4))
    assert output.needs_host_each_token()
    assert output.slot_sampling().stop_token_ids == ()


def test_the_model_may_open_its_thinking_with_the_first_token():
    constraint = RequestConstraint(Grammar([5]), starts_after_token=THINK_CLOSE, may_open_token=THINK_OPEN)
    opened = ConstrainedOutput(constraint, SamplingParams())
    assert allowed(opened) == {5, THINK_OPEN}
    assert opened.advance(THINK_OPEN) == OK and not opened.active
    assert opened.advance(THINK_CLOSE) == OK and allowed(opened) == {5}
    direct = ConstrainedOutput(constraint, SamplingParams())
    assert direct.advance(5) == OK and allowed(direct) == {END}
    assert direct.advance(THINK_OPEN) == FAILED  # only the first token may open thinking


def test_a_continuation_after_thinking_is_constrained_at_once():
    constraint = RequestConstraint(Grammar([5]), starts_after_token=THINK_CLOSE, may_open_token=THINK_OPEN)
    output = ConstrainedOutput(constraint.begun(), SamplingParams())
    assert output.active and allowed(output) == {5}
    assert output.slot_sampling() == SamplingParams()


def test_constrained_decode_is_check_unless_another_way_is_asked_for():
    from infernix_jax.engine.config import EngineConfig

    assert EngineConfig().constrained_decode == "check"  # which picks itself or split step by step
    assert EngineConfig(constrained_decode="split").constrained_decode == "split"
    assert EngineConfig(constrained_decode="fused").constrained_decode == "fused"
    assert EngineConfig(constrained_decode="callback").constrained_decode == "callback"
    assert EngineConfig(constrained_decode="check").constrained_decode == "check"
    with pytest.raises(ValueError, match="constrained_decode must be callback, check, fused or split"):
        EngineConfig(constrained_decode="fast")


def test_follow_allowed_keeps_the_allowed_prefix_and_stops_before_the_refused_token():
    # The check way: free samples are followed while the grammar allows them; the first refused
    # one is not consumed, so the matcher is where the masked replacement continues from.
    output = ConstrainedOutput(RequestConstraint(Grammar([5, 6, 7])), SamplingParams())
    assert output.follow_allowed([5, 6, 9, 7]) == (2, OK)
    assert output.error is None and allowed(output) == {7}
    assert output.follow_allowed([7, END, 4]) == (2, DONE)  # the tokens after the end are dropped


def test_follow_allowed_crosses_the_free_part_and_the_first_token_decision():
    thinking = RequestConstraint(Grammar([5]), starts_after_token=THINK_CLOSE)
    output = ConstrainedOutput(thinking, SamplingParams())
    assert output.follow_allowed([11, 12, THINK_CLOSE, 5, 8]) == (4, OK)  # free, free, close, grammar
    assert allowed(output) == {END}
    deciding = RequestConstraint(Grammar([5]), starts_after_token=THINK_CLOSE, may_open_token=THINK_OPEN)
    refused = ConstrainedOutput(deciding, SamplingParams())
    assert refused.follow_allowed([8, 5]) == (0, OK)
    assert allowed(refused) == {5, THINK_OPEN}  # still undecided
    direct = ConstrainedOutput(deciding, SamplingParams())
    assert direct.follow_allowed([5, END]) == (2, DONE)
    opened = ConstrainedOutput(deciding, SamplingParams())
    assert opened.follow_allowed([THINK_OPEN, 3, THINK_CLOSE, 5]) == (4, OK) and allowed(opened) == {END}


def test_forced_drafts_only_where_the_grammar_applies():
    output = ConstrainedOutput(RequestConstraint(Grammar([5, 6, 7])), SamplingParams())
    assert output.forced_drafts(2) == [5, 6]
    assert output.forced_drafts(0) == []
    thinking = ConstrainedOutput(
        RequestConstraint(Grammar([5]), starts_after_token=THINK_CLOSE), SamplingParams()
    )
    assert thinking.forced_drafts(4) == []  # free until </think>
    assert thinking.advance(THINK_CLOSE) == OK
    assert thinking.forced_drafts(4) == [5, END]


def test_take_forced_stops_before_stop_ids_and_the_grammar_end():
    scratch = np.zeros(WORDS + 1, np.int32)
    output = ConstrainedOutput(RequestConstraint(Grammar([5, 6])), SamplingParams())
    assert output.take_forced(8, stop_ids=(END,), scratch=scratch) == [5, 6]
    assert allowed(output) == {END}  # the matcher moved past them
    # END not a stop id (ignore_eos): it completes the grammar, so it is left to the sampler
    output = ConstrainedOutput(RequestConstraint(Grammar([5])), SamplingParams())
    assert output.take_forced(8, stop_ids=(), scratch=scratch) == [5]
    assert allowed(output) == {END} and output.advance(END) == DONE
    output = ConstrainedOutput(RequestConstraint(Grammar([5, 6, 7])), SamplingParams())
    assert output.take_forced(2, stop_ids=(), scratch=scratch) == [5, 6]


def test_only_one_allowed_token_counts_as_forced():
    from infernix_jax.engine.constrained import _only

    row = np.zeros(3, np.int32)
    row[1] = np.int32(1 << 3)  # token 35 alone
    assert _only(row, 35) and not _only(row, 36)
    row[2] = np.int32(1)  # and token 64
    assert not _only(row, 35)
    row[:] = 0
    row[0] = np.int32(np.uint32(1 << 31).view(np.int32))  # token 31: the sign bit
    assert _only(row, 31)
