"""The machine's physical ceilings, measured the same way for every benchmark.

    python -m bench.ceilings            # full sizes; writes bench/results/ceilings-<machine>.json
    python -m bench.ceilings --quick    # small sizes, runs anywhere (the CPU in tests)

What is measured (each timed after warm-up as the median of repeats, on random data):

- HBM read bandwidth: a jitted sum over a >= 4 GiB bf16 array (bytes read / time). The ceiling
  for memory-bound work such as decode (bytes that must be read per token).
- Copy bandwidth: a jitted elementwise op on the same array (bytes read + written / time).
- Tensor-core rate: an 8192^3 matmul in bf16 and in fp8 e4m3 (2 n^3 / time), both operands
  row-major with the contraction on the last axis (the layout cuBLASLt's fp8 path wants).
- Host -> device bandwidth: device_put of a >= 1 GiB array held in pinned host memory.

Other benchmarks import `measure_ceilings` (or one of the measure_* functions) and report their
figures as a fraction of what these return in the same run. The records written here compare
each ceiling with the vendor's datasheet peak where this module knows the device.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp

from bench.record import BenchRecord, git_commit, machine_name, machine_slug, make_record, write_records

GiB = 1 << 30


@dataclass(frozen=True)
class Sizes:
    """How big each measurement is; the full sizes are the ones DESIGN.md fixes."""

    read_bytes: int = 4 * GiB
    copy_bytes: int = 4 * GiB
    matmul_n: int = 8192
    host_bytes: int = 1 * GiB
    warmup: int = 2
    repeats: int = 10


QUICK = Sizes(
    read_bytes=64 << 20, copy_bytes=64 << 20, matmul_n=512, host_bytes=64 << 20, warmup=1, repeats=3
)


@dataclass(frozen=True)
class Measurement:
    """One ceiling: the rate in base units (bytes/s or FLOP/s) and how it was obtained."""

    key: str  # "hbm_read", "copy", "matmul_bf16", "matmul_fp8", "host_to_device"
    name: str  # the record name, sizes in words
    rate: float  # bytes/s or FLOP/s
    unit: str  # display unit of `figure`
    scale: float  # base units per display unit (1e9 for GB/s, 1e12 for TFLOP/s)
    seconds: list[float] = field(default_factory=list)  # every timed repeat
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def figure(self) -> float:
        return self.rate / self.scale


# Vendor datasheet peaks (dense, no sparsity), in display units, by a substring of device_kind.
# They are context for the measured ceilings, never a substitute for them.
DATASHEET: dict[str, dict[str, float]] = {
    "H200": {
        "hbm_read": 4800.0,
        "copy": 4800.0,
        "matmul_bf16": 989.4,
        "matmul_fp8": 1978.9,
        "host_to_device": 64.0,
    },
    "H100": {
        "hbm_read": 3350.0,
        "copy": 3350.0,
        "matmul_bf16": 989.4,
        "matmul_fp8": 1978.9,
        "host_to_device": 64.0,
    },
}


def median_seconds(fn: Callable[[], Any], warmup: int, repeats: int) -> list[float]:
    """Run fn warmup times, then time `repeats` runs to completion; returns all timings (seconds)."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    timings = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        timings.append(time.perf_counter() - start)
    return timings


def relative_error(got: jax.Array, want: jax.Array) -> float:
    """max |got - want| over max |want| (float32): how a kernel's output is checked against its
    reference before its time counts."""
    got, want = got.astype(jnp.float32), want.astype(jnp.float32)
    return float(jnp.max(jnp.abs(got - want)) / jnp.maximum(jnp.max(jnp.abs(want)), 1e-30))


def _random_bf16(num_bytes: int, seed: int, columns: int = 8192) -> jax.Array:
    rows = max(1, num_bytes // (2 * columns))
    return jax.jit(lambda key: jax.random.normal(key, (rows, columns), jnp.bfloat16))(jax.random.key(seed))


def _bandwidth(key: str, name: str, moved_bytes: int, timings: list[float], **details) -> Measurement:
    seconds = statistics.median(timings)
    return Measurement(
        key,
        name,
        moved_bytes / seconds,
        "GB/s",
        1e9,
        timings,
        {"bytes_moved": moved_bytes, "median_s": seconds, **details},
    )


def _size_words(num_bytes: int) -> str:
    return f"{num_bytes / GiB:g}GiB" if num_bytes >= GiB else f"{num_bytes >> 20}MiB"


def measure_hbm_read(sizes: Sizes = Sizes()) -> Measurement:
    """The HBM's read rate as the fastest of three probes over one bf16 array: a float32-accumulated
    full sum (to a scalar), a sum of each row (XLA's codegen for the two differs), and an elementwise
    copy counted as the bytes it reads and writes. Each is a lower bound on what the memory can
    stream, so their maximum is the tightest one, and a figure over it cannot flatter a kernel.
    Why three: on the H200 the full sum alone read anywhere from 2.8 to 3.8 TB/s between runs, below
    what the paged attention kernel read in the same run (docs/pallas.md), and the better of the two
    sums 2.39 to 3.85 TB/s in three runs of one session on one H200 whose decode rates stayed within
    2% (docs/gpu_runs.md)."""
    x = _random_bf16(sizes.read_bytes, seed=1)
    probes = {  # name: (program, bytes it moves)
        "full sum": (jax.jit(lambda a: jnp.sum(a, dtype=jnp.float32)), x.nbytes),
        "row sums": (jax.jit(lambda a: jnp.sum(a, axis=1, dtype=jnp.float32)), x.nbytes),
        "copy": (jax.jit(lambda a: a * jnp.bfloat16(1.5)), 2 * x.nbytes),
    }
    timed = {
        name: median_seconds(lambda fn=fn: fn(x), sizes.warmup, sizes.repeats)
        for name, (fn, _) in probes.items()
    }
    rates = {name: probes[name][1] / statistics.median(t) for name, t in timed.items()}
    best = max(rates, key=rates.get)
    return _bandwidth(
        "hbm_read",
        f"ceiling hbm read bf16 sum {_size_words(x.nbytes)}",
        probes[best][1],
        timed[best],
        shape=list(x.shape),
        probe=best,
        probe_GBps={name: rate / 1e9 for name, rate in rates.items()},
    )


def measure_copy(sizes: Sizes = Sizes()) -> Measurement:
    """Bytes read + written per second by a jitted elementwise op (a new output array)."""
    x = _random_bf16(sizes.copy_bytes, seed=2)
    scale = jax.jit(lambda a: a * jnp.bfloat16(1.5))
    timings = median_seconds(lambda: scale(x), sizes.warmup, sizes.repeats)
    return _bandwidth(
        "copy",
        f"ceiling copy bf16 elementwise {_size_words(x.nbytes)}",
        2 * x.nbytes,
        timings,
        shape=list(x.shape),
    )


def measure_matmul(dtype: Any, sizes: Sizes = Sizes()) -> Measurement:
    """FLOP/s of an n^3 matmul in dtype (bf16 or float8_e4m3fn), bf16 output, f32 accumulation."""
    n = sizes.matmul_n
    a = _random_bf16(n * n * 2, seed=3, columns=n).astype(dtype)
    b = _random_bf16(n * n * 2, seed=4, columns=n).astype(dtype)
    contract_last = (((1,), (1,)), ((), ()))
    matmul = jax.jit(
        lambda x, y: jax.lax.dot_general(x, y, contract_last, preferred_element_type=jnp.bfloat16)
    )
    timings = median_seconds(lambda: matmul(a, b), sizes.warmup, sizes.repeats)
    seconds = statistics.median(timings)
    label = "fp8" if jnp.dtype(dtype).itemsize == 1 else "bf16"
    return Measurement(
        f"matmul_{label}",
        f"ceiling matmul {label} {n}^3",
        2 * n**3 / seconds,
        "TFLOP/s",
        1e12,
        timings,
        {"n": n, "dtype": jnp.dtype(dtype).name, "median_s": seconds},
    )


def measure_host_to_device(sizes: Sizes = Sizes()) -> Measurement:
    """Bytes per second of device_put from a pinned-host array to device memory."""
    device = jax.devices()[0]
    x = _random_bf16(sizes.host_bytes, seed=5)
    source = "pinned_host"
    try:
        host = jax.device_put(x, jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host"))
        target = jax.sharding.SingleDeviceSharding(device, memory_kind="device")
    except (ValueError, RuntimeError, NotImplementedError):  # a backend without memory kinds
        host, target, source = jax.device_get(x), jax.sharding.SingleDeviceSharding(device), "numpy"
    jax.block_until_ready(host)
    del x
    timings = median_seconds(lambda: jax.device_put(host, target), sizes.warmup, sizes.repeats)
    return _bandwidth(
        "host_to_device",
        f"ceiling host->device {source} {_size_words(host.nbytes)}",
        host.nbytes,
        timings,
        source=source,
    )


def measure_ceilings(sizes: Sizes = Sizes(), *, fp8: bool = True) -> dict[str, Measurement]:
    """Every ceiling, by key. fp8=False skips the fp8 matmul (devices without fp8 tensor cores)."""
    found = [measure_hbm_read(sizes), measure_copy(sizes), measure_matmul(jnp.bfloat16, sizes)]
    if fp8:
        found.append(measure_matmul(jnp.float8_e4m3fn, sizes))
    found.append(measure_host_to_device(sizes))
    return {m.key: m for m in found}


def datasheet_peaks(machine: str) -> dict[str, float]:
    """The datasheet peaks this module knows for a device name, or {} for an unknown device."""
    return next((peaks for model, peaks in DATASHEET.items() if model in machine), {})


def ceiling_records(measurements: dict[str, Measurement], machine: str, commit: str) -> list[BenchRecord]:
    """One record per ceiling; its own ceiling is the datasheet peak when known (else null)."""
    peaks = datasheet_peaks(machine)
    records = []
    for key, m in measurements.items():
        peak = peaks.get(key)
        details = {
            **m.details,
            "seconds": m.seconds,
            "jax": jax.__version__,
            "backend": jax.default_backend(),
            "ceiling_source": "datasheet peak" if peak else None,
        }
        records.append(
            make_record(
                m.name,
                m.figure,
                m.unit,
                peak,
                m.unit if peak else None,
                machine=machine,
                commit=commit,
                details=details,
            )
        )
    return records


def main(argv: list[str] | None = None) -> list[BenchRecord]:
    parser = argparse.ArgumentParser(prog="python -m bench.ceilings", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes that run anywhere (CPU tests)")
    parser.add_argument("--no-fp8", action="store_true", help="skip the fp8 matmul")
    parser.add_argument("--out", help="output file (default: bench/results/ceilings-<machine>.json)")
    args = parser.parse_args(argv)
    machine, commit = machine_name(), git_commit()
    measurements = measure_ceilings(QUICK if args.quick else Sizes(), fp8=not args.no_fp8)
    records = ceiling_records(measurements, machine, commit)
    suffix = "-quick" if args.quick else ""
    path = write_records(records, args.out or f"ceilings-{machine_slug(machine)}{suffix}.json")
    for r in records:
        of_peak = (
            f"  ({r.fraction:.0%} of the {r.ceiling:g} {r.ceiling_unit} datasheet peak)" if r.fraction else ""
        )
        print(f"{r.name:45s} {r.figure:10.1f} {r.unit}{of_peak}")
    print(f"wrote {path}")
    return records


if __name__ == "__main__":
    main()
