"""bench.row_experts runs on the CPU (the kernel interpreted): one record a projection, the named
way's outputs equal to the sorted way's, the gate / up reading the token's word row."""

from bench.row_experts import main


def test_quick_run_records_both_projections_bit_equal(tmp_path):
    records = main(["--quick", "--out", str(tmp_path / "r.json")])
    assert [r.name for r in records] == ["row-experts gate_up nvfp4 batch1", "row-experts down nvfp4 batch1"]
    assert (tmp_path / "r.json").exists()
    for r in records:
        assert r.details["bit_equal"] and r.figure > 0 and r.ceiling > 0
        assert r.details["named_us"] > 0 and r.details["sorted_us"] > 0
    assert [r.details["x_words"] for r in records] == ["pairs", None]
