"""bench.norm_rows runs on the CPU (the kernels interpreted) and records that the kernels' rows
follow from their normed values as XLA's would, with the reference's time as the ceiling."""

from bench.norm_rows import main


def test_quick_run_records_rows_equal_to_xlas_from_the_same_norm(tmp_path):
    records = main(["--quick", "--out", str(tmp_path / "r.json")])
    assert len(records) == 4 and (tmp_path / "r.json").exists()
    assert {r.details["layout"] for r in records} == {"columns", "pairs"}
    for r in records:
        assert r.unit == "us/call" and r.figure > 0 and r.ceiling > 0
        assert r.details["words_equal"] and r.details["inverse_equal"]
        assert r.details["normed_max_abs_diff"] < 0.1  # an ulp or so: XLA orders its sums its own way
