"""Where a program's device time goes: a profiler trace of a callable, summarised per kernel.

    from bench.profile_summary import profile_device
    summary = profile_device(lambda: run_decode(...), repeats=2)

Runs the callable under `jax.profiler` and reads the trace back with `jax.profiler.ProfileData`
(part of jaxlib: no TensorBoard needed). For every device plane (a GPU) it reports the wall span
of the kernels, the time the device was busy (the union of kernel intervals: gaps are launch or
host waits), the kernel count, and the kernels that took the most time, grouped by name (XLA
fusion names, Pallas kernels by their `name=`). On the CPU there is no device plane: the summary
says so and carries the host's busiest events instead.
"""

from __future__ import annotations

import collections
import glob
import os
import tempfile
from collections.abc import Callable
from typing import Any

import jax


def _union_ns(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals."""
    total, covered_to = 0.0, float("-inf")
    for start, end in sorted(intervals):
        total += max(0.0, end - max(start, covered_to))
        covered_to = max(covered_to, end)
    return total


def summarize_planes(planes: Any, top: int = 25) -> dict:
    """{"devices": [...], "host_top": [...]} from ProfileData planes (see the module docstring)."""
    devices, host = [], collections.Counter()
    for plane in planes:
        if plane.name.startswith("/device:"):
            intervals, by_name, counts = [], collections.Counter(), collections.Counter()
            for line in plane.lines:
                if "stream" not in line.name.lower():
                    continue  # kernel events sit on per-stream lines; others are derived views
                for ev in line.events:
                    intervals.append((ev.start_ns, ev.start_ns + ev.duration_ns))
                    by_name[ev.name] += ev.duration_ns
                    counts[ev.name] += 1
            if not intervals:
                continue
            span = max(e for _, e in intervals) - min(s for s, _ in intervals)
            busy = _union_ns(intervals)
            devices.append({
                "plane": plane.name,
                "span_ms": span / 1e6,
                "busy_ms": busy / 1e6,
                "busy_fraction": busy / span if span else None,
                "kernels": len(intervals),
                "top": [
                    {"name": name[:160], "ms": ns / 1e6, "count": counts[name], "share": ns / busy}
                    for name, ns in by_name.most_common(top)
                ],
            })  # fmt: skip
        elif plane.name.startswith("/host:CPU"):
            for line in plane.lines:
                for ev in line.events:
                    host[f"{line.name}: {ev.name}"[:160]] += ev.duration_ns
    return {
        "devices": devices,
        "host_top": [{"name": n, "ms": ns / 1e6} for n, ns in host.most_common(top)],
    }


def profile_device(fn: Callable[[], Any], *, repeats: int = 1, log_dir: str | None = None, top: int = 25) -> dict:
    """Trace `repeats` calls of fn (each waited for) and summarise them (`summarize_planes`)."""
    from jax.profiler import ProfileData

    log_dir = log_dir or tempfile.mkdtemp(prefix="infernix-profile-")
    jax.profiler.start_trace(log_dir)
    try:
        for _ in range(repeats):
            jax.block_until_ready(fn())
    finally:
        jax.profiler.stop_trace()
    paths = sorted(glob.glob(os.path.join(log_dir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    if not paths:
        return {"devices": [], "host_top": [], "error": f"no trace written under {log_dir}"}
    summary = summarize_planes(ProfileData.from_file(paths[-1]).planes, top)
    summary["repeats"] = repeats
    return summary


def format_summary(summary: dict, lines: int = 15) -> str:
    """A short text table of the summary (device busy share and the top kernels)."""
    out = []
    for dev in summary.get("devices", []):
        out.append(
            f"{dev['plane']}: span {dev['span_ms']:.2f} ms, busy {dev['busy_ms']:.2f} ms "
            f"({dev['busy_fraction']:.1%}), {dev['kernels']} kernels"
        )
        for k in dev["top"][:lines]:
            out.append(f"  {k['ms']:9.3f} ms {k['share']:6.1%} x{k['count']:<5d} {k['name'][:100]}")
    if not summary.get("devices"):
        out.append("no device plane in the trace (CPU run); busiest host events:")
        out += [f"  {h['ms']:9.3f} ms {h['name'][:110]}" for h in summary.get("host_top", [])[:lines]]
    return "\n".join(out)
