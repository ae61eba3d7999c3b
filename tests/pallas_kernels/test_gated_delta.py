"""The gated delta decode kernel equals its plain-JAX reference and the model's recurrence, in place on the pool."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infernix_jax.model.gated_deltanet import causal_conv, gates, l2_normalize, recurrent_gated_delta_rule
from pallas_kernels import compat

INTERPRET = not compat.on_gpu()  # on a GPU the tests run the compiled kernel
TOL = 1e-5 if INTERPRET else 1e-4
# the model's recurrence uses default-precision einsums: TF32-class on a GPU (~1e-4 on the H200)
MODEL_TOL = 1e-5 if INTERPRET else 2e-3
from pallas_kernels.gated_delta import (
    gated_delta_conv_decode,
    gated_delta_conv_decode_call,
    gated_delta_decode,
    gated_delta_decode_call,
    reference_gated_delta_conv_decode,
    reference_gated_delta_decode,
    supports,
)


def _inputs(seed, b, t, hk, hv, dk, dv, slots_total, dtype=jnp.bfloat16):
    ks = jax.random.split(jax.random.PRNGKey(seed), 4)
    mixed = jax.random.normal(ks[0], (b, t, 2 * hk * dk + hv * dv)).astype(dtype)
    g = -jax.nn.softplus(jax.random.normal(ks[1], (b, t, hv)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[2], (b, t, hv)))
    pool = 0.3 * jax.random.normal(ks[3], (slots_total, hv, dk, dv))
    return mixed, g, beta, pool


@pytest.mark.parametrize(
    "b, t, hk, hv, dk, dv, block_v",
    [
        (1, 1, 2, 4, 16, 32, 16),  # decode, two value heads per key head, two column blocks
        (3, 1, 2, 2, 32, 16, 16),  # Dk > Dv, one block
        (2, 5, 1, 3, 16, 16, 16),  # an odd window, three value heads on one key head
        (2, 16, 2, 4, 16, 64, 32),  # the longest window
    ],
)
def test_kernel_equals_reference(b, t, hk, hv, dk, dv, block_v):
    mixed, g, beta, pool = _inputs(b * 100 + t, b, t, hk, hv, dk, dv, slots_total=b + 3)
    slots = jnp.arange(b, dtype=jnp.int32) + 2  # not the first slots
    fresh = jnp.arange(b) == 1
    want_out, want_pool = reference_gated_delta_decode(
        mixed, g, beta, pool, slots, fresh, key_heads=hk, out_dtype=jnp.float32
    )
    got_out, got_pool = gated_delta_decode(
        mixed, g, beta, pool + 0, slots, fresh, key_heads=hk, block_v=block_v, out_dtype=jnp.float32,
        interpret=INTERPRET,
    )  # fmt: skip
    np.testing.assert_allclose(np.asarray(got_out), np.asarray(want_out), rtol=TOL, atol=TOL)
    np.testing.assert_allclose(np.asarray(got_pool), np.asarray(want_pool), rtol=TOL, atol=TOL)
    untouched = [s for s in range(b + 3) if s not in set(np.asarray(slots).tolist())]
    np.testing.assert_array_equal(np.asarray(got_pool)[untouched], np.asarray(pool)[untouched])


def test_reference_equals_the_model_recurrence():
    """The reference's l2 norms, head grouping and update are the model's (gated_deltanet.py)."""
    b, t, hk, hv, dk, dv = 2, 3, 2, 4, 16, 16
    mixed, g, beta, pool = _inputs(7, b, t, hk, hv, dk, dv, slots_total=4, dtype=jnp.float32)
    slots = jnp.asarray([3, 1], jnp.int32)
    out, new_pool = reference_gated_delta_decode(
        mixed, g, beta, pool, slots, jnp.zeros(b, bool), key_heads=hk, out_dtype=jnp.float32
    )
    key_dim = hk * dk
    q = mixed[..., :key_dim].reshape(b, t, hk, dk)
    k = mixed[..., key_dim : 2 * key_dim].reshape(b, t, hk, dk)
    v = mixed[..., 2 * key_dim :].reshape(b, t, hv, dv)
    q = jnp.repeat(l2_normalize(q) * dk**-0.5, 2, axis=2)
    k = jnp.repeat(l2_normalize(k), 2, axis=2)
    want_out, want_state = recurrent_gated_delta_rule(q, k, v, g, beta, pool[slots])
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=MODEL_TOL, atol=MODEL_TOL)
    np.testing.assert_allclose(
        np.asarray(new_pool[slots]), np.asarray(want_state), rtol=MODEL_TOL, atol=MODEL_TOL
    )


def test_padding_tokens_and_the_scratch_slot():
    """Padding tokens (g = 0, beta = 0) leave a state as it was; rows aimed at the drop slot write
    nothing, even when several rows share it."""
    b, t, hk, hv, dk, dv = 3, 4, 1, 2, 16, 16
    mixed, g, beta, pool = _inputs(3, b, t, hk, hv, dk, dv, slots_total=4)
    pool = pool.at[0].set(0.0)
    valid = jnp.arange(t)[None, :] < jnp.asarray([[2], [4], [4]])
    g = jnp.where(valid[..., None], g, 0.0)
    beta = jnp.where(valid[..., None], beta, 0.0)
    slots = jnp.asarray([3, 0, 0], jnp.int32)
    out, new_pool = gated_delta_decode(
        mixed, g, beta, pool + 0, slots, jnp.zeros(b, bool), key_heads=hk, block_v=16, interpret=INTERPRET
    )
    assert not np.asarray(new_pool[0]).any()  # the scratch slot stays zero
    np.testing.assert_array_equal(np.asarray(new_pool[1:3]), np.asarray(pool[1:3]))
    short_out, short_pool = reference_gated_delta_decode(
        mixed[:1, :2], g[:1, :2], beta[:1, :2], pool, slots[:1], jnp.zeros(1, bool), key_heads=hk
    )
    np.testing.assert_allclose(np.asarray(new_pool[3]), np.asarray(short_pool[3]), rtol=TOL, atol=TOL)
    np.testing.assert_allclose(
        np.asarray(out[0, :2], np.float32), np.asarray(short_out[0], np.float32), rtol=1e-2, atol=1e-2
    )


def _window(args, t):
    """The arguments' mixed / g / beta lengthened to a window of t tokens."""
    return {
        name: jnp.zeros((1, t) + args[name].shape[2:], args[name].dtype) for name in ("mixed", "g", "beta")
    }


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: {**a, "mixed": a["mixed"][..., :-1]}, "channels"),
        (lambda a: {**a, "pool": a["pool"].astype(jnp.bfloat16)}, "float32"),
        (lambda a: {**a, "key_heads": 3}, "multiple of key_heads"),
        (lambda a: {**a, "g": a["g"][:, :, :1]}, "g must be"),
        (lambda a: {**a, "slots": jnp.asarray([1, 1], jnp.int32)}, "slots must be"),
        (lambda a: {**a, "block_v": 24}, "power of two"),
        (lambda a: {**a, **_window(a, 17)}, "windows of"),
    ],
)
def test_rejected_inputs(change, match):
    mixed, g, beta, pool = _inputs(0, 1, 1, 2, 4, 16, 32, slots_total=2)
    args = {"mixed": mixed, "g": g, "beta": beta, "pool": pool, "slots": jnp.asarray([1], jnp.int32),
            "fresh": jnp.zeros(1, bool), "key_heads": 2, "block_v": 16}  # fmt: skip
    args = change(args)
    with pytest.raises(ValueError, match=match):
        gated_delta_decode(**args, interpret=INTERPRET)


def test_supports_power_of_two_heads_and_short_windows():
    assert supports(128, 128, 1) and supports(16, 64, 16)
    assert not supports(96, 128, 1) and not supports(8, 8, 1) and not supports(128, 128, 17)


def test_lowers_for_cuda_with_the_pool_aliased():
    """The Triton lowering accepts the kernel at the Qwen3.5-27B layer's shapes, and the pool is an
    input-output alias of the call (updated in place, no copy)."""
    b, hk, hv, dk, dv = 2, 16, 48, 128, 128
    shapes = (
        jax.ShapeDtypeStruct((b, 1, 2 * hk * dk + hv * dv), jnp.bfloat16),
        jax.ShapeDtypeStruct((b, 1, hv), jnp.float32),
        jax.ShapeDtypeStruct((b, 1, hv), jnp.float32),
        jax.ShapeDtypeStruct((9, hv, dk, dv), jnp.float32),
        jax.ShapeDtypeStruct((b,), jnp.int32),
        jax.ShapeDtypeStruct((b,), jnp.bool_),
    )
    fn = jax.jit(
        lambda *a: gated_delta_decode_call(
            *a, key_heads=hk, block_v=32, num_warps=4, drop_slot=0, out_dtype=None, interpret=False
        )
    )
    text = compat.lower_for_cuda(fn, *shapes)
    assert text.count("xla.gpu.triton") == 1 and "gated_delta_decode" in text
    assert "output_operand_aliases" in text


def _conv_inputs(seed, b, t, hk, hv, dk, dv, slots_total, width=4, dtype=jnp.bfloat16):
    """The conv form's arguments (before slots, fresh and n_valid): raw, b_in, a_in, conv_weight,
    a_log, dt_bias, conv_pool, pool."""
    ks = jax.random.split(jax.random.PRNGKey(seed), 8)
    c = 2 * hk * dk + hv * dv
    return (
        jax.random.normal(ks[0], (b, t, c)).astype(dtype),
        jax.random.normal(ks[1], (b, t, hv)).astype(dtype),
        jax.random.normal(ks[2], (b, t, hv)).astype(dtype),
        (0.5 * jax.random.normal(ks[3], (c, width))).astype(dtype),
        jax.random.normal(ks[4], (hv,)) * 0.5,
        jax.random.normal(ks[5], (hv,)) * 0.5,
        jax.random.normal(ks[6], (slots_total, c, width - 1)).astype(dtype),
        0.3 * jax.random.normal(ks[7], (slots_total, hv, dk, dv)),
    )


@pytest.mark.parametrize(
    "b, t, hk, hv, dk, dv, block_v, dtype",
    [
        (1, 1, 2, 4, 16, 32, 16, jnp.float32),  # decode, two value heads a key head, two column blocks
        (3, 1, 2, 2, 32, 16, 16, jnp.bfloat16),  # Dk > Dv
        (2, 5, 1, 3, 16, 16, 16, jnp.float32),  # an odd window, three value heads on one key head
        (2, 16, 2, 4, 16, 64, 32, jnp.bfloat16),  # the longest window
    ],
)
def test_conv_kernel_equals_reference(b, t, hk, hv, dk, dv, block_v, dtype):
    """Conv, gates and recurrence in one launch: outputs, the rows' new conv states and the pool as
    the reference gives them, with fresh rows, padding tokens (n_valid < T) and the other slots
    untouched."""
    args = _conv_inputs(b * 10 + t, b, t, hk, hv, dk, dv, slots_total=b + 3, dtype=dtype)
    slots = jnp.arange(b, dtype=jnp.int32) + 2
    fresh = jnp.arange(b) == 1
    n_valid = jnp.maximum(t - jnp.arange(b, dtype=jnp.int32) * 2, 1)  # rows after the first padded
    want = reference_gated_delta_conv_decode(
        *args, slots, fresh, n_valid, key_heads=hk, out_dtype=jnp.float32
    )
    got = gated_delta_conv_decode(
        *args[:7], args[7] + 0, slots, fresh, n_valid, key_heads=hk, block_v=block_v, out_dtype=jnp.float32,
        interpret=INTERPRET,
    )  # fmt: skip
    tol = TOL if dtype == jnp.float32 else 2e-2  # bf16: a conv output may round the other way
    for name, x, y in zip(("out", "pool"), got[::2], want[::2]):
        np.testing.assert_allclose(np.asarray(x, np.float32), np.asarray(y, np.float32), rtol=tol, atol=tol,
                                   err_msg=name)  # fmt: skip
    np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))  # raw inputs: exact
    untouched = [s for s in range(b + 3) if s not in set(np.asarray(slots).tolist())]
    np.testing.assert_array_equal(np.asarray(got[2])[untouched], np.asarray(args[7])[untouched])


def test_conv_reference_equals_the_model_conv_and_gates():
    """The conv form's reference is the model's causal conv (+ SiLU) with its carried state and
    the model's gates, then the recurrence (gated_deltanet.py)."""
    b, t, hk, hv, dk, dv = 2, 3, 1, 2, 16, 16
    raw, b_in, a_in, w, a_log, dt_bias, conv_pool, pool = _conv_inputs(
        5, b, t, hk, hv, dk, dv, slots_total=3, dtype=jnp.float32
    )
    slots, fresh, n_valid = jnp.asarray([2, 1], jnp.int32), jnp.asarray([False, True]), jnp.asarray([3, 2])
    out, new_conv, _ = reference_gated_delta_conv_decode(
        raw, b_in, a_in, w, a_log, dt_bias, conv_pool, pool, slots, fresh, n_valid, key_heads=hk
    )
    conv_state = jnp.where(fresh[:, None, None], 0.0, conv_pool[slots])
    mixed, want_conv = causal_conv(raw, conv_state, w, n_valid)
    g, beta = gates(b_in, a_in, a_log, dt_bias, jnp.arange(t)[None, :] < n_valid[:, None])
    want_out, _ = reference_gated_delta_decode(mixed, g, beta, pool, slots, fresh, key_heads=hk)
    np.testing.assert_array_equal(np.asarray(new_conv), np.asarray(want_conv))
    np.testing.assert_allclose(np.asarray(out), np.asarray(want_out), rtol=1e-5, atol=1e-5)


def test_conv_form_padding_rows_share_the_scratch_slot():
    """Rows aimed at the drop slot write no recurrent state, however many share it; their conv
    states come out as the others' do (the caller's scatter drops them)."""
    b, t, hk, hv, dk, dv = 3, 2, 1, 2, 16, 16
    args = _conv_inputs(9, b, t, hk, hv, dk, dv, slots_total=3)
    pool = args[7].at[0].set(0.0)
    slots = jnp.asarray([2, 0, 0], jnp.int32)
    fresh, n_valid = jnp.zeros(b, bool), jnp.full(b, t)
    _, new_conv, new_pool = gated_delta_conv_decode(
        *args[:7], pool + 0, slots, fresh, n_valid, key_heads=hk, block_v=16, interpret=INTERPRET
    )
    assert not np.asarray(new_pool[0]).any()
    np.testing.assert_array_equal(np.asarray(new_pool[1]), np.asarray(args[7][1]))
    _, want_conv, _ = reference_gated_delta_conv_decode(*args[:7], pool, slots, fresh, n_valid, key_heads=hk)
    np.testing.assert_array_equal(np.asarray(new_conv), np.asarray(want_conv))


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda a: {**a, "conv_pool": a["conv_pool"][:, :, :2]}, "conv_pool must be"),
        (lambda a: {**a, "conv_weight": a["conv_weight"][:-1]}, "conv_weight must be"),
        (lambda a: {**a, "b_in": a["b_in"][:, :, :1]}, "b_in must be"),
        (lambda a: {**a, "dt_bias": a["dt_bias"][:1]}, "dt_bias must be"),
        (lambda a: {**a, "n_valid": jnp.ones(1, jnp.float32)}, "n_valid must be"),
    ],
)
def test_conv_form_rejected_inputs(change, match):
    names = ("raw", "b_in", "a_in", "conv_weight", "a_log", "dt_bias", "conv_pool", "pool")
    args = dict(zip(names, _conv_inputs(0, 1, 1, 2, 4, 16, 32, slots_total=2)))
    args.update(slots=jnp.asarray([1], jnp.int32), fresh=jnp.zeros(1, bool), n_valid=jnp.ones(1, jnp.int32),
                key_heads=2, block_v=16)  # fmt: skip
    with pytest.raises(ValueError, match=match):
        gated_delta_conv_decode(**change(args), interpret=INTERPRET)


@pytest.mark.parametrize("joined", [False, True])
def test_conv_form_lowers_for_cuda_with_both_pools_aliased(joined):
    """The Triton lowering takes the conv form at the Qwen3.5-27B layer's shapes (q | k | v, b, a
    apart) and at the Qwen3-Next-80B layer's with the joined array (q | k | v, z, b, a at their
    columns): one call, the pool aliased and the conv pool not (the rows' conv states come out apart)."""
    b, hk, hv = (1, 16, 32) if joined else (2, 16, 48)
    dk, dv, width = 128, 128, 4
    c = 2 * hk * dk + hv * dv
    bf16 = jnp.bfloat16
    if joined:
        projected = jax.ShapeDtypeStruct((b, 1, c + hv * dv + 2 * hv), bf16)
        inputs, columns = (projected,) * 3, (0, c + hv * dv, c + hv * dv + hv)
    else:
        gates = jax.ShapeDtypeStruct((b, 1, hv), bf16)
        inputs, columns = (jax.ShapeDtypeStruct((b, 1, c), bf16), gates, gates), None
    shapes = (
        *inputs,
        jax.ShapeDtypeStruct((c, width), bf16),
        jax.ShapeDtypeStruct((hv,), jnp.float32),
        jax.ShapeDtypeStruct((hv,), bf16),
        jax.ShapeDtypeStruct((9, c, width - 1), bf16),
        jax.ShapeDtypeStruct((9, hv, dk, dv), jnp.float32),
        jax.ShapeDtypeStruct((b,), jnp.int32),
        jax.ShapeDtypeStruct((b,), jnp.bool_),
        jax.ShapeDtypeStruct((b,), jnp.int32),
    )
    fn = jax.jit(lambda *a: gated_delta_conv_decode_call(*a, key_heads=hk, block_v=32, num_warps=4, columns=columns))
    text = compat.lower_for_cuda(fn, *shapes)
    assert text.count("xla.gpu.triton") == 1 and "gated_delta_conv_decode" in text
    assert (
        "output_operand_aliases" in text and "operand_index = 10" in text and "operand_index = 9" not in text
    )


@pytest.mark.parametrize("b, t", [(1, 1), (2, 3)])
def test_conv_form_reads_one_joined_array_at_its_columns(b, t):
    """The GDN input projections' joined output (q | k | v, z, b, a at their columns, padding
    between) read in place: the same outputs, conv states and pool bit for bit as the three
    arrays apart; columns that do not fit their array are refused."""
    hk, hv, dk, dv = 2, 4, 16, 32
    raw, b_in, a_in, *rest = _conv_inputs(31 + t, b, t, hk, hv, dk, dv, slots_total=b + 2)
    c = raw.shape[2]
    z = jnp.full((b, t, 48), 7.0, raw.dtype)  # another weight's columns, and padding before b
    pad = jnp.full((b, t, 16), jnp.nan, raw.dtype)
    joined = jnp.concatenate([raw, z, pad, b_in, a_in], axis=2)
    columns = (0, c + 64, c + 64 + hv)
    slots, fresh = jnp.arange(1, b + 1, dtype=jnp.int32), jnp.arange(b) == 0
    n_valid = jnp.full(b, t, jnp.int32)
    common = {"key_heads": hk, "block_v": 16, "interpret": INTERPRET}
    want = gated_delta_conv_decode(raw, b_in, a_in, *rest[:4], rest[4] + 0, slots, fresh, n_valid, **common)
    got = gated_delta_conv_decode(joined, joined, joined, *rest[:4], rest[4] + 0, slots, fresh, n_valid,
                                  columns=columns, **common)  # fmt: skip
    for name, x, y in zip(("out", "conv", "pool"), got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=name)
    with pytest.raises(ValueError, match="does not fit"):
        gated_delta_conv_decode(joined, joined, joined, *rest[:4], rest[4] + 0, slots, fresh, n_valid,
                                columns=(0, c + 64, joined.shape[2] - 1), **common)  # fmt: skip
    with pytest.raises(ValueError, match="b at column"):  # b's own array is Hv wide: its column is 0
        gated_delta_conv_decode(joined, b_in, a_in, *rest[:4], rest[4] + 0, slots, fresh, n_valid,
                                columns=columns, **common)  # fmt: skip
