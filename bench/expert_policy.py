"""The expert cache's swap policy on synthetic routing traces: expert copies per step, against
static placement.

    python -m bench.expert_policy            # Qwen3-Next-80B-A3B's MoE shape, 8 GiB of slots
    python -m bench.expert_policy --quick    # a short run (the test)

The real `ExpertCache` (scores, proposals, the payback gate) is fed routing that a trace draws,
with the slots of the 80B shape at an 8 GiB budget (101 of 512 experts a layer, top-10), and the
planned swaps applied every `--steps-per-dispatch` steps as the engine applies them between
dispatches. Traces: "uniform" (every expert equally likely: what random weights give), "hot" (a
fixed hot set of `--hot` experts a layer takes `--hot-share` of the choices), "shifting" (the
same, the hot set drawn anew every `--period` steps). Policies: "static" (no swaps), "gated"
(`payback` 1.0, the engine's default), "ungated" (`payback` 0: every proposal made).

Figure: expert copies a step (misses, each a copy into the step, plus promotions) per layer; no
hardware ceiling applies (a simulation), so `fraction` is static placement's copies over the
policy's: how many times fewer bytes cross PCIe. Records go to bench/results/expert-policy-cpu.json.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import numpy as np

from bench.record import git_commit, machine_name, make_record, write_records
from infernix_jax.experts.cache import ExpertCache
from infernix_jax.experts.layout import ExpertLayout
from infernix_jax.experts.store import ExpertStore

POLICIES = {"static": None, "gated": 1.0, "ungated": 0.0}  # name -> payback (None: no swaps)

Trace = Callable[[int], np.ndarray]  # step -> routed expert ids per layer, bool [L, E]


def make_trace(kind: str, layers: int, experts: int, top_k: int, batch: int, hot: int, hot_share: float,
               period: int, seed: int) -> Trace:  # fmt: skip
    """A routing trace: each token of `batch` picks `top_k` distinct experts per layer."""
    rng = np.random.default_rng(seed)
    hot_sets: list[np.ndarray] = []

    def draw(step: int) -> np.ndarray:
        if kind != "uniform" and (not hot_sets or (kind == "shifting" and step % period == 0)):
            hot_sets[:] = [rng.choice(experts, hot, replace=False) for _ in range(layers)]
        routed = np.zeros((layers, experts), bool)
        for layer in range(layers):
            for _ in range(batch):
                if kind == "uniform":
                    routed[layer, rng.choice(experts, top_k, replace=False)] = True
                    continue
                from_hot = rng.binomial(top_k, hot_share)
                chosen = set(rng.choice(hot_sets[layer], min(from_hot, hot), replace=False).tolist())
                while len(chosen) < top_k:
                    chosen.add(int(rng.integers(experts)))
                routed[layer, list(chosen)] = True
        return routed

    return draw


def simulate(trace: Trace, policy: str, layers: int, experts: int, slots: int, steps: int,
             steps_per_dispatch: int) -> dict:  # fmt: skip
    """Run the cache over `steps` of `trace` from the placement at start (experts 0..slots-1)."""
    layout = ExpertLayout(tuple(range(layers)), experts, ((1,),), (np.dtype(np.uint8),), None)
    payback = POLICIES[policy]
    cache = ExpertCache(layout, ExpertStore(layout), slots, payback=payback or 0.0,
                        swaps_per_layer=0 if payback is None else 4, reads_in_program=True)  # fmt: skip
    for layer in range(layers):
        for slot in range(slots):
            cache.assign(layer, slot, slot)
    promotions = 0
    for step in range(steps):
        routed = trace(step)
        signed = np.where(routed & (cache.slot_map < 0), -1, routed.astype(np.int64))
        cache.record_routing(tuple(range(layers)), signed)
        if step % steps_per_dispatch == steps_per_dispatch - 1:
            for swap in cache.plan_swaps():
                cache.assign(swap.layer, swap.slot, swap.expert)
                promotions += 1
    s = cache.stats
    misses = s.lookups - s.gpu_hits
    return {
        "hit_rate": s.hit_rate,
        "misses": misses,
        "promotions": promotions,
        "swaps_held": s.swaps_held,
        "copies_per_layer_step": (misses + promotions) / (steps * layers),
    }


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick", action="store_true", help="4 layers, 400 steps, a hot set that moves every 200"
    )
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--experts", type=int, default=512)
    parser.add_argument("--top-k", type=int, default=10)
    parser.add_argument("--slots", type=int, default=101, help="slots a layer (101: 8 GiB for the 80B shape)")
    parser.add_argument("--steps", type=int, default=1600)
    parser.add_argument("--steps-per-dispatch", type=int, default=8)
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--traces", default="uniform,hot,shifting")
    parser.add_argument("--hot", type=int, default=40)
    parser.add_argument("--hot-share", type=float, default=0.7)
    parser.add_argument("--period", type=int, default=400, help="steps between hot-set moves (shifting)")
    parser.add_argument("--out", default="expert-policy-cpu.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.layers, args.steps, args.period = 4, 400, 200
    machine, commit = machine_name(), git_commit()
    records = []
    for batch in [int(b) for b in args.batches.split(",")]:
        for kind in args.traces.split(","):
            results = {}
            for policy in POLICIES:
                trace = make_trace(kind, args.layers, args.experts, args.top_k, batch, args.hot, args.hot_share,
                                   args.period, seed=batch)  # fmt: skip
                results[policy] = simulate(trace, policy, args.layers, args.experts, args.slots, args.steps,
                                           args.steps_per_dispatch)  # fmt: skip
            static = results["static"]["copies_per_layer_step"]
            for policy, r in results.items():
                name = (f"expert policy simulation {args.experts} experts top{args.top_k} {args.slots} slots "
                        f"trace {kind} batch{batch} {policy} copies per layer-step")  # fmt: skip
                details = {**vars(args), "batch": batch, "trace": kind, "policy": policy, **r}
                record = make_record(name, r["copies_per_layer_step"], "expert copies/layer-step", None, None,
                                     fraction=static / r["copies_per_layer_step"] if r["copies_per_layer_step"] else None,
                                     machine=machine, commit=commit, details=details)  # fmt: skip
                print(f"{name}: {r['copies_per_layer_step']:.2f} ({record.fraction:.2f}x fewer than static), "
                      f"hit rate {r['hit_rate']:.1%}, {r['promotions']} swaps, {r['swaps_held']} held", flush=True)  # fmt: skip
                records.append(record)
    path = write_records(records, args.out)
    print(f"wrote {path}")
    return records


if __name__ == "__main__":
    main()
