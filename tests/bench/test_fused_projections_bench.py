"""bench.fused_projections: a quick run times a group fused and apart and records both."""

import json

import pytest

from bench import fused_projections
from bench.engine_setup import SHAPES
from bench.record import validate_record
from infernix_jax.config import ModelConfig
from infernix_jax.model.params import declare_params


def test_quick_run_records_the_fused_group_against_its_separate_launches(tmp_path):
    out = tmp_path / "fused.json"
    records = fused_projections.main(["--quick", "--experts", "--out", str(out)])
    assert [r.name for r in records] == [
        "fused projections tiny three batch1",
        "fused experts tiny gate_up tokens1",
        "fused experts tiny gate_up tokens4",
    ]
    d = records[0].details
    assert d["sizes"] == [96, 40, 8] and d["fused_s"] > 0 and d["separate_s"] > 0
    assert d["speedup"] == d["separate_s"] / d["fused_s"]
    assert d["max_rel_err_vs_reference"] <= 2e-2  # checked against the float32 reference
    assert records[2].details["max_rel_diff_fused_vs_apart"] == 0  # the same tiles, one launch
    rows = json.loads(out.read_text())
    assert len(rows) == 3
    for row in rows:
        validate_record(row)


@pytest.mark.parametrize(("model", "shape"), [("qwen3.5-27b", "27b"), ("qwen3-next-80b", "moe")])
def test_the_groups_are_the_bench_models_projections_of_one_input(model, shape):
    """Each group's weights are the shapes the model declares for one layer's GDN input
    projections, q / k / v and gate / up (the shared expert's on the MoE model)."""
    cfg = ModelConfig.from_hf_config(SHAPES[shape])
    layers = declare_params(cfg, with_mtp=False).layers
    gdn = next(lay.gdn for lay in layers if lay.gdn is not None)
    attn = next(lay.attn for lay in layers if lay.attn is not None)
    mlp = next(lay.mlp if lay.mlp is not None else lay.moe.shared for lay in layers)
    declared = {
        "gdn_in": (gdn.in_proj_qkv, gdn.in_proj_z, gdn.in_proj_b, gdn.in_proj_a),
        "q_k_v": (attn.q_proj, attn.k_proj, attn.v_proj),
        "gate_up" if shape == "27b" else "shared_gate_up": (mlp.gate_proj, mlp.up_proj),
    }
    for group, decls in declared.items():
        sizes, k = fused_projections.GROUPS[model][group]
        assert [d.shape for d in decls] == [(n, k) for n in sizes], group
