"""Decode with experts beyond device memory, against the PCIe bound.

    python -m bench.experts                      # GPU: Qwen3-Next-80B-A3B shape, 12 of 48 layers
    python -m bench.experts --layers 48          # the full depth (needs ~44 GB of host RAM for experts)
    python -m bench.experts --quick              # tiny model, any machine (the CPU in tests)
    python -m bench.experts --host-reads callback   # missed experts fetched by host callbacks
    python -m bench.experts --host-copy dma         # copied in the program by one callback a layer
    python -m bench.experts --hot-experts 64        # routing with a hot set: the dynamic cache's case
    python -m bench.experts --prefetch              # the next layer's guessed misses copied ahead
    python -m bench.experts --prefetch both         # without, then with it, on the same model

The model has Qwen3-Next-80B-A3B's layer shapes with random weights, every routed expert random
NVFP4 (packed bytes, e4m3 block scales, a float32 scale per expert). `--layers` keeps the first
N of the 48 layers; the GPU expert budgets (8, 16, 32 GiB) are budgets for the full 48-layer
model and are scaled by N / 48, so each layer gets the slots it would have at full depth and the
hit rates match. For each budget (and all-resident: the plain model with no slots) the engine
decodes `--dispatches` dispatches of `--steps` steps at batch 1 and 4 over prompts placed in the
cache without compute; each step's time is kept (`step_marks`), and the rate of the later half.

Figure: generated tokens per second (the engine's own step loop, host work included).
Ceiling (the PCIe bound): pinned-host -> device bandwidth measured in the same run divided by
the expert bytes that crossed to the device per generated token (missed experts fetched into
the steps plus experts promoted into slots). `fraction` = figure / ceiling. Each budget also runs
once with the slots frozen (static placement, the same budget) at batch 1, for comparison; it
runs first, on the placement at start (after a dynamic point it would inherit the slots that
point learned: with `--hot-experts`, routing with a hot set, that matters).
Records go to bench/results/experts-<machine>.json; names contain "expert" and "pcie".
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.ceilings import QUICK, Sizes, measure_host_to_device
from bench.engine_setup import QWEN3_NEXT_24_LAYERS, TINY, place_prompts_without_compute
from bench.profile_summary import MARK, format_summary, profile_device
from bench.record import git_commit, machine_name, machine_slug, make_record, write_records
from infernix_jax.cache import BLOCK_SIZE
from infernix_jax.config import ModelConfig
from infernix_jax.engine.config import EngineConfig
from infernix_jax.engine.core import EngineCore
from infernix_jax.model import host_copy as host_copy_module
from infernix_jax.model import mlp as mlp_module
from infernix_jax.model.params import Decl, declare_params, map_decls, param_dtype
from infernix_jax.weights.quant import NVFP4Weight

GiB = 1 << 30
FULL_LAYERS = 48  # Qwen3-Next-80B-A3B's depth: budgets are given for it
QUICK_SHAPE = dict(TINY, num_experts=32, num_experts_per_tok=4)


def model_config(layers: int, quick: bool) -> ModelConfig:
    shape = dict(QUICK_SHAPE) if quick else dict(QWEN3_NEXT_24_LAYERS, num_hidden_layers=layers)
    return ModelConfig.from_hf_config(shape)


def random_nvfp4(key: jax.Array, shape: tuple[int, ...]) -> NVFP4Weight:
    """Random packed NVFP4 [E, N, K]: uniform codes, block scales in [0.5, 2), a scale per expert
    of 1 / (6 * sqrt(K)) so activations stay of order one."""
    k1, k2 = jax.random.split(key)
    e, n, k = shape
    packed = jax.random.bits(k1, (e, n, k // 2), jnp.uint8)
    block = jax.random.uniform(k2, (e, n, k // 16), jnp.float32, 0.5, 2.0).astype(jnp.float8_e4m3fn)
    scale = jnp.full((e,), 1.0 / (6.0 * np.sqrt(k)), jnp.float32)
    return NVFP4Weight(packed=packed, block_scale=block, tensor_scale=scale)


def random_params(cfg: ModelConfig, dtype, seed: int = 0):
    """Random weights on the default device; routed experts straight in NVFP4 (never bf16)."""
    key = jax.random.key(seed)

    def make(path, decl: Decl):
        nonlocal key
        key, sub = jax.random.split(key)
        names = [getattr(p, "name", "") for p in path]
        if "moe" in names and len(decl.shape) == 3:  # routed expert stacks [E, N, K]
            return random_nvfp4(sub, decl.shape)
        return decl.make(sub, param_dtype(decl, dtype), cfg.zero_centered_norm)

    return map_decls(make, declare_params(cfg, with_mtp=False))


def hot_routing(cfg: ModelConfig, params, hot: int, strength: float, seed: int = 0):
    """Give the random model routing with a hot set: per MoE layer `hot` experts (random ids) that
    the router prefers for every token, so that a cache has something to learn.

    Random weights route without locality (every expert equally likely at every step), where no
    placement beats another. Here every token's embedding gets one constant coordinate (4 times the
    embedding's spread), each MoE layer's norm passes that coordinate through unscaled, and the hot
    experts' router rows read it with a weight that adds about `strength` standard deviations of
    the random logits. Returns (params, hot ids [MoE layers, hot])."""
    rng = np.random.default_rng(seed)
    embed = params.embed
    c = 4.0 * float(jnp.std(embed.astype(jnp.float32)))
    params = dataclasses.replace(params, embed=embed.at[:, 0].set(c))
    hot_ids, layers = [], list(params.layers)
    unit = 0.0 if cfg.zero_centered_norm else 1.0  # the norm weight that scales by one
    for i, layer in enumerate(layers):
        if layer.moe is None:
            continue
        ids = np.sort(rng.choice(cfg.num_experts, hot, replace=False))
        router = layer.moe.router
        spread = float(jnp.std(router.astype(jnp.float32))) * np.sqrt(router.shape[-1])  # random logits' std
        column = np.zeros(cfg.num_experts, np.float32)
        column[ids] = strength * spread / 4.0  # the coordinate reads ~4 after the norm
        moe = dataclasses.replace(layer.moe, router=router.at[:, 0].set(jnp.asarray(column, router.dtype)))
        layers[i] = dataclasses.replace(layer, moe=moe, post_norm=layer.post_norm.at[0].set(unit))
        hot_ids.append(ids)
    return dataclasses.replace(params, layers=tuple(layers)), np.stack(hot_ids)


def make_core(
    cfg,
    params,
    *,
    context: int,
    steps: int,
    gpu_budget,
    prefill_chunk: int = 16,
    host_reads: str = "auto",
    host_copy: str = "auto",
    batches: tuple[int, ...] = (1, 4),
    prefetch: bool = False,
    cpu_share: float | str = "auto",
    prefetch_blocks: int = EngineConfig.expert_prefetch_blocks,
    prefetch_guesses: int = 0,
) -> EngineCore:
    """The engine of one budget; it compiles a decode program for each of `batches` only."""
    batch = max(batches)
    config = EngineConfig(
        max_concurrency=batch, max_context=context + 64 * steps, kv_capacity=batch * -(-(context + 64 * steps) // BLOCK_SIZE),
        prefill_chunk=prefill_chunk, prefill_shape_override=((1, prefill_chunk),), decode_batch_sizes=tuple(sorted(set(batches))),
        decode_steps_per_dispatch=steps, compilation_cache_dir=None, progress=False, prefix_cache=False,
        structured_output=False, scoring=False, gpu_expert_budget=gpu_budget, expert_host_reads=host_reads,
        expert_host_copy=host_copy, expert_prefetch=prefetch, expert_cpu_share=cpu_share,
        expert_prefetch_blocks=prefetch_blocks, expert_prefetch_guesses=prefetch_guesses,
    )  # fmt: skip
    return EngineCore(cfg, params, config)


def run_decode(core: EngineCore, batch: int, context: int, dispatches: int, seed: int, hot_ids=None) -> dict:
    """Tokens per second and expert traffic of `dispatches` decode steps at `batch` (with `hot_ids`,
    `hot_routing`'s sets: also the share of the routed tokens that went to them).

    With asynchronous decode each step reads one dispatch and leaves the next in flight, and the
    statistics wait for every routing report sent: the traffic is that of the `dispatches`
    dispatches after the ones whose tokens are counted (as many, at the same batch)."""
    for request_id in list(core.requests):
        core.abort(request_id)
    while core.ahead is not None:  # a dispatch the last point left in flight: read it first
        core.step()
    place_prompts_without_compute(core, batch, context, seed=seed)
    for _ in range(2):  # the first dispatches of this batch warm caches, slots and the pipeline
        core.step()
    experts = core.experts
    before = dataclasses.replace(experts.stats) if experts else None
    counts_before = experts.cache.routing_counts.copy() if experts else None
    tokens0 = core.metrics.generated_tokens
    start = time.perf_counter()
    m = core.metrics
    marks = []  # after each step: seconds and tokens since start, and the step's host time enqueuing,
    for _ in range(dispatches):  # waiting for the device's results, and rebalancing the expert slots
        host0 = (m.decode_enqueue_s, m.decode_device_wait_s, m.expert_rebalance_s)
        core.step()
        host1 = (m.decode_enqueue_s, m.decode_device_wait_s, m.expert_rebalance_s)
        spent = [b - a for a, b in zip(host0, host1)]
        marks.append((time.perf_counter() - start, m.generated_tokens - tokens0, *spent))
    wall = time.perf_counter() - start
    tokens = core.metrics.generated_tokens - tokens0
    out = {"tokens": tokens, "seconds": wall, "tok_s": tokens / wall, "step_marks": marks}
    if dispatches >= 4:  # the later half alone: a window that starts with the pipeline's head start
        (t_half, n_half, *_), (t_end, n_end, *_) = marks[dispatches // 2 - 1], marks[-1]
        out["later_half_tok_s"] = (n_end - n_half) / (t_end - t_half)
    if experts:
        s = experts.stats
        lookups = s.lookups - before.lookups
        out.update(
            hit_rate=(s.gpu_hits - before.gpu_hits) / lookups if lookups else 0.0,
            fetched_bytes=s.fetched_bytes - before.fetched_bytes,
            promoted_bytes=s.promoted_bytes - before.promoted_bytes,
            callback_seconds=s.fetch_seconds - before.fetch_seconds,
            promotions=s.promotions - before.promotions,
            swaps_held=s.swaps_held - before.swaps_held,  # proposals the payback gate did not make
            prefetched=s.prefetched - before.prefetched,  # next-layer guesses copied ahead (--prefetch)
            prefetch_used=s.prefetch_used - before.prefetch_used,  # ... that the next layer missed
            cpu_computed=s.cpu_computed - before.cpu_computed,  # misses the host's CPU computed
            cpu_seconds=s.cpu_seconds - before.cpu_seconds,
            # the rebalances' host time between steps, by part, and the slot programs they called
            rebalance_deliver_s=s.rebalance_deliver_seconds - before.rebalance_deliver_seconds,
            rebalance_plan_s=s.rebalance_plan_seconds - before.rebalance_plan_seconds,
            rebalance_apply_s=s.rebalance_apply_seconds - before.rebalance_apply_seconds,
            slot_programs=s.slot_programs - before.slot_programs,
        )
        out["moved_bytes_per_token"] = (out["fetched_bytes"] + out["promoted_bytes"]) / max(tokens, 1)
        # the guesses copied ahead that no layer used crossed PCIe for nothing: without them, the
        # bytes the step's own misses (and promotions) needed
        wasted = (out["prefetched"] - out["prefetch_used"]) * experts.layout.expert_bytes
        out["needed_bytes_per_token"] = out["moved_bytes_per_token"] - wasted / max(tokens, 1)
        counts = experts.cache.routing_counts - counts_before  # tokens routed per (MoE layer, expert)
        if hot_ids is not None and counts.sum():
            out["hot_share"] = float(np.take_along_axis(counts, hot_ids, axis=1).sum() / counts.sum())
    return out


def profiled_steps(core: EngineCore, steps: int) -> None:
    """`steps` engine steps, each inside a host trace annotation 'mark:step i' (`profile_summary.MARK`)."""
    for i in range(steps):
        with jax.profiler.TraceAnnotation(f"{MARK}step {i}"):
            core.step()


def ways_used(core: EngineCore) -> tuple[str | None, str | None]:
    """(host reads, host copy) the engine resolved its options to: ("program", way) when the
    programs copy misses themselves, ("callback", None) with fetch callbacks, (None, None) when
    nothing is offloaded."""
    experts = core.experts
    if experts is None:
        return None, None
    if not experts.cache.reads_in_program:
        return "callback", None
    slotted = experts.params.layers[experts.layout.moe_layers[0]].moe.gate_proj
    return "program", slotted.host_copy


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--layers", type=int, default=12, help="layers of the 48 kept (budgets scale by layers / 48)"
    )
    parser.add_argument(
        "--budgets", default="8,16,32", help="GPU expert budgets in GiB for the full 48-layer model"
    )
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=8, help="decode steps per dispatch")
    parser.add_argument(
        "--dispatches",
        type=int,
        default=6,
        help="timed dispatches per point, after two untimed ones (with offloaded experts the H200's steps "
        "alternate ~20 and ~95 ms, so a window of 2 read anywhere from 140 to 264 tok/s: docs/experts.md)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny model (32 experts, top-4), any machine")
    parser.add_argument(
        "--shares",
        default="0.19,0.37,0.74",
        help="--quick: budgets as shares of all experts (those of 8/16/32 GiB of the 80B model)",
    )
    parser.add_argument(
        "--host-reads",
        default="auto",
        choices=("auto", "callback", "program"),
        help="how missed experts reach the GPU (EngineConfig.expert_host_reads; auto: the engine's "
        "choice); records of 'program' say so in their names",
    )
    parser.add_argument(
        "--host-copy",
        default="auto",
        choices=("auto", "loop", "buckets", "dma", "mapped"),
        help="with host reads in the program: how the program copies them (EngineConfig.expert_host_copy; "
        "auto: the engine's choice); records of other than 'loop' name the way used",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after each budget's first point, --profile-steps more engine steps under the profiler: kernels and "
        "idle gaps of the device (bench/profile_summary.py), printed and kept in the record",
    )
    parser.add_argument(
        "--profile-steps",
        type=int,
        default=1,
        help="--profile: engine steps traced (each marked 'step i' on the host, so the device's idle "
        "gaps can be placed in the steps)",
    )
    parser.add_argument(
        "--hot-experts",
        type=int,
        default=0,
        help="routing with a hot set of this many experts per layer (`hot_routing`; 0: the random "
        "model's own routing, which has no locality); records say 'hot N' and the share routed to them",
    )
    parser.add_argument(
        "--hot-strength", type=float, default=2.0, help="the hot experts' router bonus in logit deviations"
    )
    parser.add_argument(
        "--gather-graphs",
        default="on",
        choices=("on", "off"),
        help="host copy 'mapped': whether XLA may record the gather's callback into its CUDA graphs "
        "(host_copy.MAPPED_IN_COMMAND_BUFFERS); records of 'off' say 'gather outside graphs'",
    )
    parser.add_argument(
        "--prefetch",
        nargs="?",
        const="on",
        default="off",
        choices=("off", "on", "both"),
        help="each MoE layer copies the next one's guessed misses ahead on a second stream "
        "(EngineConfig.expert_prefetch); records say 'prefetch' and count the guesses used; "
        "'both': each budget without, then with it (an A/B on one machine and one model)",
    )
    parser.add_argument(
        "--prefetch-blocks",
        default="32",
        help="blocks of the prefetch's mapped gather (EngineConfig.expert_prefetch_blocks), comma "
        "separated: each value is a point of its own; records say 'prefetch gatherN'",
    )
    parser.add_argument(
        "--prefetch-guesses",
        type=int,
        default=0,
        help="experts each token guesses for the next layer, the router's likeliest first "
        "(EngineConfig.expert_prefetch_guesses; 0: its top-k); records of a limit say 'guessesN'",
    )
    parser.add_argument(
        "--points",
        default="static,dynamic,resident",
        help="which points to run: static (batch 1, slots frozen), dynamic (every batch), resident "
        "(all experts on the GPU); leaving some out saves device time in A/B runs",
    )
    parser.add_argument(
        "--cpu-share",
        default="auto",
        help="with callback host reads: the share of each layer's misses the CPU computes "
        "(EngineConfig.expert_cpu_share; auto: the engine's cost model); records of a share above 0 "
        "say 'cpu share' and count the experts the CPU computed",
    )
    parser.add_argument(
        "--slot-reads",
        default=mlp_module.slot_reads_mode(),
        help="comma-separated ways the grouped kernel reads a slotted layer's routed experts (mlp.slot_reads: "
        "copy, in_place), each budget point run with each; records of in_place say 'slots read in place'",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    slot_ways = args.slot_reads.split(",")
    if set(slot_ways) - set(mlp_module.SLOT_READS):
        parser.error(f"--slot-reads takes {', '.join(mlp_module.SLOT_READS)}; got {args.slot_reads!r}")
    cpu_share = args.cpu_share if args.cpu_share == "auto" else float(args.cpu_share)
    points = set(args.points.split(","))
    if points - {"static", "dynamic", "resident"}:
        parser.error(f"--points takes static, dynamic, resident; got {args.points!r}")
    host_copy_module.MAPPED_IN_COMMAND_BUFFERS = args.gather_graphs == "on"
    machine, commit = machine_name(), git_commit()
    cfg = model_config(args.layers, args.quick)
    layers = cfg.num_layers
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    params = random_params(cfg, dtype)
    hot_ids = None
    if args.hot_experts:
        params, hot_ids = hot_routing(cfg, params, args.hot_experts, args.hot_strength)
    moe = params.layers[0].moe
    expert_bytes = (
        sum(x.nbytes for x in jax.tree.leaves((moe.gate_proj, moe.up_proj, moe.down_proj))) // cfg.num_experts
    )
    full_model_experts = expert_bytes * cfg.num_experts * (layers if args.quick else FULL_LAYERS)
    if args.quick:  # budgets as shares of the tiny model's experts: the same shares as 8/16/32 GiB of 80B's
        budgets = {f"{float(x):.0%}": int(float(x) * full_model_experts) for x in args.shares.split(",")}
    else:
        budgets = {f"{b}GiB": int(float(b) * GiB * layers / FULL_LAYERS) for b in args.budgets.split(",")}
    bandwidth = measure_host_to_device(QUICK if args.quick else Sizes()).rate
    shape = "tiny-moe32" if args.quick else f"qwen3-next-80b-a3b {layers}of{FULL_LAYERS}layers"
    if hot_ids is not None:
        shape += f" hot{args.hot_experts}"
    batches = [int(b) for b in args.batches.split(",")]
    slug = machine_slug(machine)
    out = args.out or f"experts-{slug}{'-quick' if args.quick else ''}.json"
    records = []
    with_blocks = [(True, int(b)) for b in args.prefetch_blocks.split(",")]
    prefetch_modes = {"off": [(False, 0)], "on": with_blocks, "both": [(False, 0), *with_blocks]}[
        args.prefetch
    ]
    offloaded = points & {"static", "dynamic"}  # without either, no budget point runs (nor is built)
    points_run = [
        (label, budget, prefetch, blocks, way)
        for label, budget in (budgets.items() if offloaded else ())
        for prefetch, blocks in prefetch_modes
        for way in slot_ways
    ]
    if "resident" in points:
        points_run.append(("all-resident", None, False, 0, slot_ways[0]))
    for label, budget, prefetch, blocks, way in points_run:
        with mlp_module.slot_reads(way):  # read while the decode programs trace, in the point's runs
            core = make_core(
                cfg, params, context=args.context, steps=args.steps, gpu_budget=budget,
                host_reads=args.host_reads, host_copy=args.host_copy, batches=tuple(batches),
                prefetch=prefetch, cpu_share=cpu_share, prefetch_blocks=blocks or EngineConfig.expert_prefetch_blocks,
                prefetch_guesses=args.prefetch_guesses,
            )  # fmt: skip
            # static placement first, while the slots still hold the placement at start (a dynamic
            # point before it would hand it the slots it learned); then the cache may swap
            runs = [(batches[0], "static")] if budget and "static" in points else []
            if budget is None or "dynamic" in points:
                runs += [(batch, "dynamic") for batch in batches]
            swaps = core.experts.cache.swaps_per_layer if budget else 0
            for batch, policy in runs:
                if budget:
                    core.experts.cache.swaps_per_layer = 0 if policy == "static" else swaps
                r = run_decode(core, batch, args.context, args.dispatches, seed=batch, hot_ids=hot_ids)
                if args.profile and (batch, policy) == runs[0]:
                    r["profile"] = profile_device(functools.partial(profiled_steps, core, args.profile_steps))
                    print(format_summary(r["profile"]), flush=True)
                host_reads, host_copy = ways_used(core)
                details = {"batch": batch, "layers": layers, "full_layers": FULL_LAYERS, "budget_bytes": budget,
                           "budget_full_model": label, "policy": policy, "expert_bytes": expert_bytes,
                           "pinned_host_GBps": bandwidth / 1e9, "steps_per_dispatch": args.steps,
                           "host_reads": host_reads, "host_copy": host_copy,
                           "gather_in_graphs": host_copy_module.MAPPED_IN_COMMAND_BUFFERS, **r}  # fmt: skip
                reads = " host reads in program" if host_reads == "program" else ""
                if reads and host_copy != "loop":
                    reads += f" copy {host_copy}"
                if host_copy == "mapped" and args.gather_graphs == "off":
                    reads += " gather outside graphs"
                if prefetch:
                    reads += " prefetch" + (f" gather{blocks}" if host_copy == "mapped" else "")
                    details["prefetch_blocks"] = blocks
                    if args.prefetch_guesses:
                        reads += f" guesses{args.prefetch_guesses}"
                    details["prefetch_guesses"] = args.prefetch_guesses
                    details["slot_reads"] = way
                if budget and way == "in_place":
                    reads += " slots read in place"
                share = core.experts.placement.cpu_share if core.experts is not None else 0.0
                details["cpu_share"] = share
                if share:
                    reads += f" cpu share {share:.2f}"
                name = f"experts decode {shape} nvfp4 gpu-expert-budget {label}{reads} batch{batch}"
                if budget is None:
                    record = make_record(f"{name} (no pcie traffic)", r["tok_s"], "tok/s", None, None,
                                         machine=machine, commit=commit, details=details)  # fmt: skip
                else:
                    per_token = r["moved_bytes_per_token"]
                    ceiling = bandwidth / per_token if per_token else None
                    suffix = " static placement" if policy == "static" else ""
                    needed = r["needed_bytes_per_token"]
                    details["needed_bound_tok_s"] = bandwidth / needed if needed else None  # no wasted guesses
                    record = make_record(f"{name}{suffix} vs pcie bound", r["tok_s"], "tok/s", ceiling,
                                         "tok/s (pcie bound)" if ceiling else None, machine=machine, commit=commit,
                                         details=details)  # fmt: skip
                hit = (
                    f", hit rate {r['hit_rate']:.1%}, host callbacks {r['callback_seconds'] / r['seconds']:.0%} of the time"
                    if "hit_rate" in r
                    else ""
                )
                if r.get("cpu_computed"):
                    hit += f", the CPU computed {r['cpu_computed']} misses"
                if r.get("promotions"):  # the rebalances' host time between steps (the log keeps it)
                    spent = [r[f"rebalance_{part}_s"] * 1e3 for part in ("deliver", "plan", "apply")]
                    hit += (
                        f", {r['promotions']} promotions in {r['slot_programs']} slot programs, rebalance "
                        "{:.1f} ms (reports {:.1f}, plan {:.1f}, swaps {:.1f})".format(sum(spent), *spent)
                    )
                if r.get("prefetched"):
                    hit += f", prefetched {r['prefetched']} experts, {r['prefetch_used'] / r['prefetched']:.0%} of them used"
                    if details.get("needed_bound_tok_s"):
                        hit += (
                            f", {r['tok_s'] / details['needed_bound_tok_s']:.1%} of the bound of the needed bytes"
                        )
                bound = (
                    f" = {record.fraction:.1%} of the pcie bound {record.ceiling:.1f}" if record.ceiling else ""
                )
                print(f"{record.name}: {r['tok_s']:.2f} tok/s{bound}{hit}", flush=True)
                records.append(record)
                write_records(records, out)  # after every point: a run cut short keeps what it measured
            if core.experts is not None:
                core.experts.close()
            del core
    print("wrote", write_records(records, out))
    return records


if __name__ == "__main__":
    main()
