"""N-gram speculative decoding: accepted length on repetitive text and the decode speed-up.

    python -m bench.speculative                       # GPU: 27b shape, ctx 8K, batch 1 and 8
    python -m bench.speculative --shapes 27b --batches 1 --draft-tokens 4 --contexts 8192
    python -m bench.speculative --quick               # tiny shape, few tokens, any machine
    python -m bench.speculative --quick --accepted-length 1.5,3 --dtype bfloat16   # replay only
    python -m bench.speculative --batches 1 --tree-width 3   # GPU: linear and tree rows, batch 1

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
   step); details: the speed-up over the baseline, the measured accepted length beside the target,
   and the plain decode step and the verify step in ms (per dispatch and per token of a row), so
   the cost of a verify step shows beside the speed-up.

   The replay only works if the speculative run picks the same greedy tokens as the plain run. With
   plain random weights it does not: their logits are nearly flat, and the verify window's forward
   (another numerical path than single-token decode) picks another argmax, so replayed drafts are
   rejected (accepted length 1.01 instead of 2.32 on an H200, bf16). The shape's weights are
   therefore made decisive first (`decisive_params`): the embedding is scaled up by EMBED_SCALE, so
   that the residual stream, and after the final norm the hidden state, is the current token's
   embedding (the layers' outputs are orders of magnitude smaller), and the output embedding is that
   same table, so the greedy next token is the current token: its logit, ~ EMBED_SCALE x hidden
   size, beats every other, ~ EMBED_SCALE x sqrt(2 x hidden size x ln vocab), several times over
   (27b: 5120 against ~360), which no difference between numerical paths overturns. Each row thus
   repeats its last prompt token (details: replay_continuation_decisive, the share of the plain
   run's tokens that do, 1.0). Decode cost does not depend on weight values (same shapes, dtypes
   and reads). The replay stops while every row still has a whole window of continuation left.
   `--dtype bfloat16` reproduces the GPU's dtype on the CPU; `--accepted-length 1.5,3` skips (1)
   and replays each listed length after one plain run.

Tree rows (`--tree-width W`, default 3; 1 for none): (1) also runs the engine with
spec_tree_width = W (up to W different n-gram continuations per window, merged into a tree), and
(2) replays the tree's accepted length with tree windows of the same size (the right branch among
W - 1 wrong ones of full depth, so the verify step pays for every node a real tree has).
`--tree-accepted-length` replays given lengths with trees when (1) is skipped.

Records go to bench/results/speculative-<machine>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from bench.engine_setup import build_model, place_prompts_without_compute
from bench.record import context_label, git_commit, machine_name, machine_slug, make_record, write_records
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


def measure_acceptance(args, machine: str, commit: str) -> list:
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
        prefill_chunk=256, progress=False, scoring=False,
    )  # fmt: skip
    plain_rate, _ = run_engine(model, base, prompts, args.new_tokens)  # compiles, then measures
    plain_rate, _ = run_engine(model, base, prompts, args.new_tokens)
    records = []
    for width in sorted({1, args.tree_width}):
        spec = base.replace(spec="ngram", ngram_draft_tokens=args.draft_tokens, ngram_min_match=args.min_match,
                            spec_tree_width=width)  # fmt: skip
        spec_rate, core = run_engine(model, spec, prompts, args.new_tokens)
        spec_rate, core = run_engine(model, spec, prompts, args.new_tokens)
        m = core.metrics
        tree = f" tree width {width}" if width > 1 else ""
        name = f"speculative ngram acceptance demo quoting {args.draft_tokens} draft tokens{tree}"
        records.append(make_record(
            name, m.mean_accepted_length, "tokens/step", args.draft_tokens + 1, "tokens/step",
            machine=machine, commit=commit,
            details={"acceptance_rate": m.acceptance_rate, "drafted": m.drafted_tokens, "accepted": m.accepted_tokens,
                     "verify_rows": m.spec_rows, "prompts": len(prompts), "passage_tokens": args.passage,
                     "new_tokens": args.new_tokens, "min_match": args.min_match, "plain_tok_s": plain_rate,
                     "speculative_tok_s": spec_rate, "speedup_demo_model": spec_rate / plain_rate,
                     "tree_width": width, "verify_window": spec.spec_window},
        ))  # fmt: skip
    return records


# ---------------------------------------------------------------------------------------------
# 2. speed-up on a model shape


EMBED_SCALE = 256.0  # embedding rms (1 at init) over the residual added by all layers (a few to tens)


def decisive_params(params):
    """The same random weights with a decisive greedy choice: the next token is the current one.

    The embedding is scaled by EMBED_SCALE so that it dominates the residual stream (the layers see
    it through their input norms, their outputs stay of order 1 and mostly round away), and the
    output embedding becomes that same table (a tied model already has it), so that the logit of the
    current token, ~ EMBED_SCALE * hidden size, beats every other one, ~ EMBED_SCALE *
    sqrt(2 hidden size ln vocab), by far more than any difference between numerical paths. Shapes,
    dtypes and therefore the decode cost are unchanged; an untied lm_head shares the embedding's
    buffer rather than holding a copy.
    """
    embed = params.embed * jnp.asarray(EMBED_SCALE, params.embed.dtype)
    return dataclasses.replace(params, embed=embed, lm_head=None if params.lm_head is None else embed)


@dataclass
class ReplayDrafter:
    """Proposes each row's known greedy continuation so that windows accept `accepted_length` - 1
    drafts on average (exact in the mean: a running fractional budget that starts at one half, so
    that the drafts accepted after n windows are n * (accepted_length - 1) rounded), then one wrong
    token."""

    context: int
    continuation: dict  # prompt's first 8 tokens -> the greedy output of the plain run
    accepted_length: float
    vocab: int
    depth: int = 0  # tree windows: tokens per branch (0: the window's limit)
    uses_mtp: bool = False
    owed: dict = field(default_factory=dict)

    def propose_branches(self, tokens, device_drafts, limit, width):
        """The replayed branch first, then width - 1 branches wrong from their first token, each as
        deep as the replayed one may be (so a tree window holds as many nodes as a real one)."""
        depth = min(limit, self.depth or limit)
        right = self.propose(tokens, device_drafts, depth)
        out = self.continuation[tuple(tokens[:8])][len(tokens) - self.context :][:depth]
        wrong = [[(t + 1 + k) % self.vocab for t in out] for k in range(1, width)]
        return [right] + [w for w in wrong if w]

    def propose(self, tokens, device_drafts, limit):
        key = tuple(tokens[:8])
        out = self.continuation[key]
        done = len(tokens) - self.context
        self.owed[key] = self.owed.get(key, 0.5) + self.accepted_length - 1
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
        decode_steps_per_dispatch=steps, compilation_cache_dir=None, progress=False, scoring=False,
        **spec,
    )  # fmt: skip


@dataclass(frozen=True)
class Timing:
    """Dispatches (core steps) timed, the tokens they generated (all rows) and their wall time."""

    dispatches: int
    tokens: int
    seconds: float

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds

    @property
    def ms_per_dispatch(self) -> float:
        return 1e3 * self.seconds / self.dispatches


def timed_steps(core: EngineCore, dispatches: int, until_generated: int | None = None) -> Timing:
    """Times up to `dispatches` core steps after a warm one, stopping once the core has generated
    `until_generated` tokens in all (warm step included)."""
    core.step()  # warm (the programs were compiled at start)
    start_tokens, start = core.metrics.generated_tokens, time.perf_counter()
    done = 0
    for _ in range(dispatches):
        if until_generated is not None and core.metrics.generated_tokens >= until_generated:
            break
        core.step()
        done += 1
    return Timing(done, core.metrics.generated_tokens - start_tokens, time.perf_counter() - start)


def measure_shape(cfg, params, shape, batch, context, args, accepted_lengths, machine, commit) -> list:
    """One plain run, then one speculative replay per (accepted length, tree width); a record per replay.

    `params` should be `decisive_params(...)` (see the module docstring)."""
    plain = EngineCore(cfg, params, shape_config(batch, context, args.steps, args.draft_tokens))
    place_prompts_without_compute(plain, batch, context)
    base = timed_steps(plain, args.dispatches)
    generated = plain.metrics.generated_tokens
    continuation = {tuple(s.prompt[:8]): list(s.output) for s in plain.requests.values()}
    # With decisive weights every row repeats its last prompt token; anything else means the replay
    # cannot be trusted.
    repeats = np.mean([t == s.prompt[-1] for s in plain.requests.values() for t in s.output])
    del plain
    gc.collect()
    plain_step_ms = base.ms_per_dispatch / args.steps  # one token per row per step
    records = []
    for accepted_length, width in accepted_lengths:
        config = shape_config(batch, context, args.steps, args.draft_tokens, spec="ngram",
                              ngram_draft_tokens=args.draft_tokens, spec_tree_width=width)  # fmt: skip
        core = EngineCore(cfg, params, config)
        core.speculation.drafter = ReplayDrafter(
            context, continuation, accepted_length, cfg.vocab_size, depth=args.draft_tokens
        )
        place_prompts_without_compute(core, batch, context)
        # Stop while every row still has a whole window of continuation left to replay (a window
        # past its end would have no drafts and pull the accepted length down).
        window = args.draft_tokens + 1
        spec = timed_steps(
            core, 10 * args.dispatches * args.steps, until_generated=generated - window * batch
        )
        m = core.metrics
        tree = f" tree width {width}" if width > 1 else ""
        name = f"speculative ngram {shape} batch{batch} {context_label(context)} {args.draft_tokens} draft tokens{tree}"
        verify_step_ms = spec.ms_per_dispatch  # one verify step per dispatch
        row_tokens_per_verify = spec.tokens / (spec.dispatches * batch)
        records.append(make_record(
            name, spec.tok_s, "tok/s", base.tok_s * accepted_length, "tok/s", machine=machine, commit=commit,
            details={"plain_tok_s": base.tok_s, "speedup": spec.tok_s / base.tok_s,
                     "target_accepted_length": accepted_length, "measured_accepted_length": m.mean_accepted_length,
                     "timed_tokens_per_row_per_verify_step": row_tokens_per_verify,
                     "plain_dispatch_ms": base.ms_per_dispatch, "plain_step_ms": plain_step_ms,
                     "plain_ms_per_row_token": plain_step_ms,
                     "verify_step_ms": verify_step_ms,
                     "verify_ms_per_row_token": verify_step_ms / row_tokens_per_verify,
                     "verify_step_in_plain_steps": verify_step_ms / plain_step_ms,
                     "plain_dispatches": base.dispatches, "verify_dispatches": spec.dispatches,
                     "replay_continuation_decisive": float(repeats),
                     "draft_tokens": args.draft_tokens, "batch": batch, "context": context,
                     "plain_steps_per_dispatch": args.steps, "params_dtype": str(params.final_norm.dtype),
                     "verify_state_MiB": core.speculation.state_bytes(batch) / 2**20,
                     "tree_width": width, "verify_window": config.spec_window},
        ))  # fmt: skip
        del core
        gc.collect()
    return records


def main(argv: list[str] | None = None):
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shapes", default=None, help="default 27b (--quick: tiny)")
    parser.add_argument("--contexts", default=None, help="default 8192 (--quick: 256)")
    parser.add_argument("--batches", default=None, help="default 1,8 (--quick: 1,4)")
    parser.add_argument("--draft-tokens", type=int, default=4, help="n-gram draft tokens per window")
    parser.add_argument("--min-match", type=int, default=2, help="ngram_min_match")
    parser.add_argument("--steps", type=int, default=8, help="plain decode steps per dispatch")
    parser.add_argument(
        "--dispatches", type=int, default=None, help="plain decode dispatches timed (default 8, --quick: 2)"
    )
    parser.add_argument("--model", default=None, help="trained model for the acceptance (default: demo)")
    parser.add_argument("--prompts", type=int, default=8, help="quoting prompts for the acceptance")
    parser.add_argument("--passage", type=int, default=192, help="tokens of each quoted passage")
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument(
        "--accepted-length",
        default=None,
        help="skip (1) and replay these accepted lengths (comma-separated) on the shapes",
    )
    parser.add_argument("--tree-width", type=int, default=3,
                        help="also measure tree windows of this many n-gram branches (1: none)")  # fmt: skip
    parser.add_argument(
        "--tree-accepted-length",
        default=None,
        help="with --accepted-length: also replay these accepted lengths with tree windows",
    )
    parser.add_argument("--dtype", choices=("auto", "float32", "bfloat16"), default="auto",
                        help="shape weights (auto: float32 on the CPU, bfloat16 elsewhere)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="tiny shape and sizes (any machine)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    defaults = {"shapes": "27b", "contexts": "8192", "batches": "1,8", "dispatches": 8}
    if args.quick:
        defaults = {"shapes": "tiny", "contexts": "256", "batches": "1,4", "dispatches": 2}
        args.prompts, args.passage, args.new_tokens = 2, 48, 24
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    machine, commit = machine_name(), git_commit()
    records = []
    if args.accepted_length is not None:
        accepted_lengths = [(float(a), 1) for a in args.accepted_length.split(",")]
        if args.tree_accepted_length and args.tree_width > 1:
            accepted_lengths += [(float(a), args.tree_width) for a in args.tree_accepted_length.split(",")]
    else:
        accepted_lengths = []
        for record in measure_acceptance(args, machine, commit):
            print(f"{record.name}: {record.figure:.2f} tokens/step (acceptance {record.details['acceptance_rate']:.2f}, "
                  f"demo-model speed-up {record.details['speedup_demo_model']:.2f}x)", flush=True)  # fmt: skip
            records.append(record)
            accepted_lengths.append((record.figure, record.details["tree_width"]))
    if args.dtype == "auto":
        dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    else:
        dtype = jnp.dtype(args.dtype)
    for shape in args.shapes.split(","):
        cfg, params = build_model(shape, dtype)
        params = decisive_params(params)
        for context in (int(c) for c in args.contexts.split(",")):
            for batch in (int(b) for b in args.batches.split(",")):
                for record in measure_shape(
                    cfg, params, shape, batch, context, args, accepted_lengths, machine, commit
                ):
                    d = record.details
                    print(f"{record.name}: {record.figure:.1f} tok/s, {d['speedup']:.2f}x over "
                          f"{d['plain_tok_s']:.1f}; accepted length {d['measured_accepted_length']:.2f} "
                          f"(target {d['target_accepted_length']:.2f}); plain step {d['plain_step_ms']:.2f} ms, "
                          f"verify step {d['verify_step_ms']:.2f} ms", flush=True)  # fmt: skip
                    records.append(record)
        del params
    slug = machine_slug(machine)
    print(
        "wrote",
        write_records(records, args.out or f"speculative-{slug}{'-quick' if args.quick else ''}.json"),
    )
    return records


if __name__ == "__main__":
    main()
