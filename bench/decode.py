"""Engine decode throughput against the HBM roofline.

    python -m bench.decode                                   # GPU: 27b and moe, ctx 8K/32K, batch 1/8
    python -m bench.decode --shapes 27b --contexts 1024,131072 --batches 1,8,64
    python -m bench.decode --shapes 27b --contexts 8192 --batches 1 --weights nvfp4
    python -m bench.decode --shapes moe --contexts 8192 --weights nvfp4
    python -m bench.decode --quick                           # tiny model, any machine
    python -m bench.decode --quick --weights nvfp4

For each (shape, context, batch) the engine runs decode dispatches of `--steps` steps over
`batch` requests whose prompts of `context` tokens are already in the cache (zeros: decode cost
does not depend on KV values). Figure: generated tokens per second over all rows, measured by the
engine's own step loop (host work included). Ceiling: HBM read bandwidth measured in the same run
divided by the bytes one step must read (weights with top-k experts, every row's KV, the state
slots) times the batch. The record's details carry the host's share of decode time.

`--weights nvfp4|fp8` quantizes the random model's projections and routed experts on the device,
leaf by leaf (bench.engine_setup.quantized_params); quantized weights count as their packed bytes
plus scales in the ceiling. On a GPU, NVFP4 / FP8 weights run through the Pallas kernels
(infernix_jax/weights/quant.py); on the CPU through the dequantizing reference. Record names
carry the weight format ("decode 27b nvfp4 batch1 ctx8k"; the KV dtype follows it when not bf16).
Records go to bench/results/decode-<machine>.json (`-<weights>` added for quantized weights).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import itertools
import os
import time
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from bench.ceilings import QUICK, Sizes, measure_hbm_read
from bench.engine_setup import (
    QWEN_SAMPLING,
    WEIGHT_FORMATS,
    build_model,
    decode_bytes_per_step,
    make_core,
    place_prompts_without_compute,
)
from bench.profile_summary import format_summary, profile_device
from bench.record import context_label, git_commit, machine_name, machine_slug, make_record, write_records
from infernix_jax.cache import attention_choice
from infernix_jax.cache.attention_choice import recurrent_update_mode
from infernix_jax.engine.sampling import engine_plan, search_bits_for_backend, search_width_mode, wants_top
from infernix_jax.model.mlp import (
    MOE_ROUTING_WAYS,
    moe_routing,
    moe_routing_mode,
    router_top_k,
    shared_expert_rows_mode,
)
from infernix_jax.weights.quant import (
    GROUPED_DOTS,
    GROUPED_ROWS,
    NORM_ROWS,
    SCALE_SPREADS,
    STREAMED_GEMV_MODES,
    SWIGLU_ROWS,
    WORD_DOTS,
    WORD_ROWS,
    current_modes,
    fp8_decode_mode,
    fused_experts,
    fused_projections,
    norm_rows,
    nvfp4_grouped_dot,
    nvfp4_grouped_rows,
    nvfp4_scale_spread,
    nvfp4_streamed_gemv,
    nvfp4_word_dot,
    nvfp4_word_rows,
    streamed_experts,
    swiglu_rows,
)


def record_name(shape: str, weights: str, kv_dtype: str, batch: int, context: int) -> str:
    """E.g. "decode 27b nvfp4 batch1 ctx8k"; a KV dtype other than bf16 follows the weights."""
    formats = weights if kv_dtype == "bf16" else f"{weights} kv-{kv_dtype}"
    return f"decode {shape} {formats} batch{batch} {context_label(context)}"


def measure(cfg, params, shape, batch, context, steps, dispatches, kv_dtype, bandwidth, machine, commit,
            weights="bf16", profile=False, profile_top=25, profile_engine=False, loop_graphs=False,
            sampling=None):  # fmt: skip
    dtype = params.final_norm.dtype
    engine_traced = 3 if profile_engine else 0
    core = make_core(
        cfg, params, batch=batch, context=context, steps=steps, kv_dtype=kv_dtype, prefill_chunk=256,
        new_tokens=steps * (dispatches + 3 + engine_traced), warmup=False, prefix_cache=False,  # + the dispatch run ahead
        decode_loop_graphs=loop_graphs,
    )
    place_prompts_without_compute(core, batch, context, sampling=sampling)
    core.step()  # compile / warm the decode program
    start_metrics = (
        core.metrics.decode_wall_s,
        core.metrics.decode_device_wait_s,
        core.metrics.generated_tokens,
    )
    start = time.perf_counter()
    for _ in range(dispatches):
        core.step()
    wall = time.perf_counter() - start
    tokens = core.metrics.generated_tokens - start_metrics[2]
    if tokens != batch * steps * dispatches:
        raise RuntimeError(f"timed {tokens} tokens, expected {batch * steps * dispatches}: rows stopped early")
    decode_wall = core.metrics.decode_wall_s - start_metrics[0]
    device_wait = core.metrics.decode_device_wait_s - start_metrics[1]
    engine_profile = {}
    if profile_engine:  # the engine loop itself under the profiler: where the host's time per dispatch goes
        engine_profile = profile_device(core.step, repeats=engine_traced, top=profile_top)
        print(format_summary(engine_profile), flush=True)
    device_s, decode = device_only_dispatch_s(core, batch, steps, dispatches)
    profiled = {}
    if profile:  # two more device-only dispatches under the profiler: kernels and idle gaps
        profiled = profile_device(lambda: core.runner.decode(decode), repeats=2, top=profile_top)
        for device in profiled.get("devices", []):  # launches a decode step, total and by family
            device["kernels_per_step"] = device["kernels"] / (2 * steps)
            for family in device.get("categories", {}).values():
                family["per_step"] = family["kernels"] / (2 * steps)
        print(format_summary(profiled), flush=True)
    step_bytes = decode_bytes_per_step(cfg, params, batch, context, kv_dtype, dtype)
    ceiling = batch * bandwidth / step_bytes
    figure = tokens / wall
    name = record_name(shape, weights, kv_dtype, batch, context)
    return make_record(name, figure, "tok/s", ceiling, "tok/s", machine=machine, commit=commit, details={
        "weights": weights, "kv_dtype": kv_dtype, "batch": batch, "context": context,
        "steps_per_dispatch": steps, "dispatches": dispatches,
        "bytes_per_step": step_bytes, "hbm_read_GBps": bandwidth / 1e9,
        "host_fraction": 1 - dispatches * device_s / wall,
        "host_fraction_not_waiting": 1 - device_wait / decode_wall if decode_wall > 0 else None,
        "ms_per_step": 1e3 * wall / (dispatches * steps),
        "device_ms_per_step": 1e3 * device_s / steps,
        **({"profile": profiled} if profile else {}),
        **({"engine_profile": engine_profile} if profile_engine else {}),
    })  # fmt: skip


def device_only_dispatch_s(core, batch: int, steps: int, dispatches: int):
    """(seconds, its input) of one decode dispatch on the device alone: the same program enqueued back to back
    (JAX dispatch is asynchronous, so the host's work hides behind the device's). The engine loop's
    wall time above this is host overhead: scheduling, the launch, reading tokens back, events.
    Runs after the timed loop (it rewrites the rows' next positions; the engine is discarded)."""
    decode = core.runner.empty_decode(batch, steps)
    params = [state.request.sampling for state in core.scheduler.running]
    decode.sampling, decode.with_top = engine_plan(params), wants_top(params)  # as core._run_decode
    for i, state in enumerate(core.scheduler.running):
        decode.tokens[i] = state.token_at(state.num_computed)
        decode.positions[i] = state.num_computed
        decode.block_table[i, : len(state.blocks)] = state.blocks
        decode.slots[i] = state.slot
        decode.max_steps[i] = steps
    jax.block_until_ready(core.runner.decode(decode))
    start = time.perf_counter()
    for _ in range(dispatches):
        out = core.runner.decode(decode)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / dispatches, decode


class VariantSwitch(NamedTuple):
    """An NVFP4 kernel switch of weights.quant that a run measures in turn. Its `current_modes`
    key, its environment variable (INFERNIX_ + key) and the flag (--key without "nvfp4_") all
    follow from the context manager's name."""

    switch: Callable[[str], contextlib.AbstractContextManager[None]]
    plain: str  # the value whose records keep the plain name
    tag: str  # the record name's tag before any other value
    choices: tuple[str, ...]
    what: str  # the flag's help

    @property
    def key(self) -> str:
        return self.switch.__name__

    @property
    def arg(self) -> str:
        return self.key.removeprefix("nvfp4_")


NVFP4_VARIANT_SWITCHES = (
    VariantSwitch(nvfp4_scale_spread, "reshape", "scale-spread-", SCALE_SPREADS,
                  "how the NVFP4 decode gemvs meet each word with its block scale"),
    VariantSwitch(nvfp4_streamed_gemv, "auto", "", STREAMED_GEMV_MODES, "the streamed NVFP4 gemv of single rows"),
    VariantSwitch(nvfp4_grouped_dot, "auto", "grouped-", GROUPED_DOTS,
                  "the grouped kernel's formulation for NVFP4 experts at decode"),
    VariantSwitch(nvfp4_grouped_rows, "xla", "grouped-rows-", GROUPED_ROWS,
                  "where the grouped dot_jw makes its float16 rows (with --grouped-dot dot_jw)"),
    VariantSwitch(nvfp4_word_dot, "dot_w", "word-", WORD_DOTS, "the float16 word dot of NVFP4 weights at rows past one"),
    VariantSwitch(nvfp4_word_rows, "xla", "word-rows-", WORD_ROWS,
                  "where the dense NVFP4 word kernels (gemv_w, gemv_ws, dot_jw) make their float16 rows"),
    VariantSwitch(norm_rows, "source", "norm-rows-", NORM_ROWS,
                  "where the NVFP4 word kernels after a layer's norms get their float16 rows (one launch with the norm)"),
    VariantSwitch(swiglu_rows, "xla", "swiglu-rows-", SWIGLU_ROWS,
                  "where the grouped down projection of NVFP4 experts gets the float16 rows of its SwiGLU input"),
)  # fmt: skip


def xla_gpu_flags_tag(xla_flags: str) -> str:
    """" xla[...]" naming the XLA GPU flags a run was given (an XLA variant timed beside the
    default gets a record name of its own); "" without any. Other XLA flags (the test suite's
    optimization level, dumps) change no GPU figure and name nothing."""
    gpu_flags = [f.removeprefix("--xla_gpu_") for f in xla_flags.split() if f.startswith("--xla_gpu_")]
    return f" xla[{' '.join(gpu_flags)}]" if gpu_flags else ""


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default="27b,moe")
    parser.add_argument("--contexts", default="8192,32768")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--steps", type=int, default=8, help="decode steps per dispatch")
    parser.add_argument("--dispatches", type=int, default=8)
    parser.add_argument("--kv-dtype", default="bf16")
    parser.add_argument("--sampling", default="greedy", choices=("greedy", "qwen"),
                        help="the requests' sampling: greedy, or Qwen's recommended temperature 0.7, top_p 0.8, "
                             "top_k 20 (records named 'sampled')")  # fmt: skip
    parser.add_argument("--weights", default="bf16", choices=WEIGHT_FORMATS,
                        help="projections and experts in bf16, or quantized to nvfp4 / fp8 on the device")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="tiny model and sizes (any machine)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--fp8-decode", default="auto",
                        help="FP8 weights: comma-separated ways of their decode matmuls to measure in turn "
                             "(auto, kernel, xla; weights.quant.fp8_decode_mode)")  # fmt: skip
    parser.add_argument("--fused-projections", default="rows",
                        help="rows, on, off or several (rows,on): one launch for a layer's NVFP4 projections of "
                             "one input (weights.quant.matmuls; rows: also at 2-16 rows), measured in turn")  # fmt: skip
    parser.add_argument("--fused-experts", default=None,
                        help="on, off or on,off: an expert's gate and up stacks in one grouped launch "
                             "(weights.quant.fused_experts; default: INFERNIX_FUSED_EXPERTS), measured in turn")  # fmt: skip
    parser.add_argument("--streamed-experts", default=None,
                        help="on, off or on,off: NVFP4 experts at decode batches through the grouped kernel's "
                             "streamed gemv (weights.quant.streamed_experts; default: INFERNIX_STREAMED_EXPERTS), "
                             "measured in turn")  # fmt: skip
    parser.add_argument("--gdn-decode", default=None,
                        help="comma-separated ways of the linear-attention recurrence in decode to measure in turn "
                             "(auto, kernel, xla; cache.attention_choice.recurrent_update_mode; default: "
                             "INFERNIX_GDN_DECODE's)")  # fmt: skip
    parser.add_argument("--profile-top", type=int, default=25,
                        help="with --profile: kernels (by total time) and idle gaps the record keeps")  # fmt: skip
    parser.add_argument("--router-top-k", default="compare",
                        help="compare, sort or compare,sort: the MoE router's top-k at decode by comparisons "
                             "or lax.top_k's sort (model.mlp.router_top_k), measured in turn")  # fmt: skip
    parser.add_argument("--moe-routing", default=None,
                        help=f"comma-separated ways of {', '.join(MOE_ROUTING_WAYS)}: a resident MoE layer's routing "
                             "at decode in XLA's launches or one kernel's (model.mlp.moe_routing; default: "
                             "INFERNIX_MOE_ROUTING), measured in turn")  # fmt: skip
    for v in NVFP4_VARIANT_SWITCHES:
        parser.add_argument(f"--{v.arg.replace('_', '-')}", default=None,
                            help=f"comma-separated values of {', '.join(v.choices)}: {v.what} (weights.quant.{v.key}; "
                                 f"default: INFERNIX_{v.key.upper()}), measured in turn")  # fmt: skip
    parser.add_argument("--loop-graphs", default="off",
                        help="on, off or on,off: the decode program's step loop inside one CUDA graph "
                             "(EngineConfig.decode_loop_graphs), measured in turn")  # fmt: skip
    parser.add_argument("--profile-engine", action="store_true",
                        help="also trace three steps of the engine loop (host and device): where the host's "
                             "time beyond the device's goes")  # fmt: skip
    parser.add_argument("--profile", action="store_true",
                        help="also trace two device-only dispatches: busy share and top kernels in the record")  # fmt: skip
    args = parser.parse_args(argv)
    if args.moe_routing and not set(args.moe_routing.split(",")) <= set(MOE_ROUTING_WAYS):
        parser.error(f"--moe-routing takes {', '.join(MOE_ROUTING_WAYS)}; got {args.moe_routing!r}")
    if args.quick:
        args.shapes, args.contexts, args.batches, args.dispatches = "tiny", "256", "1,4", 2
    machine, commit = machine_name(), git_commit()
    bandwidth = measure_hbm_read(QUICK if args.quick else Sizes()).rate
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    slug = machine_slug(machine)
    suffix = ("" if args.weights == "bf16" else f"-{args.weights}") + ("-quick" if args.quick else "")
    out = args.out or f"decode-{slug}{suffix}.json"
    records = []
    for shape in args.shapes.split(","):
        cfg, params = build_model(shape, dtype, weights=args.weights)
        for context in (int(c) for c in args.contexts.split(",")):
            for batch in (int(b) for b in args.batches.split(",")):
                experts = args.fused_experts.split(",") if args.fused_experts else [None]
                streamed = args.streamed_experts.split(",") if args.streamed_experts else [None]
                gdn_ways = args.gdn_decode.split(",") if args.gdn_decode else [None]
                routings = args.moe_routing.split(",") if args.moe_routing else [None]
                variants = [getattr(args, flag).split(",") if getattr(args, flag) else [None]
                            for flag in (v.arg for v in NVFP4_VARIANT_SWITCHES)]  # fmt: skip
                modes = [
                    (m, f, x, g, st, lg, tk, rt, vs) for m in args.fp8_decode.split(",")
                    for f in args.fused_projections.split(",") for x in experts for g in gdn_ways for st in streamed
                    for lg in args.loop_graphs.split(",") for tk in args.router_top_k.split(",") for rt in routings
                    for vs in itertools.product(*variants)
                ]  # fmt: skip
                for mode, fused, fused_x, gdn, streamed_x, loops, top_k, routing, picked in modes:
                    if len(modes) > 1:  # engines of one shape share traced programs: trace again
                        jax.clear_caches()
                    experts_ctx = fused_experts(fused_x == "on") if fused_x else contextlib.nullcontext()
                    streamed_ctx = (
                        streamed_experts(streamed_x == "on") if streamed_x else contextlib.nullcontext()
                    )
                    gdn_ctx = recurrent_update_mode(gdn) if gdn else contextlib.nullcontext()
                    routing_ctx = moe_routing(routing) if routing else contextlib.nullcontext()
                    with (
                        fp8_decode_mode(mode), fused_projections(fused), experts_ctx, gdn_ctx, streamed_ctx,
                        router_top_k(top_k), routing_ctx, contextlib.ExitStack() as variant_ctx,
                    ):  # read at trace  # fmt: skip
                        for v, value in zip(NVFP4_VARIANT_SWITCHES, picked, strict=True):
                            if value:
                                variant_ctx.enter_context(v.switch(value))
                        record = measure(cfg, params, shape, batch, context, args.steps, args.dispatches,
                                         args.kv_dtype, bandwidth, machine, commit, args.weights, args.profile,
                                         args.profile_top, args.profile_engine, loops == "on",
                                         QWEN_SAMPLING if args.sampling == "qwen" else None)  # fmt: skip
                    if args.sampling != "greedy":
                        record.name += " sampled"
                        record.details["sampling"] = dataclasses.asdict(QWEN_SAMPLING)
                    if mode != "auto":
                        record.name += f" fp8-decode-{mode}"
                    if fused != "rows":  # the default's records keep their names
                        record.name += f" fused-projections-{fused}"
                    if fused_x == "on":
                        record.name += " fused-experts"
                    if gdn:
                        record.name += f" gdn-decode-{gdn}"
                    if streamed_x == "on":
                        record.name += " streamed-experts"
                    if loops == "on":
                        record.name += " loop-graphs"
                    record.name += xla_gpu_flags_tag(os.environ.get("XLA_FLAGS", ""))
                    if top_k != "compare":
                        record.name += f" top-k-{top_k}"
                    if routing == "kernel":
                        record.name += " moe-routing-kernel"
                    for v, value in zip(NVFP4_VARIANT_SWITCHES, picked, strict=True):
                        if value and value != v.plain:
                            record.name += f" {v.tag}{value.replace('_', '-')}"
                        record.details[v.key] = value or current_modes()[v.key]
                    record.details["router_top_k"] = top_k
                    record.details["search_bits"] = search_width_mode()  # INFERNIX_SEARCH_BITS
                    record.details["search_bits_used"] = search_bits_for_backend(batch)  # sampled rows' width
                    if search_width_mode() != "auto":
                        record.name += f" search-bits-{search_width_mode()}"
                    record.details["moe_routing"] = routing or moe_routing_mode()
                    record.details["shared_expert_rows"] = shared_expert_rows_mode()
                    record.details["loop_graphs"] = loops
                    if os.environ.get("XLA_FLAGS"):
                        record.details["xla_flags"] = os.environ["XLA_FLAGS"]
                    record.details["gdn_decode"] = gdn or attention_choice.current_modes()["recurrent"]
                    record.details["streamed_experts"] = streamed_x or current_modes()["streamed_experts"]
                    record.details["fp8_decode"] = mode
                    record.details["fused_projections"] = fused
                    record.details["fused_experts"] = fused_x or current_modes()["fused_experts"]
                    print(f"{record.name}: {record.figure:.1f} tok/s = {record.fraction:.1%} of {record.ceiling:.1f}"
                          f" (host {record.details['host_fraction']:.1%})", flush=True)  # fmt: skip
                    records.append(record)
                    write_records(records, out)  # after each record: a run cut short keeps what it measured
                    gc.collect()  # the engine's device buffers go with it, before the next one is sized
        del params
        gc.collect()  # a shape's weights must be gone before the next shape's are made
    print("wrote", write_records(records, out))
    return records


if __name__ == "__main__":
    main()
