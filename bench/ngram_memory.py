"""N-gram memory tables on disk: lookup rows/s cold and warm, and batch-1 decode from disk vs RAM.

    python -m bench.ngram_memory                         # GPU: a >= 16 GiB table under $TMPDIR, moe shape
    python -m bench.ngram_memory --dir /nvme/tmp --table-gib 16 --decode-tokens 64
    python -m bench.ngram_memory --quick                 # tiny model and table, any machine

One table is written as a volume (TensorStore zarr3 on local disk, under --dir) and the same table
is built in RAM. After writing, the volume's pages are flushed and dropped from the OS page cache
(fsync + POSIX_FADV_DONTNEED), so "cold" reads really reach the disk.

Records (bench/results/ngram-memory-<machine>.json), each with the RAM figure as its ceiling:
- "ngram lookup cold ...": rows/s of prefill-sized lookups from the volume with an empty host cache;
  ceiling: the same lookups gathered from the table in RAM. fraction = disk / RAM.
- "ngram lookup warm ...": the same lookups again (served by the host cache).
- "ngram decode batch1 cold ...": engine decode tok/s (one request, the model's memory reading the
  volume, host cache empty); ceiling: the same decode with the table in RAM. fraction = disk / RAM.
- "ngram decode batch1 warm ...": the same request again (its n-grams are now in the host cache).
Targets (issue 11): warm fraction >= 0.9, cold >= 0.7.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench.engine_setup import SHAPES, place_prompts_without_compute
from bench.record import git_commit, machine_name, machine_slug, make_record, write_records
from infernix_jax.cache import BLOCK_SIZE
from infernix_jax.config import ModelConfig
from infernix_jax.engine.config import EngineConfig
from infernix_jax.engine.core import EngineCore
from infernix_jax.model.params import init_params
from infernix_jax.ngram.memory import NgramTable
from infernix_jax.ngram.rows import ArrayRows
from infernix_jax.ngram.volume import expected_shape, open_volume, table_dtype, write_volume

ROW_WIDTH = 64  # values per row (Engram's demo: 512 per order / 8 heads)
HEADS_PER_ORDER = 8
ORDERS = (2, 3)


def memory_config(shape: str, table_bytes: int, dtype_name: str) -> ModelConfig:
    """`shape`'s model with a two-layer n-gram memory whose table holds about `table_bytes`."""
    raw = dict(SHAPES[shape])
    layers = [1, raw["num_hidden_layers"] // 2]
    row_bytes = ROW_WIDTH * table_dtype(dtype_name).itemsize
    raw["ngram_memory"] = {
        "orders": list(ORDERS),
        "heads_per_order": HEADS_PER_ORDER,
        "table_rows": int(table_bytes // row_bytes // len(layers)),
        "row_width": ROW_WIDTH,
        "layers": layers,
        "table_dtype": dtype_name,
    }
    return ModelConfig.from_hf_config(raw)


class RandomBf16Rows:
    """Random rows generated one range at a time from a seed (fast: bit patterns of +-[0.5, 1))."""

    def __init__(self, shape: tuple[int, int], dtype: np.dtype, seed: int = 0):
        self.shape, self.dtype, self.seed = shape, dtype, seed

    def __getitem__(self, rows: slice) -> np.ndarray:
        start, stop, _ = rows.indices(self.shape[0])
        bits = np.random.default_rng([self.seed, start]).integers(
            0, 1 << 16, (stop - start, self.shape[1]), np.uint16
        )
        if self.dtype.itemsize == 2:
            return ((bits & 0x807F) | 0x3F00).view(self.dtype)  # bf16: sign, exponent of 0.5, 7 mantissa bits
        return (bits.astype(np.float32) / (1 << 16) - 0.5).astype(self.dtype)


def drop_page_cache(root: Path) -> bool:
    """fsync every file under root and ask the kernel to drop its pages; False where unsupported."""
    if not hasattr(os, "posix_fadvise"):
        return False
    for path in root.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
    return True


def lookup_rate(table: NgramTable, windows: list[list[int]]) -> float:
    """Rows per second of looking up every window (as one prefill chunk each)."""
    rows = 0
    start = time.perf_counter()
    for tokens in windows:
        rows += table.rows(tokens, 0, len(tokens)).shape[0] * len(tokens) * table.spec.num_heads
    return rows / (time.perf_counter() - start)


def engine(cfg, params, table: NgramTable, context: int, tokens: int) -> EngineCore:
    total = context + 2 * tokens + 1
    config = EngineConfig(
        max_concurrency=1, max_context=total, kv_capacity=math.ceil(total / BLOCK_SIZE) + 1,
        prefill_chunk=64, prefill_shape_override=((1, 64),), decode_batch_sizes=(1,),
        compilation_cache_dir=None, progress=False, warmup=False, prefix_cache=False,
    )  # fmt: skip
    return EngineCore(cfg, params, config, ngram_table=table)


def decode_rate(core: EngineCore, context: int, tokens: int, seed: int) -> float:
    """tok/s of one request decoding `tokens` tokens after a `context`-token prompt (KV not computed:
    decode cost does not depend on its values; the n-gram rows do depend on the tokens)."""
    place_prompts_without_compute(core, 1, context, seed=seed)
    [state] = core.scheduler.running
    state.max_total = context + tokens
    core.step()  # the first step compiles (once per process) and is not timed
    produced = core.metrics.generated_tokens
    start = time.perf_counter()
    while core.has_work():
        core.step()
    return (core.metrics.generated_tokens - produced) / (time.perf_counter() - start)


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--dir", default=os.environ.get("TMPDIR", tempfile.gettempdir()), help="where the volume is written"
    )
    parser.add_argument(
        "--table-gib", type=float, default=16.0, help="table size in GiB (>= 16 for the record)"
    )
    parser.add_argument("--shape", default="moe", choices=sorted(SHAPES))
    parser.add_argument("--context", type=int, default=1024, help="prompt tokens before decode")
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--lookup-windows", type=int, default=16, help="prefill-sized lookups timed")
    parser.add_argument("--window", type=int, default=512, help="tokens per lookup")
    parser.add_argument("--cache-gib", type=float, default=4.0, help="host cache of hot rows")
    parser.add_argument("--keep", action="store_true", help="keep the volume afterwards")
    parser.add_argument("--quick", action="store_true", help="tiny model and table (any machine)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.table_gib, args.shape, args.context, args.decode_tokens = 1 / 256, "tiny", 64, 32
        args.lookup_windows, args.window, args.cache_gib = 4, 64, 1 / 64
    machine, commit = machine_name(), git_commit()
    on_cpu = jax.default_backend() == "cpu"
    cfg = memory_config(args.shape, int(args.table_gib * 2**30), "float32" if on_cpu else "bfloat16")
    spec = cfg.ngram_memory
    root = Path(args.dir) / f"ngram-bench-{os.getpid()}"
    records = []
    try:
        shape = expected_shape(cfg)
        dtype = table_dtype(spec.table_dtype)
        source = RandomBf16Rows(shape, dtype)
        gib = shape[0] * shape[1] * dtype.itemsize / 2**30
        t0 = time.perf_counter()
        write_volume(root, cfg, source)
        write_s = time.perf_counter() - t0
        dropped = drop_page_cache(root)
        print(f"volume {shape[0]} x {shape[1]} {dtype.name} = {gib:.2f} GiB written in {write_s:.1f} s "
              f"({'page cache dropped' if dropped else 'page cache NOT dropped'})", flush=True)  # fmt: skip
        t0 = time.perf_counter()
        ram_table = np.empty(shape, dtype)
        step = 1 << 20
        for start in range(0, shape[0], step):
            ram_table[start : start + step] = source[start : min(shape[0], start + step)]
        print(f"the same table in RAM in {time.perf_counter() - t0:.1f} s", flush=True)
        cache_bytes = int(args.cache_gib * 2**30)
        in_ram = NgramTable(cfg, ArrayRows(ram_table), cache_bytes=0)
        on_disk = NgramTable(cfg, open_volume(root, cfg), cache_bytes=cache_bytes)
        rng = np.random.default_rng(1)
        windows = [rng.integers(0, cfg.vocab_size, args.window).tolist() for _ in range(args.lookup_windows)]
        label = f"{gib:.0f}GiB rows{shape[1]}x{dtype.itemsize}B window{args.window}"
        lookup_rate(in_ram, windows[:1])  # first-call costs outside the timing
        ram_rate = lookup_rate(in_ram, windows)
        cold = lookup_rate(on_disk, windows)
        warm = lookup_rate(on_disk, windows)
        common = {"table_gib": gib, "write_s": write_s, "page_cache_dropped": dropped, "window": args.window,
                  "rows_per_lookup": args.window * spec.num_heads * len(spec.layers)}  # fmt: skip
        for kind, rate in (("cold", cold), ("warm", warm)):
            records.append(make_record(f"ngram lookup {kind} {label}", rate, "rows/s", ram_rate, "rows/s",
                                       machine=machine, commit=commit, details=dict(common)))  # fmt: skip
        dtype_model = jnp.float32 if on_cpu else jnp.bfloat16
        params = init_params(cfg, jax.random.key(0), dtype_model, with_mtp=False)
        on_disk = NgramTable(cfg, open_volume(root, cfg), cache_bytes=cache_bytes)  # an empty host cache
        drop_page_cache(root)
        disk_core = engine(cfg, params, on_disk, args.context, args.decode_tokens)
        ram_core = engine(cfg, params, in_ram, args.context, args.decode_tokens)
        decode_rate(ram_core, args.context, 2, seed=99)  # compile outside the timed runs
        ram_tps = decode_rate(ram_core, args.context, args.decode_tokens, seed=2)
        runs = {}
        for kind in ("cold", "warm"):
            # the warm run is the same request on a fresh engine over the same table (its host cache now
            # holds the cold run's rows): a fresh engine, because a reused state slot keeps the last
            # request's recurrent state (the prompts are not prefilled), which would change the tokens
            fresh = kind == "warm"
            core = engine(cfg, params, on_disk, args.context, args.decode_tokens) if fresh else disk_core
            before = dataclasses.replace(on_disk.cache.stats)
            tps = decode_rate(core, args.context, args.decode_tokens, seed=2)
            hits, misses = on_disk.cache.stats.hits - before.hits, on_disk.cache.stats.misses - before.misses
            runs[kind] = (tps, hits / max(1, hits + misses))
        decode_label = f"{args.shape} {gib:.0f}GiB ctx{args.context}"
        for kind, (tps, hit_rate) in runs.items():
            records.append(make_record(
                f"ngram decode batch1 {kind} {decode_label}", tps, "tok/s", ram_tps, "tok/s", machine=machine,
                commit=commit, details={**common, "decode_tokens": args.decode_tokens,
                                        "host_cache_hit_rate": hit_rate},
            ))  # fmt: skip
        for r in records:
            print(
                f"{r.name}: {r.figure:,.1f} {r.unit} = {r.fraction:.1%} of RAM's {r.ceiling:,.1f}", flush=True
            )
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    slug = machine_slug(machine)
    print(
        "wrote",
        write_records(records, args.out or f"ngram-memory-{slug}{'-quick' if args.quick else ''}.json"),
    )
    return records


if __name__ == "__main__":
    main()
