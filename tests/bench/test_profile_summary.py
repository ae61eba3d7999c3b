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
