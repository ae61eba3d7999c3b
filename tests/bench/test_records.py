"""Benchmark records and the ceilings module: the format the README's tables are built from."""

from __future__ import annotations

import json

import pytest

import bench.record
from bench.ceilings import QUICK, Measurement, ceiling_records, main, measure_hbm_read
from bench.record import REQUIRED_FIELDS, make_record, read_records, validate_record, write_records


def test_quick_ceilings_run_on_the_cpu_and_write_valid_records(tmp_path):
    out = tmp_path / "ceilings.json"
    main(["--quick", "--out", str(out)])
    records = read_records(out)
    by_kind = {r["name"].split()[1]: r for r in records}
    assert set(by_kind) == {"hbm", "copy", "matmul", "host->device"} and len(records) == 5
    for record in records:
        assert set(REQUIRED_FIELDS) <= set(record)
        assert record["figure"] > 0 and record["details"]["seconds"], record
        assert record["machine"] and record["commit"]
    units = {r["name"]: r["unit"] for r in records}
    assert [u for n, u in units.items() if "matmul" in n] == ["TFLOP/s", "TFLOP/s"]
    assert all(u == "GB/s" for n, u in units.items() if "matmul" not in n)
    read = next(r for r in records if r["name"].startswith("ceiling hbm read"))
    # The figure is the bytes read over the median time, in GB/s.
    assert read["figure"] == pytest.approx(read["details"]["bytes_moved"] / read["details"]["median_s"] / 1e9)


def test_the_hbm_read_ceiling_is_the_fastest_of_its_probes():
    """Each probe (two sums and a copy counted as read + write) is a lower bound on what the memory
    streams: the ceiling is their maximum, so no probe's bad run lowers it."""
    m = measure_hbm_read(QUICK)
    rates = m.details["probe_GBps"]
    assert set(rates) == {"full sum", "row sums", "copy"}
    assert m.details["probe"] == max(rates, key=rates.get)
    assert m.rate / 1e9 == pytest.approx(max(rates.values()))


def test_known_devices_report_the_fraction_of_the_datasheet_peak():
    measured = {
        "hbm_read": Measurement("hbm_read", "ceiling hbm read bf16 sum 4GiB", 4.0e12, "GB/s", 1e9, [0.1])
    }
    [record] = ceiling_records(measured, "NVIDIA H200", "abc")
    assert record.ceiling == 4800.0 and record.fraction == pytest.approx(4000.0 / 4800.0)
    [unknown] = ceiling_records(measured, "some new GPU", "abc")
    assert unknown.ceiling is None and unknown.fraction is None


def test_make_record_derives_the_fraction_unless_given():
    record = make_record("decode tiny batch1", 50.0, "tok/s", 200.0, "tok/s", machine="m", commit="c")
    assert record.fraction == pytest.approx(0.25)
    overhead = make_record("host share", 2.0, "ms", None, None, machine="m", commit="c", fraction=0.9)
    assert overhead.fraction == 0.9


def test_a_run_under_xla_flags_names_them_in_its_records(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_command_buffer_update_mode=SKIP_TEMP")
    record = make_record("decode tiny batch1", 50.0, "tok/s", 200.0, "tok/s", machine="m", commit="c")
    assert record.details["xla_flags"] == "--xla_gpu_command_buffer_update_mode=SKIP_TEMP"
    monkeypatch.delenv("XLA_FLAGS")
    assert "xla_flags" not in make_record("d", 1.0, "tok/s", None, None, machine="m", commit="c").details


def test_bare_file_names_go_under_bench_results(tmp_path, monkeypatch):
    monkeypatch.setattr(bench.record, "RESULTS_DIR", tmp_path / "results")
    path = write_records([make_record("x", 1.0, "GB/s", 2.0, "GB/s", machine="m", commit="c")], "x.json")
    assert path == tmp_path / "results" / "x.json"
    assert json.loads(path.read_text())[0]["fraction"] == 0.5


@pytest.mark.parametrize(
    "change, message",
    [
        ({"figure": None}, "figure"),
        ({"machine": ""}, "machine"),
        ({"ceiling": -1.0}, "ceiling"),
        ({"ceiling_unit": None}, "ceiling_unit"),
        ({"fraction": float("nan")}, "fraction"),
    ],
)
def test_invalid_records_are_refused(tmp_path, change, message):
    good = vars(make_record("x", 1.0, "GB/s", 2.0, "GB/s", machine="m", commit="c"))
    validate_record(good)
    with pytest.raises(ValueError, match=message):
        write_records([{**good, **change}], tmp_path / "bad.json")
    missing = {k: v for k, v in good.items() if k != "commit"}
    with pytest.raises(ValueError, match="missing 'commit'"):
        validate_record(missing)
