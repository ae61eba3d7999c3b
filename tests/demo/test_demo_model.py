"""The bundled demo model: transformers computes the same logits, its perplexity is pinned and beats
the unigram baseline fourfold, and the command lines use it when no model is given."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest

import infernix_jax
from infernix_jax import generate, perplexity
from infernix_jax.demo import MODEL_DIR
from infernix_jax.model.params import count_params
from tests.conftest import HF_FIXTURES

FIXTURE = HF_FIXTURES.parent / "demo_parity.npz"


@pytest.fixture(scope="module")
def demo():
    return infernix_jax.load(max_context=512)


def test_demo_is_a_small_qwen3_next(demo):
    cfg = demo.config
    assert cfg.architecture == "Qwen3NextForCausalLM" and cfg.gdn_projection == "fused"
    assert cfg.layer_types.count("full_attention") * 3 == cfg.layer_types.count("linear_attention")
    assert cfg.num_experts > 1 and cfg.shared_expert_intermediate_size > 0 and cfg.mtp_num_layers == 1
    assert demo.params.mtp is not None
    assert (MODEL_DIR / "model.safetensors").stat().st_size < 30 * 2**20
    print(f"demo model: {count_params(demo.params) / 1e6:.2f}M parameters")


def test_logits_match_transformers(demo):
    ref = np.load(FIXTURE)
    logits = demo.logits(ref["input_ids"].tolist())
    subset = logits[:, ref["vocab_ids"]]
    rel = np.abs(subset - ref["logits_subset"]).max() / np.abs(ref["logits_subset"]).max()
    assert rel <= 1e-3, f"rel error {rel:.2e}"
    np.testing.assert_array_equal(logits.argmax(-1), ref["argmax"])
    log_norm = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    np.testing.assert_allclose(log_norm, ref["logsumexp"], rtol=1e-4, atol=1e-3)


def test_perplexity_cli_without_model_is_pinned_and_beats_unigram(capsys):
    assert perplexity.main(["--max-tokens", "2048", "--context", "512", "--stride", "256", "--json"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"^perplexity: [0-9.]+$", out.strip().splitlines()[-1])
    record = json.loads(next(line for line in out.splitlines() if line.startswith("{")))
    print(f"demo perplexity {record['perplexity']:.4f}, unigram {record['unigram_perplexity']:.4f}")
    assert record["tokens_evaluated"] == 2047
    assert record["perplexity"] == pytest.approx(33.2696, rel=1e-3)
    assert record["perplexity"] <= record["unigram_perplexity"] / 4


def test_generate_cli_without_model_writes_text(capsys):
    assert generate.main(["--prompt", "And God said unto Moses,", "--max-tokens", "12"]) == 0
    out = capsys.readouterr().out
    assert len(out.strip()) > 10 and re.search(r"[a-zA-Z]{3}", out)


def test_chat_template_frames_a_conversation(demo):
    prompt = demo.apply_chat_template([{"role": "user", "content": "Who begat Enos?"}])
    assert prompt.startswith("<|im_start|>user\nWho begat Enos?<|im_end|>\n<|im_start|>assistant\n")
    assert demo.tokenizer.eos_token_ids[0] == demo.tokenizer.token_to_id("<|im_end|>")
