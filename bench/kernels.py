"""Quantized decode matmul kernels against the HBM roofline.

    python -m bench.kernels                  # GPU: real layer shapes, batch 1 and 8, tile sweep
    python -m bench.kernels --formats nvfp4 --batches 1
    python -m bench.kernels --quick          # tiny shapes through the Pallas interpreter (any machine)
    python -m bench.kernels --sweep          # GPU: every formulation and a broad tile grid per point
    python -m bench.kernels --sweep --sweep-budget-s 300 --formats nvfp4
    python -m bench.kernels --prefill        # GPU, < 3 min: "tiled" kernel at M = 4096 and 1024
    python -m bench.kernels --quick --prefill  # the same through the Pallas interpreter (any machine)

For each (layer shape, format, batch) it times the Pallas kernel over random packed weights and
reports bytes that must be read (packed weight + scales + activations + output) per second, as a
fraction of the HBM read bandwidth measured in the same run (bench.ceilings). Several tile
configurations are tried per point and the best is recorded with its tiles, beside the time of
the XLA fallback (dequantize + dot) for comparison. Records go to
bench/results/kernels-<machine>.json.

`--sweep` replaces the short tile list by a grid over the kernel
formulations (gemv / dot / dot_t, NVFP4 also gemv_bs), tiles, split-K, warps and stages, compiled
in parallel and timed back to back against several weight copies (so the weights are not served
from L2); every configuration's time goes into the point's record (`details["sweep"]`).

`--prefill` times the "tiled" formulation at prefill sizes (M = 4096 and 1024) for every real
shape and format against the bf16 tensor-core rate measured in the same run
(bench.ceilings.measure_matmul), with a small tile sweep at M = 4096 (its winner and the default
at 1024), XLA's dequantize-then-dot and a plain bf16 dot of the same shape beside it. Records:
bench/results/kernels-prefill-<machine>.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import math
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from bench.ceilings import QUICK, Sizes, measure_hbm_read, measure_matmul, median_seconds, relative_error
from bench.record import git_commit, machine_name, machine_slug, make_record, write_records
from pallas_kernels import _quant_common as qc
from pallas_kernels.fp8_matmul import DEFAULT_CONFIGS as FP8_DEFAULTS
from pallas_kernels.fp8_matmul import fp8_matmul
from pallas_kernels.nvfp4_matmul import DEFAULT_CONFIGS as NVFP4_DEFAULTS
from pallas_kernels.nvfp4_matmul import WORD_VARIANTS, nvfp4_matmul

# Linear layers, weight [N, K] (HF [out, in]), by model.
SHAPES: dict[str, dict[str, tuple[int, int]]] = {
    "qwen3.5-27b": {
        "gate_up": (2 * 17408, 5120),
        "down": (5120, 17408),
        "q_gated": (2 * 24 * 256, 5120),
        "o_proj": (5120, 24 * 256),
        "gdn_in_qkv": (2 * 16 * 128 + 48 * 128, 5120),
        "gdn_out": (5120, 48 * 128),
    },
    "qwen3-next-80b": {
        "q_gated": (2 * 16 * 256, 2048),
        "o_proj": (2048, 16 * 256),
        "gdn_in_qkvz": (2 * 16 * 128 + 2 * 32 * 128, 2048),
        "gdn_out": (2048, 32 * 128),
        "shared_gate_up": (2 * 512, 2048),
        "shared_down": (2048, 512),
    },
}
QUICK_SHAPES = {"tiny": {"wide": (256, 512), "ragged": (96, 320)}}

# Tile configurations tried per point: (block_n, block_k, split_k, num_warps, num_stages).
NVFP4_TILES = [
    (64, 256, 1, 4, 3),
    (64, 256, 4, 4, 3),
    (32, 512, 2, 4, 3),
    (128, 256, 2, 8, 3),
    (64, 512, 8, 4, 4),
]
FP8_TILES = [(64, 128, 1, 4, 3), (64, 128, 4, 4, 3), (32, 128, 8, 4, 4), (128, 128, 2, 8, 3)]


def _random_weight(fmt: str, n: int, k: int, key: jax.Array):
    """(weight args for the kernel, static kwargs, bytes of weight + scales) for one format."""
    k1, k2 = jax.random.split(key)
    if fmt == "nvfp4":
        packed = jax.random.randint(k1, (n, k // 2), 0, 256, jnp.int32).astype(jnp.uint8)
        scale = jax.random.uniform(k2, (n, k // 16), jnp.float32, 0.01, 4.0).astype(jnp.float8_e4m3fn)
        return (packed, scale, jnp.float32(0.01)), {}, packed.nbytes + scale.nbytes + 4
    if fmt == "int8":
        data = jax.random.randint(k1, (n, k), -127, 128, jnp.int32).astype(jnp.int8)
        scale = jax.random.uniform(k2, (n,), jnp.float32, 0.001, 0.01)
        return (data, scale), {}, data.nbytes + scale.nbytes
    data = (jax.random.normal(k1, (n, k), jnp.float32) * 8).astype(jnp.float8_e4m3fn)
    if fmt == "fp8":
        return (data, jnp.float32(0.01)), {"block_size": None}, data.nbytes + 4
    scale = jax.random.uniform(k2, (-(-n // 128), -(-k // 128)), jnp.float32, 0.001, 0.1)
    return (data, scale), {"block_size": 128}, data.nbytes + scale.nbytes


def _kernel_fn(fmt: str, tiles: tuple[int, ...], static: dict, interpret: bool):
    block_n, block_k, split_k, warps, stages = tiles
    kernel = nvfp4_matmul if fmt == "nvfp4" else fp8_matmul
    return jax.jit(
        functools.partial(
            kernel,
            block_n=block_n,
            block_k=block_k,
            split_k=split_k,
            num_warps=warps,
            num_stages=stages,
            interpret=interpret,
            **static,
        )
    )


def _xla_fn(fmt: str, static: dict):
    """The fallback the kernels replace: dequantize to bf16, then an XLA dot."""
    from pallas_kernels.fp8_matmul import reference_fp8_matmul
    from pallas_kernels.nvfp4_matmul import reference_nvfp4_matmul

    if fmt == "nvfp4":
        return jax.jit(lambda x, *w: reference_nvfp4_matmul(x, *w).astype(x.dtype))
    return jax.jit(lambda x, *w: reference_fp8_matmul(x, *w, **static).astype(x.dtype))


def bench_point(fmt, n, k, batch, *, sizes: Sizes, interpret: bool, tiles_list=None):
    """Best kernel time over the tile configurations, and the XLA fallback's time (seconds)."""
    key = jax.random.key(n * 7 + k)
    weight, static, weight_bytes = _random_weight(fmt, n, k, key)
    x = jax.random.normal(jax.random.key(batch), (batch, k), jnp.bfloat16)
    tiles_list = tiles_list or (NVFP4_TILES if fmt == "nvfp4" else FP8_TILES)
    best = None
    for tiles in tiles_list:
        if static.get("block_size") and (128 % tiles[0] or 128 % tiles[1]):
            continue
        fn = _kernel_fn(fmt, tiles, static, interpret)
        try:
            seconds = statistics.median(
                median_seconds(lambda fn=fn: fn(x, *weight), sizes.warmup, sizes.repeats)
            )
        except Exception as e:  # noqa: BLE001 - a tile that does not compile on this GPU: report, go on
            print(f"  {fmt} {n}x{k} b{batch} tiles {tiles}: {type(e).__name__}: {str(e)[:120]}")
            continue
        if best is None or seconds < best[0]:
            best = (seconds, tiles)
    xla = _xla_fn(fmt, static)
    xla_seconds = statistics.median(median_seconds(lambda: xla(x, *weight), sizes.warmup, sizes.repeats))
    moved = weight_bytes + x.nbytes + batch * n * 2
    if best is not None:  # the compiled kernel must agree with the reference before its time counts
        got = _kernel_fn(fmt, best[1], static, interpret)(x, *weight).astype(jnp.float32)
        want = xla(x, *weight).astype(jnp.float32)
        rel_err = float(jnp.max(jnp.abs(got - want)) / jnp.maximum(jnp.max(jnp.abs(want)), 1e-30))
        if rel_err > 2e-2:
            raise AssertionError(
                f"{fmt} {n}x{k} batch{batch} tiles {best[1]}: kernel differs from the "
                f"reference by {rel_err:.3g} of max|y|"
            )
        best = (*best, rel_err)
    return best, xla_seconds, moved


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(prog="python -m bench.kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="tiny shapes, interpret mode: a smoke run anywhere"
    )
    parser.add_argument("--formats", default="nvfp4,fp8,fp8_block128")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--models", default=",".join(SHAPES))
    parser.add_argument("--out", help="output file (default: bench/results/kernels-<machine>.json)")
    parser.add_argument("--sweep", action="store_true", help="GPU: sweep formulations and tiles per point")
    parser.add_argument("--sweep-budget-s", type=float, default=420.0, help="wall-clock cap of the sweep")
    parser.add_argument("--compile-threads", type=int, default=8, help="sweep: parallel XLA compiles")
    parser.add_argument("--variants", help="sweep: only these formulations (comma-separated; default all)")
    parser.add_argument("--scale-spreads", default="reshape",
                        help="sweep: NVFP4 word gemvs with each of these ways of meeting words with their block "
                             "scales (comma-separated: reshape, gather)")  # fmt: skip
    parser.add_argument("--tiles", help="sweep: only these block_n x block_k (e.g. 32x512,32x1024)")
    parser.add_argument("--prefill", action="store_true", help="GPU: the tiled kernel at prefill sizes")
    parser.add_argument("--prefill-ms", default="4096,1024", help="prefill: activation rows (M) per point")
    parser.add_argument(
        "--prefill-budget-s", type=float, default=150.0, help="prefill: wall-clock cap of the timed points"
    )
    args = parser.parse_args(argv)
    if args.prefill:
        return run_prefill(args)
    if args.sweep:
        return run_sweep(args)
    interpret = args.quick or jax.default_backend() == "cpu"
    sizes = QUICK if args.quick else Sizes()
    shapes = QUICK_SHAPES if args.quick else {m: SHAPES[m] for m in args.models.split(",")}
    machine, commit = machine_name(), git_commit()
    hbm = measure_hbm_read(sizes)
    print(f"{hbm.name}: {hbm.figure:.1f} GB/s")
    records = []
    for model, layers in shapes.items():
        for layer, (n, k) in layers.items():
            for fmt in args.formats.split(","):
                for batch in map(int, args.batches.split(",")):
                    best, xla_seconds, moved = bench_point(
                        fmt,
                        n,
                        k,
                        batch,
                        sizes=sizes,
                        interpret=interpret,
                        tiles_list=[NVFP4_TILES[0]]
                        if args.quick and fmt == "nvfp4"
                        else [FP8_TILES[0]]
                        if args.quick
                        else None,
                    )
                    if best is None:
                        continue
                    seconds, tiles, rel_err = best
                    name = f"decode matmul {model} {layer} {n}x{k} {fmt} batch{batch}"
                    rec = make_record(
                        name,
                        moved / seconds / 1e9,
                        "GB/s",
                        hbm.figure,
                        "GB/s",
                        machine=machine,
                        commit=commit,
                        details={
                            "n": n,
                            "k": k,
                            "batch": batch,
                            "format": fmt,
                            "bytes": moved,
                            "median_s": seconds,
                            "max_rel_err_vs_reference": rel_err,
                            "xla_dequant_dot_s": xla_seconds,
                            "tiles": dict(
                                zip(("block_n", "block_k", "split_k", "num_warps", "num_stages"), tiles)
                            ),
                            "interpret": interpret,
                            "jax": jax.__version__,
                        },
                    )
                    records.append(rec)
                    print(
                        f"{name:60s} {rec.figure:8.1f} GB/s  {rec.fraction:6.1%} of HBM  "
                        f"(xla {moved / xla_seconds / 1e9:7.1f} GB/s)  tiles {tiles}"
                    )
    slug = machine_slug(machine)
    path = write_records(records, args.out or f"kernels-{slug}{'-quick' if args.quick else ''}.json")
    print(f"wrote {path}")
    return records


# ------------------------------------------------------------------------------------------ sweep

L2_DEFEAT_BYTES = 160 << 20  # weight copies per timed call: together well over the H200's 50 MB L2
MAX_COPIES = 8
TARGET_TRIAL_S = 1e-2  # GPU time per timing trial (back-to-back calls, one sync at the end)
SMS = 132  # H200 streaming multiprocessors: split-K is offered while programs < 4 per SM


def _variants(fmt: str, batch: int, only: tuple[str, ...] | None = None) -> list[str]:
    gemv = ["gemv", "gemv_bs"] if fmt == "nvfp4" else ["gemv_ws", "gemv"]
    words = ["dot_w", "dot_jw", "dot_ws", "dot_t_w"] if fmt == "nvfp4" else []  # word-decoded float16 dots first
    if fmt == "nvfp4" and batch <= qc.GEMV_MAX_M:
        # word decode, float16 products on CUDA cores (gemv_bs_ws: block sums; gemv_h2_ws: packed half2 PTX)
        words = ["gemv_h2w_ws", "gemv_h2wx_ws", "gemv_bs_ws", "gemv_bsx_ws", "gemv_h2_ws", "gemv_ws", "gemv_wp", "gemv_w", *words]
    out = words + (gemv if batch <= qc.GEMV_MAX_M else []) + ["dot_t", "dot"]
    return out if only is None else [v for v in out if v in only]


def _splits(n_tiles: int, k_steps: int) -> list[int]:
    """split_k 1, and each doubling while the previous level left fewer than 4 programs per SM."""
    out = [1]
    while out[-1] * 2 <= min(8, k_steps) and n_tiles * out[-1] < 4 * SMS:
        out.append(out[-1] * 2)
    return out


STREAMED_PROGRAMS = (2 * SMS, 3 * SMS, SMS, 4 * SMS)  # "gemv_ws" grids tried, most promising first


def sweep_configs(
    fmt: str, n: int, k: int, batch: int, variants: tuple[str, ...] | None = None,
    scale_spreads: tuple[str, ...] = ("reshape",), tiles: tuple[tuple[int, int], ...] | None = None,
) -> list[qc.MatmulConfig]:
    """Coarse grid for one point, most promising first and round-robin over formulations so a
    budget cut keeps every formulation represented (`variants`: only these). num_warps 4 (8 for
    the word-decoded gemv formulations), num_stages 3 here; `refine_configs` varies those around
    the winners. NVFP4 word gemvs are tried with each of `scale_spreads` in turn (side by side,
    so a budget cut keeps the pairs). `tiles`: only these (block_n, block_k)."""
    per_variant = {}
    for variant in _variants(fmt, batch, variants):
        if qc.is_streamed(variant):  # the streamed grid instead of split K
            block_ns = [32, 64, 16] if fmt == "nvfp4" else [16, 32]
            block_ks = [512, 1024, 256] if fmt == "nvfp4" else [256, 512, 128]
            if variant == "dot_ws":  # dot_w's tiles (64 x 256 won most batch-8 points)
                block_ns, block_ks = [64, 32], [256, 512]
            if fmt == "fp8_block128":
                block_ks = [b for b in block_ks if b <= 128]
            warps = 8 if variant in ("gemv_ws", "gemv_bs_ws", "gemv_bsx_ws", "gemv_h2_ws", "gemv_h2w_ws", "gemv_h2wx_ws") and fmt == "nvfp4" else 4
            per_variant[variant] = [
                qc.MatmulConfig(variant, bn, bk, 1, warps, 3, programs=programs)
                for programs in STREAMED_PROGRAMS
                for bk in block_ks
                for bn in block_ns
            ]
            continue
        if variant in ("gemv_w", "gemv_wp"):  # bench.kernel_bounds: 512-element K steps decoded fastest
            block_ns, block_ks = [64, 32, 128], [512, 1024, 256]
        elif qc.is_gemv(variant):
            block_ns = [32, 16, 64]
            block_ks = [512, 1024, 256] if fmt == "nvfp4" else [256, 512, 128]
        else:
            block_ns = [64, 128] if variant.startswith("dot_t") else [64, 32, 128]
            block_ks = [256, 512] if fmt == "nvfp4" else [128, 256]
        if fmt == "fp8_block128":
            block_ns, block_ks = [b for b in block_ns if b <= 128], [b for b in block_ks if b <= 128]
        configs = []
        for bk in block_ks:
            for bn in block_ns:
                for split in _splits(-(-n // bn), -(-k // bk)):
                    warps = 8 if variant.startswith("gemv_w") else 4  # the decode probe ran best with 8
                    configs.append(qc.MatmulConfig(variant, bn, bk, split, warps, 3))
        per_variant[variant] = configs
    ordered = []
    for rank in range(max((len(c) for c in per_variant.values()), default=0)):
        for c in (c[rank] for c in per_variant.values() if rank < len(c)):
            if tiles is not None and (c.block_n, c.block_k) not in tiles:
                continue
            spread = fmt == "nvfp4" and c.variant in WORD_VARIANTS and qc.is_gemv(c.variant)
            ordered += [dataclasses.replace(c, scale_spread=h) for h in scale_spreads] if spread else [c]
    return ordered


def refine_configs(best: list[qc.MatmulConfig], tried: set) -> list[qc.MatmulConfig]:
    """num_warps x num_stages around the best coarse configurations."""
    out = []
    for cfg in best:
        for warps in (4, 8, 2):
            for stages in (3, 4, 2, 5):
                c = dataclasses.replace(cfg, num_warps=warps, num_stages=stages)
                if c not in tried and c not in out:
                    out.append(c)
    return out


def _sweep_fn(fmt: str, cfg: qc.MatmulConfig | None, static: dict, interpret: bool = False):
    """All weight copies through one formulation in one jitted call (cfg None: the XLA fallback)."""
    if cfg is None:
        one = _xla_fn(fmt, static)
    else:
        kernel, kwargs = (nvfp4_matmul if fmt == "nvfp4" else fp8_matmul), cfg.as_kwargs()
        if fmt != "nvfp4":  # the scale spread and the row place are the NVFP4 word kernels'
            kwargs.pop("scale_spread")
            kwargs.pop("x_rows")
        one = functools.partial(kernel, **kwargs, **static, interpret=interpret)
    return jax.jit(lambda xs, ws: tuple(one(x, *w) for x, w in zip(xs, ws)))


WARM_S = 0.3  # seconds of back-to-back calls before a point's timings (the GPU leaves its idle clocks)


def warm_gpu(calls, seconds: float = WARM_S) -> None:
    """Run the zero-argument callables in turn, each waited for, for about `seconds`: the GPU
    clocks down while a point's kernels compile (the H200 idles at 345 MHz), and the first form
    timed right after the compiles measured up to 5x slow (docs/pallas.md)."""
    until = time.perf_counter() + seconds
    while calls and time.perf_counter() < until:
        for call in calls:
            jax.block_until_ready(call())


def _time_compiled(compiled, xs, ws, copies: int, target_s: float = TARGET_TRIAL_S) -> float:
    """Seconds per matmul: calls queued back to back (dispatch overlaps the GPU), one sync per
    trial, median of 5 trials of about `target_s` each (at least 3 calls a trial). The call count
    comes from a second, timed call: the first one can carry one-off costs (a first launch, lazy
    loading), and sizing trials by it made them a single call each, whose dispatch latency is
    noise at a few hundred microseconds (two timings of one kernel differed 3x that way)."""
    jax.block_until_ready(compiled(xs, ws))
    start = time.perf_counter()
    jax.block_until_ready(compiled(xs, ws))
    one = time.perf_counter() - start
    reps = max(3, min(500, math.ceil(target_s / max(one, 1e-6))))
    trials = []
    for _ in range(5):
        start = time.perf_counter()
        out = None
        for _ in range(reps):
            out = compiled(xs, ws)
        jax.block_until_ready(out)
        trials.append((time.perf_counter() - start) / (reps * copies))
    return statistics.median(trials)


def _compile_all(fmt, configs, static, xs, ws, pool, interpret=False):
    """{config: compiled or exception}: lowering here (Python), XLA/Triton compiles in threads."""
    lowered = {}
    for cfg in configs:
        try:
            lowered[cfg] = _sweep_fn(fmt, cfg, static, interpret).lower(xs, ws)
        except Exception as e:  # noqa: BLE001 - an invalid combination: recorded, sweep goes on
            lowered[cfg] = e
    futures = {
        cfg: pool.submit(low.compile) for cfg, low in lowered.items() if not isinstance(low, Exception)
    }
    out = {}
    for cfg in configs:
        if cfg in futures:
            try:
                out[cfg] = futures[cfg].result()
            except Exception as e:  # noqa: BLE001
                out[cfg] = e
        else:
            out[cfg] = lowered[cfg]
    return out


def sweep_point(
    fmt, n, k, batch, weights, static, *, deadline: float, pool, interpret=False, variants=None, **grid
) -> dict:
    """Time the coarse grid until 65% of the time to `deadline` is spent, then warps x stages
    around the two best until the deadline; returns the point's summary (best, XLA time, table)."""
    coarse_deadline = time.perf_counter() + 0.65 * max(0.0, deadline - time.perf_counter())
    copies = len(weights)
    xs = tuple(
        jax.random.normal(jax.random.key(batch * 100 + c), (batch, k), jnp.bfloat16) for c in range(copies)
    )
    chunk = max(1, getattr(pool, "_max_workers", 1))  # one compile batch fills the pool once
    results: dict[qc.MatmulConfig, float | str] = {}
    compiled_ok = {}

    def run(configs, until):
        for start in range(0, len(configs), chunk):
            if time.perf_counter() > until:
                return
            batch_cfgs = configs[start : start + chunk]
            warmed = interpret  # the GPU idled through the compiles: warm it before the first timing
            for cfg, comp in _compile_all(fmt, batch_cfgs, static, xs, weights, pool, interpret).items():
                if isinstance(comp, Exception):
                    results[cfg] = f"{type(comp).__name__}: {str(comp)[:160]}"
                    continue
                try:
                    if not warmed:
                        warm_gpu([lambda comp=comp: comp(xs, weights)])
                        warmed = True
                    results[cfg] = _time_compiled(comp, xs, weights, copies)
                    compiled_ok[cfg] = comp
                except Exception as e:  # noqa: BLE001
                    results[cfg] = f"{type(e).__name__}: {str(e)[:160]}"

    coarse = sweep_configs(fmt, n, k, batch, variants, **grid)
    run(coarse, coarse_deadline)
    timed = sorted((t, c) for c, t in results.items() if isinstance(t, float))
    run(refine_configs([c for _, c in timed[:2]], set(results)), deadline)
    xla = _compile_all(fmt, [None], static, xs, weights, pool)[None]
    xla_s = _time_compiled(xla, xs, weights, copies) if not isinstance(xla, Exception) else None
    want = xla(xs, weights)[0] if xla_s is not None else None
    best, errors = None, []
    for seconds, cfg in sorted((t, c) for c, t in results.items() if isinstance(t, float)):
        rel = relative_error(compiled_ok[cfg](xs, weights)[0], want) if want is not None else float("nan")
        if rel <= 2e-2:
            best = (seconds, cfg, rel)
            break
        errors.append(f"{cfg}: differs from the reference by {rel:.3g} of max|y|")
        print(f"  MISMATCH {fmt} {n}x{k} batch{batch} {cfg}: rel err {rel:.3g}", file=sys.stderr)
        if len(errors) >= 3:
            break
    table = [
        {**dataclasses.asdict(c), **({"s": t} if isinstance(t, float) else {"error": t})}
        for c, t in sorted(results.items(), key=lambda ct: ct[1] if isinstance(ct[1], float) else 1e9)
    ]
    return {"best": best, "xla_s": xla_s, "table": table, "mismatches": errors, "copies": copies}


def _sweep_points(shapes: dict, formats: list[str], batches: list[int]):
    """(fmt, (n, k), [(model, layer), ...]) with shapes shared by several layers timed once."""
    by_shape: dict[tuple[int, int], list[tuple[str, str]]] = {}
    for model, layers in shapes.items():
        for layer, nk in layers.items():
            by_shape.setdefault(nk, []).append((model, layer))
    return [(fmt, nk, names) for nk, names in by_shape.items() for fmt in formats]


def run_sweep(args) -> list:
    """`--sweep`: see the module docstring. Writes the records after every point."""
    t0 = time.perf_counter()
    formats, batches = args.formats.split(","), [int(b) for b in args.batches.split(",")]
    interpret = args.quick or jax.default_backend() == "cpu"
    shapes = QUICK_SHAPES if args.quick else {m: SHAPES[m] for m in args.models.split(",")}
    machine, commit = machine_name(), git_commit()
    slug = machine_slug(machine)
    out_path = args.out or f"kernels-{slug}{'-quick' if args.quick else ''}.json"
    points = _sweep_points(shapes, formats, batches)
    variants = tuple(args.variants.split(",")) if args.variants else None
    grid = {"scale_spreads": tuple(args.scale_spreads.split(","))}
    if args.tiles:
        grid["tiles"] = tuple(tuple(int(v) for v in t.split("x")) for t in args.tiles.split(","))
    n_configs = sum(len(sweep_configs(fmt, n, k, b, variants, **grid)) for fmt, (n, k), _ in points for b in batches)
    print(
        f"sweep: {len(points) * len(batches)} points, at most {n_configs} coarse configs (+ warps x stages "
        f"around the 2 best per point), budget {args.sweep_budget_s:.0f} s, "
        f"{args.compile_threads} compile threads"
    )
    hbm = measure_hbm_read(QUICK if args.quick else Sizes())
    print(f"{hbm.name}: {hbm.figure:.1f} GB/s")
    records, mismatches, path = [], [], None
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.compile_threads))
    done = 0
    for fmt, (n, k), names in points:
        weight, static, weight_bytes = _random_weight(fmt, n, k, jax.random.key(n * 7 + k))
        copies = max(1, min(MAX_COPIES, math.ceil(L2_DEFEAT_BYTES / weight_bytes)))
        weights = (weight,) + tuple(
            _random_weight(fmt, n, k, jax.random.key(n * 7 + k + c))[0] for c in range(1, copies)
        )
        for batch in batches:
            left = args.sweep_budget_s - (time.perf_counter() - t0)
            points_left = len(points) * len(batches) - done
            deadline = time.perf_counter() + max(0.0, left / max(points_left, 1))
            done += 1
            if left <= 0:
                print(f"sweep budget spent: skipping {fmt} {n}x{k} batch{batch}")
                continue
            res = sweep_point(
                fmt, n, k, batch, weights, static, deadline=deadline, pool=pool, interpret=interpret,
                variants=variants, **grid,
            )
            mismatches += res["mismatches"]
            if res["best"] is None:
                print(f"  {fmt} {n}x{k} batch{batch}: no configuration ran and matched the reference")
                continue
            seconds, cfg, rel_err = res["best"]
            moved = weight_bytes + batch * k * 2 + batch * n * 2
            for model, layer in names:
                name = f"decode matmul {model} {layer} {n}x{k} {fmt} batch{batch}"
                records.append(
                    make_record(
                        name,
                        moved / seconds / 1e9,
                        "GB/s",
                        hbm.figure,
                        "GB/s",
                        machine=machine,
                        commit=commit,
                        details={
                            "n": n,
                            "k": k,
                            "batch": batch,
                            "format": fmt,
                            "bytes": moved,
                            "weight_and_scale_bytes": weight_bytes,
                            "weight_fraction_of_hbm": weight_bytes / seconds / 1e9 / hbm.figure,
                            "median_s": seconds,
                            "max_rel_err_vs_reference": rel_err,
                            "xla_dequant_dot_s": res["xla_s"],
                            "tiles": dataclasses.asdict(cfg),
                            "weight_copies": res["copies"],
                            "sweep": res["table"],
                            "interpret": interpret,
                            "jax": jax.__version__,
                        },
                    )
                )
            rec = records[-1]
            xla = f"{moved / res['xla_s'] / 1e9:7.1f}" if res["xla_s"] else "   -   "
            print(
                f"{fmt:12s} {n:6d}x{k:<6d} b{batch}  {rec.figure:7.1f} GB/s {rec.fraction:6.1%}  "
                f"(xla {xla} GB/s)  {len(res['table'])} configs  best {cfg}  "
                f"[{time.perf_counter() - t0:.0f} s]",
                flush=True,
            )
            path = write_records(records, out_path)  # after every point: a timeout keeps what ran
    pool.shutdown()
    print(f"wrote {path} ({len(records)} records)")
    if mismatches:
        raise AssertionError("kernel results differ from the reference:\n" + "\n".join(mismatches))
    return records


# ---------------------------------------------------------------------------------------- prefill

PREFILL_TRIAL_S = 20e-3  # GPU time per timing trial at prefill sizes
QUICK_PREFILL_MS = "96,65"  # --quick: rows of the interpret-mode smoke run
# "tiled" configurations tried at the largest M, most promising first:
# (block_m, block_n, block_k, num_warps, num_stages, group_m); block_k in K elements.
PREFILL_TILES = [
    (128, 128, 128, 8, 3, 8),
    (128, 256, 64, 8, 3, 8),
    (256, 128, 64, 8, 3, 8),
    (128, 128, 64, 4, 4, 8),
    (128, 256, 128, 8, 2, 8),
    (64, 128, 128, 4, 4, 8),
    (256, 128, 128, 8, 2, 8),
    (128, 128, 128, 4, 3, 16),
]
QUICK_PREFILL_TILES = [(32, 32, 64, 4, 3, 2), (64, 64, 64, 4, 3, 8)]


def prefill_configs(quick: bool, fmt: str = "fp8") -> list[qc.MatmulConfig]:
    """The "tiled" configurations of the prefill sweep (all valid for 128-element scale blocks);
    NVFP4 alternates them with "tiled_w" (the word-decoded float16 GEMM, block_k >= 128)."""
    tiles = QUICK_PREFILL_TILES if quick else PREFILL_TILES
    plain = [
        qc.MatmulConfig("tiled", bn, bk, 1, warps, stages, block_m=bm, group_m=group)
        for bm, bn, bk, warps, stages, group in tiles
    ]
    if fmt != "nvfp4":
        return plain
    words = list(
        dict.fromkeys(
            qc.MatmulConfig("tiled_w", bn, max(bk, 128), 1, warps, stages, block_m=bm, group_m=group)
            for bm, bn, bk, warps, stages, group in tiles
        )
    )
    return [c for pair in zip(words, plain, strict=False) for c in pair] + plain[len(words) :]


def _dequantize(fmt: str, weight: tuple, static: dict) -> jax.Array:
    """The float32 weight [N, K], as weights.quant's dequantize computes it."""
    from pallas_kernels.nvfp4_matmul import BLOCK, E2M1_VALUES

    if fmt == "nvfp4":
        packed, block_scale, tensor_scale = weight
        table = jnp.asarray(E2M1_VALUES, jnp.float32)
        codes = jnp.stack([packed & 0xF, packed >> 4], axis=-1).reshape(packed.shape[0], -1)
        scales = jnp.repeat(block_scale.astype(jnp.float32), BLOCK, axis=-1)
        return table[codes.astype(jnp.int32)] * scales * tensor_scale
    data, scale = weight
    if static.get("block_size") is None:
        return data.astype(jnp.float32) * scale
    b = static["block_size"]
    full = jnp.repeat(jnp.repeat(scale, b, 0), b, 1)[: data.shape[0], : data.shape[1]]
    return data.astype(jnp.float32) * full


def quant_matmul_fn(fmt: str, static: dict, mode: str = "auto", fp8_mode: str = "auto"):
    """x, *weight leaves -> what `weights.quant.matmul` runs for them in kernel_mode `mode` (and
    FP8 decode way `fp8_mode`), traced with those modes."""
    from infernix_jax.weights.quant import FP8Weight, Int8Weight, NVFP4Weight, fp8_decode_mode, kernel_mode

    def one(x, *w):
        if fmt == "nvfp4":
            weight = NVFP4Weight(*w)
        elif fmt == "int8":
            weight = Int8Weight(*w)
        else:
            weight = FP8Weight(*w, block_size=static.get("block_size"))
        with kernel_mode(mode), fp8_decode_mode(fp8_mode):
            return weight.matmul(x)

    return one


def _xla_prefill_fn(fmt: str, static: dict):
    """What weights.quant runs for M > 64: `matmul` in "auto" mode (on a GPU with bf16 rows the
    format's XLA dot: NVFP4's exact block values in bf16, FP8's convert-fused dot; block-scaled
    FP8 the float32 reference)."""
    one = quant_matmul_fn(fmt, static)
    return jax.jit(lambda xs, ws: tuple(one(x, *w) for x, w in zip(xs, ws)))


def _bf16_dot_fn():
    """A plain bf16 dot of the same shape: what an unquantized layer costs."""
    contract = (((1,), (1,)), ((), ()))

    def one(x, w):
        return jax.lax.dot_general(x, w, contract, preferred_element_type=jnp.bfloat16)

    return jax.jit(lambda xs, ws: tuple(one(x, w[0]) for x, w in zip(xs, ws)))


def prefill_point(fmt, n, k, m, weight, static, configs, *, deadline, pool, interpret) -> dict:
    """Time `configs` (in compile batches until `deadline`; the first batch always), the XLA
    fallback and a bf16 dot; the fastest configuration that matches the reference wins."""
    xs = (jax.random.normal(jax.random.key(m + k), (m, k), jnp.bfloat16),)
    ws = (weight,)
    chunk = max(1, getattr(pool, "_max_workers", 1))
    results: dict[qc.MatmulConfig, float | str] = {}
    compiled_ok = {}
    for start in range(0, len(configs), chunk):
        if start and time.perf_counter() > deadline:
            break
        batch = configs[start : start + chunk]
        for cfg, comp in _compile_all(fmt, batch, static, xs, ws, pool, interpret).items():
            if isinstance(comp, Exception):
                results[cfg] = f"{type(comp).__name__}: {str(comp)[:160]}"
                continue
            try:
                results[cfg] = _time_compiled(comp, xs, ws, 1, PREFILL_TRIAL_S)
                compiled_ok[cfg] = comp
            except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: recorded, sweep goes on
                results[cfg] = f"{type(e).__name__}: {str(e)[:160]}"
    xla_s = _time_compiled(_xla_prefill_fn(fmt, static), xs, ws, 1, PREFILL_TRIAL_S)
    w_bf16 = ((_dequantize(fmt, weight, static).astype(jnp.bfloat16),),)
    bf16_s = _time_compiled(_bf16_dot_fn(), xs, w_bf16, 1, PREFILL_TRIAL_S)
    want = _xla_fn(fmt, static)(xs[0], *weight)  # the float32 reference
    best, errors = None, []
    for seconds, cfg in sorted(
        ((t, c) for c, t in results.items() if isinstance(t, float)), key=lambda tc: tc[0]
    ):
        rel = relative_error(compiled_ok[cfg](xs, ws)[0], want)
        if rel <= 2e-2:
            best = (seconds, cfg, rel)
            break
        errors.append(f"{fmt} {n}x{k} m{m} {cfg}: differs from the reference by {rel:.3g} of max|y|")
        print(f"  MISMATCH {errors[-1]}", file=sys.stderr)
    table = [
        {**dataclasses.asdict(c), **({"s": t} if isinstance(t, float) else {"error": t})}
        for c, t in sorted(results.items(), key=lambda ct: ct[1] if isinstance(ct[1], float) else 1e9)
    ]
    return {"best": best, "xla_s": xla_s, "bf16_s": bf16_s, "table": table, "mismatches": errors}


def _prefill_record(model, layer, fmt, n, k, m, res, ceiling, *, machine, commit, interpret):
    seconds, cfg, rel_err = res["best"]
    flops = 2 * m * n * k
    return make_record(
        f"prefill matmul {model} {layer} {n}x{k} {fmt} m{m}",
        flops / seconds / 1e12,
        "TFLOP/s",
        ceiling.figure,
        "TFLOP/s",
        machine=machine,
        commit=commit,
        details={
            "m": m,
            "n": n,
            "k": k,
            "format": fmt,
            "flops": flops,
            "median_s": seconds,
            "max_rel_err_vs_reference": rel_err,
            "tiles": dataclasses.asdict(cfg),
            "xla_dequant_dot_s": res["xla_s"],
            "xla_dequant_dot_tflop_s": flops / res["xla_s"] / 1e12,
            "bf16_dot_s": res["bf16_s"],
            "bf16_dot_tflop_s": flops / res["bf16_s"] / 1e12,
            "speedup_vs_xla_dequant_dot": res["xla_s"] / seconds,
            "ceiling": ceiling.name,
            "sweep": res["table"],
            "interpret": interpret,
            "jax": jax.__version__,
        },
    )


def _xla_prefill_record(model, layer, fmt, n, k, m, res, ceiling, *, machine, commit):
    """The same point through XLA's dequantize + dot (what weights.quant runs past SMALL_M_MAX
    while it beats the kernel), so the table shows the faster of the two paths."""
    flops = 2 * m * n * k
    return make_record(
        f"prefill matmul {model} {layer} {n}x{k} {fmt} m{m} xla dequantize+dot",
        flops / res["xla_s"] / 1e12,
        "TFLOP/s",
        ceiling.figure,
        "TFLOP/s",
        machine=machine,
        commit=commit,
        details={"m": m, "n": n, "k": k, "format": fmt, "flops": flops, "median_s": res["xla_s"],
                 "ceiling": ceiling.name, "jax": jax.__version__},
    )  # fmt: skip


def run_prefill(args) -> list:
    """`--prefill`: see the module docstring. Writes the records after every point; raises at the
    end when a configuration disagreed with the reference or a point had no valid result."""
    t0 = time.perf_counter()
    interpret = args.quick or jax.default_backend() == "cpu"
    formats = args.formats.split(",")
    ms = sorted({int(v) for v in (QUICK_PREFILL_MS if args.quick else args.prefill_ms).split(",")})[::-1]
    shapes = QUICK_SHAPES if args.quick else {m: SHAPES[m] for m in args.models.split(",")}
    machine, commit = machine_name(), git_commit()
    slug = machine_slug(machine)
    out_path = args.out or f"kernels-prefill-{slug}{'-quick' if args.quick else ''}.json"
    points = _sweep_points(shapes, formats, ms)
    bf16 = measure_matmul(jnp.bfloat16, QUICK if args.quick else Sizes())
    print(f"{bf16.name}: {bf16.figure:.1f} TFLOP/s")
    print(
        f"prefill: {len(points)} shape x format points at M {ms}: {len(prefill_configs(args.quick))}+ tile configs at "
        f"M={ms[0]}, its winner and the default below; budget {args.prefill_budget_s:.0f} s"
    )
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.compile_threads))
    records, failures, path, done = [], [], None, 0
    for fmt, (n, k), names in points:
        weight, static, _ = _random_weight(fmt, n, k, jax.random.key(n * 7 + k))
        defaults = NVFP4_DEFAULTS if fmt == "nvfp4" else FP8_DEFAULTS
        winner = None
        for m in ms:
            left = args.prefill_budget_s - (time.perf_counter() - t0)
            share = left / max(1, len(points) * len(ms) - done)
            done += 1
            if left <= 0:
                print(f"prefill budget spent: skipping {fmt} {n}x{k} m{m}")
                continue
            if m == ms[0]:  # the sweep: 1.5 shares; the smaller Ms: winner and default, 0.5 share
                point_configs, deadline = prefill_configs(args.quick, fmt), time.perf_counter() + 1.5 * share
            else:
                default = qc.pick_config(defaults, m)
                point_configs = list(dict.fromkeys(c for c in (winner, default) if c is not None))
                deadline = time.perf_counter() + 0.5 * share
            res = prefill_point(
                fmt, n, k, m, weight, static, point_configs, deadline=deadline, pool=pool, interpret=interpret
            )
            failures += res["mismatches"]
            if res["best"] is None:
                failures.append(f"{fmt} {n}x{k} m{m}: no configuration ran and matched the reference")
                print(f"  {failures[-1]}", file=sys.stderr)
                continue
            if m == ms[0]:
                winner = res["best"][1]
            for model, layer in names:
                records.append(
                    _prefill_record(
                        model,
                        layer,
                        fmt,
                        n,
                        k,
                        m,
                        res,
                        bf16,
                        machine=machine,
                        commit=commit,
                        interpret=interpret,
                    )
                )
                records.append(_xla_prefill_record(model, layer, fmt, n, k, m, res, bf16, machine=machine,
                                                   commit=commit))  # fmt: skip
            rec, flops = records[-2], 2 * m * n * k
            print(
                f"{fmt:12s} {n:6d}x{k:<6d} m{m:<5d} {rec.figure:7.1f} TFLOP/s {rec.fraction:6.1%} of bf16  "
                f"(xla dequant+dot {flops / res['xla_s'] / 1e12:6.1f}, bf16 dot "
                f"{flops / res['bf16_s'] / 1e12:6.1f})  {len(res['table'])} configs  best {res['best'][1]}  "
                f"[{time.perf_counter() - t0:.0f} s]",
                flush=True,
            )
            path = write_records(records, out_path)  # after every point: a timeout keeps what ran
    pool.shutdown()
    print(f"wrote {path} ({len(records)} records)")
    if failures:
        raise AssertionError("prefill benchmark failures:\n" + "\n".join(failures))
    return records


if __name__ == "__main__":
    main()
