"""The profile summary's idle gaps: where the device waited, and between which kernels."""

from __future__ import annotations

from bench.profile_summary import idle_gaps


def test_idle_gaps_are_the_longest_stretches_without_a_kernel_in_time_order():
    ms = 1_000_000  # ns
    kernels = [  # (start, end, name); "b" overlaps "a", so the first gap starts after "b" ends
        (0, 2 * ms, "a"),
        (1 * ms, 3 * ms, "b"),
        (8 * ms, 9 * ms, "copy"),
        (9 * ms + 50_000, 10 * ms, "tiny gap before"),  # 0.05 ms: under the 0.1 ms floor
        (12 * ms, 13 * ms, "last"),
    ]
    gaps = idle_gaps(kernels, origin=0, top=5)
    assert [(g["start_ms"], g["ms"], g["after"], g["before"]) for g in gaps] == [
        (3.0, 5.0, "b", "copy"),
        (10.0, 2.0, "tiny gap before", "last"),
    ]
    assert [g["ms"] for g in idle_gaps(kernels, origin=0, top=1)] == [5.0], "the longest first"


def test_a_copy_on_a_second_stream_counts_the_time_it_ran_beside_the_first():
    """The summary says how long each kernel ran while another stream's kernels ran: whether a
    prefetch copy on its own stream overlapped the layer's compute or only took turns with it."""
    from types import SimpleNamespace as NS

    from bench.profile_summary import summarize_planes

    ms = 1_000_000

    def ev(start, end, name):
        return NS(start_ns=start * ms, duration_ns=(end - start) * ms, name=name)

    compute = NS(name="Stream #1(compute)", events=[ev(0, 2, "dot"), ev(3, 6, "dot")])
    copies = NS(name="Stream #2(copy)", events=[ev(1, 4, "gather"), ev(7, 8, "gather")])
    derived = NS(name="XLA Ops", events=[ev(0, 8, "not a kernel")])
    plane = NS(name="/device:GPU:0", lines=[compute, copies, derived])
    (device,) = summarize_planes([plane])["devices"]
    top = {k["name"]: k for k in device["top"]}
    # gather [1,4) and [7,8) against dot [0,2) and [3,6): beside for [1,2) and [3,4)
    assert top["gather"]["ms"] == 4.0 and top["gather"]["beside_other_streams_ms"] == 2.0
    assert top["dot"]["beside_other_streams_ms"] == 2.0
    assert device["busy_ms"] == 7.0  # [0,6) and [7,8)
    assert device["kernel_ms"] - device["busy_ms"] == 2.0  # the time two kernels ran at once
    assert device["streams"]["Stream #2(copy)"] == {"kernels": 2, "busy_ms": 4.0}


def test_kernels_are_counted_by_family():
    """Launches and time per kernel family, the biggest first; unnamed XLA fusions are one family."""
    from bench.profile_summary import kernel_categories

    counts = {"nvfp4_matmul_gemv_ws": 4, "nvfp4_matmul_gemv_ws__1": 2, "gated_delta_decode": 3,
              "loop_transpose_fusion_191": 10, "input_reduce_fusion_7": 5, "gemm_fusion_dot_101": 1}  # fmt: skip
    times = {"nvfp4_matmul_gemv_ws": 4e6, "nvfp4_matmul_gemv_ws__1": 2e6, "gated_delta_decode": 0.3e6,
             "loop_transpose_fusion_191": 1e6, "input_reduce_fusion_7": 0.5e6, "gemm_fusion_dot_101": 0.6e6}  # fmt: skip
    got = kernel_categories(counts, times)
    assert list(got) == ["nvfp4 matmul", "other xla", "xla gemm", "gated delta"]
    assert got["nvfp4 matmul"] == {"kernels": 6, "ms": 6.0}
    assert got["other xla"]["kernels"] == 15 and abs(got["other xla"]["ms"] - 1.5) < 1e-9
