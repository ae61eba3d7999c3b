"""The MoE routing kernel compiled against its plain-JAX reference: the same routing, and the time
of a call of each.

    python -m bench.moe_routing                  # GPU: the 80B-A3B router (512 experts, top 10, D 2048)
    python -m bench.moe_routing --quick          # tiny sizes, the kernel interpreted (any machine)
    python -m bench.moe_routing --word-rows      # also the gate / up launch's float16 word rows
    python -m bench.moe_routing --num-warps 1,2,4   # the kernel's warps a program, in turn

For each token count, with and without padding tokens: whether the compiled kernel's experts,
order, rank, counts and rows equal the reference's (XLA's own routing, the model's "xla" way), how
far its weights are, and the device time of one call of each, from `--calls` calls chained inside
one program (each call's logits depend on the last call's outputs, so none is skipped), best of 5.
Figure: the kernel's microseconds a call; "ceiling": the reference's (the launches it replaces),
so fraction = kernel / reference (below 1: the kernel is faster). Records go to
bench/results/moe-routing-<machine>.json.
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from bench.chained_calls import best_seconds, chained
from bench.record import machine_name, machine_slug, make_record, write_records
from pallas_kernels.moe_routing import DEFAULT_NUM_WARPS, moe_routing, reference_moe_routing

OUTPUTS = ("weights", "ids", "order", "rank", "sizes", "xs", "words", "inverse")


def _tie(out) -> jax.Array:
    """A float32 scalar that depends on every output of a routing call."""
    return sum(jnp.ravel(a)[0].astype(jnp.float32) for a in out) + out[0].astype(jnp.float32).sum()


def measure(
    tokens: int,
    experts: int,
    top_k: int,
    hidden: int,
    padded: bool,
    calls: int,
    interpret: bool,
    word_rows: bool = False,
    num_warps: int = DEFAULT_NUM_WARPS,
) -> dict:
    k1, k2 = jax.random.split(jax.random.PRNGKey(tokens))
    logits = jax.random.normal(k1, (tokens, experts), jnp.float32) * 2
    x = jax.random.normal(k2, (tokens, hidden), jnp.bfloat16)
    valid = (jnp.arange(tokens) % 3 != 1) if padded else None
    kernel = functools.partial(
        moe_routing, top_k=top_k, renormalize=True, word_rows=word_rows, num_warps=num_warps, interpret=interpret
    )
    reference = functools.partial(reference_moe_routing, top_k=top_k, renormalize=True, word_rows=word_rows)
    want = jax.jit(lambda lg, x, v: reference(lg, x, v))(logits, x, valid)
    got = jax.jit(lambda lg, x, v: kernel(lg, x, v))(logits, x, valid)
    out = {"tokens": tokens, "padding_tokens": padded, "word_rows": word_rows, "num_warps": num_warps}
    for name, a, b in zip(OUTPUTS, want, got):  # the last two with word_rows only
        out[f"{name}_equal"] = bool(np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32)))
    out["weights_max_abs_diff"] = float(np.max(np.abs(np.asarray(want[0], np.float32) - np.asarray(got[0], np.float32))))
    out["kernel_us"] = best_seconds(chained(kernel, calls, _tie), logits, x, valid) / calls * 1e6
    out["reference_us"] = best_seconds(chained(reference, calls, _tie), logits, x, valid) / calls * 1e6
    return out


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,4,8,16")
    parser.add_argument("--experts", type=int, default=512)
    parser.add_argument("--top-k", type=int, default=10)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--calls", type=int, default=200, help="calls chained in one timed program")
    parser.add_argument("--word-rows", action="store_true",
                        help="also the sorted rows as the grouped word dot takes them (moe_routing's word_rows)")
    parser.add_argument("--num-warps", default=str(DEFAULT_NUM_WARPS),
                        help="comma-separated warps a program, each measured in turn")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="tiny sizes, the kernel interpreted (any machine)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    try:
        warps = [int(w) for w in args.num_warps.split(",")]
    except ValueError:
        parser.error(f"--num-warps takes comma-separated integers; got {args.num_warps!r}")
    if any(w not in (1, 2, 4, 8, 16) for w in warps):
        parser.error(f"--num-warps takes powers of two from 1 to 16; got {args.num_warps!r}")
    if args.quick:
        args.experts, args.top_k, args.hidden, args.calls = 32, 4, 64, 2
        args.tokens = "1,3" if args.tokens == parser.get_default("tokens") else args.tokens
    machine = machine_name()
    records = []
    points = [(t, p, w) for t in (int(t) for t in args.tokens.split(",")) for p in (False, True) for w in warps]
    for tokens, padded, num_warps in points:
        m = measure(tokens, args.experts, args.top_k, args.hidden, padded, args.calls, interpret=args.quick,
                    word_rows=args.word_rows, num_warps=num_warps)  # fmt: skip
        name = f"moe routing kernel E{args.experts} top{args.top_k} D{args.hidden} tokens{tokens}"
        name += (" padding" if padded else "") + (" word-rows" if args.word_rows else "")
        name += f" warps{num_warps}" if len(warps) > 1 else ""
        records.append(make_record(name, m["kernel_us"], "us/call", m["reference_us"], "us/call (XLA routing)",
                                   machine=machine, details=m))  # fmt: skip
        equal = all(m[f"{o}_equal"] for o in OUTPUTS[1:] if f"{o}_equal" in m)
        print(f"{name}: kernel {m['kernel_us']:.2f} us, XLA {m['reference_us']:.2f} us; routing equal: {equal}, "
              f"weights within {m['weights_max_abs_diff']:.2g}", flush=True)  # fmt: skip
        write_records(records, args.out or f"moe-routing-{machine_slug(machine)}.json")
    return records


if __name__ == "__main__":
    main()
