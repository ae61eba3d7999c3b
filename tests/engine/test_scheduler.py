"""The phaseless scheduler's host logic: admission, chunking, decode interleaving, preemption, cancellation."""

from __future__ import annotations

from infernix_jax.cache import BlockAllocator, SlotAllocator
from infernix_jax.engine.config import EngineConfig
from infernix_jax.engine.protocol import GenerationRequest, SamplingParams
from infernix_jax.engine.request_state import RequestState, Status
from infernix_jax.engine.scheduler import Scheduler

CONFIG = EngineConfig(
    max_concurrency=4,
    max_context=1024,
    prefill_chunk=64,
    prefill_buckets=(16, 64),
    prefill_batch_sizes=(1, 4),
    decode_batch_sizes=(1, 2, 4),
    decode_steps_per_dispatch=4,
    compilation_cache_dir=None,
)

_arrivals = iter(range(10**6))


def make_request(prompt_len: int, max_tokens: int = 32, name: str | None = None) -> RequestState:
    arrival = next(_arrivals)
    request = GenerationRequest(
        name or f"r{arrival}", list(range(1, prompt_len + 1)), SamplingParams(max_tokens=max_tokens)
    )
    return RequestState(request, seed=0, arrival=arrival, max_total=prompt_len + max_tokens)


def make_scheduler(blocks: int = 64, config: EngineConfig = CONFIG) -> Scheduler:
    return Scheduler(config, BlockAllocator(blocks + 1), SlotAllocator(config.max_concurrency + 1))


def advance(scheduler: Scheduler, sampled_token: int = 7) -> object:
    """Run one step as the engine would, pretending every decode row generates all its tokens."""
    plan = scheduler.schedule()
    apply(scheduler, plan, sampled_token)
    return plan


def apply(scheduler: Scheduler, plan, sampled_token: int = 7) -> None:
    for chunk in plan.prefill:
        chunk.request.num_computed += chunk.num_tokens
        if chunk.sample:
            chunk.request.output.append(sampled_token)
    for row in plan.decode:
        row.request.num_computed += row.max_steps
        row.request.output.extend([sampled_token] * row.max_steps)
    for state in list(scheduler.running):
        if state.remaining <= 0:
            scheduler.finish(state)


def test_admission_is_fifo_and_capped_at_max_concurrency():
    scheduler = make_scheduler()
    states = [make_request(10) for _ in range(6)]
    for s in states:
        scheduler.add(s)
    scheduler.schedule()
    assert scheduler.running == states[:4]
    assert list(scheduler.waiting) == states[4:]
    assert all(s.slot is not None for s in states[:4]) and len({s.slot for s in states[:4]}) == 4


def test_short_prompts_share_one_prefill_dispatch_then_decode():
    scheduler = make_scheduler()
    states = [make_request(n) for n in (3, 9, 16, 12)]
    for s in states:
        scheduler.add(s)
    plan = advance(scheduler)
    assert plan.prefill_shape == (4, 16)
    assert [c.num_tokens for c in plan.prefill] == [3, 9, 16, 12]
    assert all(c.sample for c in plan.prefill)
    plan = advance(scheduler)
    assert not plan.prefill and plan.decode_batch == 4 and plan.decode_steps == 4
    assert [r.position for r in plan.decode] == [3, 9, 16, 12]


def test_long_prefill_never_stalls_running_decodes_more_than_one_chunk():
    scheduler = make_scheduler()
    first = make_request(5, max_tokens=200)
    scheduler.add(first)
    advance(scheduler)
    long_prompt = make_request(1000)
    scheduler.add(long_prompt)
    chunks = 0
    while long_prompt.num_pending > 1:
        plan = advance(scheduler)
        assert first in [r.request for r in plan.decode], "the running decode was skipped"
        assert sum(c.num_tokens for c in plan.prefill) <= CONFIG.prefill_chunk
        chunks += 1
    assert chunks == -(-1000 // 64)


def test_blocks_cover_what_each_step_writes():
    scheduler = make_scheduler()
    state = make_request(130, max_tokens=100)
    scheduler.add(state)
    while scheduler.has_work():
        plan = scheduler.schedule()
        for chunk in plan.prefill:
            assert len(chunk.request.blocks) * 64 >= chunk.start + chunk.num_tokens
        for row in plan.decode:
            assert len(row.request.blocks) * 64 >= row.position + row.max_steps
        apply(scheduler, plan)
    assert scheduler.blocks.num_free == scheduler.blocks.num_total


def test_newest_request_is_preempted_and_resumes_first_with_its_output():
    scheduler = make_scheduler(blocks=6)
    old, new = make_request(120, max_tokens=200, name="old"), make_request(120, max_tokens=200, name="new")
    scheduler.add(old)
    scheduler.add(new)
    preempted = []
    for _ in range(40):
        plan = advance(scheduler)
        preempted += plan.preempted
        if preempted:
            break
    assert preempted and preempted[0] is new
    assert new.status == Status.WAITING and scheduler.waiting[0] is new
    assert new.blocks == [] and new.slot is None and new.num_computed == 0
    assert new.output, "the preempted request keeps its generated tokens"
    assert old.status == Status.RUNNING
    # when the old one finishes, the preempted one is recomputed from prompt + output
    kept = list(new.output)
    while old.status != Status.FINISHED:
        advance(scheduler)
    plan = advance(scheduler) if new.num_computed == 0 else None
    assert new.output[: len(kept)] == kept
    assert new.status == Status.RUNNING and (plan is None or new.num_computed > 0)


def test_cancellation_frees_blocks_and_slot_at_once():
    scheduler = make_scheduler()
    states = [make_request(100) for _ in range(4)]
    for s in states:
        scheduler.add(s)
    advance(scheduler)
    assert scheduler.blocks.num_free < scheduler.blocks.num_total
    for s in states:
        scheduler.finish(s)
    assert scheduler.blocks.num_free == scheduler.blocks.num_total
    assert scheduler.slots.num_free == scheduler.slots.num_total
    assert not scheduler.has_work()


def test_request_larger_than_the_pool_is_rejected_not_stuck():
    scheduler = make_scheduler(blocks=2)
    state = make_request(300)
    scheduler.add(state)
    plan = scheduler.schedule()
    assert plan.rejected == [state]
    assert not scheduler.running


def test_buckets_follow_the_config():
    config = EngineConfig(
        max_concurrency=20,
        prefill_chunk=1024,
        prefill_buckets=(16, 64, 256, 1024, 4096),
        prefill_batch_sizes=(1, 2, 4),
        compilation_cache_dir=None,
    )
    assert config.chunk_buckets == (16, 64, 256, 1024)
    assert config.decode_buckets == (1, 2, 4, 8, 16, 32)
    assert (4, 256) in config.prefill_shapes and (2, 1024) not in config.prefill_shapes
    assert all(r == 1 or r * t <= 1024 for r, t in config.prefill_shapes)


def test_sixty_four_requests_run_together_in_the_largest_decode_bucket():
    config = CONFIG.replace(max_concurrency=64, decode_batch_sizes=(1, 2, 4, 8, 16, 32, 64))
    scheduler = make_scheduler(blocks=64 * 4, config=config)
    states = [make_request(10 + i % 7, max_tokens=150) for i in range(70)]
    for s in states:
        scheduler.add(s)
    plans = [advance(scheduler) for _ in range(40)]
    assert max(p.decode_batch for p in plans) == 64
    assert max(len(p.decode) for p in plans) == 64
    while scheduler.has_work():
        advance(scheduler)
    assert all(len(s.output) == 150 for s in states)
    assert scheduler.blocks.num_free == scheduler.blocks.num_total
