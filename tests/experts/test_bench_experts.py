"""The expert benchmark's quick run: records carry the PCIe bound and add up (one budget, batch 1),
and with a hot set in the routing the dynamic cache finds it where static placement cannot."""

from __future__ import annotations

import pytest

from bench.experts import main
from bench.record import read_records


@pytest.mark.slow  # ~1-2 min on 2 CPU cores, mostly compiling two engines
def test_quick_run_writes_pcie_bound_records(tmp_path):
    out = tmp_path / "experts.json"
    main(
        [
            "--quick",
            "--shares",
            "0.37",
            "--batches",
            "1",
            "--dispatches",
            "12",
            "--steps",
            "4",
            "--hot-experts",
            "8",
            "--out",
            str(out),
        ]
    )
    records = {r["name"]: r for r in read_records(out)}
    offloaded = [r for n, r in records.items() if "37%" in n]
    assert len(offloaded) == 2 and {r["details"]["policy"] for r in offloaded} == {"dynamic", "static"}
    for record in offloaded:
        d = record["details"]
        assert "expert" in record["name"] and "pcie" in record["name"]
        assert 0.0 < d["hit_rate"] < 1.0 and d["tokens"] == 48
        assert d["hot_share"] > 0.5, "the hot experts should take most of the routing"
        moved = (d["fetched_bytes"] + d["promoted_bytes"]) / d["tokens"]
        assert d["moved_bytes_per_token"] == pytest.approx(moved)
        assert record["ceiling"] == pytest.approx(d["pinned_host_GBps"] * 1e9 / moved)
        assert record["fraction"] == pytest.approx(record["figure"] / record["ceiling"])
    by_policy = {r["details"]["policy"]: r["details"] for r in offloaded}
    assert by_policy["static"]["promotions"] == 0 < by_policy["dynamic"]["promotions"]
    assert by_policy["dynamic"]["hit_rate"] > by_policy["static"]["hit_rate"] + 0.15
    resident = [r for n, r in records.items() if "all-resident" in n]
    assert len(resident) == 1 and resident[0]["ceiling"] is None and resident[0]["figure"] > 0
