"""The word rows of an RMSNorm's output with their scale bounded from the norm's input
(weights/norm_words.py, `quant.norm_rows("source")`): the normed rows are the model's norm bit for
bit, the words times their inverse factors give them back exactly in both layouts, and each row's
max lands inside float16's range with room to spare."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infernix_jax.model.norm import gated_rms_norm, rms_norm
from infernix_jax.weights.norm_words import gated_rms_norm_words, rms_norm_words
from pallas_kernels import _quant_common as qc

EPS = 1e-6


def _inputs(m: int, k: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)) * np.exp(rng.uniform(-6, 6, (m, 1)))  # rows of very different sizes
    w = rng.standard_normal(k) * 0.3
    return jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)


def _rows_from_words(words: np.ndarray, layout: str) -> np.ndarray:
    """float16 rows [M, K] in natural column order from the words of either layout."""
    m = words.shape[0]
    if layout == "pairs":  # [M, 4, K/8] pairs (x[8j + p], x[8j + p + 4]) -> columns [M, 8, K/8]
        halves = np.stack([words & 0xFFFF, words >> 16], axis=-1).astype(np.uint16).view(np.float16)
        halves = halves.reshape(m, 4, -1, 2)
        cols = np.concatenate([halves[..., 0], halves[..., 1]], axis=1)
    else:
        cols = words.reshape(m, 8, -1)
    return cols.transpose(0, 2, 1).reshape(m, -1)  # column p * K/8 + j holds x[8j + p]


@pytest.mark.parametrize("layout", ["columns", "pairs"])
@pytest.mark.parametrize("zero_centered", [True, False])
def test_words_give_back_the_models_norm_exactly(layout, zero_centered):
    x, w = _inputs(6, 256)
    normed, words, inverse = jax.jit(rms_norm_words, static_argnames=("eps", "zero_centered", "layout"))(
        x, w, eps=EPS, zero_centered=zero_centered, layout=layout
    )
    want = rms_norm(x, w, EPS, zero_centered)
    np.testing.assert_array_equal(np.asarray(normed, np.float32), np.asarray(want, np.float32))
    rows = _rows_from_words(np.asarray(words), layout).astype(np.float32)
    np.testing.assert_array_equal(rows * np.asarray(inverse)[:, None], np.asarray(want, np.float32))
    peak = np.abs(rows).max(axis=1)
    assert np.all((peak >= 2.0**12) & (peak < 2.0**14)), peak


def test_a_row_just_under_a_power_of_two_gets_half_the_factor_and_the_same_values():
    """The bound's margin may halve f16_rows' factor; the rows then land in [2**12, 2**13) and the
    words still hold every bit of the normed values."""
    k = 64
    x = np.zeros((1, k), np.float32)
    x[0, 0] = 1.0
    # with one nonzero element the normed max is sqrt(k) * w0 = 8 * (2 - 2**-7), just under 2**4
    w = np.ones(k, np.float32)
    w[0] = 2 - 2.0**-7
    x, w = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
    normed, words, inverse = rms_norm_words(x, w, eps=0.0, zero_centered=False, layout="columns")
    _, exact_inverse = qc.f16_rows(normed)
    assert float(inverse[0]) == 2 * float(exact_inverse[0])
    rows = _rows_from_words(np.asarray(words), "columns").astype(np.float32)
    np.testing.assert_array_equal(rows * float(inverse[0]), np.asarray(normed, np.float32))


def test_an_all_zero_row_stays_zero_and_finite():
    x = jnp.zeros((2, 64), jnp.bfloat16)
    _, words, inverse = rms_norm_words(
        x, jnp.ones(64, jnp.bfloat16), eps=EPS, zero_centered=True, layout="pairs"
    )
    assert not np.asarray(words).any() and np.isfinite(np.asarray(inverse)).all()


def test_an_unknown_layout_is_refused():
    x, w = _inputs(1, 64)
    with pytest.raises(ValueError, match="layout"):
        rms_norm_words(x, w, eps=EPS, zero_centered=True, layout="rows")


@pytest.mark.parametrize("layout", ["columns", "pairs"])
def test_gated_words_give_back_the_gdn_output_norm_exactly(layout):
    """The GDN output norm's form: each head's 1/rms from its own columns, times silu of the gate;
    the row bound is the max over heads of each head's bound."""
    heads, d = 4, 64
    x, _ = _inputs(5, heads * d, seed=1)
    gate, _ = _inputs(5, heads * d, seed=2)
    w = jnp.asarray(np.random.default_rng(3).standard_normal(d) * 0.3, jnp.bfloat16)
    gated, words, inverse = gated_rms_norm_words(x, gate, w, eps=EPS, layout=layout)
    want = gated_rms_norm(x.reshape(5, heads, d), gate.reshape(5, heads, d), w, EPS).reshape(5, heads * d)
    np.testing.assert_array_equal(np.asarray(gated, np.float32), np.asarray(want, np.float32))
    rows = _rows_from_words(np.asarray(words), layout).astype(np.float32)
    # exact but where silu makes a value so small next to its row's max that float16 holds it as
    # a subnormal (as with `f16_rows`): there within float16's smallest step, scaled back
    inverse = np.asarray(inverse)[:, None]
    diff = np.abs(rows * inverse - np.asarray(want, np.float32))
    assert np.all(diff <= 2.0**-24 * inverse), diff.max()
    assert np.all(diff[np.abs(rows) >= 2.0**-14] == 0)
    peak = np.abs(rows).max(axis=1)
    assert np.all((peak >= 2.0**12) & (peak < 2.0**14)), peak
