"""The norm-and-rows kernels compiled against their plain-JAX references: the same rows, and the
time of a call of each.

    python -m bench.norm_rows            # GPU: the 80B-A3B's and the 27B's norms at 1 and 8 rows
    python -m bench.norm_rows --quick    # tiny sizes, the kernels interpreted (any machine)

For each site (a layer's RMSNorm before its projections, K = the hidden size; the GDN output
norm before out_proj, K = heads x 128) and row count: whether the compiled kernel's words and
inverse factors equal those the reference (XLA: the norm, `f16_rows` and the reorder, what the
model runs under "xla") makes from the kernel's own normed rows, how far its normed rows are from
XLA's, and the device time of one call of each, from `--calls` calls chained inside one program,
best of 5. Figure: the kernel's microseconds a call; "ceiling": the reference's (the launches it
replaces), so fraction = kernel / reference (below 1: the kernel is faster). Records go to
bench/results/norm-rows-<machine>.json.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from bench.chained_calls import best_seconds, chained
from bench.record import machine_name, machine_slug, make_record, write_records
from pallas_kernels import _e2m1_half2 as h2
from pallas_kernels import _quant_common as qc
from pallas_kernels.norm_rows import (
    gated_rms_norm_rows,
    reference_gated_rms_norm_rows,
    reference_rms_norm_rows,
    rms_norm_rows,
)

# (name, K, head dim (0: the plain norm), layout): the projections' formulation decides the layout
SITES = (
    ("80b norm", 2048, 0, "columns"),
    ("80b gdn output", 4096, 128, "columns"),
    ("27b norm", 5120, 0, "pairs"),
    ("27b gdn output", 6144, 128, "columns"),
)
QUICK_SITES = (("tiny norm", 64, 0, "columns"), ("tiny gdn output", 64, 16, "pairs"))


def _tie(out) -> jax.Array:
    """A float32 scalar that depends on every output of a norm-rows call."""
    normed, words, inverse = out
    return normed[0, 0].astype(jnp.float32) + words.reshape(-1)[0].astype(jnp.float32) + inverse[0]


def measure(site: tuple, rows: int, calls: int, interpret: bool) -> dict:
    name, k, head, layout = site
    keys = jax.random.split(jax.random.PRNGKey(k + rows), 3)
    x = jax.random.normal(keys[0], (rows, k), jnp.bfloat16) * 4
    w = (1 + 0.2 * jax.random.normal(keys[1], (head or k,), jnp.float32)).astype(jnp.bfloat16)
    if head:
        gate = jax.random.normal(keys[2], (rows, k), jnp.bfloat16)
        kernel = functools.partial(gated_rms_norm_rows, eps=1e-6, layout=layout, interpret=interpret)
        reference = functools.partial(reference_gated_rms_norm_rows, eps=1e-6, layout=layout)
        operands = (x, gate, w)
    else:
        kernel = functools.partial(rms_norm_rows, eps=1e-6, zero_centered=True, layout=layout, interpret=interpret)
        reference = functools.partial(reference_rms_norm_rows, eps=1e-6, zero_centered=True, layout=layout)
        operands = (x, w)
    got = jax.jit(kernel)(*operands)
    want = jax.jit(reference)(*operands)
    x16, inverse = qc.f16_rows(got[0])  # the rows the kernel's own normed values make
    words = qc.word_columns(x16) if layout == "columns" else h2.word_x_pairs(x16)
    normed_gap = np.abs(np.asarray(got[0], np.float32) - np.asarray(want[0], np.float32))
    out = {
        "site": name, "k": k, "head_dim": head, "layout": layout, "rows": rows,
        "words_equal": bool(np.array_equal(np.asarray(got[1]), np.asarray(words))),
        "inverse_equal": bool(np.array_equal(np.asarray(got[2]), np.asarray(inverse))),
        "normed_equal_to_xla": bool(np.array_equal(np.asarray(got[0]), np.asarray(want[0]))),
        "normed_max_abs_diff": float(normed_gap.max()),
        "kernel_us": best_seconds(chained(kernel, calls, _tie), *operands) / calls * 1e6,
        "reference_us": best_seconds(chained(reference, calls, _tie), *operands) / calls * 1e6,
    }  # fmt: skip
    return out


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,8")
    parser.add_argument("--calls", type=int, default=200, help="calls chained in one timed program")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, the kernels interpreted (any machine)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    sites = QUICK_SITES if args.quick else SITES
    if args.quick:
        args.calls = 2
    machine = machine_name()
    records = []
    for site in sites:
        for rows in (int(r) for r in args.rows.split(",")):
            m = measure(site, rows, args.calls, interpret=args.quick)
            name = f"norm rows kernel {m['site']} K{m['k']} {m['layout']} rows{rows}"
            records.append(make_record(name, m["kernel_us"], "us/call", m["reference_us"], "us/call (XLA norm and rows)",
                                       machine=machine, details=m))  # fmt: skip
            print(f"{name}: kernel {m['kernel_us']:.2f} us, XLA {m['reference_us']:.2f} us; words equal: "
                  f"{m['words_equal'] and m['inverse_equal']}, normed within {m['normed_max_abs_diff']:.2g} of XLA's",
                  flush=True)  # fmt: skip
            write_records(records, args.out or f"norm-rows-{machine_slug(machine)}.json")
    return records


if __name__ == "__main__":
    main()
