"""`python -m bench.kernels --quick --prefill`: the interpret-mode smoke run of the prefill
benchmark writes one checked record per layer and M, and fails loudly on a wrong kernel."""

import json

import pytest

from bench import kernels


def _run(tmp_path):
    out = tmp_path / "prefill.json"
    kernels.main(["--quick", "--prefill", "--formats", "fp8", "--out", str(out)])
    return json.loads(out.read_text())


def test_quick_prefill_writes_a_record_per_layer_and_m(tmp_path):
    records = _run(tmp_path)
    xla = [r for r in records if r["name"].endswith(" xla dequantize+dot")]
    records = [r for r in records if r not in xla]
    want = {
        f"prefill matmul tiny {layer} {n}x{k} fp8 m{m}"
        for layer, (n, k) in kernels.QUICK_SHAPES["tiny"].items()
        for m in map(int, kernels.QUICK_PREFILL_MS.split(","))
    }
    assert {r["name"] for r in records} == want
    assert {r["name"] for r in xla} == {f"{name} xla dequantize+dot" for name in want}  # the path beside
    for r in xla:
        d = r["details"]
        assert r["figure"] == pytest.approx(2 * d["m"] * d["n"] * d["k"] / d["median_s"] / 1e12)
    for r in records:
        d = r["details"]
        assert r["unit"] == r["ceiling_unit"] == "TFLOP/s"
        assert r["figure"] == pytest.approx(2 * d["m"] * d["n"] * d["k"] / d["median_s"] / 1e12)
        assert d["tiles"]["variant"] == "tiled" and d["max_rel_err_vs_reference"] <= 2e-2
        assert d["xla_dequant_dot_s"] > 0 and d["bf16_dot_s"] > 0


def test_quick_prefill_fails_when_the_kernel_disagrees_with_the_reference(tmp_path, monkeypatch):
    monkeypatch.setattr(kernels, "relative_error", lambda got, want: 0.5)
    with pytest.raises(AssertionError, match="differs from the reference"):
        _run(tmp_path)
