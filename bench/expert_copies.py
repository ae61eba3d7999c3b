"""How fast a program copies a step's missed experts out of `pinned_host` memory, by method.

    python -m bench.expert_copies            # GPU: Qwen3-Next-80B-A3B expert shapes, 12 layers, ~1 min
    python -m bench.expert_copies --quick    # small shapes, any machine (the CPU in tests)

`--expert-host-reads program` copies each layer's missed experts from full expert stacks kept in
pinned host memory, inside the decode program. This times that copy alone, for one decode token
at batch 1: `--layers` layers, each with `--missed` of its `--slots` routed experts missing (ids
at random), in one jitted program. Methods:

- `loop-leaves`: a `fori_loop` over the missed experts, one dynamic slice per leaf (packed data,
  block scales and scale of gate, up and down: 9 leaves for NVFP4) moved to device memory.
- `unrolled-leaves`: the same copies with the loop unrolled over all `--slots` rows (rows past
  the missed ones copy expert 0 and are ignored): no loop, more bytes.
- `loop-bytes` (what the model does, `mlp.copy_host_rows` with a count) / `unrolled-bytes`: each
  layer's experts as one uint8 stack [E, expert_bytes]; one copy per expert, then the leaves are
  cut out of the bytes on the device (bitcasts).
- `bucket-bytes` (`mlp.copy_missed_rows` "buckets"): `lax.switch` on the count picks a static
  size (0, 1, 2, 3, 4, 6, 8, 12, ...); its branch makes that many row copies, unrolled.
- `dma-bytes` (`mlp.copy_missed_rows` "dma"): one buffer callback per layer reads the ids back
  once and enqueues one host-to-device copy per run of consecutive ids on XLA's stream.
- `mapped-bytes` (`mlp.copy_missed_rows` "mapped"): one buffer callback per layer launches a
  gather kernel that reads the ids on the device and the rows from mapped pinned host memory;
  nothing is read back or waited for.
- `streams-bytes`: the unrolled row copies, each in its own `compute_on("gpu_stream:i")`, so that
  the runtime may run them side by side (the CPU ignores the streams).
- `host-gather-buckets`: per bucket (as `bucket-bytes`), the rows gathered on the host inside
  the program (`compute_on("device_host")`) into a pinned staging block, then one copy of it.
- `host-gather-bytes`: one host gather of all `--slots` rows (-1 reads expert 0), one copy.
- `contiguous`: one static slice of `--missed` consecutive experts' bytes per layer: the best a
  copy of those bytes can do, for reference.

Methods that fail (a backend without host compute, streams or the CUDA driver) are reported and
skipped; the others still run. The risky ones come last: `--methods` picks some.

Ceiling: pinned-host -> device bandwidth of one large copy, measured in the same run. Figure:
copied expert bytes (only the missed ones) per second. Records go to
bench/results/expert-copies-<machine>.json; names contain "expert" and "pcie".
"""

from __future__ import annotations

import argparse
import inspect
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.ceilings import QUICK, Sizes, measure_host_to_device
from bench.record import git_commit, machine_name, machine_slug, make_record, write_records
from infernix_jax.cache.prefix_host import PINNED_HOST, memory_kinds
from infernix_jax.experts.offload import expert_rows
from infernix_jax.model.host_copy import host_rows_address, register_host_rows
from infernix_jax.model.mlp import (
    copy_host_rows,
    copy_missed_rows,
    expert_rows_to_leaves,
    fetch_buckets,
    on_stream,
)

METHODS = (
    "loop-leaves",
    "unrolled-leaves",
    "loop-bytes",
    "unrolled-bytes",
    "contiguous",
    "bucket-bytes",
    "dma-bytes",
    "mapped-bytes",
    "streams-bytes",
    "host-gather-buckets",
    "host-gather-bytes",
)
LEAF_METHODS = ("loop-leaves", "unrolled-leaves")  # the others read byte rows [E, expert_bytes]


def expert_leaves(num_experts: int, hidden: int, inter: int) -> list[tuple[tuple[int, ...], np.dtype]]:
    """NVFP4 (gate, up, down) leaves of one expert: packed uint8, e4m3 block scales, f32 scale."""
    e4m3 = np.dtype(jnp.float8_e4m3fn)
    out = []
    for n, k in ((inter, hidden), (inter, hidden), (hidden, inter)):
        out += [((n, k // 2), np.dtype(np.uint8)), ((n, k // 16), e4m3), ((), np.dtype(np.float32))]
    return out


def random_stacks(num_experts: int, shapes, rng: np.random.Generator) -> list[np.ndarray]:
    stacks = []
    for shape, dtype in shapes:
        raw = rng.integers(0, 256, (num_experts, *shape, dtype.itemsize), dtype=np.uint8)
        if dtype == np.float32:  # keep the scales finite
            raw = rng.random((num_experts, *shape), dtype=np.float32).view(np.uint8).reshape(raw.shape)
        stacks.append(raw.view(dtype).reshape(num_experts, *shape))
    return stacks


def as_bytes(stacks: list[np.ndarray]) -> np.ndarray:
    """[E, expert_bytes]: each expert's leaves laid end to end (the model's host rows)."""
    return expert_rows([[s[e] for s in stacks] for e in range(stacks[0].shape[0])])


def split_bytes(rows: jax.Array, shapes) -> list[jax.Array]:
    """The leaves [M, ...] back out of byte rows [M, expert_bytes] (on the device)."""
    return expert_rows_to_leaves(rows, [jax.ShapeDtypeStruct((1, *shape), dtype) for shape, dtype in shapes])


def _loop(stack_leaves: list[jax.Array], missed: jax.Array, num_missed: jax.Array) -> list[jax.Array]:
    out = [jnp.zeros((missed.shape[0], *leaf.shape[1:]), leaf.dtype) for leaf in stack_leaves]

    def copy_one(i, bufs):
        expert = jnp.maximum(missed[i], 0)
        rows = [jax.lax.dynamic_slice_in_dim(leaf, expert, 1) for leaf in stack_leaves]
        rows = [jax.device_put(row, jax.memory.Space.Device) for row in rows]
        return [jax.lax.dynamic_update_slice_in_dim(b, r, i, 0) for b, r in zip(bufs, rows)]

    return jax.lax.fori_loop(0, num_missed, copy_one, out)


def _unrolled(stack_leaves: list[jax.Array], missed: jax.Array) -> list[jax.Array]:
    rows = []
    for i in range(missed.shape[0]):
        expert = jnp.maximum(missed[i], 0)
        rows.append(
            [
                jax.device_put(jax.lax.dynamic_slice_in_dim(leaf, expert, 1), jax.memory.Space.Device)
                for leaf in stack_leaves
            ]
        )
    return [jnp.concatenate([r[j] for r in rows]) for j in range(len(stack_leaves))]


def _unrolled_on_streams(host_rows: jax.Array, missed: jax.Array) -> jax.Array:
    """Every row of `missed` copied on its own GPU stream (`compute_on("gpu_stream:i")`, through
    `mlp.on_stream`, which speaks both jax 0.10's and 0.11's form of it)."""
    rows = [
        on_stream(copy_host_rows, f"gpu_stream:{i + 1}")(host_rows, missed[i : i + 1])
        for i in range(missed.shape[0])
    ]
    return jnp.concatenate(rows)


def _host_transform(f, out_memory_spaces):
    """`f` as host compute inside the program: jax 0.10's `compute_on2`, which jax 0.11 made
    `compute_on` itself."""
    from jax.experimental import compute_on as module

    transform = module.compute_on
    if "out_memory_spaces" not in inspect.signature(transform).parameters:
        transform = module.compute_on2
    return transform(f, compute_type="device_host", out_memory_spaces=out_memory_spaces)


def _gathered_on_host(host_rows: jax.Array, experts: jax.Array) -> jax.Array:
    """Rows [len(experts), row_bytes]: gathered by host compute inside the program into a pinned
    staging block, then one host-to-device copy of the block."""
    ids = jax.device_put(jnp.maximum(experts, 0), jax.memory.Space.Host)
    gather = _host_transform(
        lambda rows, ids: jnp.take(rows, ids, axis=0, mode="clip"), jax.memory.Space.Host
    )
    return jax.device_put(gather(host_rows, ids), jax.memory.Space.Device)


def _host_gather_in_buckets(host_rows: jax.Array, missed: jax.Array, num_missed: jax.Array) -> jax.Array:
    """`_gathered_on_host` of the smallest bucket (`mlp.fetch_buckets`) holding `num_missed` rows."""
    m_max, row_bytes = missed.shape[0], host_rows.shape[1]
    buckets = fetch_buckets(m_max)

    def branch(m: int):
        def run(host_rows, missed):
            if m == 0:
                return jnp.zeros((m_max, row_bytes), jnp.uint8)
            return jnp.pad(_gathered_on_host(host_rows, missed[:m]), [(0, m_max - m), (0, 0)])

        return run

    index = jnp.searchsorted(jnp.asarray(buckets, jnp.int32), num_missed, side="left")
    return jax.lax.switch(index, [branch(m) for m in buckets], host_rows, missed)


def copy_fn(method: str, shapes):
    """A jitted function (host stacks per layer, missed [L, M], num_missed [L], host rows' refs [L,
    ...]: ids for dma-bytes, device addresses for mapped-bytes) -> fetched leaves per layer."""

    def one_layer(host, missed, num_missed, rows_ref):
        if method == "loop-leaves":
            return _loop(host, missed, num_missed)
        if method == "unrolled-leaves":
            return _unrolled(host, missed)
        if method == "loop-bytes":
            return split_bytes(copy_host_rows(host, missed, num_missed), shapes)
        if method == "unrolled-bytes":
            return split_bytes(copy_host_rows(host, missed), shapes)
        if method == "contiguous":
            rows = jax.device_put(jax.lax.slice_in_dim(host, 0, missed.shape[0]), jax.memory.Space.Device)
            return split_bytes(rows, shapes)
        if method == "bucket-bytes":
            return split_bytes(copy_missed_rows("buckets", host, missed, num_missed), shapes)
        if method == "dma-bytes":
            return split_bytes(copy_missed_rows("dma", host, missed, num_missed, rows_ref), shapes)
        if method == "mapped-bytes":
            return split_bytes(copy_missed_rows("mapped", host, missed, num_missed, rows_ref), shapes)
        if method == "streams-bytes":
            return split_bytes(_unrolled_on_streams(host, missed), shapes)
        if method == "host-gather-buckets":
            return split_bytes(_host_gather_in_buckets(host, missed, num_missed), shapes)
        if method == "host-gather-bytes":
            return split_bytes(_gathered_on_host(host, missed), shapes)
        raise ValueError(method)

    def run(hosts, missed, num_missed, rows_refs):
        return [one_layer(h, missed[i], num_missed[i], rows_refs[i]) for i, h in enumerate(hosts)]

    return jax.jit(run)


def main(argv: list[str] | None = None) -> list:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--experts", type=int, default=512)
    p.add_argument("--slots", type=int, default=10, help="routed experts per token (the copy rows)")
    p.add_argument("--missed", type=int, default=8, help="of them missing (80B at an 8 GiB budget: ~80%%)")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    unknown = set(args.methods.split(",")) - set(METHODS)
    if unknown:
        p.error(f"unknown methods {sorted(unknown)}; choose from {', '.join(METHODS)}")
    device = jax.devices()[0]
    if PINNED_HOST not in memory_kinds(device):
        raise SystemExit(f"{device} has no {PINNED_HOST} memory")
    hidden, inter = (128, 64) if args.quick else (2048, 512)
    experts = min(args.experts, 16) if args.quick else args.experts
    layers = min(args.layers, 2) if args.quick else args.layers
    shapes = expert_leaves(experts, hidden, inter)
    rng = np.random.default_rng(0)
    on_host = jax.sharding.SingleDeviceSharding(device, memory_kind=PINNED_HOST)
    per_layer = [random_stacks(experts, shapes, rng) for _ in range(layers)]
    leaf_hosts = [jax.device_put(s, on_host) for s in per_layer]
    byte_hosts = [jax.device_put(as_bytes(s), on_host) for s in per_layer]
    expert_bytes = as_bytes([s[:1] for s in per_layer[0]]).nbytes
    missed = np.full((layers, args.slots), -1, np.int32)
    for i in range(layers):  # ascending, as the model lists a layer's missed experts
        missed[i, : args.missed] = np.sort(rng.choice(experts, args.missed, replace=False))
    num_missed = np.full(layers, args.missed, np.int32)
    rows_refs = {
        "dma-bytes": np.asarray([register_host_rows(h) for h in byte_hosts], np.int32),
        "mapped-bytes": np.stack([host_rows_address(h) for h in byte_hosts]),
    }
    bandwidth = measure_host_to_device(QUICK if args.quick else Sizes()).rate
    machine, commit = machine_name(), git_commit()
    moved = layers * args.missed * expert_bytes
    records, failed = [], []
    out = args.out or f"expert-copies-{machine_slug(machine)}{'-quick' if args.quick else ''}.json"
    for method in args.methods.split(","):
        hosts = leaf_hosts if method in LEAF_METHODS else byte_hosts
        ids = (
            np.tile(np.arange(args.slots, dtype=np.int32), (layers, 1)) if method == "contiguous" else missed
        )
        refs = rows_refs.get(method, np.zeros(layers, np.int32))
        inputs = (hosts, jnp.asarray(ids), jnp.asarray(num_missed), jnp.asarray(refs))
        try:
            seconds, compile_s = time_method(
                copy_fn(method, shapes), inputs, per_layer, args.missed, args.repeats
            )
        except Exception as e:  # noqa: BLE001 - a method this backend lacks; the others still run
            failed.append(method)
            print(f"{method:19s} failed: {type(e).__name__}: {str(e).splitlines()[0][:300]}", flush=True)
            continue
        rate = moved / seconds
        record = make_record(
            f"expert copies pinned_host -> device {method} {layers} layers x {args.missed} of {args.slots} "
            f"experts ({expert_bytes} B each) vs pcie",
            rate / 1e9, "GB/s", bandwidth / 1e9, "GB/s", machine=machine, commit=commit,
            details={"method": method, "layers": layers, "slots": args.slots, "missed": args.missed,
                     "expert_bytes": expert_bytes, "seconds": seconds, "compile_s": compile_s,
                     "per_layer_ms": seconds / layers * 1e3},
        )  # fmt: skip
        print(f"{method:19s} {seconds * 1e3:8.3f} ms ({seconds / layers * 1e3:.3f} ms a layer): "
              f"{rate / 1e9:6.2f} GB/s = {record.fraction:.1%} of {bandwidth / 1e9:.1f} GB/s", flush=True)  # fmt: skip
        records.append(record)
        write_records(records, out)
    if failed:
        print(f"failed: {', '.join(failed)}", flush=True)
    return records


def time_method(
    fn, inputs, per_layer: list[list[np.ndarray]], missed: int, repeats: int
) -> tuple[float, float]:
    """(median seconds of a call, seconds of the first call: compilation included) of `fn` on
    `inputs`, after checking that every layer's first `missed` rows are the asked experts' bytes."""
    start = time.perf_counter()
    got = jax.block_until_ready(fn(*inputs))
    compile_s = time.perf_counter() - start
    ids = np.asarray(inputs[1])
    for i, stacks in enumerate(per_layer):
        for leaf, stack in zip(got[i], stacks):
            want = stack[ids[i, :missed]]
            if not np.array_equal(np.asarray(leaf[:missed]).view(np.uint8), want.view(np.uint8)):
                raise ValueError(f"layer {i} copied the wrong bytes")
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*inputs))
        times.append(time.perf_counter() - start)
    return float(np.median(times)), compile_s


if __name__ == "__main__":
    main()
