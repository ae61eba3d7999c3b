"""Paged decode attention kernel against the HBM roofline.

    python -m bench.attention_kernels            # GPU: 27B and 80B shapes, batch 1 and 8, 8K and 32K
    python -m bench.attention_kernels --formats bf16 --batches 1 --contexts 32768
    python -m bench.attention_kernels --quick    # tiny shapes through the Pallas interpreter (any machine)

For each (model shape, KV format, batch, context) it fills a paged pool with random KV (every
row `context` tokens long, its blocks in shuffled order), times the Pallas kernel
(pallas_kernels.paged_attention) under each configuration of `CONFIGS` (at the longest context;
shorter ones try the default and the longest one's winner, which keeps the run under four
minutes on an H200) and records the best as KV bytes read (pages + scales of the visible tokens)
per second, as a fraction of the HBM read bandwidth measured in the same run (bench.ceilings).
Every configuration's output is checked against reference_paged_attention before its time
counts (a mismatch raises). Each timed call runs the kernel over enough copies of the pool
(different random KV) that together they exceed the 50 MB L2, and 20 calls are queued back to
back, so the figure is HBM-bound work without Python dispatch. The kernel alone (without the
combine of the partitions) and the engine's current XLA path (PagedKV.attend: gather the
blocks, dequantize, masked softmax) are timed beside it. Records go to
bench/results/attention-kernels-<machine>.json; the run exits non-zero if some point had no
configuration that compiled.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from bench.ceilings import QUICK, Sizes, measure_hbm_read, relative_error
from bench.record import context_label, git_commit, machine_name, machine_slug, make_record, write_records
from infernix_jax.cache.kv_pool import PagedKV
from pallas_kernels.paged_attention import (
    PAGE_SIZE,
    default_partition_size,
    paged_decode_attention,
    paged_decode_partials,
    reference_paged_attention,
)


@dataclass(frozen=True)
class AttentionShape:
    """The full-attention layer of a model: query heads, KV heads, head dim."""

    heads: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class KernelConfig:
    """One point of the sweep (partition_size None: default_partition_size for the shape)."""

    partition_size: int | None
    block_tokens: int
    num_warps: int
    num_stages: int


SHAPES = {
    "qwen3.5-27b": AttentionShape(24, 4, 256),
    "qwen3-next-80b": AttentionShape(16, 2, 256),
}
QUICK_SHAPES = {"tiny": AttentionShape(4, 2, 32)}
# The first is the kernel's default. Shared memory per program is about num_stages x 2 tiles of
# block_tokens x Dh (bf16 at Dh 256: 64 KB a stage at 64 tokens), which sets how many programs
# share an SM: 64/2 -> one, 32/3 -> two, 32/2 -> three.
CONFIGS = [
    KernelConfig(None, 64, 4, 2),
    KernelConfig(None, 32, 4, 3),
    KernelConfig(None, 32, 4, 2),
    KernelConfig(None, 64, 8, 2),
    KernelConfig(1024, 32, 4, 3),
]
QUICK_CONFIGS = [KernelConfig(64, 32, 4, 2)]
PAGE_DTYPES = {"bf16": jnp.bfloat16, "int8": jnp.int8, "fp8": jnp.float8_e4m3fn}
MAX_REL_ERR = 2e-2  # q, pages and probabilities enter the dots in bf16; sums are float32
CALLS_PER_TIMING = 20  # back-to-back calls per timed repeat (--quick: 2)
L2_DEFEAT_BYTES = 160 << 20  # KV of the copies one timed call reads: well over the H200's 50 MB L2
MAX_COPIES = 8


def random_paged_kv(shape: AttentionShape, fmt: str, batch: int, context: int, seed: int = 0):
    """(q [B, H, Dh] bf16, PagedKV of B rows holding `context` tokens each, lengths [B] int32).

    Blocks are handed out in a random order (a pool after some churn), block 0 stays the null block.
    """
    blocks_per_row = -(-context // PAGE_SIZE)
    num_blocks = 1 + batch * blocks_per_row
    page_shape = (num_blocks, PAGE_SIZE, shape.kv_heads, shape.head_dim)
    keys = jax.random.split(jax.random.key(seed), 5)

    @functools.partial(jax.jit, static_argnums=(1,))
    def pages(key, dtype):
        if dtype == jnp.int8:
            return jax.random.randint(key, page_shape, -127, 128, jnp.int32).astype(jnp.int8)
        return jax.random.normal(key, page_shape, jnp.float32).astype(dtype)

    dtype = PAGE_DTYPES[fmt]
    scaled = fmt != "bf16"
    scales = (
        (lambda key: jax.random.uniform(key, page_shape[:3], jnp.float32, 0.002, 0.05))
        if scaled
        else (lambda key: None)
    )
    order = np.random.default_rng(seed).permutation(np.arange(1, num_blocks)).reshape(batch, blocks_per_row)
    kv = PagedKV(
        pages(keys[0], dtype),
        pages(keys[1], dtype),
        scales(keys[2]),
        scales(keys[3]),
        jnp.asarray(order, jnp.int32),
        fmt,
    )
    q = jax.random.normal(keys[4], (batch, shape.heads, shape.head_dim), jnp.bfloat16)
    return q, kv, jnp.full((batch,), context, jnp.int32)


def kv_bytes_read(kv: PagedKV, lengths: jax.Array) -> int:
    """Bytes decode must read: K and V page rows and scales of every visible token."""
    _n, _p, kv_heads, head_dim = kv.k_pages.shape
    per_token = kv_heads * (head_dim * kv.k_pages.dtype.itemsize + (4 if kv.k_scales is not None else 0))
    return 2 * per_token * int(np.sum(np.asarray(lengths)))


def pipelined_seconds(fn, sizes: Sizes, calls: int) -> float:
    """Median seconds per call over `sizes.repeats` timings of `calls` back-to-back calls.

    Only the last call of a timing is waited for, so the host's dispatch overlaps the device's
    work as it does inside a jitted decode step (a 20-microsecond kernel is not timed as one
    Python dispatch plus itself).
    """
    for _ in range(sizes.warmup):
        jax.block_until_ready(fn())
    timings = []
    for _ in range(sizes.repeats):
        start = time.perf_counter()
        for _ in range(calls - 1):
            fn()
        jax.block_until_ready(fn())
        timings.append((time.perf_counter() - start) / calls)
    return statistics.median(timings)


def _kernel_fn(config: KernelConfig, interpret: bool, entry=paged_decode_attention):
    return jax.jit(
        functools.partial(
            entry,
            partition_size=config.partition_size,
            block_tokens=config.block_tokens,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
            interpret=interpret,
        )
    )


def _xla_fn(scale: float):
    """The engine's current decode attention (PagedKV.attend over the gathered blocks), over copies."""

    def attend(q, kv, lengths):
        return kv.attend(q[:, None], (lengths - 1)[:, None], scale)[:, 0]

    return _over_copies(attend)


@dataclass
class PointResult:
    """What one (shape, format, batch, context) point measured; times are seconds per call."""

    sweep: list[tuple[float, KernelConfig, float]]  # (seconds, config, max rel err) per compiled config
    kernel_only_s: float | None  # the best config's pallas_call alone (no combine), None if none compiled
    xla_s: float  # PagedKV.attend, the engine's XLA path
    xla_rel_err: float
    kv_bytes: int  # read by one call
    copies: int  # KV pools cycled through per timed call (L2 defeat)

    @property
    def best(self) -> tuple[float, KernelConfig, float]:
        return min(self.sweep, key=lambda r: r[0])


def l2_defeat_copies(kv_bytes: int, interpret: bool) -> int:
    """How many KV pools one timed call cycles through so that the KV is not served from L2."""
    return 1 if interpret else max(1, min(MAX_COPIES, -(-L2_DEFEAT_BYTES // kv_bytes)))


def _over_copies(one):
    """One jitted call running `one` over every copy's arguments (so consecutive kernels read different KV)."""
    return jax.jit(lambda arg_sets: tuple(one(*a) for a in arg_sets))


def bench_point(
    shape: AttentionShape,
    fmt: str,
    batch: int,
    context: int,
    *,
    sizes: Sizes,
    interpret: bool,
    configs,
    calls: int = CALLS_PER_TIMING,
) -> PointResult:
    """Time every configuration that compiles (each checked against the reference first), the
    kernel alone at the best one, and the XLA path; seconds are per attention call."""
    q, kv, lengths = random_paged_kv(shape, fmt, batch, context)
    kv_bytes = kv_bytes_read(kv, lengths)
    copies = l2_defeat_copies(kv_bytes, interpret)
    pools = [(q, kv, lengths)] + [
        random_paged_kv(shape, fmt, batch, context, seed=c) for c in range(1, copies)
    ]
    arg_sets = tuple(
        (q, kv.k_pages, kv.v_pages, kv.block_table, n, kv.k_scales, kv.v_scales) for q, kv, n in pools
    )
    want = jax.jit(reference_paged_attention)(*arg_sets[0])
    sweep = []
    for config in configs:
        fn = _over_copies(_kernel_fn(config, interpret))
        try:
            got = jax.block_until_ready(fn(arg_sets))[0]
        except Exception as e:  # noqa: BLE001 - a configuration that does not compile here: report, go on
            print(f"  {fmt} b{batch} {context_label(context)} {config}: {type(e).__name__}: {str(e)[:160]}")
            continue
        rel_err = relative_error(got, want)
        if not rel_err <= MAX_REL_ERR:  # also catches NaN
            raise AssertionError(
                f"{shape} {fmt} batch{batch} ctx{context} {config}: kernel differs from the reference "
                f"by {rel_err:.3g} of max|out|"
            )
        seconds = pipelined_seconds(lambda fn=fn: fn(arg_sets), sizes, calls) / copies
        sweep.append((seconds, config, rel_err))
    kernel_only_s = None
    if sweep:
        partials = _over_copies(
            _kernel_fn(min(sweep, key=lambda r: r[0])[1], interpret, paged_decode_partials)
        )
        kernel_only_s = pipelined_seconds(lambda: partials(arg_sets), sizes, calls) / copies
    xla = _xla_fn(shape.head_dim**-0.5)
    xla_sets = tuple(pools)
    xla_rel_err = relative_error(xla(xla_sets)[0], want)
    xla_s = pipelined_seconds(lambda: xla(xla_sets), sizes, calls) / copies
    return PointResult(sweep, kernel_only_s, xla_s, xla_rel_err, kv_bytes, copies)


def _config_dict(config: KernelConfig, shape: AttentionShape, batch: int, context: int) -> dict:
    capacity = -(-context // PAGE_SIZE) * PAGE_SIZE  # the block table's, as the kernel sees it
    partition = config.partition_size or default_partition_size(batch, shape.kv_heads, capacity)
    return {
        "partition_size": partition,
        "partition_size_default": config.partition_size is None,
        "block_tokens": config.block_tokens,
        "num_warps": config.num_warps,
        "num_stages": config.num_stages,
    }


def _record(
    model: str,
    shape: AttentionShape,
    fmt: str,
    batch: int,
    context: int,
    point: PointResult,
    *,
    hbm,
    machine: str,
    commit: str,
    interpret: bool,
):
    seconds, best, rel_err = point.best
    gb_s = point.kv_bytes / 1e9
    return make_record(
        f"decode attention {model} {fmt} batch{batch} {context_label(context)}",
        gb_s / seconds,
        "GB/s",
        hbm.figure,
        "GB/s",
        machine=machine,
        commit=commit,
        details={
            "heads": shape.heads,
            "kv_heads": shape.kv_heads,
            "head_dim": shape.head_dim,
            "batch": batch,
            "context": context,
            "format": fmt,
            "kv_bytes": point.kv_bytes,
            "median_s": seconds,
            "max_rel_err_vs_reference": rel_err,
            "config": _config_dict(best, shape, batch, context),
            "kernel_only_s": point.kernel_only_s,
            "kernel_only_gb_s": gb_s / point.kernel_only_s,
            "sweep": [
                {**_config_dict(c, shape, batch, context), "median_s": s, "gb_s": gb_s / s}
                for s, c, _ in point.sweep
            ],
            "xla_paged_attend_s": point.xla_s,
            "xla_paged_attend_gb_s": gb_s / point.xla_s,
            "xla_max_rel_err_vs_reference": point.xla_rel_err,
            "calls_per_timing": CALLS_PER_TIMING if not interpret else 2,
            "kv_copies": point.copies,
            "interpret": interpret,
            "jax": jax.__version__,
        },
    )


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(
        prog="python -m bench.attention_kernels", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny shapes, interpret mode: a smoke run anywhere"
    )
    parser.add_argument("--formats", default="bf16,int8,fp8")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--contexts", default="8192,32768")
    parser.add_argument("--models", default=",".join(SHAPES))
    parser.add_argument("--out", help="output file (default: bench/results/attention-kernels-<machine>.json)")
    args = parser.parse_args(argv)
    interpret = args.quick or jax.default_backend() == "cpu"
    sizes = QUICK if args.quick else Sizes()
    shapes = QUICK_SHAPES if args.quick else {m: SHAPES[m] for m in args.models.split(",")}
    # Longest context first: the full sweep runs there, shorter contexts try the default and its winner.
    contexts = [130] if args.quick else sorted((int(c) for c in args.contexts.split(",")), reverse=True)
    batches = [2] if args.quick else [int(b) for b in args.batches.split(",")]
    configs = QUICK_CONFIGS if args.quick else CONFIGS
    calls = 2 if interpret else CALLS_PER_TIMING
    machine, commit = machine_name(), git_commit()
    hbm = measure_hbm_read(sizes)
    print(f"{hbm.name}: {hbm.figure:.1f} GB/s")
    records, failed = [], []
    for model, shape in shapes.items():
        for fmt in args.formats.split(","):
            for batch in batches:
                tried = configs
                for context in contexts:
                    point = bench_point(
                        shape,
                        fmt,
                        batch,
                        context,
                        sizes=sizes,
                        interpret=interpret,
                        configs=tried,
                        calls=calls,
                    )
                    if not point.sweep:
                        failed.append(f"{model} {fmt} batch{batch} {context_label(context)}")
                        continue
                    tried = list(dict.fromkeys([configs[0], point.best[1]]))
                    rec = _record(
                        model,
                        shape,
                        fmt,
                        batch,
                        context,
                        point,
                        hbm=hbm,
                        machine=machine,
                        commit=commit,
                        interpret=interpret,
                    )
                    records.append(rec)
                    d = rec.details
                    print(
                        f"{rec.name:55s} {rec.figure:8.1f} GB/s {rec.fraction:6.1%} of HBM "
                        f"(kernel alone {d['kernel_only_gb_s']:7.1f}, xla path {d['xla_paged_attend_gb_s']:7.1f} GB/s)"
                        f"  {d['config']}",
                        flush=True,
                    )
    slug = machine_slug(machine)
    path = write_records(
        records, args.out or f"attention-kernels-{slug}{'-quick' if args.quick else ''}.json"
    )
    print(f"wrote {path}")
    if failed:
        print(f"no kernel configuration compiled for: {', '.join(failed)}", file=sys.stderr)
        raise SystemExit(1)
    return records


if __name__ == "__main__":
    main()
