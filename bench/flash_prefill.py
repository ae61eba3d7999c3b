"""Paged prefill flash attention kernel against the bf16 tensor-core ceiling.

    python -m bench.flash_prefill                 # GPU: 27B and 80B head shapes, batch 1, 32K context
    python -m bench.flash_prefill --models qwen3.5-27b --formats bf16
    python -m bench.flash_prefill --quick         # tiny shapes through the Pallas interpreter (any machine)

Two workloads per (model shape, KV format), batch 1, over a paged pool holding a 32K-token row
(random KV, blocks in shuffled order):

* "chunk4k@ctx32k": the last 4096-token chunk of a 32K prompt (positions 28672..32767), the chunk
  continuing a cached prefix of 28K tokens;
* "prefill32k-chunks4k": the whole 32K prompt prefilled from position 0 in eight 4096-token chunks
  (time and FLOPs summed over the chunks).

The figure is causal attention FLOPs / time in TFLOP/s: 4 * Dh * H FLOPs (Q.K^T and P.V) for every
(query, visible key) pair, i.e. sum over the chunk's queries of (position + 1). The ceiling is
`bench.ceilings.measure_matmul(jnp.bfloat16)` measured in the same run. The tile sweep (`CONFIGS`)
runs on the bf16 chunk workload; the other formats (int8 / fp8 pages, and the INT8 Q.K option on
bf16 and int8 pages) and the chunked prefill use its winner. Every configuration is checked
against `reference_prefill_attention` on a subset of query rows (the first, middle and last rows
of the chunk) before its time counts; a mismatch raises. The engine's XLA path (`PagedKV.attend`:
gather the blocks, masked float32 softmax over the whole capacity) is timed beside it
(`details["xla_paged_attend_s"]`, or the error if it does not fit). Calls are queued back to back
with one sync per timing. Records go to bench/results/flash-prefill-<machine>.json; the run exits
non-zero if a workload had no configuration that compiled.
"""

from __future__ import annotations

import argparse
import functools
import sys
from dataclasses import asdict, dataclass

import jax
import jax.numpy as jnp
import numpy as np

from bench.attention_kernels import SHAPES, AttentionShape, pipelined_seconds, random_paged_kv
from bench.ceilings import QUICK, Sizes, measure_matmul, relative_error
from bench.record import git_commit, machine_name, machine_slug, make_record, write_records
from infernix_jax.cache.kv_pool import PagedKV
from pallas_kernels.flash_prefill import paged_prefill_attention, reference_prefill_attention


@dataclass(frozen=True)
class PrefillConfig:
    """One point of the tile sweep."""

    block_q: int
    block_kv: int
    num_warps: int
    num_stages: int


@dataclass(frozen=True)
class Workload:
    """Sizes of the two workloads."""

    context: int  # tokens the row holds once the prompt is in
    chunk: int  # tokens a prefill chunk holds


FULL = Workload(context=32768, chunk=4096)
QUICK_WORKLOAD = Workload(context=256, chunk=64)
QUICK_SHAPES = {"tiny": AttentionShape(4, 2, 32)}
# The first is the kernel's default. Shared memory per program at Dh 256 in bf16: the Q tile
# (block_q x 256 x 2 bytes) plus num_stages x (K + V) tiles of block_kv x 256 x 2 bytes each.
CONFIGS = [
    PrefillConfig(128, 64, 8, 2),
    PrefillConfig(64, 64, 4, 2),
    PrefillConfig(128, 64, 8, 3),
    PrefillConfig(64, 128, 4, 2),
    PrefillConfig(128, 32, 8, 3),
    PrefillConfig(64, 64, 4, 3),
]
QUICK_CONFIGS = [PrefillConfig(16, 32, 4, 2), PrefillConfig(32, 64, 4, 2)]
FORMATS = ("bf16", "int8", "fp8", "bf16+qk_int8", "int8+qk_int8")
MAX_REL_ERR = 2e-2  # q, pages and probabilities enter the dots in bf16; sums are float32
MAX_REL_ERR_QK_INT8 = 5e-2  # against exact scores: QK_INT8_TOLERANCE plus bf16 rounding
CHECK_ROWS = 96  # query rows of a chunk checked against the reference (first, middle, last third)
CALLS_PER_TIMING = 5
XLA_SIZES = Sizes(warmup=1, repeats=3)  # the XLA path is timed one call at a time: it is slow at 32K
_reference = jax.jit(reference_prefill_attention)


def causal_flops(shape: AttentionShape, positions: np.ndarray) -> float:
    """FLOPs of causal attention for queries at `positions` (padding < 0 skipped): 4 Dh H (p + 1) each."""
    seen = np.where(positions >= 0, positions + 1, 0).astype(np.float64)
    return 4.0 * shape.head_dim * shape.heads * float(seen.sum())


def check_rows(chunk: int, count: int = CHECK_ROWS) -> np.ndarray:
    """Query indices of a chunk to check: a third each from its start, middle and end."""
    if chunk <= count:
        return np.arange(chunk)
    third = count // 3
    middle = chunk // 2 - third // 2
    return np.concatenate([np.arange(third), middle + np.arange(third), chunk - third + np.arange(third)])


def _tokens(n: int) -> str:
    return f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n)


def workload_label(workload: Workload, at_end_only: bool) -> str:
    """ "chunk4k@ctx32k" (the last chunk) or "prefill32k-chunks4k" (the whole prompt in chunks)."""
    if at_end_only:
        return f"chunk{_tokens(workload.chunk)}@ctx{_tokens(workload.context)}"
    return f"prefill{_tokens(workload.context)}-chunks{_tokens(workload.chunk)}"


def _kernel_fn(config: PrefillConfig, qk_int8: bool, interpret: bool):
    return jax.jit(
        functools.partial(
            paged_prefill_attention,
            block_q=config.block_q,
            block_kv=config.block_kv,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
            qk_int8=qk_int8,
            interpret=interpret,
        )
    )


def _check(fn, q, kv: PagedKV, positions, rows: np.ndarray, max_rel_err: float, what: str) -> float:
    """Run fn on the whole chunk, compare the chosen rows with the float32 reference; raise on mismatch."""
    got = jax.block_until_ready(
        fn(q, kv.k_pages, kv.v_pages, kv.block_table, positions, kv.k_scales, kv.v_scales)
    )
    want = _reference(
        q[:, rows], kv.k_pages, kv.v_pages, kv.block_table, positions[:, rows], kv.k_scales, kv.v_scales
    )
    rel_err = relative_error(got[:, rows], want)
    if not rel_err <= max_rel_err:  # also catches NaN
        raise AssertionError(f"{what}: kernel differs from the reference by {rel_err:.3g} of max|out|")
    return rel_err


def _time(fn, args, sizes: Sizes, calls: int) -> float:
    return pipelined_seconds(lambda: fn(*args), sizes, calls)


def _xla_seconds(q, kv: PagedKV, positions, scale: float, sizes: Sizes) -> float | str:
    """PagedKV.attend (the engine's prefill attention today), or the error text if it cannot run."""
    attend = jax.jit(lambda q, kv, pos: kv.attend(q, pos, scale))
    try:
        jax.block_until_ready(attend(q, kv, positions))
        return _time(attend, (q, kv, positions), sizes, 1)
    except Exception as e:  # noqa: BLE001 - e.g. out of memory for the [H, T, S] scores: report it
        return f"{type(e).__name__}: {str(e)[:200]}"


def _chunks(workload: Workload, at_end_only: bool) -> list[np.ndarray]:
    """Positions [1, chunk] of each chunk: the last one only, or all of a prompt from 0."""
    starts = (
        [workload.context - workload.chunk] if at_end_only else range(0, workload.context, workload.chunk)
    )
    return [(start + np.arange(workload.chunk, dtype=np.int32))[None, :] for start in starts]


def bench_workload(
    shape: AttentionShape,
    fmt: str,
    workload: Workload,
    at_end_only: bool,
    configs: list[PrefillConfig],
    *,
    sizes: Sizes,
    calls: int,
    interpret: bool,
) -> dict | None:
    """Time every configuration (each checked first) over the workload's chunks; None if none compiled."""
    page_fmt, _, option = fmt.partition("+")
    qk_int8 = option == "qk_int8"
    _q, kv, _lengths = random_paged_kv(shape, page_fmt, 1, workload.context)
    chunks = _chunks(workload, at_end_only)
    q = jax.random.normal(jax.random.key(7), (1, workload.chunk, shape.heads, shape.head_dim), jnp.bfloat16)
    rows = check_rows(workload.chunk)
    max_err = MAX_REL_ERR_QK_INT8 if qk_int8 else MAX_REL_ERR
    flops = sum(causal_flops(shape, c) for c in chunks)
    sweep = []
    for config in configs:
        fn = _kernel_fn(config, qk_int8, interpret)
        try:
            errors = [
                _check(fn, q, kv, jnp.asarray(c), rows, max_err, f"{shape} {fmt} {config} chunk@{c[0, 0]}")
                for c in chunks
            ]
        except AssertionError:  # a wrong result fails the run
            raise
        except Exception as e:  # noqa: BLE001 - a configuration that does not compile here: report, go on
            print(f"  {fmt} {config}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        seconds = sum(
            _time(
                fn,
                (q, kv.k_pages, kv.v_pages, kv.block_table, jnp.asarray(c), kv.k_scales, kv.v_scales),
                sizes,
                calls,
            )
            for c in chunks
        )
        sweep.append(
            {
                **asdict(config),
                "seconds": seconds,
                "tflop_s": flops / seconds / 1e12,
                "max_rel_err": max(errors),
            }
        )
    if not sweep:
        return None
    scale = shape.head_dim**-0.5
    if qk_int8:  # None: the XLA path does not depend on the option (its page format's record has it)
        xla_s = None
    else:
        xla = [_xla_seconds(q, kv, jnp.asarray(c), scale, QUICK if interpret else XLA_SIZES) for c in chunks]
        xla_s = (
            sum(xla) if all(isinstance(x, float) for x in xla) else next(x for x in xla if isinstance(x, str))
        )
    best = min(sweep, key=lambda r: r["seconds"])
    return {"flops": flops, "best": best, "sweep": sweep, "xla": xla_s, "chunks": len(chunks)}


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(
        prog="python -m bench.flash_prefill", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "--quick", action="store_true", help="tiny shapes, interpret mode: a smoke run anywhere"
    )
    parser.add_argument("--formats", default=",".join(FORMATS), help=f"subset of {','.join(FORMATS)}")
    parser.add_argument("--models", default=",".join(SHAPES))
    parser.add_argument("--out", help="output file (default: bench/results/flash-prefill-<machine>.json)")
    args = parser.parse_args(argv)
    interpret = args.quick or jax.default_backend() == "cpu"
    sizes = QUICK if args.quick else Sizes(warmup=1, repeats=5)
    workload = QUICK_WORKLOAD if args.quick else FULL
    shapes = QUICK_SHAPES if args.quick else {m: SHAPES[m] for m in args.models.split(",")}
    configs = QUICK_CONFIGS if args.quick else CONFIGS
    calls = 1 if interpret else CALLS_PER_TIMING
    formats = args.formats.split(",")
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        parser.error(f"unknown formats {unknown}; choose from {FORMATS}")
    machine, commit = machine_name(), git_commit()
    ceiling = measure_matmul(jnp.bfloat16, QUICK if args.quick else Sizes())
    print(f"{ceiling.name}: {ceiling.figure:.1f} TFLOP/s", flush=True)
    records, failed = [], []
    for model, shape in shapes.items():
        winner = configs[0]
        # The sweep first (bf16 pages, the last chunk), then everything else at its winner.
        plan = [(fmt, at_end) for at_end in (True, False) for fmt in formats]
        plan.sort(key=lambda p: p != ("bf16", True))
        for fmt, at_end in plan:
            tried = configs if (fmt, at_end) == ("bf16", True) else [winner]
            name = f"prefill attention {model} {fmt} batch1 {workload_label(workload, at_end)}"
            result = bench_workload(
                shape, fmt, workload, at_end, tried, sizes=sizes, calls=calls, interpret=interpret
            )
            if result is None:
                failed.append(name)
                continue
            best = result["best"]
            if (fmt, at_end) == ("bf16", True):
                winner = PrefillConfig(
                    best["block_q"], best["block_kv"], best["num_warps"], best["num_stages"]
                )
            xla = result["xla"]
            rec = make_record(
                name,
                best["tflop_s"],
                "TFLOP/s",
                ceiling.figure,
                "TFLOP/s",
                machine=machine,
                commit=commit,
                details={
                    "heads": shape.heads,
                    "kv_heads": shape.kv_heads,
                    "head_dim": shape.head_dim,
                    "batch": 1,
                    "context": workload.context,
                    "chunk": workload.chunk,
                    "chunks_timed": result["chunks"],
                    "format": fmt,
                    "causal_flops": result["flops"],
                    "seconds": best["seconds"],
                    "max_rel_err_vs_reference": best["max_rel_err"],
                    "rows_checked_per_chunk": len(check_rows(workload.chunk)),
                    "config": {k: best[k] for k in ("block_q", "block_kv", "num_warps", "num_stages")},
                    "sweep": result["sweep"],
                    "xla_paged_attend_s": xla if isinstance(xla, float) else None,
                    "xla_paged_attend_tflop_s": result["flops"] / xla / 1e12
                    if isinstance(xla, float)
                    else None,
                    "xla_error": xla if isinstance(xla, str) else None,
                    "ceiling": ceiling.name,
                    "calls_per_timing": calls,
                    "interpret": interpret,
                    "jax": jax.__version__,
                },
            )
            records.append(rec)
            if isinstance(xla, float):
                xla_words = f"{rec.details['xla_paged_attend_tflop_s']:7.1f}"
            else:
                xla_words = "  error" if isinstance(xla, str) else "    n/a"
            print(
                f"{rec.name:70s} {rec.figure:7.1f} TFLOP/s {rec.fraction:6.1%} of bf16 matmul "
                f"(xla path {xla_words} TFLOP/s)  {rec.details['config']}",
                flush=True,
            )
    slug = machine_slug(machine)
    path = write_records(records, args.out or f"flash-prefill-{slug}{'-quick' if args.quick else ''}.json")
    print(f"wrote {path}")
    if failed:
        print(f"no kernel configuration compiled for: {', '.join(failed)}", file=sys.stderr)
        raise SystemExit(1)
    return records


if __name__ == "__main__":
    main()
