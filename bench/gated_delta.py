"""The linear-attention layers' decode recurrence: the in-place kernel against XLA's gathered form.

    python -m bench.gated_delta                  # GPU: Qwen3.5-27B and Qwen3-Next-80B heads, batch 1, 4, 8
    python -m bench.gated_delta --sweep          # also block_v x num_warps of the kernel
    python -m bench.gated_delta --quick          # interpret mode, tiny shapes (any machine)

One decode token through the gated delta rule of `layers` linear-attention layers (distinct
state pools, together larger than L2), as the engine's decode program runs it:

* "kernel": `pallas_kernels.gated_delta` reading each row's state from its pool slot and writing
  it back in place (the pools donated, as the engine's are);
* "xla": what the model does without it: gather the rows' states, l2-normalise q and k, the
  per-token recurrence (`model.gated_deltanet.recurrent_gated_delta_rule`), scatter the states.

Records ("gated delta <model> batch<B> <way>") give the state bytes moved per second (each row's
[Hv, Dk, Dv] float32 state read and written once) against the HBM read probe of the same run;
the XLA form moves more than that, so its figure is an effective rate. Both are checked against
`reference_gated_delta_decode` first.
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
from infernix_jax.model.gated_deltanet import l2_normalize, recurrent_gated_delta_rule
from pallas_kernels import compat
from pallas_kernels.gated_delta import (
    DEFAULT_BLOCK_V,
    DEFAULT_NUM_WARPS,
    gated_delta_decode_call,
    reference_gated_delta_decode,
)

# (key heads, value heads, Dk, Dv) of the linear-attention layers (as bench.engine_setup.SHAPES declares)
MODELS = {"qwen3.5-27b": (16, 48, 128, 128), "qwen3-next-80b": (16, 32, 128, 128)}
QUICK_MODELS = {"tiny": (2, 4, 16, 32)}
L2_DEFEAT_BYTES = 160 << 20
TRIAL_S = 1e-2
SWEEP = [(bv, w) for bv in (16, 32, 64) for w in (2, 4, 8)]


def _inputs(shape, batch, layers, seed=0):
    hk, hv, dk, dv = shape
    key = jax.random.PRNGKey(seed)
    ks = jax.random.split(key, 4)
    channels = 2 * hk * dk + hv * dv
    mixed = jax.random.normal(ks[0], (batch, 1, channels)).astype(jnp.bfloat16)
    g = -jax.nn.softplus(jax.random.normal(ks[1], (batch, 1, hv)))
    beta = jax.nn.sigmoid(jax.random.normal(ks[2], (batch, 1, hv)))
    slots_total = batch + 1  # slot 0 is the scratch slot
    pools = [
        0.1 * jax.random.normal(jax.random.fold_in(ks[3], i), (slots_total, hv, dk, dv), jnp.float32)
        for i in range(layers)
    ]
    slots = jnp.arange(1, batch + 1, dtype=jnp.int32)
    return mixed, g, beta, pools, slots


def _xla_step(mixed, g, beta, pool, slots, fresh, hk):
    """The model's gathered form of one layer's recurrence (gated_deltanet without the kernel)."""
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
    target = jnp.where(slots == SCRATCH_SLOT, pool.shape[0], slots)  # as cache.state_pool.scatter_states
    return out.astype(mixed.dtype), pool.at[target].set(state, mode="drop")


def _program(way, hk, block_v, num_warps, interpret):
    def run(pools, mixed, g, beta, slots, fresh):
        outs, new = [], []
        for pool in pools:
            if way == "kernel":
                out, pool = gated_delta_decode_call(
                    mixed, g, beta, pool, slots, fresh, key_heads=hk, block_v=block_v, num_warps=num_warps,
                    drop_slot=0, out_dtype=None, interpret=interpret,
                )  # fmt: skip
            else:
                out, pool = _xla_step(mixed, g, beta, pool, slots, fresh, hk)
            outs.append(out)
            new.append(pool)
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
    mixed, g, beta, pools, slots = _inputs(shape, batch, layers)
    fresh = jnp.zeros(batch, bool)
    want_out, _ = reference_gated_delta_decode(mixed, g, beta, pools[0], slots, fresh, key_heads=hk)
    fn = _program(way, hk, min(block_v, dv), num_warps, interpret)
    seconds, _, first = _timed(fn, [p + 0 for p in pools], (mixed, g, beta, slots, fresh),
                               0.0 if interpret else TRIAL_S, 1 if interpret else 5)  # fmt: skip
    out_err = float(jnp.max(jnp.abs(first[0].astype(jnp.float32) - want_out.astype(jnp.float32))))
    seconds /= layers
    moved = 2 * batch * state_bytes
    name = f"gated delta {model} batch{batch} {way}"
    if way == "kernel" and (block_v, num_warps) != (DEFAULT_BLOCK_V, DEFAULT_NUM_WARPS):
        name += f" bv{block_v} w{num_warps}"
    details = {
        "key_heads": hk, "value_heads": hv, "dk": dk, "dv": dv, "batch": batch, "layers": layers,
        "way": way, "block_v": block_v, "num_warps": num_warps, "us_per_layer": 1e6 * seconds,
        "state_bytes_moved": moved, "max_abs_err_out_vs_reference": out_err, "interpret": interpret,
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
    parser.add_argument("--sweep", action="store_true", help="also block_v x num_warps of the kernel")
    parser.add_argument("--quick", action="store_true", help="interpret mode, tiny shapes (any machine)")
    parser.add_argument("--out", help="output file (default: bench/results/gated-delta-<machine>.json)")
    args = parser.parse_args(argv)
    interpret = args.quick or not compat.on_gpu()
    models = QUICK_MODELS if args.quick else {m: MODELS[m] for m in args.models.split(",")}
    batches = (1, 2) if args.quick else tuple(int(b) for b in args.batches.split(","))
    machine, commit = machine_name(), git_commit()
    bandwidth = measure_hbm_read(QUICK if args.quick else Sizes()).rate
    out = args.out or f"gated-delta-{machine_slug(machine)}{'-quick' if args.quick else ''}.json"
    configs = [("xla", DEFAULT_BLOCK_V, DEFAULT_NUM_WARPS), ("kernel", DEFAULT_BLOCK_V, DEFAULT_NUM_WARPS)]
    if args.sweep:
        configs += [("kernel", bv, w) for bv, w in SWEEP if (bv, w) != (DEFAULT_BLOCK_V, DEFAULT_NUM_WARPS)]
    records = []
    for model, shape in models.items():
        for batch in batches:
            for way, block_v, warps in configs:
                record = measure(
                    model, shape, batch, way, block_v, warps, bandwidth, machine, commit, interpret
                )
                d = record.details
                if d["max_abs_err_out_vs_reference"] > 3e-2:  # bf16 outputs of unit-scale values
                    raise RuntimeError(f"{record.name}: output error {d['max_abs_err_out_vs_reference']:.2e}")
                print(f"{record.name}: {d['us_per_layer']:.2f} us a layer, {record.figure:.0f} GB/s "
                      f"({record.fraction:.1%})", flush=True)  # fmt: skip
                records.append(record)
                write_records(records, out)
    print("wrote", write_records(records, out))
    return records


if __name__ == "__main__":
    main()
