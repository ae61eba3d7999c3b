"""bench.ngram_memory --quick runs on the CPU and writes valid records with RAM as the ceiling."""

from __future__ import annotations

from bench.ngram_memory import main
from bench.record import REQUIRED_FIELDS, read_records


def test_quick_run_writes_lookup_and_decode_records(tmp_path):
    out = tmp_path / "ngram.json"
    main(["--quick", "--dir", str(tmp_path / "vol"), "--out", str(out)])
    records = read_records(out)
    names = [r["name"] for r in records]
    assert len(records) == 4 and all("ngram" in n for n in names)
    assert sum(n.startswith("ngram lookup") for n in names) == 2
    assert sum(n.startswith("ngram decode batch1") for n in names) == 2
    for r in records:
        assert set(REQUIRED_FIELDS) <= set(r)
        assert r["figure"] > 0 and r["ceiling"] > 0
        assert abs(r["fraction"] - r["figure"] / r["ceiling"]) < 1e-9
    assert not any((tmp_path / "vol").glob("ngram-bench-*")), "the volume is removed afterwards"
