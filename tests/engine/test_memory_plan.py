"""`plan_blocks`: the KV pool takes what the weights and the other reserved state leave."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp

from infernix_jax.cache import kv_bytes_per_block, state_bytes_per_slot
from infernix_jax.config import ModelConfig
from infernix_jax.engine import memory_plan
from infernix_jax.engine.config import EngineConfig
from infernix_jax.model.params import init_params
from tests.conftest import HF_FIXTURES


def test_the_check_way_reserves_its_copies_of_a_batch_of_state_slots(monkeypatch):
    # The check way copies a decode batch's recurrent states and penalty rows before each dispatch;
    # the memory plan keeps room for the largest batch, so the KV pool gets that much less. With
    # asynchronous decode (the default) two dispatches' copies are alive at once.
    cfg = ModelConfig.from_hf_config(json.loads((HF_FIXTURES / "qwen3_next" / "config.json").read_text()))
    params = init_params(cfg, jax.random.PRNGKey(0), with_mtp=False)
    dtype = jnp.float32
    weights = sum(x.nbytes for x in jax.tree.leaves(params))
    check = EngineConfig(
        max_concurrency=8,
        max_context=8192,
        decode_batch_sizes=(1, 8),
        gpu_memory_utilization=1.0,
        prefix_cache=False,
    )
    assert check.constrained_decode == "check"  # the default
    split = dataclasses.replace(check, constrained_decode="split")
    block = kv_bytes_per_block(cfg, split.kv_dtype, dtype)
    state = state_bytes_per_slot(cfg, dtype)
    assert check.async_decode
    copies = 2 * 8 * (state + cfg.vocab_size * 5 + 4)
    limit = weights + 9 * state + 300 * block + copies  # 300 blocks left with the copies (< 8 x 128 wanted)
    monkeypatch.setattr(memory_plan, "device_memory", lambda: (limit, 0))

    def blocks(config: EngineConfig) -> int:
        return memory_plan.plan_blocks(cfg, config, dtype, params)

    assert blocks(check) == 300
    assert blocks(split) - blocks(check) in (copies // block, copies // block + 1) and copies >= block
    # batches above check_max_batch split, so only the largest bucket within it is reserved
    capped = dataclasses.replace(check, check_max_batch=4)
    one_row = 2 * (state + cfg.vocab_size * 5 + 4)  # buckets (1, 8): 1 is the largest within 4
    assert capped.check_buckets == (1,)
    assert blocks(split) - blocks(capped) in (one_row // block, one_row // block + 1)
    synchronous = dataclasses.replace(check, async_decode=False)  # one dispatch's copies at a time
    assert blocks(split) - blocks(synchronous) in (copies // 2 // block, copies // 2 // block + 1)
    no_masks = dataclasses.replace(check, structured_output=False)  # no constrained requests at all
    assert blocks(no_masks) == blocks(split)
