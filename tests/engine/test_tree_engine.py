"""Tree verification in the engine: greedy output with draft trees equals greedy output without
speculation, token for token, batched and alone, with each drafter on the hybrid MoE fixture (random
MTP weights) and the n-gram drafter on the dense fixture. An oracle drafter (the known greedy
continuation as one branch among wrong ones, placed first, in the middle or last, and corrupted at
chosen depths) makes sure accepted paths that are not the first branch are committed right (KV
moved to consecutive positions, the GDN state of the path's last node kept).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from infernix_jax.engine.protocol import GenerationRequest, SamplingParams
from tests.engine.test_engine_core import assert_pool_empty, run
from tests.engine.test_speculative_engine import (
    check_greedy_equal,
    expected,
    repetitive_prompts,
    speculative_core,
)

TREE = {"spec_tree_width": 3, "spec_tree_nodes": 7}


@dataclass
class OracleBranches:
    """For request i: the greedy continuation corrupted at depth i % 4 (3: never) as branch i % 3 of
    three, beside two branches that are wrong from their first token."""

    name: str
    prompts: list[list[int]]
    uses_mtp: bool = False

    def propose(self, tokens, device_drafts, limit):
        raise AssertionError("tree mode asks for branches")

    def propose_branches(self, tokens, device_drafts, limit, width):
        for i, p in enumerate(self.prompts):
            if list(tokens[: len(p)]) == p:
                done = len(tokens) - len(p)
                right = expected(self.name, tuple(p))[done : done + limit]
                if i % 4 < len(right) and i % 4 != 3:
                    right[i % 4] = (right[i % 4] + 1) % 512
                wrong = [[(t + 7 + k) % 512 for t in right[:2]] for k in range(2)]
                branches = wrong[: i % 3] + [right] + wrong[i % 3 :]
                return [b for b in branches if b]
        raise AssertionError("unknown request")


@pytest.mark.slow  # ~75 s hybrid, ~40 s dense: the reference runs and the tree verify program's compile
@pytest.mark.parametrize("name", ["hybrid", "dense"])
def test_tree_paths_off_the_first_branch_are_committed_exactly(name):
    core = speculative_core(name, "ngram", **TREE)
    ids = repetitive_prompts(6, seed=21)
    core.speculation.drafter = OracleBranches(name, ids)
    check_greedy_equal(name, core, ids, batched=True)
    m = core.metrics
    assert m.drafted_tokens > m.accepted_tokens > 0
    assert m.mean_accepted_length > 1.5, m
    stats = core.stats()  # what /metrics exports
    assert stats.spec_drafted_tokens == m.drafted_tokens and stats.spec_accepted_tokens == m.accepted_tokens
    assert 0 < stats.spec_verify_steps <= stats.spec_rows == m.spec_rows


@pytest.mark.slow  # ~40 s each: compiles the tree verify (and MTP prefill) programs
@pytest.mark.parametrize("spec", ["ngram", "mtp", "mtp+ngram"])
def test_hybrid_moe_greedy_with_tree_speculation_equals_without(spec):
    core = speculative_core("hybrid", spec, ngram_min_match=1, **TREE)
    check_greedy_equal("hybrid", core, repetitive_prompts(8, seed=11), batched=True)
    check_greedy_equal("hybrid", core, repetitive_prompts(2, seed=12), batched=False)
    assert core.metrics.drafted_tokens >= 20


@pytest.mark.slow  # ~30 s
def test_dense_greedy_with_ngram_tree_speculation_equals_without():
    core = speculative_core("dense", "ngram", ngram_min_match=1, **TREE)
    check_greedy_equal("dense", core, repetitive_prompts(8, seed=13), batched=True)
    check_greedy_equal("dense", core, repetitive_prompts(2, seed=14), batched=False)
    assert core.metrics.drafted_tokens > 0


@pytest.mark.slow  # compiles the MTP tree programs unless an earlier test did
def test_seeded_sampling_with_trees_is_reproducible_and_batch_independent():
    core = speculative_core("hybrid", "mtp+ngram", **TREE)
    prompt = repetitive_prompts(1, seed=15)[0]
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True)
    alone = run(core, [GenerationRequest("s", prompt, params)])["s"]["tokens"]
    others = [
        GenerationRequest(f"o{i}", p, SamplingParams(max_tokens=8, temperature=0.7, seed=i))
        for i, p in enumerate(repetitive_prompts(3, seed=16))
    ]
    together = run(core, others + [GenerationRequest("s", prompt, params)])["s"]["tokens"]
    assert len(alone) == 12 and together == alone
    assert_pool_empty(core)
