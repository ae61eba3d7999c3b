"""Constrained decode after warm-up, fused and check (`EngineConfig.constrained_decode`; check
warms split's programs too, and here its steps alternate between the two ways, so the default way
is covered; the callback way is left out for the suite's time budget): masks are
obeyed and nothing compiles, with and without logprobs (the programs have variants without the
top-k alternatives).

The engine is test_engine_core's (the hybrid MoE fixture, the same small buckets), so in one test
session the two share compiled programs; the grammar is a scripted token sequence.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import pytest

import infernix_jax
from infernix_jax.engine.constrained_way import CHECK, SPLIT
from infernix_jax.engine.core import EngineCore
from infernix_jax.engine.protocol import FINISH_STOP, GenerationRequest, SamplingParams
from infernix_jax.structured import RequestConstraint
from tests.conftest import HF_FIXTURES
from tests.engine.test_constrained_output import END, Grammar
from tests.engine.test_engine_core import COMPILE_EVENT, MAX_CONTEXT, SMALL, prompts

SCRIPT = [11, 40, 5, 33, 60, 21]  # the only output the grammar allows, then END


@pytest.fixture(scope="module", params=["fused", "check"])
def core(request):
    model = infernix_jax.load(HF_FIXTURES / "qwen3_next", max_context=MAX_CONTEXT)
    config = dataclasses.replace(SMALL, structured_output=True, constrained_decode=request.param)
    return EngineCore(model.config, model.params, config, model.tokenizer, model.eos_token_ids())


def test_constrained_batches_follow_the_grammar_without_compiling(core, monkeypatch):
    compiles = {"n": 0}
    if core.config.constrained_decode == "check":  # its chooser keeps a random model on split
        ways = itertools.cycle([CHECK, SPLIT])
        monkeypatch.setattr(core.way_chooser, "choose", lambda batch: next(ways))

    def listen(event: str, duration: float, **kwargs) -> None:
        compiles["n"] += event == COMPILE_EVENT

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        for lengths, logprobs in (((5, 30, 9), None), ((4, 12, 3, 50, 7, 22), 2)):
            requests = [
                GenerationRequest(
                    f"g{i}",
                    p,
                    SamplingParams(
                        max_tokens=12, temperature=1.0, seed=i, logprobs=logprobs, ignore_eos=True
                    ),
                    constraint=RequestConstraint(Grammar(SCRIPT)),
                )
                for i, p in enumerate(prompts(lengths, seed=len(lengths)))
            ]
            finished = {}
            for request in requests:
                core.add_request(request)
            while core.has_work():
                for event in core.step():
                    tokens, logprob_list, _ = finished.get(event.request_id, ([], [], None))
                    finished[event.request_id] = (
                        tokens + event.token_ids,
                        logprob_list + (event.logprobs or []),
                        event.finish_reason,
                    )
            for tokens, logprob_list, reason in finished.values():
                assert tokens == SCRIPT + [END] and reason == FINISH_STOP
                if logprobs is None:
                    assert logprob_list == []
                else:
                    assert [lp.token_id for lp in logprob_list] == tokens
                    assert all(len(lp.top) == logprobs for lp in logprob_list)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert compiles["n"] == 0, f"{compiles['n']} compilations after warm-up"
    if core.config.constrained_decode == "check":  # both of its ways ran
        assert min(core.way_chooser.chosen.values()) > 0 and core.metrics.check_refusals > 0
