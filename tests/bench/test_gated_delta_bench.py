"""bench.gated_delta: a quick run times the in-place kernels and XLA's gathered form and records each."""

import json

import pytest

from bench import gated_delta
from bench.engine_setup import SHAPES
from bench.record import validate_record
from infernix_jax.config import ModelConfig


def test_quick_run_records_the_kernels_and_the_xla_form(tmp_path):
    out = tmp_path / "gated_delta.json"
    records = gated_delta.main(["--quick", "--out", str(out)])
    assert [r.name for r in records] == [
        f"gated delta tiny batch{b} {way}" for b in (1, 2) for way in ("xla", "kernel", "conv-kernel")
    ]
    for record in records:
        d = record.details
        assert d["us_per_layer"] > 0 and d["max_abs_err_out_vs_reference"] <= 3e-2
        assert d["state_bytes_moved"] == 2 * d["batch"] * d["value_heads"] * d["dk"] * d["dv"] * 4
    rows = json.loads(out.read_text())
    assert len(rows) == 6
    for row in rows:
        validate_record(row)


@pytest.mark.parametrize(("model", "shape"), [("qwen3.5-27b", "27b"), ("qwen3-next-80b", "moe")])
def test_the_heads_are_the_bench_models(model, shape):
    cfg = ModelConfig.from_hf_config(SHAPES[shape])
    heads = (cfg.linear_num_k_heads, cfg.linear_num_v_heads, cfg.linear_k_head_dim, cfg.linear_v_head_dim)
    assert gated_delta.MODELS[model] == heads
