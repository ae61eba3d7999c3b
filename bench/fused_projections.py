"""One launch for a layer's NVFP4 projections of one input against one launch a weight.

    python -m bench.fused_projections                      # GPU: 27B and 80B groups, one row
    python -m bench.fused_projections --quick              # interpret mode, tiny shapes (any machine)

For each group of weights that a layer runs on the same input (the GDN input projections,
q / k / v, an MLP's gate and up), times `weights.quant.matmuls` with the group fused
(`nvfp4_matmuls`, one streamed launch) and apart (`fused_projections(False)`: each weight its
own `matmul`, tiles from `nvfp4_tiles`), one decode row, on random NVFP4 weights. With
`--experts`, also the routed experts' gate and up stacks (`grouped_expert_matmuls`, one grouped
launch with `fused_experts` on, one a stack off) for 1 and 4 tokens under random top-k routing
("fused experts <model> gate_up tokens<T>"). Both run in one
jitted function over enough copies of the group that the copies together exceed L2, calls queued
back to back. Each is checked against the float32 reference first. Records ("fused projections
<model> <group> batch1") give the fused launch's bytes per second (weights + scales) against the
HBM read probe of the same run, with the separate launches' time and the speed-up in the details.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.ceilings import QUICK, Sizes, measure_hbm_read, relative_error
from bench.record import git_commit, machine_name, machine_slug, make_record, write_records
from infernix_jax.weights.quant import (
    fused_experts,
    fused_projections,
    grouped_expert_matmuls,
    kernel_mode,
    matmuls,
    quantize_nvfp4,
)
from pallas_kernels import compat

# Groups of weights [N, K] that one layer runs on the same input, by model (HF [out, in]).
GROUPS: dict[str, dict[str, tuple[tuple[int, ...], int]]] = {
    "qwen3.5-27b": {
        "gdn_in": ((10240, 6144, 48, 48), 5120),  # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a
        "q_k_v": ((12288, 1024, 1024), 5120),  # q (with its output gate), k, v
        "gate_up": ((17408, 17408), 5120),
    },
    "qwen3-next-80b": {
        "gdn_in": ((8192, 4096, 32, 32), 2048),
        "q_k_v": ((8192, 512, 512), 2048),
        "shared_gate_up": ((512, 512), 2048),
    },
}
QUICK_GROUPS = {"tiny": {"three": ((96, 40, 8), 256)}}
# Routed experts: (experts, intermediate, hidden, top_k) of the gate and up stacks [E, I, D].
EXPERTS = {"qwen3-next-80b": (512, 512, 2048, 10)}
QUICK_EXPERTS = {"tiny": (8, 64, 256, 2)}
L2_DEFEAT_BYTES = 160 << 20
TRIAL_S = 1e-2


def _group_weights(sizes, k, copies, seed):
    key = jax.random.PRNGKey(seed)
    out = []
    for c in range(copies):
        ws = []
        for i, n in enumerate(sizes):
            w = jax.random.normal(jax.random.fold_in(key, c * 16 + i), (n, k), jnp.float32) * 0.05
            ws.append(quantize_nvfp4(w.astype(jnp.bfloat16)))
        out.append(tuple(ws))
    return out


def _timed(fn, args, trial_s: float, trials: int = 5) -> float:
    """Median seconds per call of `fn(*args)`, calls queued back to back in trials of ~trial_s."""
    jax.block_until_ready(fn(*args))
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    calls = max(3, int(trial_s / max(time.perf_counter() - start, 1e-6)))
    times = []
    for _ in range(trials):
        start = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        times.append((time.perf_counter() - start) / calls)
    return float(np.median(times))


def measure_group(model, group, sizes, k, bandwidth, machine, commit, interpret):
    weight_bytes = sum(n * k // 2 + n * k // 16 for n in sizes)
    copies = 1 if interpret else max(1, min(16, -(-L2_DEFEAT_BYTES // weight_bytes)))
    groups = _group_weights(sizes, k, copies, seed=len(sizes) + k)
    x = jax.random.normal(jax.random.PRNGKey(7), (1, k), jnp.float32).astype(jnp.bfloat16)
    mode = "interpret" if interpret else "auto"
    results, seconds = {}, {}
    for fused in (True, False):
        with kernel_mode(mode), fused_projections(fused):  # read while tracing
            fn = jax.jit(lambda x, gs: [matmuls(x, g) for g in gs])
            out = fn(x, groups)
        results[fused] = out[0]
        seconds[fused] = (
            _timed(fn, (x, groups), TRIAL_S if not interpret else 0.0, 5 if not interpret else 1) / copies
        )
    errors = []
    for y, w in zip(results[True], groups[0], strict=True):
        want = x.astype(jnp.float32) @ w.dequantize(jnp.float32).T
        errors.append(relative_error(y, want))
    figure = weight_bytes / seconds[True]
    name = f"fused projections {model} {group} batch1"
    details = {
        "sizes": list(sizes), "k": k, "weight_and_scale_bytes": weight_bytes, "copies": copies,
        "fused_s": seconds[True], "separate_s": seconds[False], "speedup": seconds[False] / seconds[True],
        "separate_GBps": weight_bytes / seconds[False] / 1e9, "max_rel_err_vs_reference": max(errors),
        "interpret": interpret, "jax": jax.__version__,
    }  # fmt: skip
    return make_record(name, figure / 1e9, "GB/s", bandwidth / 1e9, "GB/s", machine=machine, commit=commit,
                       details=details)  # fmt: skip


def measure_experts(model, shape, tokens, bandwidth, machine, commit, interpret):
    """The gate and up stacks of one layer's routed experts for `tokens` tokens, fused and apart."""
    experts, inter, hidden, top_k = shape
    key = jax.random.PRNGKey(tokens)
    stacks = tuple(
        quantize_nvfp4((jax.random.normal(jax.random.fold_in(key, i), (experts, inter, hidden)) * 0.05).astype(
            jnp.bfloat16))
        for i in range(2)
    )  # fmt: skip
    ids = np.stack([np.random.default_rng(t).choice(experts, top_k, replace=False) for t in range(tokens)])
    sizes = jnp.asarray(np.bincount(ids.ravel(), minlength=experts), jnp.int32)
    xs = jax.random.normal(jax.random.fold_in(key, 9), (tokens * top_k, hidden), jnp.float32).astype(
        jnp.bfloat16
    )
    mode = "interpret" if interpret else "auto"
    results, seconds = {}, {}
    for fused in (True, False):
        with kernel_mode(mode), fused_experts(fused):
            fn = jax.jit(lambda xs, ws, sizes: grouped_expert_matmuls(xs, ws, sizes, tokens=tokens))
            results[fused] = fn(xs, stacks, sizes)
        seconds[fused] = _timed(fn, (xs, stacks, sizes), 0.0 if interpret else TRIAL_S, 1 if interpret else 5)
    errors = [relative_error(a, b) for a, b in zip(results[True], results[False], strict=True)]
    routed = int((np.asarray(sizes) > 0).sum())
    read = 2 * routed * (inter * hidden // 2 + inter * hidden // 16)
    details = {
        "experts": experts, "intermediate": inter, "hidden": hidden, "top_k": top_k, "tokens": tokens,
        "routed_experts": routed, "bytes_read": read, "fused_s": seconds[True], "separate_s": seconds[False],
        "speedup": seconds[False] / seconds[True], "separate_GBps": read / seconds[False] / 1e9,
        "max_rel_diff_fused_vs_apart": max(errors), "interpret": interpret, "jax": jax.__version__,
    }  # fmt: skip
    return make_record(f"fused experts {model} gate_up tokens{tokens}", read / seconds[True] / 1e9, "GB/s",
                       bandwidth / 1e9, "GB/s", machine=machine, commit=commit, details=details)  # fmt: skip


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--models", default=",".join(GROUPS))
    parser.add_argument("--quick", action="store_true", help="interpret mode, tiny shapes (any machine)")
    parser.add_argument("--experts", action="store_true", help="also the routed experts' gate and up stacks")
    parser.add_argument("--out", help="output file (default: bench/results/fused-projections-<machine>.json)")
    args = parser.parse_args(argv)
    interpret = args.quick or not compat.on_gpu()
    groups = QUICK_GROUPS if args.quick else {m: GROUPS[m] for m in args.models.split(",")}
    machine, commit = machine_name(), git_commit()
    bandwidth = measure_hbm_read(QUICK if args.quick else Sizes()).rate
    out = args.out or f"fused-projections-{machine_slug(machine)}{'-quick' if args.quick else ''}.json"
    records = []

    def keep(record, error_key: str, limit: float) -> None:
        """Refuse a wrong result, print the figures, write the file (a cut-short run keeps them)."""
        d = record.details
        if d[error_key] > limit:
            raise RuntimeError(f"{record.name}: {error_key} {d[error_key]:.2e} over {limit}")
        print(f"{record.name}: fused {1e6 * d['fused_s']:.1f} us ({record.figure:.0f} GB/s, {record.fraction:.1%}), "
              f"apart {1e6 * d['separate_s']:.1f} us: x{d['speedup']:.2f}", flush=True)  # fmt: skip
        records.append(record)
        write_records(records, out)

    for model, named in groups.items():
        for group, (sizes, k) in named.items():
            keep(measure_group(model, group, sizes, k, bandwidth, machine, commit, interpret),
                 "max_rel_err_vs_reference", 2e-2)  # fmt: skip
    experts = QUICK_EXPERTS if args.quick else {m: EXPERTS[m] for m in EXPERTS if m in groups}
    for model, shape in experts.items() if args.experts else ():
        for tokens in (1, 4):  # fused and apart compute the same tiles: equal on the CPU
            keep(measure_experts(model, shape, tokens, bandwidth, machine, commit, interpret),
                 "max_rel_diff_fused_vs_apart", 1e-3)  # fmt: skip
    print("wrote", write_records(records, out))
    return records


if __name__ == "__main__":
    main()
