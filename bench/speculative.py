"""N-gram speculative decoding: accepted length on repetitive text and the decode speed-up.

    python -m bench.speculative                       # GPU: 27b shape, ctx 8K, batch 1 and 8
    python -m bench.speculative --shapes 27b --batches 1 --draft-tokens 4 --contexts 8192
    python -m bench.speculative --quick               # tiny shape, few tokens, any machine

Two measurements:

1. Acceptance, on a trained model (the bundled demo model, or --model DIR): "quote the prompt" /
   "edit the code" prompts, i.e. a held-out passage, a blank line, then the first part of the same
   passage again, so that the natural continuation repeats text already in the context. The engine
   generates greedily with spec="ngram"; the record's figure is the mean accepted length (tokens per
   row per verify step = accepted drafts + 1; ceiling: the window, draft tokens + 1), with the
   acceptance rate and the speed-up against the same engine without speculation in its details.
2. Speed-up on a model shape (random weights on the device, as bench.decode builds them): a plain
   greedy decode run gives each row's continuation and the baseline tok/s; the speculative run's
   drafter replays that continuation so that windows accept, on average, the accepted length
   measured in (1) (random weights never quote their prompt, so the acceptance must come from a
   trained model), and the rest of each window is a wrong draft, rejected as a real miss is. Figure:
   speculative tok/s; ceiling: baseline tok/s x accepted length (a verify step costing one decode
   step); details: the speed-up over the baseline.

Records go to bench/results/speculative-<machine>.json.
"""

from __future__ import annotations

import argparse
import gc
import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from bench.engine_setup import build_model, place_prompts_without_compute
from bench.record import context_label, git_commit, machine_name, make_record, write_records
from infernix_jax.cache import BLOCK_SIZE
from infernix_jax.engine.config import EngineConfig
from infernix_jax.engine.core import EngineCore
from infernix_jax.engine.protocol import GenerationRequest, SamplingParams

# ---------------------------------------------------------------------------------------------
# 1. acceptance on repetitive text


def quoting_prompts(ids: np.ndarray, count: int, passage: int, quoted: int, separator: Sequence[int]) -> list:
    """`count` prompts: passage tokens, the separator, then the first `quoted` tokens of the passage."""
    stride = max(1, (len(ids) - passage) // count)
    out = []
    for i in range(count):
        text = ids[i * stride : i * stride + passage].tolist()
        out.append(text + list(separator) + text[:quoted])
    return out


def run_engine(model, config: EngineConfig, prompts: list, new_tokens: int) -> tuple[float, EngineCore]:
    """Generate greedily for all prompts at once; returns (decode tok/s over the run, the core)."""
    core = EngineCore(model.config, model.params, config, model.tokenizer, model.eos_token_ids())
    for i, p in enumerate(prompts):
        core.add_request(
            GenerationRequest(f"q{i}", p, SamplingParams(max_tokens=new_tokens, ignore_eos=True))
        )
    start = time.perf_counter()
    while core.has_work():
        core.step()
    return core.metrics.generated_tokens / (time.perf_counter() - start), core


def measure_acceptance(args, machine: str, commit: str):
    from infernix_jax.demo.data import heldout_token_ids
    from infernix_jax.loaded_model import load

    model = load(args.model, max_context=args.passage * 2 + args.new_tokens + 64)
    if args.model is not None:
        raise SystemExit("--model: held-out token ids exist only for the demo model for now")
    ids = heldout_token_ids(None)
    separator = model.encode("\n\n") if model.tokenizer is not None else [0]
    prompts = quoting_prompts(ids, args.prompts, args.passage, args.passage // 2, separator)
    base = EngineConfig(
        max_concurrency=len(prompts), max_context=model.max_context, compilation_cache_dir=None,
        prefill_chunk=256, progress=False,
    )  # fmt: skip
    plain_rate, _ = run_engine(model, base, prompts, args.new_tokens)  # compiles, then measures
    plain_rate, _ = run_engine(model, base, prompts, args.new_tokens)
    spec = base.replace(spec="ngram", ngram_draft_tokens=args.draft_tokens, ngram_min_match=args.min_match)
    spec_rate, core = run_engine(model, spec, prompts, args.new_tokens)
    spec_rate, core = run_engine(model, spec, prompts, args.new_tokens)
    m = core.metrics
    name = f"speculative ngram acceptance demo quoting {args.draft_tokens} draft tokens"
    return make_record(
        name, m.mean_accepted_length, "tokens/step", args.draft_tokens + 1, "tokens/step",
        machine=machine, commit=commit,
        details={"acceptance_rate": m.acceptance_rate, "drafted": m.drafted_tokens, "accepted": m.accepted_tokens,
                 "verify_rows": m.spec_rows, "prompts": len(prompts), "passage_tokens": args.passage,
                 "new_tokens": args.new_tokens, "min_match": args.min_match, "plain_tok_s": plain_rate,
                 "speculative_tok_s": spec_rate, "speedup_demo_model": spec_rate / plain_rate},
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------
# 2. speed-up on a model shape


@dataclass
class ReplayDrafter:
    """Proposes each row's known greedy continuation so that windows accept `accepted_length` - 1
    drafts on average (exact in the mean: a running fractional budget), then one wrong token."""

    context: int
    continuation: dict  # prompt's first 8 tokens -> the greedy output of the plain run
    accepted_length: float
    vocab: int
    uses_mtp: bool = False
    owed: dict = field(default_factory=dict)

    def propose(self, tokens, device_drafts, limit):
        key = tuple(tokens[:8])
        out = self.continuation[key]
        done = len(tokens) - self.context
        self.owed[key] = self.owed.get(key, 0.0) + self.accepted_length - 1
        good = min(int(self.owed[key]), limit)
        self.owed[key] -= good
        drafts = list(out[done : done + good])
        if len(drafts) < limit and done + len(drafts) < len(out):
            drafts.append((out[done + len(drafts)] + 1) % self.vocab)  # a miss ends the window
        return drafts


def shape_config(batch: int, context: int, steps: int, draft_tokens: int, **spec) -> EngineConfig:
    max_context = context + 4 * steps * (draft_tokens + 1) + 1
    return EngineConfig(
        max_concurrency=batch, max_context=max_context, kv_capacity=batch * math.ceil(max_context / BLOCK_SIZE),
        prefill_chunk=256, prefill_shape_override=((1, 256),), decode_batch_sizes=(batch,),
        decode_steps_per_dispatch=steps, compilation_cache_dir=None, progress=False, **spec,
    )  # fmt: skip


def timed_steps(core: EngineCore, dispatches: int, until_tokens: int | None = None) -> float:
    core.step()  # warm (the programs were compiled at start)
    start_tokens, start = core.metrics.generated_tokens, time.perf_counter()
    for _ in range(dispatches):
        core.step()
        if until_tokens is not None and core.metrics.generated_tokens - start_tokens >= until_tokens:
            break
    return (core.metrics.generated_tokens - start_tokens) / (time.perf_counter() - start)


def measure_shape(cfg, params, shape, batch, context, args, accepted_length, machine, commit):
    plain = EngineCore(cfg, params, shape_config(batch, context, args.steps, args.draft_tokens))
    place_prompts_without_compute(plain, batch, context)
    plain_rate = timed_steps(plain, args.dispatches)
    generated = plain.metrics.generated_tokens
    continuation = {tuple(s.prompt[:8]): list(s.output) for s in plain.requests.values()}
    del plain
    gc.collect()
    config = shape_config(batch, context, args.steps, args.draft_tokens, spec="ngram",
                          ngram_draft_tokens=args.draft_tokens)  # fmt: skip
    core = EngineCore(cfg, params, config)
    core.speculation.drafter = ReplayDrafter(context, continuation, accepted_length, cfg.vocab_size)
    place_prompts_without_compute(core, batch, context)
    spec_rate = timed_steps(core, 10 * args.dispatches * args.steps, until_tokens=generated - 2 * batch)
    m = core.metrics
    name = f"speculative ngram {shape} batch{batch} {context_label(context)} {args.draft_tokens} draft tokens"
    record = make_record(
        name, spec_rate, "tok/s", plain_rate * accepted_length, "tok/s", machine=machine, commit=commit,
        details={"plain_tok_s": plain_rate, "speedup": spec_rate / plain_rate, "target_accepted_length": accepted_length,
                 "measured_accepted_length": m.mean_accepted_length, "draft_tokens": args.draft_tokens,
                 "batch": batch, "context": context, "plain_steps_per_dispatch": args.steps,
                 "verify_state_MiB": core.speculation.state_bytes(batch) / 2**20},
    )  # fmt: skip
    del core
    gc.collect()
    return record


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default="27b")
    parser.add_argument("--contexts", default="8192")
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--draft-tokens", type=int, default=4, help="n-gram draft tokens per window")
    parser.add_argument("--min-match", type=int, default=2, help="ngram_min_match")
    parser.add_argument("--steps", type=int, default=8, help="plain decode steps per dispatch")
    parser.add_argument("--dispatches", type=int, default=8, help="plain decode dispatches timed")
    parser.add_argument("--model", default=None, help="trained model for the acceptance (default: demo)")
    parser.add_argument("--prompts", type=int, default=8, help="quoting prompts for the acceptance")
    parser.add_argument("--passage", type=int, default=192, help="tokens of each quoted passage")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--accepted-length", type=float, default=None,
                        help="skip (1) and replay this accepted length on the shapes")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="tiny shape and sizes (any machine)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.shapes, args.contexts, args.batches, args.dispatches = "tiny", "256", "1,4", 2
        args.prompts, args.passage, args.new_tokens = 2, 48, 24
    machine, commit = machine_name(), git_commit()
    records = []
    accepted_length = args.accepted_length
    if accepted_length is None:
        record = measure_acceptance(args, machine, commit)
        print(f"{record.name}: {record.figure:.2f} tokens/step (acceptance {record.details['acceptance_rate']:.2f}, "
              f"demo-model speed-up {record.details['speedup_demo_model']:.2f}x)", flush=True)  # fmt: skip
        records.append(record)
        accepted_length = record.figure
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    for shape in args.shapes.split(","):
        cfg, params = build_model(shape, dtype)
        for context in (int(c) for c in args.contexts.split(",")):
            for batch in (int(b) for b in args.batches.split(",")):
                record = measure_shape(
                    cfg, params, shape, batch, context, args, accepted_length, machine, commit
                )
                print(f"{record.name}: {record.figure:.1f} tok/s, {record.details['speedup']:.2f}x over "
                      f"{record.details['plain_tok_s']:.1f} (accepted length "
                      f"{record.details['measured_accepted_length']:.2f})", flush=True)  # fmt: skip
                records.append(record)
        del params
    slug = re.sub(r"[^a-z0-9]+", "-", machine.lower()).strip("-")
    print(
        "wrote",
        write_records(records, args.out or f"speculative-{slug}{'-quick' if args.quick else ''}.json"),
    )
    return records


if __name__ == "__main__":
    main()
