"""bench.attention_kernels --quick runs on the CPU and writes valid records against the HBM ceiling."""

import pytest

from bench.attention_kernels import AttentionShape, kv_bytes_read, l2_defeat_copies, main, random_paged_kv
from bench.record import read_records


def test_quick_run_writes_a_checked_record_per_point(tmp_path):
    out = tmp_path / "attention.json"
    main(["--quick", "--formats", "int8", "--out", str(out)])
    [record] = read_records(out)
    details = record["details"]
    assert record["name"] == "decode attention tiny int8 batch2 ctx130"
    assert record["unit"] == record["ceiling_unit"] == "GB/s" and record["ceiling"] > 0
    # The figure is KV bytes over the kernel's median time; the result matched the reference.
    assert record["figure"] == pytest.approx(details["kv_bytes"] / details["median_s"] / 1e9)
    assert details["max_rel_err_vs_reference"] <= 2e-2 and details["xla_paged_attend_s"] > 0
    assert details["kernel_only_s"] > 0 and details["config"]["partition_size"] == 64
    assert details["sweep"] and details["interpret"] is True


def test_kv_bytes_count_pages_and_scales_of_visible_tokens_only():
    shape = AttentionShape(heads=4, kv_heads=2, head_dim=32)
    _q, kv, lengths = random_paged_kv(shape, "int8", batch=2, context=100)
    # K and V, 2 heads, 32 int8 values + one float32 scale per token per head, 100 tokens a row.
    assert kv_bytes_read(kv, lengths) == 2 * 2 * (32 + 4) * 100 * 2
    _q, kv, lengths = random_paged_kv(shape, "bf16", batch=1, context=64)
    assert kv_bytes_read(kv, lengths) == 2 * 2 * 32 * 2 * 64


def test_small_points_cycle_through_enough_kv_copies_to_miss_l2():
    # 80B batch 1 at 8K reads 16.8 MB a call: 8 copies; a 1 GB point needs none; interpret mode never copies.
    assert l2_defeat_copies(2 * 2 * 256 * 2 * 8192, interpret=False) == 8
    assert l2_defeat_copies(100 << 20, interpret=False) == 2
    assert l2_defeat_copies(1 << 30, interpret=False) == 1
    assert l2_defeat_copies(1 << 20, interpret=True) == 1
