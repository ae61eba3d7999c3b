"""Constrained decoding through the engine: a tiny random-weight model and the real Qwen3 tokenizer.

A random model writes near-uniform garbage, so whatever structure its output has comes from the
constraint. Samples of one kind run as one batch of requests; `length` finishes are allowed by the
spec (a constraint that cannot complete within max_tokens), so each test also checks that enough
samples completed for its assertion to mean something.
"""

from __future__ import annotations

import ast
import contextlib
import dataclasses
import json
import re

import jsonschema
import pytest

from infernix_jax.engine.constrained_way import CHECK, SPLIT, ConstrainedWayChooser
from infernix_jax.engine.protocol import FINISH_LENGTH, FINISH_STOP, GenerationRequest, SamplingParams
from infernix_jax.structured import ConstraintSpec, RequestConstraint
from tests.structured.run import generate, sampled_requests
from tests.structured.schemas import SCHEMAS, UNBOUNDED

THINK_OPEN, THINK_CLOSE = 151667, 151668
ARITHMETIC_GBNF = r"""
root   ::= expr
expr   ::= term ([+-] term){0,2}
term   ::= factor ([*/] factor){0,1}
factor ::= [0-9] | "(" [0-9] [+*] [0-9] ")"
"""
ASSIGNMENT_LARK = r"""
start: "let " NAME " = " VALUE ";"
NAME: /[a-z]{1,3}/
VALUE: /[0-9]{1,2}/ | "true" | "false"
"""


def constraint(backend, spec: ConstraintSpec, **where) -> RequestConstraint:
    return RequestConstraint(backend.compile(spec), **where)


@pytest.fixture(scope="module")
def prompt(qwen3_tokenizer) -> list[int]:
    return qwen3_tokenizer.encode("Answer in the requested format.")


def check_json_sweep(llm, backend, prompt, samples: int, max_tokens: int) -> None:
    requests = []
    for name, schema in SCHEMAS.items():
        spec = ConstraintSpec.json_schema(schema)
        requests += sampled_requests(name, prompt, constraint(backend, spec), samples, max_tokens)
    outputs = generate(llm.core, requests)
    completed = 0
    for request_id, output in outputs.items():
        name = request_id.rsplit("-", 1)[0]
        assert output.finish_reason in (FINISH_STOP, FINISH_LENGTH), output.error
        if output.finish_reason == FINISH_STOP:
            jsonschema.validate(json.loads(output.text), SCHEMAS[name])
            completed += 1
    assert completed >= 0.85 * len(requests)
    if samples >= 10:  # every schema has completed samples, not only the easy ones
        for name in set(SCHEMAS) - UNBOUNDED:
            assert any(outputs[f"{name}-{i}"].finish_reason == FINISH_STOP for i in range(samples)), name


def test_json_schemas_yield_valid_json_at_temperature_one(llm, backend, prompt):
    check_json_sweep(llm, backend, prompt, samples=3, max_tokens=24)


@pytest.mark.sweep  # test_json_schemas_yield_valid_json_at_temperature_one at 3 samples runs by default
def test_json_schema_sweep_twenty_samples_each(llm, backend, prompt):
    """The acceptance sweep: 16 schemas x 20 samples at temperature 1.0 (~2-3 min on 2 cores)."""
    check_json_sweep(llm, backend, prompt, samples=20, max_tokens=40)


def check_other_kinds(llm, backend, prompt, samples: int) -> None:
    regex = r"[A-Z][a-z]{1,4} [0-9]{2}"
    choices = ["apple", "banana split", "cherry"]
    kinds = {
        "regex": ConstraintSpec.regex(regex),
        "choice": ConstraintSpec.choice(choices),
        "gbnf": ConstraintSpec.grammar(ARITHMETIC_GBNF),
        "lark": ConstraintSpec.grammar(ASSIGNMENT_LARK),
    }
    requests = []
    for name, spec in kinds.items():
        requests += sampled_requests(name, prompt, constraint(backend, spec), samples, max_tokens=40)
    outputs = generate(llm.core, requests)
    completed = {name: [] for name in kinds}
    for request_id, output in outputs.items():
        if output.finish_reason == FINISH_STOP:
            completed[request_id.rsplit("-", 1)[0]].append(output.text)
    assert len(completed["regex"]) == samples and len(completed["choice"]) == samples
    assert all(re.fullmatch(regex, text) for text in completed["regex"])
    assert all(text in choices for text in completed["choice"])
    assert len(completed["gbnf"]) >= samples // 2 and len(completed["lark"]) >= samples // 2
    for text in completed["gbnf"]:
        assert re.fullmatch(r"[0-9+\-*/()]+", text), text
        ast.parse(text, mode="eval")  # a well-formed arithmetic expression
    for text in completed["lark"]:
        assert re.fullmatch(r"let [a-z]{1,3} = ([0-9]{1,2}|true|false);", text), text


def test_regex_choice_and_grammars_yield_accepted_strings(llm, backend, prompt):
    check_other_kinds(llm, backend, prompt, samples=6)


@pytest.mark.sweep  # test_regex_choice_and_grammars_yield_accepted_strings at 6 samples runs by default
def test_regex_choice_and_grammars_twenty_samples_each(llm, backend, prompt):
    check_other_kinds(llm, backend, prompt, samples=20)


def test_free_rows_batched_with_constrained_rows_give_the_same_tokens(llm, backend, prompt):
    free = [
        GenerationRequest("greedy", prompt, SamplingParams(max_tokens=10)),
        GenerationRequest("sampled", prompt, SamplingParams(max_tokens=10, temperature=1.0, seed=5)),
    ]
    alone = generate(llm.core, free)
    json_constraint = constraint(backend, ConstraintSpec.json_schema(SCHEMAS["person"]))
    mixed_requests = [
        GenerationRequest(f"{r.request_id}-mixed", r.prompt_token_ids, r.sampling) for r in free
    ] + sampled_requests("person", prompt, json_constraint, 4, max_tokens=30)
    mixed = generate(llm.core, mixed_requests)
    for r in free:
        assert mixed[f"{r.request_id}-mixed"].token_ids == alone[r.request_id].token_ids
    assert all(
        json.loads(mixed[f"person-{i}"].text)
        for i in range(4)
        if mixed[f"person-{i}"].finish_reason == FINISH_STOP
    )


def test_a_constraint_that_cannot_complete_in_time_ends_with_length(llm, backend, prompt):
    spec = ConstraintSpec.json_schema({"type": "string", "minLength": 40, "maxLength": 40})
    outputs = generate(llm.core, sampled_requests("long", prompt, constraint(backend, spec), 2, max_tokens=5))
    for output in outputs.values():
        assert output.finish_reason == FINISH_LENGTH
        assert len(output.token_ids) == 5 and output.text.startswith('"')


def test_thinking_is_free_and_the_json_starts_after_it(llm, backend, qwen3_tokenizer):
    prompt = qwen3_tokenizer.encode(
        "<|im_start|>user\nJSON please<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
    schema = SCHEMAS["const_and_enum"]
    json_after_thinking = constraint(
        backend, ConstraintSpec.json_schema(schema), starts_after_token=THINK_CLOSE
    )
    # A random model would think forever: a bias makes it close the thinking after a few tokens.
    requests = sampled_requests(
        "think", prompt, json_after_thinking, 8, max_tokens=48, logit_bias=((THINK_CLOSE, 15.0),)
    )
    outputs = generate(llm.core, requests)
    thought = 0
    for output in outputs.values():
        assert output.finish_reason == FINISH_STOP, output
        assert THINK_CLOSE in output.token_ids
        _thinking, answer = output.text.split("</think>", 1)
        thought += output.token_ids.index(THINK_CLOSE) > 0
        jsonschema.validate(json.loads(answer), schema)
    assert thought >= 2  # some samples thought freely before answering


def test_a_constraint_failing_mid_way_ends_only_its_request(llm, backend, prompt):
    # min_tokens suppresses the end of sequence the completed grammar requires: the request ends
    # with an error naming the constraint, and the batch's free request is unharmed.
    spec = ConstraintSpec.choice(["ok"])
    requests = [
        GenerationRequest(
            "stuck", prompt, SamplingParams(max_tokens=12, min_tokens=8), constraint(backend, spec)
        ),
        GenerationRequest("free", prompt, SamplingParams(max_tokens=12)),
    ]
    outputs = generate(llm.core, requests)
    assert outputs["stuck"].finish_reason == "error" and "constraint" in outputs["stuck"].error
    assert outputs["free"].finish_reason == FINISH_LENGTH and len(outputs["free"].token_ids) == 12


def _tokens_and_logprobs(core, requests: list[GenerationRequest]) -> dict[str, tuple[list, list]]:
    """Each request's token ids and TokenLogprobs, in order (the requests run as one batch)."""
    out: dict[str, tuple[list, list]] = {r.request_id: ([], []) for r in requests}
    for request in requests:
        core.add_request(request)
    while core.has_work():
        for event in core.step():
            out[event.request_id][0].extend(event.token_ids)
            out[event.request_id][1].extend(event.logprobs or [])
    return out


def test_logprobs_come_back_from_constrained_batches(llm, backend, prompt):
    # A batch with a constrained row reads each step back in one packed array, with the top
    # alternatives only when a row asked for them: a free row's logprobs are those it gets alone,
    # and constrained rows get one logprob (with its alternatives) per token.
    sampling = SamplingParams(max_tokens=8, temperature=1.0, seed=3, logprobs=3)
    alone = _tokens_and_logprobs(llm.core, [GenerationRequest("free", prompt, sampling)])["free"][1]
    json_constraint = constraint(backend, ConstraintSpec.json_schema(SCHEMAS["person"]))
    mixed = [GenerationRequest("free-mixed", prompt, sampling)] + sampled_requests(
        "person", prompt, json_constraint, 2, max_tokens=8, logprobs=2
    )
    together = _tokens_and_logprobs(llm.core, mixed)
    assert len(alone) == 8 and len(together["free-mixed"][1]) == 8
    for a, b in zip(alone, together["free-mixed"][1]):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [t for t, _ in a.top] == [t for t, _ in b.top] and len(b.top) == 3
    for i in range(2):
        tokens, logprobs = together[f"person-{i}"]
        assert tokens and [lp.token_id for lp in logprobs] == tokens
        assert all(len(lp.top) == 2 and lp.logprob <= 0 for lp in logprobs)


def test_a_free_row_asking_for_alternatives_gets_them_in_a_checked_batch(llm, backend, prompt):
    # The check way serves a batch whose constrained row samples from the whole distribution; a
    # free row of that batch asking for top alternatives gets the ones it gets alone, also when the
    # constrained row's refused token is replaced by the window program (which has no top-k).
    sampling = SamplingParams(max_tokens=8, temperature=1.0, seed=3, logprobs=3)
    alone = _tokens_and_logprobs(llm.core, [GenerationRequest("free", prompt, sampling)])["free"][1]
    json_constraint = constraint(backend, ConstraintSpec.json_schema(SCHEMAS["person"]))
    mixed = [GenerationRequest("free-mixed", prompt, sampling)] + sampled_requests(
        "person", prompt, json_constraint, 1, max_tokens=8
    )
    core = llm.core
    saved, refusals = core.config, core.metrics.check_refusals
    core.config = dataclasses.replace(saved, constrained_decode="check")
    try:
        with _always_check(core):
            together = _tokens_and_logprobs(core, mixed)
    finally:
        core.config = saved
    assert core.metrics.check_refusals > refusals  # checked (and replaced), not split
    assert len(together["free-mixed"][1]) == 8
    for a, b in zip(alone, together["free-mixed"][1]):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert [t for t, _ in a.top] == [t for t, _ in b.top] and len(b.top) == 3
        assert [lp for _, lp in a.top] == pytest.approx([lp for _, lp in b.top], abs=1e-5)


def test_the_constrained_decode_ways_give_the_same_tokens(llm, backend, prompt):
    # The three ways of decoding a constrained batch (one masked forward+sample program per token,
    # with the tokens a grammar forces fed in one window; a forward and a masked sample per token; the
    # multi-step program with each step's masks from a host callback) draw the same keys under the
    # same masks: the same tokens for constrained and free rows alike, the same logprobs where asked
    # for. Forced tokens are taken only for rows without logprobs, and not while a row wants top
    # alternatives (test_logprobs_come_back_from_constrained_batches).
    json_constraint = constraint(backend, ConstraintSpec.json_schema(SCHEMAS["person"]))

    def batch():
        sampling = SamplingParams(max_tokens=12, temperature=1.0, seed=9, logprobs=0)
        return (
            [GenerationRequest("free", prompt, sampling)]
            + sampled_requests("person", prompt, json_constraint, 3, max_tokens=24)
            + sampled_requests("logged", prompt, json_constraint, 1, max_tokens=24, logprobs=0)
        )

    core = llm.core
    results = {}
    ways = {  # the split way once more with its programs compiled without command buffers on a GPU
        "fused": {}, "split": {}, "callback": {}, "split no graphs": {"one_step_command_buffers": False},
        "check": {},
    }  # fmt: skip
    for mode, changes in ways.items():
        saved, saved_runner = core.config, core.runner.config
        core.config = dataclasses.replace(saved, constrained_decode=mode.split()[0], **changes)
        core.runner.config = dataclasses.replace(saved_runner, **changes)
        forced, host_s = core.metrics.forced_tokens, core.metrics.constrained_host_s
        refusals = core.metrics.check_refusals
        try:
            with _always_check(core):  # not split, whatever the chooser measured
                results[mode] = _tokens_and_logprobs(core, batch())
        finally:
            core.config, core.runner.config = saved, saved_runner
        if mode == "fused":
            assert core.metrics.forced_tokens > forced  # the schema's keys and punctuation
        if mode == "callback":
            assert core.metrics.constrained_host_s > host_s  # the masks came from its callback
        if mode == "check":  # a random model leaves its grammar: most free samples are replaced
            assert core.metrics.check_refusals > refusals + 20
    for mode in ("fused", "callback", "split no graphs", "check"):
        for request_id, (tokens, logprobs) in results[mode].items():
            split_tokens, split_logprobs = results["split"][request_id]
            assert tokens and tokens == split_tokens, (mode, request_id)
            assert [lp.logprob for lp in logprobs] == pytest.approx(
                [lp.logprob for lp in split_logprobs], abs=1e-5
            )


def _count_calls(monkeypatch, runner, *names: str) -> dict[str, int]:
    """Count the calls of the runner's dispatch methods `names` (the dict fills as they run)."""
    counts: dict[str, int] = {}
    for name in names:
        method = getattr(runner, name)

        def counted(*args, _name=name, _method=method, **kwargs):
            counts[_name] = counts.get(_name, 0) + 1
            return _method(*args, **kwargs)

        monkeypatch.setattr(runner, name, counted)
    return counts


@contextlib.contextmanager
def _always_check(core):
    """The check way for every checkable constrained step (not the chooser's measured pick)."""
    choose = core.way_chooser.choose
    core.way_chooser.choose = lambda batch: "check"
    try:
        yield
    finally:
        core.way_chooser.choose = choose


def test_a_model_that_keeps_to_its_grammar_decodes_at_free_speed_with_the_check_way(
    llm, backend, prompt, monkeypatch
):
    # The check way runs the free multi-step program and checks its tokens afterwards. Constrained
    # to the text it writes anyway (its own greedy output as the only choice), the model keeps every
    # free sample: 4 tokens a dispatch (the engine's steps), where split takes a forward and a
    # sample per token. The one refusal is where the free model writes on and the grammar ends;
    # the end token is then sampled under the mask in one window dispatch. The tokens are split's.
    # Each check dispatch is enqueued before the one before it is read (asynchronous decode), so
    # the device never waits for the host's checking; the one enqueued after the refused dispatch
    # ran on dropped tokens and its outputs are void.
    core = llm.core
    assert core.async_decode.enabled
    # a chooser of its own: what the earlier tests' rows kept says nothing of this one
    monkeypatch.setattr(core, "way_chooser", ConstrainedWayChooser(window=core.way_chooser.window))
    free = generate(core, [GenerationRequest("free", prompt, SamplingParams(max_tokens=16))])["free"]
    assert len(free.token_ids) == 16 and free.finish_reason == FINISH_LENGTH
    own = constraint(backend, ConstraintSpec.choice([free.text]))
    request = GenerationRequest("own", prompt, SamplingParams(max_tokens=24), constraint=own)
    # multi-step, split's forward, the window
    counts = _count_calls(monkeypatch, core.runner, "decode", "decode_forward", "decode_step_masked")
    outputs, seen = {}, {}
    for way in ("split", "check"):
        saved, before = core.config, dataclasses.replace(core.metrics)
        core.config = dataclasses.replace(saved, constrained_decode=way)
        counts.clear()
        try:
            with _always_check(core):
                outputs[way] = generate(core, [request])["own"]
        finally:
            core.config = saved
        kept = core.metrics.check_kept_tokens - before.check_kept_tokens
        seen[way] = (dict(counts), kept, core.metrics.check_refusals - before.check_refusals)
        seen[way] += (core.metrics.async_dispatches - before.async_dispatches,)
    assert outputs["check"] == outputs["split"]
    assert outputs["check"].text == free.text and outputs["check"].finish_reason == FINISH_STOP
    split_counts, _, _, _ = seen["split"]  # a forward per token (and one after the last)
    assert list(split_counts) == ["decode_forward"] and split_counts["decode_forward"] >= 17
    check_counts, kept, refusals, ahead = seen["check"]
    # the first token is a prefill's sample, or a decode's where the prefix cache held the prompt
    assert kept in (15, 16) and refusals == 1
    dispatches = -(-(kept + 1) // 4)
    assert check_counts == {"decode": dispatches + 1, "decode_step_masked": 1}  # + the void one
    # enqueued ahead: every dispatch after the second (the first one's tokens are the evidence
    # that a row keeps whole dispatches, check_ahead_min_keep), and the void one
    assert ahead == dispatches - 1


def test_a_refusal_while_the_next_check_dispatch_runs_drops_only_the_refused_rows_tokens(
    llm, backend, prompt
):
    # One batch, checked dispatch after dispatch with the next one enqueued before the last is
    # read: a row that keeps to its grammar (its own greedy text), one that leaves it at once (a JSON
    # schema on a random model) and a free row. The dispatch enqueued after a refusal ran the
    # refused row on tokens that were dropped: its outputs for that row are void, the others'
    # are kept. Every row ends as it does under split.
    core = llm.core
    free = generate(core, [GenerationRequest("free", prompt, SamplingParams(max_tokens=14))])["free"]
    own = constraint(backend, ConstraintSpec.choice([free.text]))
    json_constraint = constraint(backend, ConstraintSpec.json_schema(SCHEMAS["person"]))

    def batch():
        return [
            GenerationRequest("own", prompt, SamplingParams(max_tokens=20), constraint=own),
            GenerationRequest("free", prompt, SamplingParams(max_tokens=18, temperature=1.0, seed=3)),
            *sampled_requests("person", prompt, json_constraint, 1, max_tokens=20),
        ]

    outputs, seen = {}, {}
    for way in ("split", "check"):
        saved, before = core.config, dataclasses.replace(core.metrics)
        # follow whatever the keep share (the random model's JSON row refuses at once)
        core.config = dataclasses.replace(saved, constrained_decode=way, check_ahead_min_keep=0.0)
        try:
            with _always_check(core):
                outputs[way] = generate(core, batch())
        finally:
            core.config = saved
        seen[way] = (
            core.metrics.check_kept_tokens - before.check_kept_tokens,
            core.metrics.check_refusals - before.check_refusals,
            core.metrics.async_dispatches - before.async_dispatches,
        )
    assert outputs["check"] == outputs["split"]
    assert outputs["check"]["own"].text == free.text
    kept, refusals, ahead = seen["check"]
    assert refusals >= 3 and kept >= 13 and ahead >= 2


def test_an_abort_while_the_next_check_dispatch_runs_ends_only_that_request(llm, backend, prompt):
    # A constrained request checked with its next dispatch in flight is aborted between steps:
    # the dispatch is read back without it, its neighbour goes on to split's tokens, and a later
    # request runs as usual.
    core = llm.core
    free = generate(core, [GenerationRequest("free", prompt, SamplingParams(max_tokens=14))])["free"]
    own = constraint(backend, ConstraintSpec.choice([free.text]))

    def request(name):
        return GenerationRequest(name, prompt, SamplingParams(max_tokens=20), constraint=own)

    saved = core.config
    core.config = dataclasses.replace(saved, constrained_decode="check", check_ahead_min_keep=0.0)
    try:
        with _always_check(core):
            for r in (request("kept"), request("aborted")):
                core.add_request(r)
            for _ in range(4):  # until a check dispatch is enqueued before the last was read
                core.step()
                if core.ahead is not None:
                    break
            assert core.ahead.check is not None
            finished = core.abort("aborted")
            assert [event.finish_reason for event in finished] == ["abort"]
            texts = []
            while core.has_work():
                texts += [event.text for event in core.step() if event.request_id == "kept"]
            later = generate(core, [request("later")])["later"]
    finally:
        core.config = saved
    assert later.text == free.text and later.finish_reason == FINISH_STOP
    assert free.text.endswith("".join(texts)) and texts


def test_the_chooser_checks_only_where_the_model_keeps_to_its_grammar(llm, backend, prompt, monkeypatch):
    # With constrained_decode "check" the engine measures before it checks: split's steps say how
    # often the model's free choice is one its grammar allows. A random model under a JSON schema
    # leaves its grammar at once, so it never pays for a check dispatch; constrained to its own
    # greedy text it keeps every choice, and check is tried after one split step.
    core = llm.core
    free = generate(core, [GenerationRequest("free", prompt, SamplingParams(max_tokens=16))])["free"]
    constraints = {
        "json": constraint(backend, ConstraintSpec.json_schema(SCHEMAS["person"])),
        "own": constraint(backend, ConstraintSpec.choice([free.text])),
    }
    monkeypatch.setattr(core, "config", dataclasses.replace(core.config, constrained_decode="check"))
    with _always_check(core):  # compile check's programs: a step that compiles is no measurement
        generate(
            core,
            [GenerationRequest("warm", prompt, SamplingParams(max_tokens=8), constraint=constraints["own"])],
        )
    counts = _count_calls(monkeypatch, core.runner, "decode", "decode_forward")
    seen = {}
    for name, where in constraints.items():
        chooser, ways = ConstrainedWayChooser(window=core.way_chooser.window), []
        choose = chooser.choose
        monkeypatch.setattr(
            chooser, "choose", lambda batch, _c=choose, _w=ways: _w.append(_c(batch)) or _w[-1]
        )
        monkeypatch.setattr(core, "way_chooser", chooser)
        counts.clear()
        request = GenerationRequest(name, prompt, SamplingParams(max_tokens=24), constraint=where)
        output = generate(core, [request])[name]
        one_row = min(core.config.decode_buckets)  # the decode batch size a lone request runs at
        seen[name] = (dict(counts), ways, chooser.keep_share(one_row), output)
    json_counts, json_ways, json_share, _ = seen["json"]
    assert json_ways == [SPLIT] * len(json_ways) and "decode" not in json_counts
    assert len(json_ways) >= 3 and json_share < 0.2  # engine steps of up to 4 tokens
    own_counts, own_ways, own_share, own_output = seen["own"]
    assert own_output.text == free.text and own_output.finish_reason == FINISH_STOP
    # split first, then check at once: the keep share decides, before any timing does
    assert own_ways[:2] == [SPLIT, CHECK] and own_share > 0.8
    assert own_counts["decode"] == own_ways.count(CHECK)


def test_thinking_and_a_broken_constraint_end_as_split_ends_them_with_the_check_way(
    llm, backend, qwen3_tokenizer
):
    # Free thinking, then JSON (the check way crosses </think> inside a dispatch's tokens), and a
    # constraint that min_tokens breaks (its replacement sample is refused too): the outputs,
    # errors included, are split's.
    think_prompt = qwen3_tokenizer.encode(
        "<|im_start|>user\nJSON please<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )
    schema = SCHEMAS["const_and_enum"]
    after_thinking = constraint(backend, ConstraintSpec.json_schema(schema), starts_after_token=THINK_CLOSE)
    requests = sampled_requests(
        "think",
        think_prompt,
        after_thinking,
        3,
        max_tokens=40,
        logit_bias=((THINK_CLOSE, 12.0),),
        min_tokens=2,
    ) + [
        GenerationRequest(
            "stuck",
            think_prompt,
            SamplingParams(max_tokens=12, min_tokens=8),
            constraint(backend, ConstraintSpec.choice(["ok"])),
        )
    ]
    core, outputs = llm.core, {}
    before = dataclasses.replace(core.metrics)
    for way in ("split", "check"):
        saved = core.config
        core.config = dataclasses.replace(saved, constrained_decode=way)
        try:
            with _always_check(core):
                outputs[way] = generate(core, requests)
        finally:
            core.config = saved
    assert outputs["check"] == outputs["split"]
    # the thinking tokens were kept from free samples, the JSON's mostly replaced
    assert core.metrics.check_kept_tokens > before.check_kept_tokens + 3
    assert core.metrics.check_refusals > before.check_refusals + 3
    assert outputs["check"]["stuck"].finish_reason == "error"
    assert any(THINK_CLOSE in out.token_ids for name, out in outputs["check"].items() if name != "stuck")


def test_the_check_way_splits_rows_it_cannot_check_exactly(llm, backend, prompt, monkeypatch):
    # Top-p over the allowed tokens can keep a token the free cut dropped, and the replacement's
    # program has no top alternatives: such rows decode the split way, so their tokens stay split's.
    json_constraint = constraint(backend, ConstraintSpec.json_schema(SCHEMAS["person"]))
    core = llm.core
    monkeypatch.setattr(core, "config", dataclasses.replace(core.config, constrained_decode="check"))
    chosen = dict(core.way_chooser.chosen)
    calls = _count_calls(monkeypatch, core.runner, "decode")
    for options in ({"top_p": 0.9}, {"top_k": 20}, {"min_p": 0.05}, {"logprobs": 2}):
        requests = sampled_requests("unchecked", prompt, json_constraint, 2, max_tokens=6, **options)
        assert all(out.token_ids for out in generate(core, requests).values())
    assert calls == {} and core.way_chooser.chosen == chosen


def test_batches_above_check_max_batch_split_without_asking_the_chooser(llm, backend, prompt, monkeypatch):
    # The check way's copies of a batch's state slots are reserved for at most check_max_batch
    # rows: a larger batch decodes the split way, and the chooser is not asked about it.
    json_constraint = constraint(backend, ConstraintSpec.json_schema(SCHEMAS["person"]))
    core = llm.core
    config = dataclasses.replace(core.config, constrained_decode="check", check_max_batch=1)
    monkeypatch.setattr(core, "config", config)
    asked, forward_rows = [], []
    choose, forward = core.way_chooser.choose, core.runner.decode_forward
    monkeypatch.setattr(core.way_chooser, "choose", lambda batch: asked.append(batch) or choose(batch))
    monkeypatch.setattr(
        core.runner,
        "decode_forward",
        lambda tokens, *args: forward_rows.append(len(tokens)) or forward(tokens, *args),
    )
    requests = sampled_requests("wide", prompt, json_constraint, 2, max_tokens=8)
    assert all(out.token_ids for out in generate(core, requests).values())
    assert max(forward_rows) > 1 and all(batch <= 1 for batch in asked)


def test_forced_tokens_take_no_dispatch_of_their_own(llm, backend, prompt, monkeypatch):
    # Qwen3 writes each digit as its own token: every token of this regex is forced. In fused mode
    # the first digit is the prefill's sample (or, when the prompt is in the prefix cache already, a
    # forced token too); the rest and the end need 3 dispatches (the engine's steps allow 4 tokens
    # per row: up to 3 forced + 1 sampled each), not 10.
    grammar = constraint(backend, ConstraintSpec.regex("1234567890"))
    core = llm.core
    dispatches = _count_calls(monkeypatch, core.runner, "decode_step_masked")
    monkeypatch.setattr(core, "config", dataclasses.replace(core.config, constrained_decode="fused"))
    before = core.metrics.forced_tokens
    sampling = SamplingParams(max_tokens=20, temperature=1.0, seed=4)
    output = generate(core, [GenerationRequest("digits", prompt, sampling, constraint=grammar)])["digits"]
    assert output.text == "1234567890" and output.finish_reason == FINISH_STOP
    assert core.metrics.forced_tokens - before in (7, 8)
    assert dispatches == {"decode_step_masked": 3}
