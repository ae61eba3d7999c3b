"""Engine prefill throughput and time to first token against the tensor-core roofline.

    python -m bench.prefill                                  # GPU: 27b and moe, ctx 8K/32K, batch 1/8
    python -m bench.prefill --shapes moe --contexts 1024,131072 --batches 1
    python -m bench.prefill --shapes 27b --contexts 8192 --batches 1 --weights nvfp4
    python -m bench.prefill --quick                          # tiny model, any machine

For each (shape, context, batch) `batch` prompts of `context` random tokens go through the engine
with max_tokens=1 (chunked prefill, `--chunk` tokens per step); the figure is prompt tokens per
second from submission to the last first token, and the time to first token of the first request
is in the details. Ceiling: the bf16 matmul rate measured in the same run divided by the FLOPs
the prompts need (2 x active parameters per token + causal attention 4 x n^2/2 x heads x head_dim
per attention layer). `--weights nvfp4|fp8|fp8_block|int8` quantizes the projections and experts as bench.decode
does (on a GPU their prefill rows go through `weights.quant`'s XLA dot in bf16). Records go to
bench/results/prefill-<machine>.json (`-<weights>` added for quantized weights).
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.ceilings import QUICK, Sizes, measure_matmul
from bench.engine_setup import WEIGHT_FORMATS, active_params_per_token, build_model, make_core
from bench.record import context_label, git_commit, machine_name, machine_slug, make_record, write_records
from infernix_jax.engine.protocol import GenerationRequest, SamplingParams


def prompt_flops(cfg, params, context: int) -> float:
    active = active_params_per_token(cfg, params)
    attention = len(cfg.full_attention_layers) * 4 * (context**2 / 2) * cfg.num_heads * cfg.head_dim
    return 2 * active * context + attention


def measure(cfg, params, shape, batch, context, chunk, rate, machine, commit, weights="bf16"):
    start = time.perf_counter()
    core = make_core(
        cfg, params, batch=batch, context=context, steps=1, kv_dtype="bf16", prefill_chunk=chunk,
        warmup=False, prefix_cache=False,  # the warm-up run compiles what the prompts use; no hits
    )
    print(f"  {shape} batch{batch} ctx{context}: engine ready in {time.perf_counter() - start:.0f} s", flush=True)
    rng = np.random.default_rng(0)

    def run_once(tag: str) -> tuple[float, float]:
        start = time.perf_counter()
        first = None
        for i in range(batch):
            prompt = rng.integers(0, cfg.vocab_size, size=context).tolist()
            core.add_request(
                GenerationRequest(f"{tag}{i}", prompt, SamplingParams(max_tokens=1, ignore_eos=True))
            )
        while core.has_work():
            for event in core.step():
                if event.finished and first is None:
                    first = time.perf_counter() - start
        return time.perf_counter() - start, first

    warm, _ = run_once("warm")  # compiles the chunk programs
    print(f"  warm-up prefill (compiles included) {warm:.0f} s", flush=True)
    wall, ttft = run_once("bench")
    figure = batch * context / wall
    ceiling = rate / (prompt_flops(cfg, params, context) / context)
    name = f"prefill {shape} {weights} batch{batch} {context_label(context)}"
    return make_record(name, figure, "tok/s", ceiling, "tok/s", machine=machine, commit=commit, details={
        "batch": batch, "context": context, "chunk": chunk, "ttft_s": ttft, "wall_s": wall,
        "matmul_bf16_TFLOPs": rate / 1e12, "warmup_s": warm, "weights": weights,
    })  # fmt: skip


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default="27b,moe")
    parser.add_argument("--contexts", default="8192,32768")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--chunk", type=int, default=4096, help="prefill chunk (tokens per step)")
    parser.add_argument("--weights", default="bf16", choices=WEIGHT_FORMATS,
                        help="projections and experts in bf16, or quantized to nvfp4 / fp8 on the device")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="tiny model and sizes (any machine)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.shapes, args.contexts, args.batches, args.chunk = "tiny", "256", "1,2", 64
    machine, commit = machine_name(), git_commit()
    rate = measure_matmul(jnp.bfloat16, QUICK if args.quick else Sizes()).rate
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    records = []
    for shape in args.shapes.split(","):
        start = time.perf_counter()
        cfg, params = build_model(shape, dtype, weights=args.weights)
        print(f"{shape}: random weights built in {time.perf_counter() - start:.0f} s", flush=True)
        for context in (int(c) for c in args.contexts.split(",")):
            for batch in (int(b) for b in args.batches.split(",")):
                record = measure(cfg, params, shape, batch, context, args.chunk, rate, machine, commit, args.weights)
                print(f"{record.name}: {record.figure:.0f} tok/s = {record.fraction:.1%} of {record.ceiling:.0f}, "
                      f"ttft {record.details['ttft_s']:.3f}s", flush=True)  # fmt: skip
                records.append(record)
        del params
    slug = machine_slug(machine)
    suffix = ("" if args.weights == "bf16" else f"-{args.weights}") + ("-quick" if args.quick else "")
    print("wrote", write_records(records, args.out or f"prefill-{slug}{suffix}.json"))
    return records


if __name__ == "__main__":
    main()
