"""Where the NVFP4 decode matmul's time goes: the same tiling with less and less work per byte.

    python -m bench.kernel_bounds                 # GPU, ~2-3 min: 27B gate_up and down, batch 1
    python -m bench.kernel_bounds --shapes 34816x5120 --probes read,decode,dot_t_w
    python -m bench.kernel_bounds --quick         # interpret mode, tiny shape, any machine

The NVFP4 decode kernels (pallas_kernels/nvfp4_matmul.py) stream packed weights at 14-27% of
HBM bandwidth on the H200 while XLA's bf16 dot streams at ~85%. Each probe below walks the same
grid (one program per `block_n` weight rows, a K loop of `block_k` elements) and adds one piece
of the real kernel's work, so the step where GB/s falls names the bound:

    read       load the uint32 words and the uint8 block scales, xor/add them (no decode)
    read_pf    the same with the next step's loads issued before this step's xor (loop carry)
    decode     + the word decode to float16 and the block-scale multiply, summed elementwise
    gemv_w     a real kernel (nvfp4_matmul "gemv_w": + the products with x on CUDA cores)
    gemv_wp    a real kernel (gemv_w with the next step's loads issued early, as read_pf)
    gemv_ws    a real kernel (gemv_wp's work streamed: a fixed grid of two programs per SM, each
               walking an equal run of (row tile, K step) units, loads one unit ahead)
    dot_t_w    a real kernel (nvfp4_matmul "dot_t_w": + 8 float16 dots per K step instead)
    bf16_dot   plain bf16 weights through the same dot_t structure (Triton's dense streaming)
    bf16_gemv  plain bf16 weights, float32 FMAs on CUDA cores (no tensor cores)
    xla_bf16   XLA's bf16 dot on the bf16 weight (cuBLAS: the rate we know is reachable)

Figures are bytes of weights (+ scales) per second, timed as bench.kernels' sweep times them
(several weight copies per call so L2 cannot serve them, calls queued, one sync per trial),
against the HBM read rate measured in the same run. For each probe a small tile grid is tried
and the best kept; every configuration's time is in the record's details.
Records: bench/results/kernel-bounds-<machine>.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import itertools
import time

import jax
import jax.numpy as jnp

from bench.ceilings import QUICK, Sizes, measure_hbm_read
from bench.kernels import L2_DEFEAT_BYTES, MAX_COPIES, _time_compiled
from bench.record import git_commit, machine_name, machine_slug, make_record, write_records
from pallas_kernels import _quant_common as qc
from pallas_kernels import compat
from pallas_kernels.nvfp4_matmul import nvfp4_matmul

PROBES = (
    "read", "read_pf", "decode", "gemv_w", "gemv_wp", "gemv_ws", "dot_t_w", "bf16_dot", "bf16_gemv", "xla_bf16"
)  # fmt: skip
DEFAULT_SHAPES = "34816x5120,5120x17408"  # Qwen3.5-27B gate_up and down ([N, K])
# (block_n, bytes of one weight row per K step, num_warps, num_stages)
TILES = [
    (bn, row_bytes, w, s) for bn, row_bytes, w, s in itertools.product((64, 128), (256, 512), (4, 8), (3, 4))
]
QUICK_TILES = [(32, 128, 4, 3)]


def _probe_kernel(words_ref, scale_ref, out_ref, *, probe: str, block_n: int, block_w: int, steps: int):
    """read / read_pf / decode: one program's [block_n] rows, K in steps of block_w words (shapes
    divide). Every probe loads each step's words and scale bits once; read_pf loads step t + 1
    before folding step t in (carried through the loop)."""
    j = compat.program_id(0)
    rows = compat.ds(j * block_n, block_n)

    def load_step(t):
        t = jnp.minimum(t, steps - 1)  # read_pf's load past the last step reloads it
        words = compat.load(words_ref.at[rows, compat.ds(t * block_w, block_w)])
        return words, compat.load(scale_ref.at[rows, compat.ds(t * (block_w // 2), block_w // 2)])

    def fold(acc, extra, words, bits):
        if probe != "decode":  # the bytes only: xor the words, add the scale bits
            return acc ^ words, extra + bits.astype(jnp.uint32)
        scale = jax.lax.bitcast_convert_type(bits, jnp.float8_e4m3fn).astype(jnp.float16)
        scale = jnp.broadcast_to(scale[:, :, None], (block_n, block_w // 2, 2)).reshape(block_n, block_w)
        for w in qc.e2m1_word_f16(words):
            acc = acc + w * scale
        return acc, extra

    acc = jnp.zeros((block_n, block_w), jnp.float16 if probe == "decode" else jnp.uint32)
    extra = jnp.zeros((block_n, block_w // 2), jnp.uint32)
    if probe == "read_pf":

        def body(t, carry):
            return (*fold(*carry), *load_step(t + 1))

        acc, extra, _, _ = jax.lax.fori_loop(0, steps, body, (acc, extra, *load_step(0)))
    else:
        acc, extra = jax.lax.fori_loop(0, steps, lambda t, c: fold(*c, *load_step(t)), (acc, extra))
    out = acc.astype(jnp.float32).sum(axis=1) + extra.sum(axis=1).astype(jnp.float32)
    compat.store(out_ref.at[rows], out)


def _bf16_kernel(x_ref, w_ref, out_ref, *, probe: str, block_n: int, block_k: int, steps: int, m: int):
    """bf16_dot: acc [block_n, 16] += W [block_n, bk] @ x.T (x rows past m masked); bf16_gemv:
    float32 FMAs into a [block_n, bk] accumulator, summed once after the loop."""
    j = compat.program_id(0)
    rows = compat.ds(j * block_n, block_n)

    def body(t, acc):
        w = compat.load(w_ref.at[rows, compat.ds(t * block_k, block_k)])
        if probe == "bf16_dot":
            x_mask = (jnp.arange(16) < m)[:, None] & jnp.ones((1, block_k), bool)
            x = compat.load(x_ref.at[compat.ds(0, 16), compat.ds(t * block_k, block_k)], mask=x_mask, other=0)
            return acc + jax.lax.dot_general(w, x, qc.dims_nt(), preferred_element_type=jnp.float32)
        x = compat.load(x_ref.at[compat.ds(0, 1), compat.ds(t * block_k, block_k)]).astype(jnp.float32)
        return acc + w.astype(jnp.float32) * x

    shape = (block_n, 16) if probe == "bf16_dot" else (block_n, block_k)
    acc = jax.lax.fori_loop(0, steps, body, jnp.zeros(shape, jnp.float32))
    compat.store(out_ref.at[rows], acc.sum(axis=1))


def probe_fn(probe: str, n: int, k: int, tiles: tuple[int, int, int, int], interpret: bool):
    """A function (x, weight args) -> output for one probe and tiling, and the weight's bytes."""
    if probe == "xla_bf16":
        return lambda x, w: jnp.dot(x, w.T, preferred_element_type=jnp.float32)
    block_n, row_bytes, warps, stages = tiles
    params = compat.triton_compiler_params(num_warps=warps, num_stages=stages)
    grid = (n // block_n,)
    if probe in ("read", "read_pf", "decode"):
        block_w = row_bytes // 4
        kernel = functools.partial(
            _probe_kernel, probe=probe, block_n=block_n, block_w=block_w, steps=(k // 8) // block_w
        )
        call = compat.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct((n,), jnp.float32), grid=grid,
            compiler_params=params, interpret=interpret, name=f"bound_{probe}",
        )  # fmt: skip

        def run(x, words, scale_bits, tensor_scale):
            return call(words, scale_bits)

        return run
    if probe in ("dot_t_w", "gemv_w", "gemv_wp", "gemv_ws"):
        opts = dict(variant=probe, block_n=block_n, block_k=row_bytes * 2, split_k=1)  # noqa: C408
        opts.update(num_warps=warps, num_stages=stages, interpret=interpret)

        def run(x, words, scale_bits, tensor_scale):
            packed = jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(n, k // 2)
            scale = jax.lax.bitcast_convert_type(scale_bits, jnp.float8_e4m3fn)
            return nvfp4_matmul(x, packed, scale, tensor_scale, **opts)

        return run
    if probe in ("bf16_dot", "bf16_gemv"):
        block_k = row_bytes // 2
        kernel = functools.partial(
            _bf16_kernel, probe=probe, block_n=block_n, block_k=block_k, steps=k // block_k, m=1
        )
        call = compat.pallas_call(
            kernel, out_shape=jax.ShapeDtypeStruct((n,), jnp.float32), grid=grid,
            compiler_params=params, interpret=interpret, name=f"bound_{probe}",
        )  # fmt: skip
        return lambda x, w: call(x, w)
    raise ValueError(f"probe={probe!r} must be one of {PROBES}")


def _weights(probe: str, n: int, k: int, copies: int):
    """Per copy: the probe's weight args and their bytes (NVFP4 words + scales, or bf16)."""
    out = []
    for c in range(copies):
        k1, k2 = jax.random.split(jax.random.key(c))
        if probe.startswith(("bf16", "xla")):
            w = jax.random.normal(k1, (n, k), jnp.bfloat16)
            out.append(((w,), w.nbytes))
            continue
        words = jax.random.bits(k1, (n, k // 8), jnp.uint32)
        scale = jax.random.uniform(k2, (n, k // 16), jnp.float32, 0.01, 4.0).astype(jnp.float8_e4m3fn)
        bits = jax.lax.bitcast_convert_type(scale, jnp.uint8)
        out.append(((words, bits, jnp.float32(0.01)), words.nbytes + bits.nbytes))
    return out


def bench_probe(probe, n, k, tiles_list, *, interpret, pool, copy_bytes):
    """{tiles: seconds or error} and the bytes one matmul reads."""
    one_copy = n * k * 2 if probe.startswith(("bf16", "xla")) else n * k // 2 + n * k // 16
    copies = max(1, min(MAX_COPIES, -(-copy_bytes // one_copy)))
    weights = _weights(probe, n, k, copies)
    ws = tuple(w for w, _ in weights)
    xs = tuple(jax.random.normal(jax.random.key(100 + c), (1, k), jnp.bfloat16) for c in range(copies))
    tiles_list = [None] if probe == "xla_bf16" else tiles_list
    lowered = {}
    for tiles in tiles_list:
        fn = probe_fn(probe, n, k, tiles, interpret)
        try:
            lowered[tiles] = jax.jit(lambda xs, ws, fn=fn: tuple(fn(x, *w) for x, w in zip(xs, ws))).lower(
                xs, ws
            )
        except Exception as e:  # noqa: BLE001 - a tiling this shape cannot take: recorded
            lowered[tiles] = e
    futures = {t: pool.submit(low.compile) for t, low in lowered.items() if not isinstance(low, Exception)}
    results = {}
    for tiles, low in lowered.items():
        try:
            if isinstance(low, Exception):
                raise low
            results[tiles] = _time_compiled(futures[tiles].result(), xs, ws, copies)
        except Exception as e:  # noqa: BLE001
            results[tiles] = f"{type(e).__name__}: {str(e)[:160]}"
    return results, weights[0][1], copies


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(
        prog="python -m bench.kernel_bounds", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--shapes", default=DEFAULT_SHAPES, help="NxK weight shapes, comma separated")
    parser.add_argument("--probes", default=",".join(PROBES))
    parser.add_argument(
        "--quick", action="store_true", help="tiny shape, interpret mode: a smoke run anywhere"
    )
    parser.add_argument("--out", help="output file (default: bench/results/kernel-bounds-<machine>.json)")
    args = parser.parse_args(argv)
    interpret = args.quick or jax.default_backend() == "cpu"
    sizes = QUICK if args.quick else Sizes()
    shapes = "256x512" if args.quick else args.shapes
    tiles_list = QUICK_TILES if args.quick else TILES
    copy_bytes = 0 if args.quick else L2_DEFEAT_BYTES
    machine, commit = machine_name(), git_commit()
    hbm = measure_hbm_read(sizes)
    print(f"{hbm.name}: {hbm.figure:.1f} GB/s", flush=True)
    records = []
    slug = machine_slug(machine)
    out = args.out or f"kernel-bounds-{slug}{'-quick' if args.quick else ''}.json"
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        for shape in shapes.split(","):
            n, k = (int(v) for v in shape.split("x"))
            for probe in args.probes.split(","):
                start = time.perf_counter()
                results, nbytes, copies = bench_probe(
                    probe, n, k, tiles_list, interpret=interpret, pool=pool, copy_bytes=copy_bytes
                )
                timed = sorted((s, t) for t, s in results.items() if isinstance(s, float))
                if not timed:
                    print(f"{probe} {shape}: nothing ran: {results}", flush=True)
                    continue
                seconds, tiles = timed[0]
                rec = make_record(
                    f"bound probe {shape} {probe} batch1", nbytes / seconds / 1e9, "GB/s", hbm.figure, "GB/s",
                    machine=machine, commit=commit, details={
                        "n": n, "k": k, "probe": probe, "bytes": nbytes, "median_s": seconds,
                        "weight_copies": copies, "interpret": interpret, "jax": jax.__version__,
                        "tiles": None if tiles is None else dict(
                            zip(("block_n", "row_bytes_per_step", "num_warps", "num_stages"), tiles)
                        ),
                        "sweep": [{"tiles": list(t) if t else None, "result": r} for t, r in results.items()],
                    },
                )  # fmt: skip
                records.append(rec)
                print(
                    f"{rec.name:50s} {rec.figure:8.1f} GB/s {rec.fraction:6.1%} of HBM  tiles {tiles}"
                    f"  ({time.perf_counter() - start:.0f} s)", flush=True,
                )  # fmt: skip
                write_records(records, out)
    print("wrote", write_records(records, out))
    return records


if __name__ == "__main__":
    main()
