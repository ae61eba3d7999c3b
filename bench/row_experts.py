"""One token's MoE pairs naming their experts (`grouped_matmuls(row_experts=True)`) against the same
pairs sorted by expert, through the compiled grouped kernel.

    python -m bench.row_experts            # GPU: the 80B-A3B's gate / up and down at one token, ~1 min
    python -m bench.row_experts --quick    # tiny shapes through the Pallas interpreter (any machine)

At one token the decode hands the grouped kernel each (token, expert) pair in slot order with its
expert (`model.mlp._experts_by_pair`) instead of group sizes over the pairs sorted by expert
(`_experts_grouped`): no count, sort, gather of rows or unsort around the launch, and no program
locates its work item by scanning the [E] group sizes. The gate / up read the token's word row for
all of its pairs. For each projection (gate and up as two stacks in one launch, as the decode runs
them; down), a timed call runs R routings back to back (different experts each, enough bytes that
L2 cannot serve them, as successive layers would), each way with the kernel tiles the decode uses
(`quant.grouped_tiles`). The named way's outputs must equal the sorted way's bit for bit (put back
in slot order); a mismatch fails the run. Records

    figure = bytes of the routed experts (packed + scales) / time of the named way   [GB/s]

against the HBM read bandwidth measured in the same run, the sorted way's time in the details.
Records: bench/results/row-experts-<machine>.json.
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench.ceilings import QUICK, Sizes, measure_hbm_read
from bench.kernels import _time_compiled, warm_gpu
from bench.moe_kernels import (
    L2_DEFEAT_BYTES,
    MAX_ROUTINGS,
    QUICK_SHAPE,
    QWEN3_NEXT_80B,
    MoEShape,
    random_stack,
)
from bench.record import git_commit, machine_name, machine_slug, make_record, write_records
from infernix_jax.weights.quant import grouped_tiles
from pallas_kernels import _e2m1_half2 as h2
from pallas_kernels import _quant_common as qc
from pallas_kernels.moe_matmul import grouped_matmuls, x_words_layout


def _routing_inputs(rng, shape: MoEShape, k: int, token_rows: bool, key) -> dict:
    """One routing of one token: its experts in slot order and the rows each way reads."""
    ids = rng.choice(shape.num_experts, shape.top_k, replace=False).astype(np.int32)
    order = np.argsort(ids, kind="stable")
    if token_rows:  # gate / up: the token's row, read by every pair
        token = jax.random.normal(key, (1, k), jnp.bfloat16) * 4
        x = jnp.repeat(token, shape.top_k, axis=0)
    else:  # down: each pair's own SwiGLU row
        token, x = None, jax.random.normal(key, (shape.top_k, k), jnp.bfloat16) * 4
    return {
        "experts": jnp.asarray(ids),
        "order": jnp.asarray(order, jnp.int32),
        "sizes": jnp.asarray(np.bincount(ids, minlength=shape.num_experts), jnp.int32),
        "x": x,
        "token": token,
    }


def _words(rows: jax.Array, layout: str | None):
    """Rows as the word formulation takes them made outside (`x_words`), or None."""
    if layout is None:
        return None
    x16, inverse = qc.f16_rows(rows)
    return (h2.word_x_pairs(x16) if layout == "pairs" else qc.word_columns(x16)), inverse


def _calls(tiles: dict, interpret: bool, named: bool, layout: str | None):
    """A jitted call over every routing, one way: (routings, stacks) -> one output per routing."""

    def one(r, stacks):
        if named:
            source = r["token"] if r["token"] is not None and layout == "pairs" else r["x"]
            return grouped_matmuls(r["x"], stacks, r["experts"], fmt="nvfp4", row_experts=True, x_words=_words(source, layout),
                                   interpret=interpret, **tiles)  # fmt: skip
        rows = r["x"][r["order"]]
        return grouped_matmuls(rows, stacks, r["sizes"], fmt="nvfp4", x_words=_words(rows, layout), interpret=interpret,
                               **tiles)  # fmt: skip

    return jax.jit(lambda routings, stacks: tuple(jnp.concatenate(one(r, stacks), axis=1) for r in routings))


def bench_projection(proj: str, n: int, k: int, args, *, shape: MoEShape, hbm, machine: str, commit: str):
    """The record of one projection, and a mismatch message or None."""
    count = 2 if proj == "gate_up" else 1  # gate and up: two stacks of n // 2 rows, one launch
    leaves = [
        random_stack("nvfp4", shape.num_experts, n // count, k, jax.random.key(n + k + i))
        for i in range(count)
    ]
    stacks = tuple(leaf[0] for leaf in leaves)
    per_expert = sum(leaf[2] for leaf in leaves)
    routings = args.routings or min(MAX_ROUTINGS, -(-L2_DEFEAT_BYTES // (per_expert * shape.top_k)))
    rng = np.random.default_rng(n * 7 + k)
    keys = jax.random.split(jax.random.key(k), routings)
    inputs = tuple(_routing_inputs(rng, shape, k, proj == "gate_up", keys[i]) for i in range(routings))
    tiles = grouped_tiles("nvfp4", 1, shape.top_k, None, jnp.bfloat16)
    layout = x_words_layout(tiles["variant"], tiles.get("x_rows")) if proj == "gate_up" else None
    named = _calls(tiles, args.quick, True, layout).lower(inputs, stacks).compile()
    sorted_way = _calls(tiles, args.quick, False, layout).lower(inputs, stacks).compile()
    got, want = named(inputs, stacks), sorted_way(inputs, stacks)
    equal = all(
        np.array_equal(np.asarray(g)[np.asarray(r["order"])], np.asarray(w))
        for g, w, r in zip(got, want, inputs, strict=True)
    )
    warm_gpu([lambda: named(inputs, stacks)] if not args.quick else [])
    times = {"named": [], "sorted": []}
    for _ in range(2):  # in turn, twice: the better of each (the clocks move between calls)
        times["named"].append(_time_compiled(named, inputs, stacks, routings))
        times["sorted"].append(_time_compiled(sorted_way, inputs, stacks, routings))
    named_s, sorted_s = min(times["named"]), min(times["sorted"])
    read = per_expert * shape.top_k  # each routing's distinct experts
    record = make_record(
        f"row-experts {proj} nvfp4 batch1",
        read / named_s / 1e9,
        "GB/s",
        hbm.figure,
        hbm.unit,
        machine=machine,
        commit=commit,
        details={
            "named_us": named_s * 1e6,
            "sorted_us": sorted_s * 1e6,
            "speedup": sorted_s / named_s,
            "named_us_each": [t * 1e6 for t in times["named"]],
            "sorted_us_each": [t * 1e6 for t in times["sorted"]],
            "bit_equal": equal,
            "routings_per_call": routings,
            "bytes_per_call": read,
            "tiles": tiles,
            "x_words": layout,
            "ceiling": hbm.name,
        },
    )
    mismatch = None if equal else f"{proj}: rows naming their experts differ from the sorted pairs"
    return record, mismatch


def main(argv: list[str] | None = None) -> list:
    parser = argparse.ArgumentParser(prog="python -m bench.row_experts", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="tiny shapes, interpret mode: a smoke run anywhere"
    )
    parser.add_argument("--routings", type=int, default=None, help="routings per timed call")
    parser.add_argument("--out", help="output file (default: bench/results/row-experts-<machine>.json)")
    args = parser.parse_args(argv)
    if not args.quick and jax.default_backend() == "cpu":
        raise SystemExit("python -m bench.row_experts times the GPU kernel: run it on a GPU, or pass --quick")
    args.routings = args.routings or (2 if args.quick else None)
    shape = QUICK_SHAPE if args.quick else QWEN3_NEXT_80B
    machine, commit = machine_name(), git_commit()
    hbm = measure_hbm_read(QUICK if args.quick else Sizes())
    print(f"{hbm.name}: {hbm.figure:.1f} GB/s")
    records, mismatches = [], []
    out = args.out or f"row-experts-{machine_slug(machine)}{'-quick' if args.quick else ''}.json"
    for proj, (n, k) in shape.projections.items():
        record, mismatch = bench_projection(
            proj, n, k, args, shape=shape, hbm=hbm, machine=machine, commit=commit
        )
        records.append(record)
        d = record.details
        print(f"{record.name}: named {d['named_us']:.1f} us ({record.figure:.0f} GB/s, {record.fraction:.1%}), "
              f"sorted {d['sorted_us']:.1f} us, bit equal {d['bit_equal']}")  # fmt: skip
        write_records(records, out)
        if mismatch:
            mismatches.append(mismatch)
    if mismatches:
        print("\n".join(mismatches), file=sys.stderr)
        raise SystemExit(1)
    return records


if __name__ == "__main__":
    main()
