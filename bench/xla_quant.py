"""Quantized decode matmuls as plain XLA fusions (native float4_e2m1fn / float8 converts) against
the Pallas kernels and the HBM roofline.

    python -m bench.xla_quant                 # GPU: real layer shapes, batch 1 and 8, ~4 min
    python -m bench.xla_quant --quick         # tiny shapes on any machine (checks the formulations)

JAX has the E2M1 type (`jnp.float4_e2m1fn`); `lax.bitcast_convert_type` turns ModelOpt's packed
uint8 bytes into it with no copy, element 2j from the low nibble (ModelOpt's order), so XLA itself
can fuse the unpacking into the consumer of the weight instead of a kernel doing it by hand.
Each point times, over the same random weights and several weight copies (> L2):

- `kernel`: the Pallas kernel with the tiles `weights.quant` picks (`nvfp4_tiles` /
  `fp8_tiles`; the grouped kernel for expert stacks);
- `auto` (FP8, INT8): what `weights.quant` dispatches (FP8: `fp8_decode_way`, the kernel or
  XLA's dot; INT8, which has no kernel: `int8_xla_matmul`, `--formats int8`);
- `xla_dot`: codes converted to bf16, times the block scale, one `dot_general` (float32
  accumulation) — XLA's GEMM fusion may take the converts in;
- `xla_dot_blocks` (NVFP4): the dot contracting K as (K/16, 16) on both operands, so the block
  scale is a plain broadcast (no reshape) inside the weight operand XLA may fuse;
- `xla_reduce`: the same product as float32 multiplies and a sum over K (a reduction fusion:
  the row-reduction emitter reads the packed weight once per output row);
- `reference`: the float32 weight and a full-precision float32 dot (kernel_mode "reference"; the
  GPU prefill path of NVFP4 / FP8 before `weights.quant` took the XLA dot for it);
- expert stacks: `xla_pairs`, the per-(token, expert) gather of packed bytes with the native
  convert, fused into the reduction (what model/mlp.py's gather path could become).

Figures are weight + scale bytes read per second against `measure_hbm_read` of the same run;
batches of more than 64 rows (`--batches 4096`: prefill, where `kernel` is what `weights.quant`
runs there) are TFLOP/s against the bf16 matmul rate of the same run.
Every formulation is checked against the float32 reference (2% of max |y|) before its time
counts. The optimized HLO of the gate_up points is written beside the records (`--hlo-out`),
so the fusion XLA chose can be read. Records: bench/results/xla-quant-<machine>.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.ceilings import QUICK, Sizes, measure_hbm_read, measure_matmul, relative_error
from bench.kernels import (
    L2_DEFEAT_BYTES,
    MAX_COPIES,
    SHAPES,
    _random_weight,
    _time_compiled,
    quant_matmul_fn,
    warm_gpu,
)
from bench.moe_kernels import QUICK_SHAPE, QWEN3_NEXT_80B, random_stack, routing, routings_per_call
from bench.record import git_commit, machine_name, machine_slug, make_record, write_records
from infernix_jax.model.mlp import _sort_pairs, _unsort_pairs
from infernix_jax.weights.quant import (
    NVFP4Weight,
    e2m1_codes,
    fp8_xla_matmul,
    grouped_expert_matmul,
    kernel_mode,
    nvfp4_block_values,
    nvfp4_xla_matmul,
)
from pallas_kernels.fp8_matmul import reference_fp8_matmul
from pallas_kernels.nvfp4_matmul import reference_nvfp4_matmul

QUICK_SHAPES = {"tiny": {"wide": (256, 512)}}
CONTRACT_K = (((1,), (1,)), ((), ()))
PREFILL_ROWS = 64  # more rows than this (weights.quant.SMALL_M_MAX) are timed as prefill, in TFLOP/s


nvfp4_xla_dot = nvfp4_xla_matmul  # what weights.quant runs for NVFP4 prefill rows on a GPU


def nvfp4_xla_dot_blocks(x, packed, block_scale, tensor_scale):
    """The dot with K kept as (K/16 blocks, 16) on both sides: the block scale is then a plain
    broadcast along the last axis of the weight operand, with no reshape between it and the dot."""
    codes = e2m1_codes(packed).reshape(*block_scale.shape, 16).astype(jnp.bfloat16)  # [N, K/16, 16]
    w = codes * block_scale.astype(jnp.bfloat16)[..., None]  # [N, K/16, 16]
    xb = x.astype(jnp.bfloat16).reshape(x.shape[0], *block_scale.shape[1:], 16)  # [M, K/16, 16]
    y = jax.lax.dot_general(xb, w, (((1, 2), (1, 2)), ((), ())), preferred_element_type=jnp.float32)
    return (y * tensor_scale).astype(x.dtype)


def nvfp4_xla_reduce(x, packed, block_scale, tensor_scale):
    w = nvfp4_block_values(packed, block_scale, jnp.float32)
    y = jnp.sum(x.astype(jnp.float32)[:, None, :] * w[None], axis=-1)
    return (y * tensor_scale).astype(x.dtype)


fp8_xla_dot = fp8_xla_matmul  # what weights.quant runs for FP8 when it picks XLA


def fp8_xla_reduce(x, data, scale):
    y = jnp.sum(x.astype(jnp.float32)[:, None, :] * data.astype(jnp.float32)[None], axis=-1)
    return (y * scale).astype(x.dtype)


FORMS = {
    "nvfp4": {"kernel": quant_matmul_fn("nvfp4", {}), "xla_dot": nvfp4_xla_dot,
              "xla_dot_blocks": nvfp4_xla_dot_blocks, "xla_reduce": nvfp4_xla_reduce,
              "reference": quant_matmul_fn("nvfp4", {}, mode="reference")},
    "fp8": {"kernel": quant_matmul_fn("fp8", {}, fp8_mode="kernel"), "xla_dot": fp8_xla_dot,
            "xla_reduce": fp8_xla_reduce, "auto": quant_matmul_fn("fp8", {}),
            "reference": quant_matmul_fn("fp8", {}, mode="reference")},
    # INT8 has no kernel: "auto" is its dot (int8_xla_matmul), "reference" the float32 path it replaced
    "int8": {"auto": quant_matmul_fn("int8", {}), "reference": quant_matmul_fn("int8", {}, mode="reference")},
}
def reference_int8_matmul(x, data, scale):
    """float32 x @ (int8 W * per-row scale).T at full precision."""
    w = data.astype(jnp.float32) * scale[:, None]
    return jnp.dot(x.astype(jnp.float32), w.T, precision=jax.lax.Precision.HIGHEST)


REFERENCES = {"nvfp4": reference_nvfp4_matmul, "fp8": reference_fp8_matmul, "int8": reference_int8_matmul}


def _record_form(form: str, details: dict) -> str:
    """The form's name in a record: past the kernels' rows `kernel` is what weights.quant runs."""
    return "weights.quant" if form == "kernel" and details.get("flops") else form


def _over_copies(one):
    return jax.jit(lambda xs, ws: tuple(one(x, *w) for x, w in zip(xs, ws)))


def dense_points(shapes, formats, batches):
    by_shape = {}
    for model, layers in shapes.items():
        for layer, nk in layers.items():
            by_shape.setdefault(nk, []).append(f"{model} {layer}")
    return [(fmt, nk, names, b) for nk, names in by_shape.items() for fmt in formats for b in batches]


# ------------------------------------------------------------------------------------- experts


def expert_pairs_f4(x, ids, packed, block_scale, tensor_scale):
    """x [T, K], ids [T, k] -> [T, k, N]: each pair's expert gathered as packed bytes, unpacked by
    the native convert inside the fused reduction."""
    w = nvfp4_block_values(packed[ids], block_scale[ids], jnp.float32)  # [T, k, N, K]
    y = jnp.sum(x.astype(jnp.float32)[:, None, None, :] * w, axis=-1)
    return (y * tensor_scale[ids][..., None]).astype(x.dtype)


def expert_pairs_kernel(x, ids, packed, block_scale, tensor_scale):
    """The production grouped path: pairs sorted by expert, the grouped kernel, un-sorted."""
    t, k = ids.shape
    order, sizes = _sort_pairs(ids, packed.shape[0])
    rows = jnp.take(x, order // k, axis=0)
    with kernel_mode("auto"):
        ys = grouped_expert_matmul(rows, NVFP4Weight(packed, block_scale, tensor_scale), sizes, tokens=t)
    return _unsort_pairs(ys, order, ids)


def expert_pairs_reference(x, ids, packed, block_scale, tensor_scale):
    t, k = ids.shape
    out = []
    for r in range(t):
        for j in range(k):
            e = ids[r, j]
            out.append(reference_nvfp4_matmul(x[r : r + 1], packed[e], block_scale[e], tensor_scale[e])[0])
    return jnp.stack(out).reshape(t, k, -1)


EXPERT_FORMS = {"kernel": expert_pairs_kernel, "xla_pairs": expert_pairs_f4}


# ----------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(prog="python -m bench.xla_quant", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny shapes: check the formulations anywhere")
    parser.add_argument("--formats", default="nvfp4,fp8")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--models", default=",".join(SHAPES))
    parser.add_argument("--no-experts", action="store_true", help="skip the expert-stack points")
    parser.add_argument("--forms", help="only these formulations (comma-separated; default all)")
    parser.add_argument("--budget-s", type=float, default=420.0, help="wall-clock cap (points past it skipped)")
    parser.add_argument("--compile-threads", type=int, default=8)
    parser.add_argument("--hlo-out", help="write the optimized HLO of the largest points here")
    parser.add_argument("--out", help="output file (default: bench/results/xla-quant-<machine>.json)")
    args = parser.parse_args(argv)
    t0 = time.perf_counter()
    sizes = QUICK if args.quick else Sizes()
    shapes = QUICK_SHAPES if args.quick else {m: SHAPES[m] for m in args.models.split(",")}
    batches = [int(b) for b in args.batches.split(",")]
    machine, commit = machine_name(), git_commit()
    out_path = args.out or f"xla-quant-{machine_slug(machine)}{'-quick' if args.quick else ''}.json"
    hbm = measure_hbm_read(sizes)
    print(f"{hbm.name}: {hbm.figure:.1f} GB/s", flush=True)
    prefill = any(b > PREFILL_ROWS for b in batches)
    bf16_rate = measure_matmul(jnp.bfloat16, sizes) if prefill else None
    if bf16_rate:
        print(f"{bf16_rate.name}: {bf16_rate.figure:.1f} TFLOP/s", flush=True)
    pool = concurrent.futures.ThreadPoolExecutor(args.compile_threads)
    records, failures, hlo = [], [], []

    def time_forms(label, forms, args_of_copy, copies, reference, weight_bytes, details):
        xs_ws = [args_of_copy(c) for c in range(copies)]
        xs, ws = tuple(a[0] for a in xs_ws), tuple(a[1:] for a in xs_ws)
        want = reference(xs[0], *ws[0])
        lowered = {}
        for form, fn in forms.items():
            try:
                lowered[form] = _over_copies(fn).lower(xs, ws)
            except Exception as e:  # noqa: BLE001 - a formulation this backend cannot lower
                lowered[form] = e
        futures = {f: pool.submit(low.compile) for f, low in lowered.items() if not isinstance(low, Exception)}
        row, compiled = {}, {}
        for form in forms:
            try:
                if form not in futures:
                    raise lowered[form]
                comp = futures[form].result()
                rel = relative_error(comp(xs, ws)[0], want)
                if rel > 2e-2:
                    failures.append(f"{label} {form}: differs from the reference by {rel:.3g} of max|y|")
                    row[form] = {"error": failures[-1]}
                    continue
                compiled[form] = comp
                row[form] = {"rel_err": rel}
                if args.hlo_out and ("gate_up" in label) and form not in ("kernel", "auto"):
                    hlo.append(f"// ===== {label} {form}\n{comp.as_text()}")
            except Exception as e:  # noqa: BLE001 - recorded, the run goes on
                row[form] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        # The GPU clocks down while the compiles run: busy it first, then time the forms in two
        # rounds in opposite orders and keep each form's faster round, so no form is timed cold.
        warm_gpu([lambda comp=comp: comp(xs, ws) for comp in compiled.values()])
        order = list(compiled)
        for round_order in (order, order[::-1]):
            for form in round_order:
                try:
                    seconds = _time_compiled(compiled[form], xs, ws, copies)
                except Exception as e:  # noqa: BLE001
                    row[form] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                    continue
                if "error" not in row[form]:
                    row[form]["s"] = min(seconds, row[form].get("s", seconds))
                    row[form]["gb_s"] = weight_bytes / row[form]["s"] / 1e9
                    if details.get("flops"):
                        row[form]["tflop_s"] = details["flops"] / row[form]["s"] / 1e12
        for form, r in row.items():
            if "s" not in r:
                print(f"  {label} {form}: {r['error'][:200]}", flush=True)
                continue
            figure, unit, ceiling = (r["tflop_s"], "TFLOP/s", bf16_rate.figure) if "tflop_s" in r else (
                r["gb_s"], "GB/s", hbm.figure)
            records.append(
                make_record(
                    f"{label} {_record_form(form, details)}", figure, unit, ceiling, unit, machine=machine,
                    commit=commit,
                    details={**details, "form": form, "median_s": r["s"], "weight_and_scale_bytes": weight_bytes,
                             "max_rel_err_vs_reference": r["rel_err"], "weight_copies": copies,
                             "jax": jax.__version__},
                )
            )
        cells = "  ".join(
            f"{f} {r.get('tflop_s', r.get('gb_s')):7.1f}" if "s" in r else f"{f}    err" for f, r in row.items()
        )
        print(f"{label:58s} {cells}  [{time.perf_counter() - t0:.0f} s]", flush=True)
        write_records(records, out_path)

    for fmt, (n, k), names, batch in dense_points(shapes, args.formats.split(","), batches):
        if time.perf_counter() - t0 > args.budget_s:
            print(f"budget spent: skipping {fmt} {n}x{k} batch{batch}")
            continue
        _, _, weight_bytes = _random_weight(fmt, n, k, jax.random.key(0))
        copies = max(1, min(MAX_COPIES, math.ceil(L2_DEFEAT_BYTES / weight_bytes)))

        def args_of_copy(c, fmt=fmt, n=n, k=k, batch=batch):
            w, _, _ = _random_weight(fmt, n, k, jax.random.key(n * 7 + k + c))
            x = jax.random.normal(jax.random.key(100 * batch + c), (batch, k), jnp.bfloat16)
            return (x, *w)

        if batch > PREFILL_ROWS:  # prefill rows: TFLOP/s against the bf16 matmul rate
            label = f"prefill matmul {names[0]} {n}x{k} {fmt} m{batch}"
            extra = {"flops": 2 * batch * n * k}
        else:
            label = f"decode matmul {names[0]} {n}x{k} {fmt} batch{batch}"
            extra = {}
        forms = {f: fn for f, fn in FORMS[fmt].items() if not args.forms or f in args.forms.split(",")}
        time_forms(label, forms, args_of_copy, copies, REFERENCES[fmt], weight_bytes,
                   {"n": n, "k": k, "batch": batch, "format": fmt, "layers": names, **extra})

    if not args.no_experts and "nvfp4" in args.formats:
        shape = QUICK_SHAPE if args.quick else QWEN3_NEXT_80B
        e, top_k = shape.num_experts, shape.top_k
        rng = np.random.default_rng(0)
        for proj, (n, k) in shape.projections.items():
            stack, _, per_expert = random_stack("nvfp4", e, n, k, jax.random.key(n + k))
            for batch in batches:
                if time.perf_counter() - t0 > args.budget_s:
                    print(f"budget spent: skipping experts {proj} batch{batch}")
                    continue
                copies = routings_per_call(batch, shape, per_expert)
                routings = [routing(rng, batch, shape, "uniform") for _ in range(copies)]
                distinct = sum(len(np.unique(r)) for r in routings) / copies
                weight_bytes = int(distinct * per_expert)

                def args_of_copy(c, k=k, batch=batch, routings=routings, stack=stack):
                    x = jax.random.normal(jax.random.key(c), (batch, k), jnp.bfloat16)
                    return (x, jnp.asarray(routings[c], jnp.int32), *stack)

                model = "tiny" if args.quick else "qwen3-next-80b"
                label = f"moe experts {model} {proj} {n}x{k} nvfp4 batch{batch} top{top_k}"
                time_forms(label, EXPERT_FORMS, args_of_copy, copies, expert_pairs_reference, weight_bytes,
                           {"n": n, "k": k, "batch": batch, "experts": e, "top_k": top_k,
                            "distinct_experts_per_step": distinct})
    pool.shutdown()
    if args.hlo_out:
        with open(args.hlo_out, "w") as f:
            f.write("\n\n".join(hlo))
    path = write_records(records, out_path)
    print(f"wrote {path} ({len(records)} records)")
    if failures:
        raise AssertionError("formulations differ from the reference:\n" + "\n".join(failures))
    return records


if __name__ == "__main__":
    main()
