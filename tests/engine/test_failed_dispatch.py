"""After a dispatch fails, the engine rebuilds its pools exactly when they can no longer be used."""

from types import SimpleNamespace

import jax.numpy as jnp

from infernix_jax.engine.core import EngineCore


class _FailedOutput:
    """An output of a program that failed after it was dispatched (dispatch is asynchronous, so the
    runner already holds it): reading it raises the program's error."""

    def is_deleted(self) -> bool:
        return False

    def block_until_ready(self):
        raise RuntimeError("expert 4 of MoE layer 0: checksum mismatch in host memory")


def _pools_lost(kv_pool) -> bool:
    runner = SimpleNamespace(kv_pool=kv_pool, state_pool=jnp.zeros(2), slot_sampling=jnp.ones(2))
    return EngineCore._pools_lost(SimpleNamespace(runner=runner))


def test_outputs_of_a_program_that_failed_while_running_are_rebuilt():
    assert _pools_lost(_FailedOutput())


def test_pools_donated_to_a_failed_call_are_rebuilt():
    pool = jnp.zeros(3)
    pool.delete()
    assert _pools_lost(pool)


def test_pools_a_failed_call_never_touched_are_kept():
    assert not _pools_lost(jnp.zeros(3))
