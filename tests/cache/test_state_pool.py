"""Writing rows' recurrent states back to their slots: every row lands in its slot, and the scratch
slot (the padding rows' slot) still reads zeros after rows aimed at it are written."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from infernix_jax.cache import SCRATCH_SLOT
from infernix_jax.cache.state_pool import GDNState, scatter_states


def _pool_in_use(slots: int) -> GDNState:
    """A pool whose real slots hold ones (states in use) and whose scratch slot holds zeros."""
    ones = lambda shape, dtype: jnp.ones(shape, dtype).at[SCRATCH_SLOT].set(0)
    return GDNState(conv=ones((slots, 6, 3), jnp.bfloat16), recurrent=ones((slots, 2, 4, 4), jnp.float32))


@pytest.mark.parametrize("slots", [[2], [SCRATCH_SLOT], [3, SCRATCH_SLOT, 1, SCRATCH_SLOT]])
def test_rows_land_in_their_slots_and_the_scratch_slot_stays_zero(slots):
    rng = np.random.default_rng(0)
    states = GDNState(
        conv=jnp.asarray(rng.normal(size=(len(slots), 6, 3)) + 1, jnp.bfloat16),
        recurrent=jnp.asarray(rng.normal(size=(len(slots), 2, 4, 4)) + 1, jnp.float32),
    )
    pool = _pool_in_use(4)
    new = scatter_states(pool, jnp.asarray(slots, jnp.int32), states)
    for name in ("conv", "recurrent"):
        got, old, rows = (
            np.asarray(getattr(new, name)),
            np.asarray(getattr(pool, name)),
            np.asarray(getattr(states, name)),
        )
        for slot in range(4):
            if slot == SCRATCH_SLOT:
                assert not got[slot].any(), name
            elif slot in slots:
                np.testing.assert_array_equal(got[slot], rows[slots.index(slot)])
            else:
                np.testing.assert_array_equal(got[slot], old[slot])  # untouched


def test_a_part_given_as_none_leaves_that_pool_as_it_is():
    pool = _pool_in_use(3)
    conv = jnp.full((1, 6, 3), 5, jnp.bfloat16)
    new = scatter_states(pool, jnp.asarray([1], jnp.int32), GDNState(conv=conv, recurrent=None))
    assert new.recurrent is pool.recurrent
    np.testing.assert_array_equal(np.asarray(new.conv[1]), np.asarray(conv[0]))
