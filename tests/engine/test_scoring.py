"""Scoring candidate continuations: exact against teacher forcing, one scoring pass, no compiles.

The reference is the single-sequence path (`Model.logits` on prompt + candidate, one causal
forward) over the hybrid float32 fixture (qwen3_next: Gated DeltaNet and gated attention layers).
"""

from __future__ import annotations

import asyncio
from functools import partial

import jax
import numpy as np
import pytest

import infernix_jax
from infernix_jax.cache.sequence import init_cache
from infernix_jax.engine.config import EngineConfig
from infernix_jax.engine.core import EngineCore
from infernix_jax.engine.engine import AsyncEngine
from infernix_jax.engine.protocol import (
    FINISH_ERROR,
    GenerationRequest,
    SamplingParams,
    ScoreError,
    ScoreRequest,
)
from infernix_jax.engine.scoring import SCORE_ROWS, plan_rows, score_shapes
from infernix_jax.model.forward import forward
from tests.conftest import HF_FIXTURES

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
MAX_CONTEXT = 256
CONFIG = EngineConfig(
    max_concurrency=4,
    max_context=MAX_CONTEXT,
    kv_capacity=6,  # blocks of 64 tokens: two long generations force preemption
    prefill_chunk=64,
    prefill_shape_override=((1, 64),),
    decode_batch_sizes=(4,),
    decode_steps_per_dispatch=4,
    max_top_logprobs=2,
    structured_output=False,
    compilation_cache_dir=None,
    progress=False,
)


@pytest.fixture(scope="module")
def reference():
    return infernix_jax.load(HF_FIXTURES / "qwen3_next", max_context=MAX_CONTEXT)


@pytest.fixture(scope="module")
def core(reference):
    return EngineCore(reference.config, reference.params, CONFIG, None, reference.eos_token_ids())


REFERENCE_LENGTH = 192  # every reference forward is padded to this (one compiled shape)


@partial(jax.jit, static_argnums=3)
def _reference_logits(params, tokens, positions, cfg):
    cache = init_cache(cfg, 1, REFERENCE_LENGTH)
    return forward(params, tokens, positions, cache, cfg)[0][0]


def teacher_forced(reference, prompt: list[int], candidate: tuple[int, ...]) -> list[float]:
    """log P(candidate[j] | prompt + candidate[:j]) from one causal forward over prompt + candidate
    (a plain contiguous cache, no engine)."""
    ids = prompt + list(candidate)
    tokens = np.zeros((1, REFERENCE_LENGTH), np.int32)
    positions = np.full((1, REFERENCE_LENGTH), -1, np.int32)
    tokens[0, : len(ids)], positions[0, : len(ids)] = ids, np.arange(len(ids))
    logits = np.asarray(_reference_logits(reference.params, tokens, positions, reference.config), np.float64)
    top = logits.max(-1, keepdims=True)
    logprobs = logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))
    return [float(logprobs[len(prompt) - 1 + j, t]) for j, t in enumerate(candidate)]


def run(core: EngineCore, requests, tokens: dict | None = None) -> dict:
    """Drive the core until idle; returns the final event of each request by id (and gathers the
    generated tokens into `tokens` when given)."""
    finals = {}

    def collect(events):
        finals.update({e.request_id: e for e in events if e.finished})
        for e in events:
            if tokens is not None:
                tokens.setdefault(e.request_id, []).extend(e.token_ids)

    for request in requests:
        add = core.add_score_request if isinstance(request, ScoreRequest) else core.add_request
        collect(add(request))
    while core.has_work():
        collect(core.step())
    return finals


def prompt_of(length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 512, size=length).tolist()


CANDIDATES = ((7,), (9,), (7, 3), (7, 3, 11, 12), (100, 200), (5,) * 12)


def test_rows_share_prefixes():
    yes_no = plan_rows([(1,), (2,), (3,)])
    assert yes_no.paths == ((),) and yes_no.row_of == (0, 0, 0)  # one next-token distribution
    scale = plan_rows([(16,), (17,), (16, 15)])  # "1", "2", "10" on a digit-split tokenizer
    assert scale.paths == ((16,),) and scale.row_of == (0, 0, 0)
    mixed = plan_rows(CANDIDATES)
    assert len(mixed.paths) == 3  # (7, 3, 11), (100,), (5,) * 11
    for candidate, row in zip(CANDIDATES, mixed.row_of):
        assert mixed.paths[row][: len(candidate) - 1] == candidate[:-1]


@pytest.mark.parametrize("length", [1, 2, 65, 150])  # 2: the remainder runs as a decode step
def test_scores_equal_teacher_forcing_each_candidate(core, reference, length):
    prompt = prompt_of(length, length)
    finals = run(core, [ScoreRequest("s", prompt, CANDIDATES)])
    result = finals["s"].score
    assert result is not None, finals["s"].error
    for candidate, got in zip(CANDIDATES, result.logprobs):
        np.testing.assert_allclose(got, teacher_forced(reference, prompt, candidate), atol=2e-4)
    assert result.prompt_tokens == length


def test_one_scoring_dispatch_after_one_prefill_and_no_compilation(core, reference, monkeypatch):
    counts = {"prefill": 0, "decode": 0, "score": 0}
    runner, scorer = core.runner, core.scorer
    for name, owner, attr in (
        ("prefill", runner, "prefill"),
        ("decode", runner, "decode"),
        ("score", scorer, "_call"),
    ):
        original = getattr(owner, attr)

        def counted(*args, _original=original, _name=name):
            counts[_name] += 1
            return _original(*args)

        monkeypatch.setattr(owner, attr, counted)
    compiles = {"n": 0}

    def listen(event: str, duration: float, **kwargs) -> None:
        compiles["n"] += event == COMPILE_EVENT

    prompt = prompt_of(30, 7)
    yes_no = ((11,), (12,), (13,), (14,))
    many = tuple((i, i + 1) for i in range(20, 20 + SCORE_ROWS + 1))  # one row more than a dispatch holds
    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        finals = run(core, [ScoreRequest("one", prompt, yes_no)])
        assert counts == {"prefill": 1, "decode": 0, "score": 1}
        finals |= run(core, [ScoreRequest("many", prompt_of(20, 8), many)])
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert compiles["n"] == 0, f"{compiles['n']} compilations after warm-up"
    assert finals["one"].score.score_dispatches == 1
    totals = finals["one"].score.totals()
    np.testing.assert_allclose(totals, [teacher_forced(reference, prompt, c)[0] for c in yes_no], atol=2e-4)
    assert finals["many"].score.score_dispatches == 2  # one scoring step, in two dispatches


def test_scoring_batches_with_generation_and_preemption_keeps_results_exact(core, reference):
    greedy = SamplingParams(max_tokens=70, ignore_eos=True)
    generations = [GenerationRequest(f"g{i}", prompt_of(130 + 10 * i, 20 + i), greedy) for i in range(2)]
    alone: dict = {}
    for request in generations:
        run(core, [request], alone)
    core.prefix_cache.clear()
    scores = [ScoreRequest(f"s{i}", prompt_of(50 + 20 * i, 30 + i), CANDIDATES[:4]) for i in range(2)]
    preemptions = core.metrics.preemptions
    together: dict = {}
    finals = run(core, [*generations, *scores], together)
    assert core.metrics.preemptions > preemptions  # the small pool forced recompute
    assert {r.request_id: together[r.request_id] for r in generations} == alone
    for request in scores:
        result = finals[request.request_id].score
        for candidate, got in zip(request.candidates, result.logprobs):
            np.testing.assert_allclose(
                got, teacher_forced(reference, request.prompt_token_ids, candidate), atol=2e-4
            )
    blocks, slots = core.scheduler.blocks, core.scheduler.slots
    assert blocks.num_free + core.prefix_cache.evictable_blocks() == blocks.num_total
    assert slots.num_free == slots.num_total


def test_invalid_score_requests_end_with_one_error_event(core):
    length = score_shapes(CONFIG)[0][1]
    for request in (
        ScoreRequest("e1", [1, 2], ()),
        ScoreRequest("e2", [], ((1,),)),
        ScoreRequest("e3", [1, 2], ((1,) * length,)),
        ScoreRequest("e4", [1, 2], ((10**6,),)),
        ScoreRequest("e5", [1] * MAX_CONTEXT, ((1, 2),)),
    ):
        (event,) = core.add_score_request(request)
        assert event.finish_reason == FINISH_ERROR and event.error


def test_an_engine_without_scoring_compiles_no_scoring_program_and_refuses_score_requests(
    reference, monkeypatch
):
    """EngineConfig.scoring=False: an engine that only generates skips the scoring programs at
    warm-up, and a score request ends at once with one error event that says why."""
    from infernix_jax.engine.scoring import Scorer

    core = EngineCore(
        reference.config, reference.params, CONFIG.replace(scoring=False, warmup=False), None,
        reference.eos_token_ids(),
    )  # fmt: skip
    monkeypatch.setattr(Scorer, "_call", lambda *a: pytest.fail("a scoring program was run"))
    core.scorer.warmup()
    (event,) = core.add_score_request(ScoreRequest("off", [1, 2, 3], ((4,), (5, 6))))
    assert event.finish_reason == FINISH_ERROR and "scoring is off" in event.error
    assert not core.has_work()


def test_async_engine_scores_and_reports_errors(core, reference):
    async def main():
        engine = AsyncEngine(core)
        try:
            prompt = prompt_of(12, 3)
            result = await engine.score(ScoreRequest("a", prompt, ((4,), (4, 5))))
            with pytest.raises(ScoreError):
                await engine.score(ScoreRequest("b", prompt, ()))
            return prompt, result
        finally:
            engine.close()

    prompt, result = asyncio.run(main())
    np.testing.assert_allclose(result.logprobs[1], teacher_forced(reference, prompt, (4, 5)), atol=2e-4)


def test_llm_score_equals_the_engine_core(core, reference):
    from infernix_jax.engine.llm import LLM

    options = {f.name: getattr(CONFIG, f.name) for f in CONFIG.__dataclass_fields__.values()}
    llm = LLM(model=reference, **{**options, "warmup": False})  # same shapes: the programs are compiled
    prompt = prompt_of(20, 11)
    result = llm.score(prompt, [[3], [3, 4]])
    expected = run(core, [ScoreRequest("llm", prompt, ((3,), (3, 4)))])["llm"].score
    for got, want in zip(result.logprobs, expected.logprobs):
        assert got == pytest.approx(want, abs=1e-5)
    with pytest.raises(ScoreError):
        llm.score(prompt, [])
