"""bench.kernel_bounds: the probes of the NVFP4 decode bound run and are recorded against HBM."""

import json

from bench import kernel_bounds


def test_quick_run_records_each_probe_against_the_hbm_ceiling(tmp_path):
    out = tmp_path / "bounds.json"
    records = kernel_bounds.main(["--quick", "--probes", "read,dot_t_w,xla_bf16", "--out", str(out)])
    assert [r.details["probe"] for r in records] == ["read", "dot_t_w", "xla_bf16"]
    for r in records:
        assert r.unit == "GB/s" and r.figure > 0 and r.ceiling > 0
        nvfp4_bytes = 256 * 512 // 2 + 256 * 512 // 16  # packed words + e4m3 block scales
        assert r.details["bytes"] == (256 * 512 * 2 if r.details["probe"] == "xla_bf16" else nvfp4_bytes)
    assert [row["name"] for row in json.loads(out.read_text())] == [r.name for r in records]
