"""The gather kernel of the "mapped" expert copy alone, by variant (GPU only).

    python -m bench.mapped_gather                       # every variant
    python -m bench.mapped_gather --unrolls 1,4 --loads ld --blocks 1024

`--expert-host-copy mapped` (`infernix_jax.model.host_copy`) launches one gather per MoE layer
that reads the missed experts' rows straight from pinned host memory over PCIe. How fast such a
kernel reads depends on how many loads it keeps in flight: this times the variants of
`host_copy.gather_entry` (loads in flight per thread, the PTX load instruction, blocks per launch)
on `--rows` rows of one NVFP4 Qwen3-Next expert each (as `bench.expert_copies` lays them out),
launched through the CUDA driver on a stream of its own and timed with CUDA events. Every variant's
bytes are checked before it is timed.

Ceiling: pinned-host -> device bandwidth of one large copy, measured in the same run. Records go to
bench/results/mapped-gather-<machine>.json; names contain "expert" and "pcie".
"""

from __future__ import annotations

import argparse
import ctypes

import jax
import jax.numpy as jnp
import numpy as np

from bench.ceilings import Sizes, measure_host_to_device
from bench.expert_copies import as_bytes, expert_leaves, random_stacks
from bench.record import git_commit, machine_name, machine_slug, make_record, write_records
from infernix_jax.cache.prefix_host import PINNED_HOST
from infernix_jax.model import host_copy

_EXTRA_ARGS = {
    "cuStreamCreate": (ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint),
    "cuEventCreate": (ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint),
    "cuEventRecord": (ctypes.c_void_p, ctypes.c_void_p),
    "cuEventSynchronize": (ctypes.c_void_p,),
    "cuEventElapsedTime": (ctypes.POINTER(ctypes.c_float), ctypes.c_void_p, ctypes.c_void_p),
}


def _driver() -> host_copy._CudaDriver:
    cuda = host_copy._cuda()
    for name, args in _EXTRA_ARGS.items():
        fn = getattr(cuda.lib, name)
        fn.argtypes, fn.restype = args, ctypes.c_int
    return cuda


def main(argv: list[str] | None = None) -> list:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experts", type=int, default=64, help="rows in pinned host memory")
    p.add_argument("--rows", type=int, default=8, help="rows gathered per launch (missed experts of a layer)")
    p.add_argument("--unrolls", default="1,2,4,8")
    p.add_argument("--loads", default="ld,ld.global.nc,ld.global.cs")
    p.add_argument("--blocks", default="264,1024,4096", help="blocks per launch, spread over the rows")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    device = jax.devices()[0]
    if device.platform != "gpu":
        raise SystemExit("bench.mapped_gather launches CUDA kernels: it needs a GPU")
    rng = np.random.default_rng(0)
    rows = as_bytes(random_stacks(args.experts, expert_leaves(args.experts, 2048, 512), rng))
    row_bytes = rows.shape[1]
    host = jax.device_put(rows, jax.sharding.SingleDeviceSharding(device, memory_kind=PINNED_HOST))
    chosen = np.sort(rng.choice(args.experts, args.rows, replace=False)).astype(np.int32)
    header = jnp.asarray(
        np.concatenate([host_copy.host_rows_address(host), [args.rows], chosen]).astype(np.int32)
    )
    out = jnp.zeros((args.rows, row_bytes), jnp.uint8)
    jax.block_until_ready((host, header, out))
    want = rows[chosen]
    bandwidth = measure_host_to_device(Sizes()).rate
    width = host_copy.gather_width(row_bytes)
    words = row_bytes // width
    variants = [(u, ld) for u in map(int, args.unrolls.split(",")) for ld in args.loads.split(",")]
    ptx = host_copy.gather_ptx([(width, u, ld) for u, ld in variants])
    cuda = _driver()
    machine, commit = machine_name(), git_commit()
    moved = args.rows * row_bytes
    records = []
    with cuda.some_context(getattr(device, "local_hardware_id", None) or 0):
        stream, start, stop = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        cuda.check("cuStreamCreate", ctypes.byref(stream), 1)  # CU_STREAM_NON_BLOCKING
        cuda.check("cuEventCreate", ctypes.byref(start), 0)
        cuda.check("cuEventCreate", ctypes.byref(stop), 0)
        params_in = [ctypes.c_uint64(header.unsafe_buffer_pointer()), ctypes.c_uint64(out.unsafe_buffer_pointer()),
                     ctypes.c_uint64(words)]  # fmt: skip
        params = (ctypes.c_void_p * 3)(*[ctypes.addressof(a) for a in params_in])
        got = np.empty_like(want)
        for unroll, load in variants:
            fn = cuda.function(stream.value, host_copy.gather_kernel_name(width, unroll, load), ptx)
            for blocks in map(int, args.blocks.split(",")):
                per_row = max(1, blocks // args.rows)

                def launch(fn=fn, per_row=per_row):
                    cuda.check("cuLaunchKernel", fn, per_row, args.rows, 1, host_copy.GATHER_THREADS, 1, 1, 0,
                               stream, params, None)  # fmt: skip

                cuda.check("cuMemsetD8Async", out.unsafe_buffer_pointer(), 0, moved, stream)
                launch()
                cuda.check(
                    "cuMemcpyDtoHAsync_v2", got.ctypes.data, out.unsafe_buffer_pointer(), moved, stream
                )
                cuda.check("cuStreamSynchronize", stream)
                if not np.array_equal(got, want):
                    raise SystemExit(f"u{unroll} {load} {blocks} blocks copied wrong bytes")
                for _ in range(3):
                    launch()
                cuda.check("cuEventRecord", start, stream)
                for _ in range(args.repeats):
                    launch()
                cuda.check("cuEventRecord", stop, stream)
                cuda.check("cuEventSynchronize", stop)
                ms = ctypes.c_float()
                cuda.check("cuEventElapsedTime", ctypes.byref(ms), start, stop)
                seconds = ms.value / 1e3 / args.repeats
                rate = moved / seconds
                record = make_record(
                    f"expert mapped gather pinned_host -> device w{width} u{unroll} {load} {per_row * args.rows} "
                    f"blocks {args.rows} rows of {row_bytes} B vs pcie",
                    rate / 1e9, "GB/s", bandwidth / 1e9, "GB/s", machine=machine, commit=commit,
                    details={"width": width, "unroll": unroll, "load": load, "blocks": per_row * args.rows,
                             "rows": args.rows, "row_bytes": row_bytes, "seconds": seconds},
                )  # fmt: skip
                records.append(record)
                print(f"u{unroll} {load:13s} {per_row * args.rows:5d} blocks: {seconds * 1e3:7.3f} ms "
                      f"{rate / 1e9:6.2f} GB/s = {record.fraction:.1%} of {bandwidth / 1e9:.1f} GB/s", flush=True)  # fmt: skip
    path = write_records(records, args.out or f"mapped-gather-{machine_slug(machine)}.json")
    print(f"wrote {path}")
    return records


if __name__ == "__main__":
    main()
