"""bench.kernel_counters: the ncu command profiles the kernel's first launch after its warm calls,
and ncu's raw page reads as headline metrics and stall reasons (the parts that run without ncu)."""

import itertools
import sys
from pathlib import Path

from bench import kernel_counters

RAW = (
    '"ID","Kernel Name","gpu__time_duration.sum","dram__throughput.avg.pct_of_peak_sustained_elapsed",'
    '"smsp__average_warp_latency_issue_stalled_long_scoreboard.ratio",'
    '"smsp__average_warp_latency_issue_stalled_wait.ratio","smsp__inst_executed.sum","other__metric"\n'
    '"","","us","%","","","inst",""\n'
    '"0","nvfp4_matmul_gemv_ws","27.90","61.20","12.5","3,100.25","1,234","x"\n'
)


def test_the_raw_page_gives_headline_metrics_and_stall_reasons_largest_first():
    summary = kernel_counters.summarize(kernel_counters.parse_raw_csv(RAW))
    assert summary["headline"] == {
        "gpu__time_duration.sum": "27.90 us",
        "dram__throughput.avg.pct_of_peak_sustained_elapsed": "61.20 %",
        "smsp__inst_executed.sum": "1,234 inst",
    }
    assert list(summary["stalls"].items()) == [("wait", 3100.25), ("long_scoreboard", 12.5)]


def test_an_empty_or_failed_export_summarizes_to_nothing():
    assert kernel_counters.summarize(kernel_counters.parse_raw_csv("# ncu --page raw failed\n")) == {
        "headline": {},
        "stalls": {},
    }


def test_ncu_profiles_one_launch_of_the_variant_after_the_warm_calls_and_drops_parent_options():
    child = kernel_counters._drop_option(
        ["--variant", "gemv_ws", "--out-dir", "/tmp/x", "--ncu=/opt/ncu", "--tag", "down", "--warm", "5"],
        ("--out-dir", "--ncu", "--tag"),
    )
    assert child == ["--variant", "gemv_ws", "--warm", "5"]

    class Args:
        variant, warm = "gemv_ws", 5

    cmd = kernel_counters.ncu_command("ncu", Path("/tmp/r.ncu-rep"), Args, child)
    flags = dict(itertools.pairwise(cmd))
    assert flags["--kernel-name"] == "regex:nvfp4_matmul_gemv_ws"
    assert flags["--launch-skip"] == "5" and flags["--launch-count"] == "1"
    assert flags["--clock-control"] == "none"
    assert cmd[cmd.index(sys.executable) :] == [sys.executable, "-m", "bench.kernel_counters", "--child", *child]


def test_a_missing_ncu_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setattr(kernel_counters, "find_ncu", lambda given=None: None)
    try:
        kernel_counters.main(["--out-dir", str(tmp_path)])
    except SystemExit as e:
        assert "ncu not found" in str(e)
    else:
        raise AssertionError("no error without ncu")


def test_the_grouped_kernel_is_profiled_by_its_own_name_on_a_decode_steps_routed_rows():
    from bench.kernel_sass import kernel_inputs

    class Args:
        variant, warm, experts, rows, n, k = "dot_w", 3, 64, 10, 32, 256
        block_n, block_k, warps, stages = 32, 128, 4, 2

    cmd = kernel_counters.ncu_command("ncu", Path("/tmp/r.ncu-rep"), Args, [])
    assert dict(itertools.pairwise(cmd))["--kernel-name"] == "regex:grouped_nvfp4_matmul_dot_w"
    _, (x, packed, scales, tensor_scale, sizes) = kernel_inputs(Args)
    assert x.shape == (10, 256) and packed.shape == (64, 32, 128) and scales.shape == (64, 32, 16)
    assert tensor_scale.shape == (64,)
    # one row on each of ten distinct experts, as one token's top-10
    assert int(sizes.sum()) == 10 and int(sizes.max()) == 1
