"""The compat layer gives a working masked load/store and Triton compiler params on this jax."""

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import compat


def test_masked_load_and_store_skip_the_out_of_bounds_edge():
    def kernel(x_ref, o_ref):
        i = compat.program_id(0)
        idx = i * 8 + jnp.arange(8)
        v = compat.load(x_ref.at[compat.ds(i * 8, 8)], mask=idx < 13, other=-1.0)
        compat.store(o_ref.at[compat.ds(i * 8, 8)], v * 2.0, mask=idx < 13)

    x = jnp.arange(13, dtype=jnp.float32)
    out = compat.pallas_call(
        kernel,
        out_shape=jax.ShapeDtypeStruct((13,), jnp.float32),
        grid=(2,),
        interpret=True,
        name="masked_copy",
    )(x)
    np.testing.assert_array_equal(np.asarray(out), np.arange(13) * 2.0)


def test_triton_compiler_params_keep_the_values():
    params = compat.triton_compiler_params(num_warps=8, num_stages=2)
    assert (params.num_warps, params.num_stages) == (8, 2)


def test_pow2_at_least():
    assert [compat.pow2_at_least(v, 16) for v in (1, 16, 17, 64)] == [16, 16, 32, 64]


def test_kernel_choice_maps_each_dispatch_mode():
    assert compat.kernel_choice("kernel") == (True, False)
    assert compat.kernel_choice("interpret") == (True, True)
    assert compat.kernel_choice("auto") == (False, False)  # this suite runs on the CPU backend
    assert compat.kernel_choice("xla") == compat.kernel_choice("reference") == (False, False)
