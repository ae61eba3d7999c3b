"""The in-program expert copy benchmark: every method copies exactly the missed experts' bytes."""

from __future__ import annotations

import pytest

from bench.expert_copies import METHODS, main


def test_every_method_copies_the_asked_experts_and_reports_the_rate(tmp_path):
    out = tmp_path / "copies.json"
    records = main(["--quick", "--repeats", "1", "--out", str(out)])  # main checks the bytes of each
    assert [r.details["method"] for r in records] == list(METHODS)
    for r in records:
        d = r.details
        moved = d["layers"] * d["missed"] * d["expert_bytes"]
        assert r.figure == pytest.approx(moved / d["seconds"] / 1e9)
        assert "expert" in r.name and "pcie" in r.name
