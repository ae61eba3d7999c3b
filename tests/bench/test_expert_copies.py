"""The in-program expert copy benchmark: every method copies exactly the missed experts' bytes."""

from __future__ import annotations

import pytest

from bench import expert_copies
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


def test_a_method_that_fails_is_reported_and_the_others_still_run(tmp_path, monkeypatch, capsys):
    real = expert_copies.copy_fn

    def copy_fn(method, shapes):
        if method == "dma-bytes":
            raise RuntimeError("no CUDA driver here")
        return real(method, shapes)

    monkeypatch.setattr(expert_copies, "copy_fn", copy_fn)
    methods = "loop-bytes,dma-bytes,bucket-bytes"
    records = main(["--quick", "--repeats", "1", "--methods", methods, "--out", str(tmp_path / "c.json")])
    assert [r.details["method"] for r in records] == ["loop-bytes", "bucket-bytes"]
    assert "dma-bytes           failed: RuntimeError: no CUDA driver here" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--quick", "--methods", "loop-bytes,gather"])
