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
- `contiguous`: one static slice of `--missed` consecutive experts' bytes per layer: the best a
  copy of those bytes can do, for reference.

Ceiling: pinned-host -> device bandwidth of one large copy, measured in the same run. Figure:
copied expert bytes (only the missed ones) per second. Records go to
bench/results/expert-copies-<machine>.json; names contain "expert" and "pcie".
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.ceilings import QUICK, Sizes, measure_host_to_device
from bench.record import git_commit, machine_name, machine_slug, make_record, write_records
from infernix_jax.cache.prefix_host import PINNED_HOST, memory_kinds
from infernix_jax.experts.offload import expert_rows
from infernix_jax.model.mlp import copy_host_rows, expert_rows_to_leaves

METHODS = ("loop-leaves", "unrolled-leaves", "loop-bytes", "unrolled-bytes", "contiguous")


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


def copy_fn(method: str, shapes):
    """A jitted function (host stacks per layer, missed [L, M], num_missed [L]) -> fetched leaves."""

    def one_layer(host, missed, num_missed):
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
        raise ValueError(method)

    def run(hosts, missed, num_missed):
        return [one_layer(h, missed[i], num_missed[i]) for i, h in enumerate(hosts)]

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
    for i in range(layers):
        missed[i, : args.missed] = rng.choice(experts, args.missed, replace=False)
    num_missed = np.full(layers, args.missed, np.int32)
    bandwidth = measure_host_to_device(QUICK if args.quick else Sizes()).rate
    machine, commit = machine_name(), git_commit()
    moved = layers * args.missed * expert_bytes
    records = []
    out = args.out or f"expert-copies-{machine_slug(machine)}{'-quick' if args.quick else ''}.json"
    for method in args.methods.split(","):
        fn = copy_fn(method, shapes)
        hosts = byte_hosts if method in ("loop-bytes", "unrolled-bytes", "contiguous") else leaf_hosts
        ids = (
            np.tile(np.arange(args.slots, dtype=np.int32), (layers, 1)) if method == "contiguous" else missed
        )
        start = time.perf_counter()
        got = jax.block_until_ready(fn(hosts, jnp.asarray(ids), jnp.asarray(num_missed)))
        compile_s = time.perf_counter() - start
        for i in range(layers):  # the copied rows are the experts asked for
            for leaf, stack in zip(got[i], per_layer[i]):
                want = stack[ids[i, : args.missed]]
                if not np.array_equal(np.asarray(leaf[: args.missed]).view(np.uint8), want.view(np.uint8)):
                    raise SystemExit(f"{method}: layer {i} copied the wrong bytes")
        times = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            jax.block_until_ready(fn(hosts, jnp.asarray(ids), jnp.asarray(num_missed)))
            times.append(time.perf_counter() - start)
        seconds = float(np.median(times))
        rate = moved / seconds
        record = make_record(
            f"expert copies pinned_host -> device {method} {layers} layers x {args.missed} of {args.slots} "
            f"experts ({expert_bytes} B each) vs pcie",
            rate / 1e9, "GB/s", bandwidth / 1e9, "GB/s", machine=machine, commit=commit,
            details={"method": method, "layers": layers, "slots": args.slots, "missed": args.missed,
                     "expert_bytes": expert_bytes, "seconds": seconds, "compile_s": compile_s,
                     "per_layer_ms": seconds / layers * 1e3},
        )  # fmt: skip
        print(f"{method:16s} {seconds * 1e3:8.3f} ms ({seconds / layers * 1e3:.3f} ms a layer): "
              f"{rate / 1e9:6.2f} GB/s = {record.fraction:.1%} of {bandwidth / 1e9:.1f} GB/s", flush=True)  # fmt: skip
        records.append(record)
        write_records(records, out)
    return records


if __name__ == "__main__":
    main()
