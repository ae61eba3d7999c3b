"""The README table: known result files first in their order, others after them, bad files skipped."""

from __future__ import annotations

from bench.readme_table import table
from bench.record import make_record, write_records


def record(name: str, figure: float = 2.0, machine: str = "m", commit: str = "abcdef123"):
    return make_record(name, figure, "tok/s", 4.0, "tok/s", machine=machine, commit=commit)


def test_known_files_come_first_and_unknown_ones_are_listed_after(tmp_path):
    write_records([record("zz new benchmark")], tmp_path / "aaa-new.json")
    write_records([record("prefix replay share")], tmp_path / "prefix-replay-cpu.json")
    write_records([record("decode 27b")], tmp_path / "decode-nvidia-h200.json")
    (tmp_path / "broken.json").write_text("{not json")
    rows = table(tmp_path).splitlines()[2:]
    names = [row.split(" | ")[0].lstrip("| ") for row in rows]
    assert names == ["decode 27b", "prefix replay share", "zz new benchmark"]
    assert rows[0].endswith("| 2 tok/s | 4 tok/s | 50.0% | abcdef12 |")


def test_prefill_kernel_files_show_the_largest_matrix_at_m4096_by_kernel_and_by_xla(tmp_path):
    names = [f"prefill matmul 27b {layer} nvfp4 m{m}{path}" for layer in ("gate_up", "down")
             for m in (4096, 1024) for path in ("", " xla dequantize+dot")]  # fmt: skip
    write_records([record(n) for n in names], tmp_path / "kernels-prefill-nvidia-h200.json")
    rows = table(tmp_path).splitlines()[2:]
    shown = [row.split(" | ")[0].lstrip("| ") for row in rows]
    assert shown == [
        "prefill matmul 27b gate_up nvfp4 m4096",
        "prefill matmul 27b gate_up nvfp4 m4096 xla dequantize+dot",
    ]


def test_xla_quant_files_show_the_largest_matrix_and_the_expert_stacks_by_kernel_and_by_xla(tmp_path):
    names = [f"decode matmul 27b {shape} fp8 batch1 {form}" for shape in ("gate_up 34816x5120", "down 5120x17408")
             for form in ("kernel", "xla_dot", "xla_reduce")]  # fmt: skip
    names += [f"moe experts 80b gate_up 1024x2048 nvfp4 batch1 top10 {form}" for form in ("kernel", "xla_pairs")]
    names += [f"prefill matmul 27b gate_up 34816x5120 nvfp4 m4096 {form}" for form in ("weights.quant", "reference")]
    write_records([record(n) for n in names], tmp_path / "xla-quant-nvidia-h200.json")
    shown = [row.split(" | ")[0].lstrip("| ") for row in table(tmp_path).splitlines()[2:]]
    assert shown == [names[0], names[1], *names[6:]]


def test_experiment_files_stay_out_of_the_table(tmp_path):
    write_records([record("experts decode 8GiB batch1")], tmp_path / "experts-nvidia-h200.json")
    write_records([record("experts decode 8GiB batch1")], tmp_path / "experts-no-routing-report-nvidia-h200.json")
    write_records([record("experts decode 8GiB batch1")], tmp_path / "experts-deferred-routing-nvidia-h200.json")
    assert len(table(tmp_path).splitlines()[2:]) == 1


def test_a_benchmark_measured_again_shows_its_newest_record_per_machine(tmp_path):
    write_records(
        [record("decode 27b", 1.0, commit="1111111"), record("decode 80b", 1.5),
         record("decode 27b", 3.0, machine="h100", commit="2222222"), record("decode 27b", 2.0, commit="3333333")],
        tmp_path / "decode-nvidia-h200.json",
    )  # fmt: skip
    rows = [[c.strip() for c in row.split("|")[1:-1]] for row in table(tmp_path).splitlines()[2:]]
    assert [(r[0], r[1], r[2], r[5]) for r in rows] == [
        ("decode 80b", "m", "1.5 tok/s", "abcdef12"),
        ("decode 27b", "h100", "3 tok/s", "2222222"),
        ("decode 27b", "m", "2 tok/s", "3333333"),
    ]


def test_an_ab_runs_baseline_records_stay_out_of_the_table(tmp_path):
    """An A/B call times an older commit after the new one: the table shows the new commit's
    record, the baseline's stays in the file."""
    old = make_record("decode moe", 1.0, "tok/s", 4.0, "tok/s", machine="m", commit="0000000",
                      details={"baseline": True})  # fmt: skip
    write_records([record("decode moe", 2.0, commit="1111111"), old], tmp_path / "decode-ab-m.json")
    rows = [[c.strip() for c in row.split("|")[1:-1]] for row in table(tmp_path).splitlines()[2:]]
    assert [(r[0], r[2], r[5]) for r in rows] == [("decode moe", "2 tok/s", "1111111")]
