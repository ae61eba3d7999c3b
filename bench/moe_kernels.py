"""Grouped MoE matmul kernel (pallas_kernels/moe_matmul.py) against the HBM roofline.

    python -m bench.moe_kernels                  # GPU: Qwen3-Next-80B expert shapes, batch 1-8, ~2-3 min
    python -m bench.moe_kernels --formats nvfp4 --batches 1,8
    python -m bench.moe_kernels --quick          # tiny shapes through the Pallas interpreter (any machine)

For each format (nvfp4, fp8; fp8_block128 on request), expert projection of Qwen3-Next-80B-A3B
(gate_up [1024, 2048] and down [2048, 512] per expert, 512 experts, top-10), decode batch and
routing (uniform: each token's top-10 drawn uniformly; skewed: drawn with Zipf weights over the
experts, so tokens share experts more often), it times a few kernel configurations over the full
512-expert stack and records the best as

    figure = bytes of the distinct experts the step reads (packed + scales) / time   [GB/s]

against the HBM read bandwidth measured in the same run (bench.ceilings.measure_hbm_read).
Each timed call runs several routings back to back (each its own sorted rows and group sizes, as
successive layers would; enough that their experts add up to >= 160 MB, at most 32), so L2
cannot serve the experts a routing reads; calls are queued with one sync per trial. Every configuration is
checked against `reference_grouped_matmul` (max error <= 2% of max |y|) before its time counts;
a mismatch fails the run at the end. The per-row gather + dequantize + dot that model/mlp.py's
decode path runs today is timed beside it (`details["xla_gather_s"]`).

Records: bench/results/moe-kernels-<machine>.json (printed at the end).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.ceilings import QUICK, Sizes, measure_hbm_read, relative_error
from bench.kernels import _time_compiled, warm_gpu
from bench.record import git_commit, machine_name, machine_slug, make_record, write_records
from pallas_kernels.moe_matmul import GroupedConfig, grouped_matmul, reference_grouped_matmul
from pallas_kernels.nvfp4_matmul import WORD_MIN_BLOCK_K


@dataclasses.dataclass(frozen=True)
class MoEShape:
    """The routed experts of one MoE layer."""

    num_experts: int
    top_k: int
    projections: dict  # name -> per-expert weight [N, K]


QWEN3_NEXT_80B = MoEShape(512, 10, {"gate_up": (2 * 512, 2048), "down": (2048, 512)})
QUICK_SHAPE = MoEShape(16, 4, {"gate_up": (64, 128), "down": (96, 64)})
L2_DEFEAT_BYTES = 160 << 20  # expert bytes per timed call: well over the H200's 50 MB L2
MAX_ROUTINGS = 32  # routings per timed call (different experts each), as successive layers would
QUICK_ROUTINGS = 2
SKEW_EXPONENT = 1.2  # skewed routing: expert of rank r drawn with weight 1 / (r + 1) ** SKEW_EXPONENT
MAX_REL_ERR = 2e-2


def routing(rng: np.random.Generator, batch: int, shape: MoEShape, kind: str) -> np.ndarray:
    """Expert ids [batch, top_k], distinct within each token; "skewed" favours a few experts (a
    fresh random ranking per call, as each layer has its own hot experts)."""
    e = shape.num_experts
    if kind == "uniform":
        p = None
    else:
        weights = 1.0 / (np.arange(e) + 1.0) ** SKEW_EXPONENT
        p = (weights / weights.sum())[rng.permutation(e)]
    return np.stack([rng.choice(e, shape.top_k, replace=False, p=p) for _ in range(batch)])


def sorted_rows(ids: np.ndarray, hidden: int, num_experts: int, key: jax.Array):
    """(rows [batch * top_k, hidden] bf16 sorted by expert, group sizes int32 [E], distinct experts):
    what a caller hands the grouped kernel for one decode step."""
    batch, top_k = ids.shape
    x = jax.random.normal(key, (batch, hidden), jnp.bfloat16)
    order = np.argsort(ids.ravel(), kind="stable")
    rows = x[jnp.asarray(order // top_k)]
    sizes = np.bincount(ids.ravel(), minlength=num_experts)
    return rows, jnp.asarray(sizes, jnp.int32), int((sizes > 0).sum())


def random_stack(fmt: str, e: int, n: int, k: int, key: jax.Array):
    """(weight leaves, static kwargs, bytes per expert of packed data + scales) for one format."""
    k1, k2 = jax.random.split(key)
    if fmt == "nvfp4":
        packed = jax.random.randint(k1, (e, n, k // 2), 0, 256, jnp.int32).astype(jnp.uint8)
        scale = jax.random.uniform(k2, (e, n, k // 16), jnp.float32, 0.01, 4.0).astype(jnp.float8_e4m3fn)
        tensor = jnp.full((e,), 0.01, jnp.float32)
        return (packed, scale, tensor), {"fmt": "nvfp4"}, n * k // 2 + n * k // 16 + 4
    data = (jax.random.normal(k1, (e, n, k), jnp.float32) * 8).astype(jnp.float8_e4m3fn)
    if fmt == "fp8":
        return (data, jnp.full((e,), 0.01, jnp.float32)), {"fmt": "fp8"}, n * k + 4
    nb, kb = -(-n // 128), -(-k // 128)
    scale = jax.random.uniform(k2, (e, nb, kb), jnp.float32, 0.001, 0.1)
    return (data, scale), {"fmt": "fp8", "block_size": 128}, n * k + nb * kb * 4


def routings_per_call(batch: int, shape: MoEShape, per_expert: int) -> int:
    """Routings per timed call so that the experts they read exceed L2 (a bound from
    tokens x top_k experts per routing)."""
    per_routing = min(batch * shape.top_k, shape.num_experts) * per_expert
    return max(2, min(MAX_ROUTINGS, -(-L2_DEFEAT_BYTES // per_routing)))


# --wide: NVFP4's word-decoded dots at decode batches over more tiles (block_n, block_k, split_k,
# num_warps, num_stages): narrower tiles and split K put more programs (and loads) on the SMs
# when ten experts' weights are all a step reads
WIDE_WORD_TILES = [  # (block_n, block_k, split_k, num_warps, num_stages)
    (16, 256, 1, 4, 3), (32, 256, 1, 4, 3), (32, 512, 1, 4, 3), (64, 256, 1, 8, 3),
    (64, 256, 1, 4, 4), (64, 256, 1, 4, 2), (128, 256, 1, 8, 3), (32, 256, 2, 4, 3),
    (64, 256, 2, 4, 3), (32, 256, 4, 4, 3), (64, 256, 4, 4, 3), (64, 128, 4, 4, 3),
    (16, 256, 2, 4, 3), (32, 128, 2, 4, 4),
]  # fmt: skip


def configs(fmt: str, batch: int, k: int, quick: bool, wide: bool = False) -> list[GroupedConfig]:
    """The small sweep of one point: gemv with one item per expert (block_m = tokens, which is the
    most rows a decode group can hold) at three tile shapes and one split-K, and dot_t at two;
    NVFP4 adds the word-decoded float16 formulations (dot_t_w at four tiles, dot_w and the joined
    dot_jw at two each); every format the streamed gemv_ws at four."""
    gemv_m = min(batch, 8)
    words = fmt == "nvfp4"
    if quick:
        out = [
            GroupedConfig("gemv", gemv_m, 32, 64),
            GroupedConfig("dot_t", 16, 32, 64),
            GroupedConfig("dot", 16, 32, 64),
        ]
        if words:  # a 128-element step is the word variants' shortest; longer than K only masks
            out += [
                GroupedConfig("dot_t_w", 16, 32, WORD_MIN_BLOCK_K),
                GroupedConfig("dot_w", 16, 32, WORD_MIN_BLOCK_K),
                GroupedConfig("dot_jw", 16, 32, WORD_MIN_BLOCK_K),
                GroupedConfig("gemv_h2w", gemv_m, 32, WORD_MIN_BLOCK_K),
            ]
        out.append(GroupedConfig("gemv_ws", gemv_m, 32, WORD_MIN_BLOCK_K if words else 64, programs=4))
        return out
    if fmt == "nvfp4":
        gemv_tiles, dot_tiles = [(32, 512), (64, 256), (16, 1024)], [(64, 256), (128, 256)]
    else:
        gemv_tiles, dot_tiles = [(32, 256), (64, 128), (16, 512)], [(64, 128), (128, 128)]
    if fmt == "fp8_block128":
        gemv_tiles = [(bn, min(bk, 128)) for bn, bk in gemv_tiles]
    kmax = 1 << (k - 1).bit_length()  # a K step longer than K only masks
    out = [GroupedConfig("gemv", gemv_m, bn, min(bk, kmax)) for bn, bk in gemv_tiles]
    if k >= 2048:  # long K loops: two programs per tile put more loads in flight
        out.append(GroupedConfig("gemv", gemv_m, gemv_tiles[0][0], gemv_tiles[0][1] // 2, split_k=2))
    out += [GroupedConfig("dot_t", 16, bn, min(bk, kmax)) for bn, bk in dot_tiles]
    if words:
        word_tiles = [
            ("dot_t_w", 64, 256),
            ("dot_t_w", 128, 256),
            ("dot_t_w", 64, 512),
            ("dot_t_w", 128, 512),
        ]
        word_tiles += [("dot_w", 64, 256), ("dot_w", 128, 512), ("dot_jw", 64, 256), ("dot_jw", 128, 512)]
        out += [GroupedConfig(v, 16, bn, max(WORD_MIN_BLOCK_K, min(bk, kmax))) for v, bn, bk in word_tiles]
        # the half2 word gemv, the item's rows unrolled: (block_n, block_k, split_k, num_warps)
        h2w_tiles = [(32, 512, 1, 8), (32, 512, 1, 4), (32, 256, 1, 4), (16, 512, 1, 4), (64, 512, 1, 8),
                     (32, 256, 2, 8)]  # fmt: skip
        out += [
            GroupedConfig("gemv_h2w", gemv_m, bn, max(WORD_MIN_BLOCK_K, min(bk, kmax)), split_k=sk, num_warps=w)
            for bn, bk, sk, w in h2w_tiles
            if k >= bk * sk
        ]
    # the dense layers' streamed gemv over the work items (8 KB weight tiles, as their 27B defaults)
    if words:
        streamed = [(32, 512, 8), (64, 512, 8), (32, 256, 4), (16, 1024, 8)]
    else:
        streamed = [(32, 256, 8), (64, 128, 8), (32, 128, 4), (16, 512, 8)]
    if fmt == "fp8_block128":
        streamed = [(bn, min(bk, 128), w) for bn, bk, w in streamed]
    low_k = WORD_MIN_BLOCK_K if words else 16
    out += [GroupedConfig("gemv_ws", gemv_m, bn, max(low_k, min(bk, kmax)), num_warps=w) for bn, bk, w in streamed]
    if wide and words:
        out += [
            GroupedConfig("dot_w", 16, bn, max(WORD_MIN_BLOCK_K, min(bk, kmax)), split_k=sk, num_warps=w, num_stages=st)
            for bn, bk, sk, w, st in WIDE_WORD_TILES
            if k >= bk * sk
        ]
    return list(dict.fromkeys(out))


def _calls_fn(static: dict, cfg: GroupedConfig | None, interpret: bool):
    """One jitted call over every routing: the kernel with `cfg`, or (None) the per-row gather
    reference, which is model/mlp.py's decode path today."""
    if cfg is None:
        one = functools.partial(reference_grouped_matmul, **static)
    else:
        one = functools.partial(grouped_matmul, **static, **cfg.as_kwargs(), interpret=interpret)
    return jax.jit(lambda routes, w: tuple(one(x, w, sizes) for x, sizes in routes))


def _compile(fns: dict, routes, weight, pool) -> dict:
    """{key: compiled or exception}: lowering here, XLA/Triton compiles in the thread pool."""
    lowered = {}
    for key, fn in fns.items():
        try:
            lowered[key] = fn.lower(routes, weight)
        except Exception as e:  # noqa: BLE001 - an invalid configuration: recorded, the run goes on
            lowered[key] = e
    futures = {k: pool.submit(low.compile) for k, low in lowered.items() if not isinstance(low, Exception)}
    out = {}
    for key in fns:
        try:
            out[key] = futures[key].result() if key in futures else lowered[key]
        except Exception as e:  # noqa: BLE001
            out[key] = e
    return out


def bench_projection(fmt, proj, n, k, batches, routings, args, *, shape, hbm, pool, machine, commit):
    """Records of one (format, projection) over batches x routing kinds; mismatches as strings."""
    weight, static, per_expert = random_stack(fmt, shape.num_experts, n, k, jax.random.key(n + k))
    records, mismatches = [], []
    for batch in batches:
        rng = np.random.default_rng(batch * 1000 + n)
        count = args.routings or routings_per_call(batch, shape, per_expert)
        by_kind = {}
        for kind in routings:
            steps = [
                sorted_rows(routing(rng, batch, shape, kind), k, shape.num_experts, jax.random.key(i))
                for i in range(count)
            ]
            by_kind[kind] = steps
        routes0 = tuple((x, sizes) for x, sizes, _ in by_kind[routings[0]])
        cfgs = configs(fmt, batch, k, args.quick, args.wide)
        if args.variants:  # an A/B of a few formulations: the rest of the sweep left out
            cfgs = [c for c in cfgs if c.variant in args.variants.split(",")]
        fns = {cfg: _calls_fn(static, cfg, args.interpret) for cfg in cfgs}
        fns[None] = _calls_fn(static, None, False)
        compiled = _compile(fns, routes0, weight, pool)  # shapes do not depend on the routing
        reference = compiled[None]
        for kind, steps in by_kind.items():
            routes = tuple((x, sizes) for x, sizes, _ in steps)
            distinct = sum(d for _, _, d in steps) / len(steps)
            want = reference(routes, weight) if not isinstance(reference, Exception) else None
            ready = [c for c in compiled.values() if not isinstance(c, Exception)]
            warm_gpu([lambda c=c, r=routes: c(r, weight) for c in ready[:1]])  # the GPU idled through the compiles
            table, best = [], None
            for cfg in cfgs:
                comp = compiled[cfg]
                row = dataclasses.asdict(cfg)
                if isinstance(comp, Exception):
                    table.append({**row, "error": f"{type(comp).__name__}: {str(comp)[:160]}"})
                    continue
                got = comp(routes, weight)
                rel = (
                    max(relative_error(g, w) for g, w in zip(got, want)) if want is not None else float("nan")
                )
                if not rel <= MAX_REL_ERR:
                    msg = f"{fmt} {proj} batch{batch} {kind} {cfg}: differs from the reference by {rel:.3g}"
                    print(f"  MISMATCH {msg}", file=sys.stderr)
                    mismatches.append(msg)
                    table.append({**row, "error": f"reference mismatch {rel:.3g}"})
                    continue
                seconds = _time_compiled(comp, routes, weight, len(routes))
                table.append({**row, "s": seconds, "rel_err": rel})
                if best is None or seconds < best[0]:
                    best = (seconds, cfg, rel)
            if best is None:
                print(f"  {fmt} {proj} batch{batch} {kind}: no configuration ran and matched the reference")
                continue
            xla_s = None
            if not isinstance(reference, Exception):
                xla_s = _time_compiled(reference, routes, weight, len(routes))
            seconds, cfg, rel = best
            read = distinct * per_expert
            name = (
                f"moe grouped matmul qwen3-next-80b {proj} {n}x{k} {fmt} batch{batch} top{shape.top_k} {kind}"
            )
            records.append(
                make_record(
                    name,
                    read / seconds / 1e9,
                    "GB/s",
                    hbm.figure,
                    "GB/s",
                    machine=machine,
                    commit=commit,
                    details={
                        "n": n,
                        "k": k,
                        "num_experts": shape.num_experts,
                        "top_k": shape.top_k,
                        "batch": batch,
                        "routing": kind,
                        "format": fmt,
                        "mean_distinct_experts": distinct,
                        "bytes_per_expert": per_expert,
                        "bytes_read": read,
                        "median_s": seconds,
                        "max_rel_err_vs_reference": rel,
                        "config": dataclasses.asdict(cfg),
                        "xla_gather_s": xla_s,
                        "routings_per_call": len(routes),
                        "sweep": sorted(table, key=lambda r: r.get("s", 1e9)),
                        "interpret": args.interpret,
                        "jax": jax.__version__,
                    },
                )
            )
            rec = records[-1]
            xla = f"{read / xla_s / 1e9:7.1f}" if xla_s else "   -   "
            print(
                f"{fmt:12s} {proj:8s} b{batch} {kind:8s} {distinct:5.1f} experts  {rec.figure:7.1f} GB/s "
                f"{rec.fraction:6.1%}  {seconds * 1e6:7.1f} us  (gather+dequant {xla} GB/s)  best {cfg}",
                flush=True,
            )
    return records, mismatches


def main(argv: list[str] | None = None) -> list:
    parser = argparse.ArgumentParser(prog="python -m bench.moe_kernels", description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="tiny shapes, interpret mode: a smoke run anywhere"
    )
    parser.add_argument("--formats", default="nvfp4,fp8", help="nvfp4, fp8, fp8_block128")
    parser.add_argument("--batches", default=None, help="decode batches (default 1,2,4,8; --quick 1,2)")
    parser.add_argument("--routing", default="uniform,skewed")
    parser.add_argument("--routings", type=int, default=None, help="routings per timed call")
    parser.add_argument("--wide", action="store_true", help="NVFP4: also the word-decoded dots at more tiles")
    parser.add_argument("--variants", default=None, help="only these formulations of the sweep (e.g. dot_w,gemv_h2w)")
    parser.add_argument("--compile-threads", type=int, default=8)
    parser.add_argument("--out", help="output file (default: bench/results/moe-kernels-<machine>.json)")
    args = parser.parse_args(argv)
    if not args.quick and jax.default_backend() == "cpu":
        raise SystemExit("python -m bench.moe_kernels times the GPU kernel: run it on a GPU, or pass --quick")
    args.interpret = args.quick
    args.routings = args.routings or (QUICK_ROUTINGS if args.quick else None)
    shape = QUICK_SHAPE if args.quick else QWEN3_NEXT_80B
    batches = [int(b) for b in (args.batches or ("1,2" if args.quick else "1,2,4,8")).split(",")]
    routings = args.routing.split(",")
    machine, commit = machine_name(), git_commit()
    slug = machine_slug(machine)
    out_path = args.out or f"moe-kernels-{slug}{'-quick' if args.quick else ''}.json"
    t0 = time.perf_counter()
    hbm = measure_hbm_read(QUICK if args.quick else Sizes())
    print(f"{hbm.name}: {hbm.figure:.1f} GB/s")
    records, mismatches, path = [], [], None
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, args.compile_threads)) as pool:
        for fmt in args.formats.split(","):
            for proj, (n, k) in shape.projections.items():
                recs, bad = bench_projection(
                    fmt,
                    proj,
                    n,
                    k,
                    batches,
                    routings,
                    args,
                    shape=shape,
                    hbm=hbm,
                    pool=pool,
                    machine=machine,
                    commit=commit,
                )
                records += recs
                mismatches += bad
                if records:
                    path = write_records(
                        records, out_path
                    )  # after every projection: a timeout keeps what ran
    print(f"wrote {path} ({len(records)} records, {time.perf_counter() - t0:.0f} s)")
    if mismatches:
        raise AssertionError("kernel results differ from the reference:\n" + "\n".join(mismatches))
    if not records:
        raise RuntimeError("no configuration ran: nothing was measured")
    return records


if __name__ == "__main__":
    main()
