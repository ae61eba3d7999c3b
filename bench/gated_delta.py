"""The linear-attention layers' decode step: the in-place kernels against XLA's gathered form.

    python -m bench.gated_delta                  # GPU: Qwen3.5-27B and Qwen3-Next-80B heads, batch 1, 4, 8
    python -m bench.gated_delta --sweep          # also block_v x num_warps of the kernels
    python -m bench.gated_delta --quick          # interpret mode, tiny shapes (any machine)

One decode token of `layers` linear-attention layers (distinct state pools, together larger than
L2) from the input projection's outputs to the recurrence's output, as the engine's decode
program runs it:

* "xla": the model without the kernels: gather the rows' conv and recurrent states, the causal
  conv, the gates, l2-normalise q and k, the per-token recurrence
  (`model.gated_deltanet.recurrent_gated_delta_rule`), scatter both states;
* "kernel": the conv, the gates and the conv state's gather / scatter in XLA, the recurrence by
  `pallas_kernels.gated_delta.gated_delta_decode` in place on the pool;
* "conv-kernel": all of it in one launch (`gated_delta_conv_decode`, what the engine runs), the
  pool in place, then the rows' conv states scattered into their pool.

The pools are donated, as the engine's are. Records ("gated delta <model> batch<B> <way>") give
the state bytes moved per second (each row's [Hv, Dk, Dv] float32 state read and written once)
against the HBM read probe of the same run; the other forms move more than that, so theirs is an
effective rate. Every form is checked against `reference_gated_delta_conv_decode` first.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.ceilings import QUICK, Sizes, measure_hbm_read
from bench.record import git_commit, machine_name, machine_slug, make_record, write_records
from infernix_jax.cache.allocators import SCRATCH_SLOT
from infernix_jax.model.gated_deltanet import causal_conv, gates, l2_normalize, recurrent_gated_delta_rule
from pallas_kernels import compat
from pallas_kernels.gated_delta import (
    DEFAULT_BLOCK_V,
    DEFAULT_NUM_WARPS,
    gated_delta_conv_decode_call,
    gated_delta_decode_call,
    reference_gated_delta_conv_decode,
)

# (key heads, value heads, Dk, Dv) of the linear-attention layers (as bench.engine_setup.SHAPES declares)
MODELS = {"qwen3.5-27b": (16, 48, 128, 128), "qwen3-next-80b": (16, 32, 128, 128)}
QUICK_MODELS = {"tiny": (2, 4, 16, 32)}
CONV_WIDTH = 4  # linear_conv_kernel of both models
WAYS = ("xla", "kernel", "conv-kernel")
L2_DEFEAT_BYTES = 160 << 20
TRIAL_S = 1e-2
SWEEP = [(bv, w) for bv in (16, 32, 64) for w in (2, 4, 8)] + [
    (128, 4),
    (128, 8),
]  # 128: a whole head a program


def _inputs(shape, batch, layers, seed=0):
    """(per-token inputs, layer parameters, per-layer (conv pool, pool) pairs, slots)."""
    hk, hv, dk, dv = shape
    ks = jax.random.split(jax.random.PRNGKey(seed), 8)
    channels = 2 * hk * dk + hv * dv
    bf16 = jnp.bfloat16
    tokens = (
        jax.random.normal(ks[0], (batch, 1, channels)).astype(bf16),  # raw q | k | v
        jax.random.normal(ks[1], (batch, 1, hv)).astype(bf16),  # b
        jax.random.normal(ks[2], (batch, 1, hv)).astype(bf16),  # a
    )
    params = (
        (0.5 * jax.random.normal(ks[3], (channels, CONV_WIDTH))).astype(bf16),
        0.5 * jax.random.normal(ks[4], (hv,)),
        (0.5 * jax.random.normal(ks[5], (hv,))).astype(bf16),
    )
    slots_total = batch + 1  # slot 0 is the scratch slot
    pools = [
        (
            jax.random.normal(jax.random.fold_in(ks[6], i), (slots_total, channels, CONV_WIDTH - 1)).astype(
                bf16
            ),
            0.1 * jax.random.normal(jax.random.fold_in(ks[7], i), (slots_total, hv, dk, dv), jnp.float32),
        )
        for i in range(layers)
    ]
    slots = jnp.arange(1, batch + 1, dtype=jnp.int32)
    return tokens, params, pools, slots


def _conv_and_gates(tokens, params, conv_pool, slots, fresh, n_valid):
    """The model's conv (gathered state) and gates: (mixed, g, beta, new conv states [B, C, W-1])."""
    raw, b_in, a_in = tokens
    conv_weight, a_log, dt_bias = params
    conv_state = jnp.where(fresh[:, None, None], 0, conv_pool[slots])
    mixed, new_conv = causal_conv(raw, conv_state, conv_weight, n_valid)
    valid = jnp.arange(raw.shape[1])[None, :] < n_valid[:, None]
    g, beta = gates(b_in, a_in, a_log, dt_bias, valid)
    return mixed, g, beta, new_conv


def _scatter(pool, slots, rows):
    target = jnp.where(slots == SCRATCH_SLOT, pool.shape[0], slots)  # as cache.state_pool.scatter_states
    return pool.at[target].set(rows.astype(pool.dtype), mode="drop")


def _xla_step(tokens, params, conv_pool, pool, slots, fresh, n_valid, hk):
    """The model's gathered form of one layer (gated_deltanet without the kernels)."""
    mixed, g, beta, new_conv = _conv_and_gates(tokens, params, conv_pool, slots, fresh, n_valid)
    b, t, _ = mixed.shape
    _, hv, dk, dv = pool.shape
    key_dim = hk * dk
    state = jnp.where(fresh[:, None, None, None], 0, pool[slots])
    q = mixed[..., :key_dim].reshape(b, t, hk, dk)
    k = mixed[..., key_dim : 2 * key_dim].reshape(b, t, hk, dk)
    v = mixed[..., 2 * key_dim :].reshape(b, t, hv, dv).astype(jnp.float32)
    q = jnp.repeat(l2_normalize(q.astype(jnp.float32)) * dk**-0.5, hv // hk, axis=2)
    k = jnp.repeat(l2_normalize(k.astype(jnp.float32)), hv // hk, axis=2)
    out, state = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    return out.astype(mixed.dtype), _scatter(conv_pool, slots, new_conv), _scatter(pool, slots, state)


def _program(way, hk, block_v, num_warps, interpret):
    tiles = {"key_heads": hk, "block_v": block_v, "num_warps": num_warps, "drop_slot": SCRATCH_SLOT}
    tiles["interpret"] = interpret

    def one_layer(tokens, params, conv_pool, pool, slots, fresh, n_valid):
        if way == "conv-kernel":  # the rows' conv states scattered after it, as the engine does
            out, new_conv, pool = gated_delta_conv_decode_call(
                *tokens, *params, conv_pool, pool, slots, fresh, n_valid, **tiles
            )
            return out, _scatter(conv_pool, slots, new_conv), pool
        if way == "kernel":
            mixed, g, beta, new_conv = _conv_and_gates(tokens, params, conv_pool, slots, fresh, n_valid)
            out, pool = gated_delta_decode_call(mixed, g, beta, pool, slots, fresh, **tiles)
            return out, _scatter(conv_pool, slots, new_conv), pool
        return _xla_step(tokens, params, conv_pool, pool, slots, fresh, n_valid, hk)

    def run(pools, tokens, params, slots, fresh, n_valid):
        outs, new = [], []
        for conv_pool, pool in pools:
            out, conv_pool, pool = one_layer(tokens, params, conv_pool, pool, slots, fresh, n_valid)
            outs.append(out)
            new.append((conv_pool, pool))
        return new, outs

    return jax.jit(run, donate_argnums=(0,))


def _timed(fn, pools, args, trial_s, trials):
    """(median seconds per call, the pools after the calls, the first call's outputs)."""
    pools, first = fn(pools, *args)
    jax.block_until_ready(pools)
    start = time.perf_counter()
    pools, _ = fn(pools, *args)
    jax.block_until_ready(pools)
    calls = max(3, int(trial_s / max(time.perf_counter() - start, 1e-6)))
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(calls):
            pools, _ = fn(pools, *args)
        jax.block_until_ready(pools)
        times.append((time.perf_counter() - start) / calls)
    return float(np.median(times)), pools, first


def measure(model, shape, batch, way, block_v, num_warps, bandwidth, machine, commit, interpret):
    hk, hv, dk, dv = shape
    state_bytes = hv * dk * dv * 4
    layers = 1 if interpret else max(2, min(48, -(-L2_DEFEAT_BYTES // (state_bytes * (batch + 1)))))
    tokens, params, pools, slots = _inputs(shape, batch, layers)
    fresh = jnp.zeros(batch, bool)
    n_valid = jnp.ones(batch, jnp.int32)
    want_out, _, _ = reference_gated_delta_conv_decode(
        *tokens, *params, *pools[0], slots, fresh, n_valid, key_heads=hk, drop_slot=SCRATCH_SLOT
    )
    fn = _program(way, hk, min(block_v, dv), num_warps, interpret)
    seconds, _, first = _timed(fn, [(c + 0, p + 0) for c, p in pools], (tokens, params, slots, fresh, n_valid),
                               0.0 if interpret else TRIAL_S, 1 if interpret else 5)  # fmt: skip
    out_err = float(jnp.max(jnp.abs(first[0].astype(jnp.float32) - want_out.astype(jnp.float32))))
    out_scale = float(jnp.max(jnp.abs(want_out.astype(jnp.float32))))
    seconds /= layers
    moved = 2 * batch * state_bytes
    name = f"gated delta {model} batch{batch} {way}"
    if way != "xla" and (block_v, num_warps) != (DEFAULT_BLOCK_V, DEFAULT_NUM_WARPS):
        name += f" bv{block_v} w{num_warps}"
    details = {
        "key_heads": hk, "value_heads": hv, "dk": dk, "dv": dv, "batch": batch, "layers": layers,
        "way": way, "block_v": block_v, "num_warps": num_warps, "us_per_layer": 1e6 * seconds,
        "state_bytes_moved": moved, "max_abs_err_out_vs_reference": out_err, "max_abs_out": out_scale, "interpret": interpret,
        "jax": jax.__version__,
    }  # fmt: skip
    return make_record(name, moved / seconds / 1e9, "GB/s", bandwidth / 1e9, "GB/s", machine=machine,
                       commit=commit, details=details)  # fmt: skip


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--batches", default="1,4,8")
    parser.add_argument("--sweep", action="store_true", help="also block_v x num_warps of the conv kernel")
    parser.add_argument("--quick", action="store_true", help="interpret mode, tiny shapes (any machine)")
    parser.add_argument("--out", help="output file (default: bench/results/gated-delta-<machine>.json)")
    args = parser.parse_args(argv)
    interpret = args.quick or not compat.on_gpu()
    models = QUICK_MODELS if args.quick else {m: MODELS[m] for m in args.models.split(",")}
    batches = (1, 2) if args.quick else tuple(int(b) for b in args.batches.split(","))
    machine, commit = machine_name(), git_commit()
    bandwidth = measure_hbm_read(QUICK if args.quick else Sizes()).rate
    out = args.out or f"gated-delta-{machine_slug(machine)}{'-quick' if args.quick else ''}.json"
    configs = [(way, DEFAULT_BLOCK_V, DEFAULT_NUM_WARPS) for way in WAYS]
    if args.sweep:
        configs += [
            ("conv-kernel", bv, w) for bv, w in SWEEP if (bv, w) != (DEFAULT_BLOCK_V, DEFAULT_NUM_WARPS)
        ]
    records = []
    for model, shape in models.items():
        for batch in batches:
            for way, block_v, warps in configs:
                record = measure(
                    model, shape, batch, way, block_v, warps, bandwidth, machine, commit, interpret
                )
                d = record.details
                # bf16 outputs: a conv output or an output may round the other way (a few ulps of the largest)
                if d["max_abs_err_out_vs_reference"] > 2e-2 * max(1.0, d["max_abs_out"]):
                    raise RuntimeError(f"{record.name}: output error {d['max_abs_err_out_vs_reference']:.2e}")
                print(f"{record.name}: {d['us_per_layer']:.2f} us a layer, {record.figure:.0f} GB/s "
                      f"({record.fraction:.1%})", flush=True)  # fmt: skip
                records.append(record)
                write_records(records, out)
    print("wrote", write_records(records, out))
    return records


if __name__ == "__main__":
    main()
