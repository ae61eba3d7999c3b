"""Asynchronous decode (engine/async_decode.py): the next decode dispatch is enqueued from the last
one's device outputs before the host reads it. It must change nothing a user sees: the same tokens
(greedy and seeded sampling) as decoding one dispatch at a time, no leaked blocks when requests
stop or are aborted mid-flight, and a prefix cache whose entries are still exact when a request is
ended by the host (a stop string) while a dispatch it is part of runs on."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import infernix_jax
from infernix_jax.engine.config import EngineConfig
from infernix_jax.engine.core import EngineCore
from infernix_jax.engine.protocol import FINISH_ABORT, FINISH_STOP, GenerationRequest, SamplingParams
from infernix_jax.engine.runner import decode_program, decode_width
from infernix_jax.engine.sampling import ANY_PLAN, GREEDY_PLAN
from tests.conftest import HF_FIXTURES

CONFIG = EngineConfig(
    max_concurrency=4,
    max_context=256,
    kv_capacity=20,
    prefill_chunk=64,
    prefill_shape_override=((2, 64),),
    decode_batch_sizes=(4,),
    decode_steps_per_dispatch=4,
    max_top_logprobs=3,
    compilation_cache_dir=None,
    progress=False,
    warmup=False,
    structured_output=False,
)


class LetterTokenizer:
    """Token i reads as one letter (a-z by i mod 26): enough for stop strings in the engine."""

    def decode(self, ids, skip_special_tokens=False, clean_up_tokenization_spaces=None) -> str:
        return "".join(chr(ord("a") + int(i) % 26) for i in ids)


@pytest.fixture(scope="module")
def model():
    return infernix_jax.load(HF_FIXTURES / "qwen3_next", max_context=256)


@pytest.fixture(scope="module")
def core(model):
    return EngineCore(model.config, model.params, CONFIG, LetterTokenizer())


def prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 500, size=n).tolist() for n in lengths]


def run(core: EngineCore, requests, on_step=None) -> dict[str, dict]:
    results = {
        r.request_id: {"tokens": [], "logprobs": [], "alternatives": [], "finish": None, "cached": 0}
        for r in requests
    }
    events = [e for r in requests for e in core.add_request(r)]
    steps = 0
    while True:
        for e in events:
            out = results[e.request_id]
            out["tokens"] += e.token_ids
            out["logprobs"] += [round(lp.logprob, 4) for lp in e.logprobs or []]
            out["alternatives"] += [len(lp.top) for lp in e.logprobs or []]
            out["cached"] = max(out["cached"], e.cached_tokens)
            if e.finished:
                out["finish"] = e.finish_reason
        if not core.has_work():
            break
        events = core.step()
        steps += 1
        if on_step is not None:
            events += on_step(steps)
    return results


def both_ways(core: EngineCore, make_requests, on_step=None):
    """Results with asynchronous decode off, then on (same engine, same programs); the number of
    dispatches that were enqueued ahead in the second run."""
    core.async_decode.enabled = False
    core.prefix_cache.clear()
    plain = run(core, make_requests("x"), on_step)
    core.async_decode.enabled = True
    core.prefix_cache.clear()
    before = core.metrics.async_dispatches
    ahead = run(core, make_requests("x"), on_step)
    return plain, ahead, core.metrics.async_dispatches - before


def assert_pool_empty(core: EngineCore) -> None:
    blocks, slots = core.scheduler.blocks, core.scheduler.slots
    assert core.ahead is None
    assert blocks.num_free + core.prefix_cache.evictable_blocks() == blocks.num_total
    assert slots.num_free == slots.num_total


def test_greedy_and_seeded_sampling_are_unchanged(core):
    ids = prompts((5, 30, 70, 12))

    def make(prefix):
        return [
            GenerationRequest(f"{prefix}{i}", p, SamplingParams(max_tokens=10 + 7 * i, ignore_eos=True, logprobs=2))
            for i, p in enumerate(ids[:2])
        ] + [
            GenerationRequest(
                f"{prefix}s{i}",
                p,
                SamplingParams(max_tokens=23, temperature=1.0, top_p=0.9, seed=7 + i, ignore_eos=True,
                               frequency_penalty=0.5, logprobs=2),
            )
            for i, p in enumerate(ids[2:])
        ]  # fmt: skip

    plain, ahead, dispatched = both_ways(core, make)
    assert dispatched > 0, "the steady batch was never run ahead"
    assert ahead == plain
    assert_pool_empty(core)


def test_stop_strings_and_aborts_mid_flight_leave_exact_state(core, model):
    """A request ended by a stop string (which only the host sees) while the next dispatch already
    runs it: its output ends at the stop, and the next turn of that conversation, served from the
    prefix cache, gives the tokens of a cold run (its state past the stop is not snapshotted; its
    prompt's snapshots are used). Aborted requests free everything."""
    ids = prompts((20, 40, 9, 33), seed=3)
    probe = run(core, [GenerationRequest("probe", ids[0], SamplingParams(max_tokens=24, ignore_eos=True))])
    letters = LetterTokenizer().decode(probe["probe"]["tokens"])
    stop = next(letters[k : k + 2] for k in range(9, 20) if letters[k : k + 2] not in letters[: k + 1])

    def make(prefix):
        return [
            GenerationRequest(f"{prefix}stop", ids[0], SamplingParams(max_tokens=24, stop=(stop,), ignore_eos=True)),
            GenerationRequest(f"{prefix}long", ids[1], SamplingParams(max_tokens=30, ignore_eos=True)),
            GenerationRequest(f"{prefix}cut0", ids[2], SamplingParams(max_tokens=30, ignore_eos=True)),
            GenerationRequest(f"{prefix}cut1", ids[3], SamplingParams(max_tokens=30, ignore_eos=True)),
        ]  # fmt: skip

    def abort_two(step):
        return [e for rid in ("xcut0", "xcut1") for e in core.abort(rid)] if step == 4 else []

    plain, ahead, dispatched = both_ways(core, make, abort_two)
    assert dispatched > 0
    assert ahead == plain
    assert ahead["xstop"]["finish"] == FINISH_STOP
    assert ahead["xcut0"]["finish"] == FINISH_ABORT == ahead["xcut1"]["finish"]
    assert_pool_empty(core)

    # the next turn: everything the stopped request saw and wrote, then more
    turn = ids[0] + ahead["xstop"]["tokens"] + prompts((70,), seed=4)[0]
    params = SamplingParams(max_tokens=8, ignore_eos=True, logprobs=3)
    warm = run(core, [GenerationRequest("turn", turn, params)])["turn"]
    assert warm["cached"] >= len(ids[0]) - 1, "the first turn's prompt was meant to be reused"
    core.prefix_cache.clear()
    cold = run(core, [GenerationRequest("turn", turn, params)])["turn"]
    assert warm["tokens"] == cold["tokens"]
    np.testing.assert_allclose(warm["logprobs"], cold["logprobs"], atol=2e-4)


def test_a_waiting_request_stops_the_run_ahead(core):
    """A request that arrives while a dispatch is in flight is admitted at the next step that
    schedules: the engine never enqueues a second dispatch ahead of a waiting request."""
    core.prefix_cache.clear()
    ids = prompts((10, 15), seed=5)
    core.add_request(GenerationRequest("first", ids[0], SamplingParams(max_tokens=40, ignore_eos=True)))
    while core.ahead is None:
        core.step()
    core.add_request(GenerationRequest("second", ids[1], SamplingParams(max_tokens=4, ignore_eos=True)))
    core.step()  # reads the dispatch in flight; enqueues nothing: a request waits
    assert core.ahead is None
    core.step()  # schedules: admits and prefills the new request
    assert core.requests["second"].num_computed > 0
    while core.has_work():
        core.step()
    assert_pool_empty(core)


def test_the_config_switch_turns_it_off(model):
    core = EngineCore(model.config, model.params, dataclasses.replace(CONFIG, async_decode=False))
    assert core.async_decode.enabled is False


def test_loop_graphs_give_the_same_tokens(core, model):
    """The decode program compiled with its step loop in one CUDA graph (EngineConfig.decode_loop_graphs)
    samples what the per-step launches do, greedy and seeded, with asynchronous decode on. On the
    CPU both are one program; on a GPU (`JAX_PLATFORMS=cuda pytest`) they are two compilations."""
    ids = prompts((7, 41, 18), seed=5)

    def make(prefix):
        return [
            GenerationRequest(f"{prefix}g", ids[0], SamplingParams(max_tokens=19, ignore_eos=True, logprobs=2)),
            GenerationRequest(f"{prefix}s", ids[1], SamplingParams(max_tokens=26, temperature=0.8, seed=3,
                                                                    ignore_eos=True, logprobs=2)),
            GenerationRequest(f"{prefix}t", ids[2], SamplingParams(max_tokens=11, top_k=5, temperature=1.0,
                                                                    seed=9, ignore_eos=True)),
        ]  # fmt: skip

    core.prefix_cache.clear()
    per_step = run(core, make("p"))
    graphs = EngineCore(model.config, model.params, dataclasses.replace(CONFIG, decode_loop_graphs=True),
                        LetterTokenizer())  # fmt: skip
    assert run(graphs, make("p")) == per_step
    assert_pool_empty(graphs)


def test_sampling_plans_chosen_on_the_host_give_the_same_tokens(core, model):
    """Sampling branches chosen on the host (EngineConfig.sampling_plans "static", the default on
    accelerators, where a branch the device chooses makes the host wait every step) sample what
    the device's choice does, greedy and seeded, with asynchronous decode on: an all-greedy batch
    dispatches GREEDY_PLAN, one with a sampled row ANY_PLAN, the follow-up dispatches too. Only a
    batch whose rows ask for top alternatives runs the program with the top-k over the vocabulary,
    and its rows get them."""
    ids = prompts((9, 30), seed=7)

    def make(prefix, temperatures, logprobs):
        return [
            GenerationRequest(f"{prefix}{i}", prompt, SamplingParams(max_tokens=13 + 5 * i, temperature=t, top_p=0.9,
                                                                      seed=4 + i, ignore_eos=True, logprobs=logprobs))
            for i, (prompt, t) in enumerate(zip(ids, temperatures))
        ]  # fmt: skip

    static = EngineCore(model.config, model.params, dataclasses.replace(CONFIG, sampling_plans="static"),
                        LetterTokenizer())  # fmt: skip
    assert static.runner.static_sampling_plans and not core.runner.static_sampling_plans
    seen, decode = [], static.runner.decode

    def spy(batch, feed=None):
        seen.append((batch.sampling, batch.with_top))
        return decode(batch, feed)

    static.runner.decode = spy
    variants = (
        ((0.0, 0.0), None, (GREEDY_PLAN, False)),
        ((0.0, 0.0), 2, (GREEDY_PLAN, True)),
        ((0.0, 0.7), None, (ANY_PLAN, False)),
    )
    for temperatures, logprobs, variant in variants:
        seen.clear()
        core.prefix_cache.clear()
        static.prefix_cache.clear()
        got = run(static, make("q", temperatures, logprobs))
        assert got == run(core, make("q", temperatures, logprobs))
        assert len(seen) >= 2 and set(seen) == {variant}
        alternatives = {n for out in got.values() for n in out["alternatives"]}
        assert alternatives == (set() if logprobs is None else {logprobs})
    assert_pool_empty(static)


def test_the_packed_output_goes_into_a_buffer_of_its_width(core):
    """decode_program writes its packed output into the buffer the runner gives it (donated on a
    GPU, so that the step loop's graph keeps its buffers: docs/engine.md); one of another width is
    refused before anything is compiled."""
    runner = core.runner
    batch = runner.empty_decode(4, 4)
    with pytest.raises(ValueError, match="decode_width"):
        decode_program(
            runner.params, runner.kv_pool, runner.state_pool, runner.slot_sampling, batch.tokens,
            batch.positions, batch.block_table, batch.slots, batch.max_steps,
            out_buffer=np.zeros((4, decode_width(4, runner.num_top) + 1), np.int32),
            cfg=runner.cfg, steps=4, num_top=runner.num_top,
        )  # fmt: skip
