"""Host-side stop rules: stop strings across token boundaries, held-back text, stop tokens, length."""

from __future__ import annotations

from infernix_jax.engine.protocol import FINISH_LENGTH, FINISH_STOP, GenerationRequest, SamplingParams
from infernix_jax.engine.request_state import OutputTracker, RequestState


class CharTokenizer:
    """Token id i decodes to chr(i): enough to test text bookkeeping."""

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=None):
        return "".join(chr(i) for i in ids)


def tracker_for(**sampling) -> tuple[RequestState, OutputTracker]:
    params = SamplingParams(**sampling)
    state = RequestState(
        GenerationRequest("r", [1, 2], params), seed=0, arrival=0, max_total=2 + params.max_tokens
    )
    return state, OutputTracker(state, CharTokenizer(), {0})


def feed(tracker: OutputTracker, text: str) -> tuple[str, bool]:
    out, alive = "", True
    for ch in text:
        alive = tracker.add(ord(ch))
        if not alive:
            break
        out += tracker.take(final=False)[1]
    return out + tracker.take(final=True)[1] if not alive else out, alive


def test_stop_string_spanning_tokens_ends_text_before_it():
    state, tracker = tracker_for(stop=("END",))
    text, alive = feed(tracker, "hello ENDworld")
    assert (
        not alive and text == "hello " and state.finish_reason == FINISH_STOP and state.stop_reason == "END"
    )


def test_text_that_may_start_a_stop_string_is_held_back_until_it_cannot():
    _, tracker = tracker_for(stop=("ab",))
    tracker.add(ord("x"))
    assert tracker.take(final=False)[1] == ""  # the last character might start "ab": held
    tracker.add(ord("a"))
    assert tracker.take(final=False)[1] == "x"  # "a" may start "ab"
    tracker.add(ord("c"))
    assert tracker.take(final=False)[1] == "a"
    assert tracker.take(final=True)[1] == "c"


def test_stop_token_is_not_part_of_the_output_unless_min_tokens_not_reached():
    state, tracker = tracker_for(min_tokens=0)
    assert tracker.add(ord("a")) and not tracker.add(0)
    assert state.output == [ord("a")] and state.stop_reason == 0


def test_length_limit_finishes_with_length():
    state, tracker = tracker_for(max_tokens=3)
    assert tracker.add(5) and tracker.add(6) and not tracker.add(7)
    assert state.finish_reason == FINISH_LENGTH and state.output == [5, 6, 7]
