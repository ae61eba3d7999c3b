"""The script-facing Model: no compilation after warm-up, stop rules, chunk planning."""

from __future__ import annotations

import jax
import numpy as np
import pytest

import infernix_jax
from infernix_jax.loaded_model import PREFILL_BUCKETS, chunk_plan
from tests.conftest import HF_FIXTURES

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
    def __init__(self):
        self.count = 0

    def __call__(self, event: str, duration: float, **kwargs) -> None:
        if event == COMPILE_EVENT:
            self.count += 1


@pytest.fixture(scope="module")
def model():
    return infernix_jax.load(HF_FIXTURES / "qwen3_next", max_context=512)


def test_no_compilation_after_warmup(model):
    model.warmup()
    counter = CompileCounter()
    jax.monitoring.register_event_duration_secs_listener(counter)
    try:
        ids = np.load(HF_FIXTURES / "qwen3_next" / "reference.npz")["input_ids"].tolist()
        for length in (3, 37, 140):
            model.generate(ids[:length], max_new_tokens=5, ignore_eos=True)
    finally:
        jax.monitoring.unregister_event_duration_listener(counter)
    assert counter.count == 0, f"{counter.count} compilations after warm-up"


def test_chunk_plan_covers_prompt_with_bucketed_chunks():
    for length in (1, 16, 17, 300, 1024, 2500):
        plan = chunk_plan(length)
        assert sum(n for n, _ in plan) == length
        assert all(bucket in PREFILL_BUCKETS and n <= bucket for n, bucket in plan)


def test_stop_token_ends_generation(model):
    ids = np.load(HF_FIXTURES / "qwen3_next" / "reference.npz")
    free = model.generate(ids["greedy_prompt"].tolist(), max_new_tokens=8, ignore_eos=True)
    stop_at = free.token_ids[3]
    stopped = model.generate(ids["greedy_prompt"].tolist(), max_new_tokens=8, stop_token_ids=[stop_at])
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == free.token_ids[: free.token_ids.index(stop_at)]


def test_seeded_sampling_reproduces(model):
    prompt = [1, 2, 3, 4]
    a = model.generate(prompt, max_new_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
    b = model.generate(prompt, max_new_tokens=8, temperature=1.0, seed=7, ignore_eos=True)
    c = model.generate(prompt, max_new_tokens=8, temperature=1.0, seed=8, ignore_eos=True)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


def test_prompt_longer_than_context_is_rejected(model):
    with pytest.raises(ValueError, match="exceed the context"):
        model.logits(list(range(10)) * 60)
