"""bench.moe_routing runs on the CPU (the kernel interpreted) and records that the kernel routes
as XLA does, with the reference's time as the record's ceiling."""

import pytest

from bench.moe_routing import main


def test_quick_run_records_equal_routing_against_xlas_time(tmp_path):
    records = main(["--quick", "--out", str(tmp_path / "r.json")])
    assert len(records) == 4 and (tmp_path / "r.json").exists()
    for r in records:
        assert r.unit == "us/call" and r.figure > 0 and r.ceiling > 0
        assert all(r.details[f"{o}_equal"] for o in ("weights", "ids", "order", "rank", "sizes", "xs"))


def test_quick_run_with_word_rows_checks_them_too(tmp_path):
    records = main(["--quick", "--tokens", "2", "--word-rows", "--out", str(tmp_path / "r.json")])
    assert [r.name.endswith("word-rows") for r in records] == [True, True]
    assert all(r.details["words_equal"] and r.details["inverse_equal"] for r in records)


def test_each_warp_count_gets_its_own_record(tmp_path):
    records = main(["--quick", "--tokens", "1", "--num-warps", "1,4", "--out", str(tmp_path / "r.json")])
    assert [(r.details["num_warps"], r.name.endswith(f"warps{r.details['num_warps']}")) for r in records] == [
        (1, True), (4, True), (1, True), (4, True)
    ]


def test_a_warp_count_not_a_power_of_two_is_refused(capsys):
    with pytest.raises(SystemExit):
        main(["--quick", "--num-warps", "3"])
    assert "powers of two" in capsys.readouterr().err
