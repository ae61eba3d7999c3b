"""Sample free, check after: constrained decoding at free speed for a model that keeps to its grammar.

    python -m bench.structured_check                   # the bundled demo model, batch 1 and 4
    python -m bench.structured_check --model DIR --batches 1,8 --tokens 96

The check way (`EngineConfig.constrained_decode = "check"`, docs/structured_output.md) runs a
constrained batch in the free multi-step program and checks the tokens against the grammars
afterwards; a refused token is replaced by a masked sample in a second dispatch. Its speed depends
on how often the model's free choice is allowed, so it is measured with a trained model (random
weights leave every grammar at once): the bundled demo model (Python code and King James prose),
on workloads whose grammar it mostly follows.

For each workload, batch and way, `batch` requests (seeds 0..batch-1, greedy and at temperature
0.7) generate at most `--tokens` tokens each; the ways: free (no constraint), split (two one-step
dispatches per token), check (the check way on every step) and auto (check or split chosen step by
step from measured seconds per token, engine/constrained_way.py). Each way runs twice on the same
engine and the second run is timed. Recorded per point: tokens per second, the share of checked
free samples kept (kept / (kept + refusals)), dispatches per generated token, and whether check and
split gave the same tokens (they must). Dispatches count the runner's dispatching calls (the
multi-step decode, split's forward and sample, the window, the row copies and restores). Figure: check's tok/s; ceiling: free decoding's tok/s of
the same batch in the same run (not the same tokens: the free rows stop at their own ends);
fraction = check / free. Records go to bench/results/structured-check-<machine>.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from bench.record import git_commit, machine_name, machine_slug, make_record, write_records
from infernix_jax.demo import MODEL_DIR
from infernix_jax.engine.llm import LLM
from infernix_jax.engine.protocol import GenerationRequest, SamplingParams
from infernix_jax.structured import ConstraintSpec, RequestConstraint, default_backend

# (name, prompt, constraint): outputs the demo model writes mostly of its own accord
WORKLOADS = (
    (
        "init-lines",
        "class Point:\n    def __init__(self, x, y):\n",
        ConstraintSpec.regex(r"(        self\.[a-z_]+ = [a-z_0-9]+\n){1,12}"),
    ),
    (
        "json-strings",
        "DEFAULTS = ",
        ConstraintSpec.json_schema(
            {
                "type": "object",
                "additionalProperties": {"type": "string", "maxLength": 24},
                "maxProperties": 12,
            }
        ),
    ),
    ("digits", "def ", ConstraintSpec.regex(r"[0-9]{8,64}")),
)
WAYS = ("free", "split", "check", "auto")


def _run(core, requests: list[GenerationRequest]) -> tuple[dict[str, list[int]], float]:
    """Generate every request in one batch: (token ids per request, wall seconds)."""
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    start = time.perf_counter()
    for request in requests:
        core.add_request(request)
    while core.has_work():
        for event in core.step():
            tokens[event.request_id].extend(event.token_ids)
    return tokens, time.perf_counter() - start


def _requests(way: str, batch: int, prompt: list[int], grammar, temperature: float, tokens: int):
    """`batch` requests of one prompt, seeds 0..batch-1, under `grammar` unless the way is free."""
    sampling = SamplingParams(max_tokens=tokens, temperature=temperature)
    constraint = None if way == "free" else RequestConstraint(grammar)
    return [
        GenerationRequest(f"{way}-{i}", prompt, sampling.replace(seed=i), constraint=constraint)
        for i in range(batch)
    ]


DISPATCHES = (
    "decode",
    "decode_forward",
    "sample_masked",
    "decode_step_masked",
    "save_slots",
    "restore_slots",
)


def _count_dispatches(runner) -> tuple[dict[str, int], callable]:
    """Count calls of the runner's dispatching methods; returns (the counts, a function undoing it)."""
    counts = dict.fromkeys(DISPATCHES, 0)
    originals = {name: getattr(runner, name) for name in DISPATCHES}
    for name, method in originals.items():

        def counted(*args, _name=name, _method=method, **kwargs):
            counts[_name] += 1
            return _method(*args, **kwargs)

        setattr(runner, name, counted)

    def undo() -> None:
        for name in DISPATCHES:
            delattr(runner, name)  # the instance attribute: the class's method shows again

    return counts, undo


def measure_way(core, way: str, requests: list[GenerationRequest]) -> dict:
    """Run `requests` twice the given way; the second run's figures."""
    saved, choose = core.config, core.way_chooser.choose
    if way != "free":
        core.config = dataclasses.replace(saved, constrained_decode="split" if way == "split" else "check")
    if way == "check":
        core.way_chooser.choose = lambda batch: "check"
    try:
        _run(core, requests)
        before = dataclasses.replace(core.metrics)
        chosen = dict(core.way_chooser.chosen)
        counts, undo = _count_dispatches(core.runner)
        try:
            tokens, wall = _run(core, requests)
        finally:
            undo()
    finally:
        core.config, core.way_chooser.choose = saved, choose
    m = core.metrics
    generated = sum(len(t) for t in tokens.values())
    kept = m.check_kept_tokens - before.check_kept_tokens
    refusals = m.check_refusals - before.check_refusals
    return {
        "tok_s": generated / wall,
        "generated": generated,
        "wall_s": wall,
        "kept": kept,
        "refusals": refusals,
        "kept_share": kept / (kept + refusals) if kept + refusals else None,
        "dispatches": {name: n for name, n in counts.items() if n},
        "dispatches_per_token": sum(counts.values()) / max(generated, 1),
        "chosen": {k: v - chosen[k] for k, v in core.way_chooser.chosen.items()},
        "tokens": tokens,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=str(MODEL_DIR), help="model folder (default: the demo model)")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--tokens", type=int, default=64, help="most tokens per request")
    parser.add_argument("--steps", type=int, default=8, help="decode steps per dispatch")
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    llm = LLM(
        args.model,
        max_context=1024,
        max_concurrency=max(batches),
        decode_batch_sizes=tuple(sorted(set(batches))),
        decode_steps_per_dispatch=args.steps,
        constrained_decode="check",  # warm-up compiles check's programs and split's
        prefill_chunk=64,  # short prompts: few programs to compile
        prefill_buckets=(16, 64),
        prefill_batch_sizes=(1, 4),
        scoring=False,
    )
    core, backend = llm.core, default_backend(llm.tokenizer)
    machine, commit = machine_name(), git_commit()
    records = []
    for name, prompt, spec in WORKLOADS:
        grammar = backend.compile(spec)
        prompt_ids = llm.tokenizer.encode(prompt)
        for temperature in (0.0, 0.7):
            for batch in batches:
                results = {
                    way: measure_way(
                        core, way, _requests(way, batch, prompt_ids, grammar, temperature, args.tokens)
                    )
                    for way in WAYS
                }
                same = [results["check"]["tokens"][f"check-{i}"] == results["split"]["tokens"][f"split-{i}"]
                        for i in range(batch)]  # fmt: skip
                for result in results.values():
                    result.pop("tokens")
                label = f"{name} t{temperature:g} batch{batch}"
                print(
                    f"{label:28s} "
                    + "  ".join(f"{w} {r['tok_s']:7.1f}" for w, r in results.items())
                    + f"  kept {results['check']['kept_share'] or 0:.3f}  same {all(same)}",
                    flush=True,
                )
                records.append(
                    make_record(
                        f"structured check {label}",
                        results["check"]["tok_s"],
                        "tok/s",
                        results["free"]["tok_s"],
                        "tok/s free decode",
                        machine=machine,
                        commit=commit,
                        details={
                            "workload": name,
                            "prompt": prompt,
                            "constraint": spec.describe(),
                            "temperature": temperature,
                            "batch": batch,
                            "max_tokens": args.tokens,
                            "steps_per_dispatch": args.steps,
                            "model": "demo" if Path(args.model) == MODEL_DIR else Path(args.model).name,
                            "ways": results,
                            "check_vs_split": results["check"]["tok_s"] / results["split"]["tok_s"],
                            "same_tokens_as_split": all(same),
                        },
                    )
                )
    path = write_records(records, args.out or f"structured-check-{machine_slug(machine)}.json")
    print(f"wrote {len(records)} records to {path}")


if __name__ == "__main__":
    main()
