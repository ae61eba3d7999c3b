"""Quantized decode matmul kernels against the HBM roofline.

    python -m bench.kernels                  # GPU: real layer shapes, batch 1 and 8, tile sweep
    python -m bench.kernels --formats nvfp4 --batches 1
    python -m bench.kernels --quick          # tiny shapes through the Pallas interpreter (any machine)

For each (layer shape, format, batch) it times the Pallas kernel over random packed weights and
reports bytes that must be read (packed weight + scales + activations + output) per second, as a
fraction of the HBM read bandwidth measured in the same run (bench.ceilings). Several tile
configurations are tried per point and the best is recorded with its tiles, beside the time of
the XLA fallback (dequantize + dot) for comparison. Records go to
bench/results/kernels-<machine>.json.
"""

from __future__ import annotations

import argparse
import functools
import re
import statistics

import jax
import jax.numpy as jnp

from bench.ceilings import QUICK, Sizes, measure_hbm_read, median_seconds
from bench.record import git_commit, machine_name, make_record, write_records
from pallas_kernels.fp8_matmul import fp8_matmul
from pallas_kernels.nvfp4_matmul import nvfp4_matmul

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
    args = parser.parse_args(argv)
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
    slug = re.sub(r"[^a-z0-9]+", "-", machine.lower()).strip("-")
    path = write_records(records, args.out or f"kernels-{slug}{'-quick' if args.quick else ''}.json")
    print(f"wrote {path}")
    return records


if __name__ == "__main__":
    main()
