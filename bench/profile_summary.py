"""Where a program's device time goes: a profiler trace of a callable, summarised per kernel.

    from bench.profile_summary import profile_device
    summary = profile_device(lambda: run_decode(...), repeats=2)

Runs the callable under `jax.profiler` and reads the trace back with `jax.profiler.ProfileData`
(part of jaxlib: no TensorBoard needed). For every device plane (a GPU) it reports the wall span
of the kernels, the time the device was busy (the union of kernel intervals: gaps are launch or
host waits), the kernel count, the launches and time of each kernel family (`CATEGORIES`), and
the kernels that took the most time, grouped by name (XLA fusion names, Pallas kernels by their
`name=`). On the CPU there is no device plane: the summary says so and carries the host's
busiest events instead.
"""

from __future__ import annotations

import collections
import glob
import os
import tempfile
from collections.abc import Callable
from typing import Any

import jax

# host events named MARK + text (`jax.profiler.TraceAnnotation`) are kept with their times, so a
# summary can say which device gaps fall in which engine step
MARK = "mark:"


def _union_ns(intervals: list[tuple[float, float]]) -> float:
    """Total length of the union of [start, end) intervals."""
    total, covered_to = 0.0, float("-inf")
    for start, end in sorted(intervals):
        total += max(0.0, end - max(start, covered_to))
        covered_to = max(covered_to, end)
    return total


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of [start, end) intervals as disjoint sorted intervals."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(a, b) for a, b in out]


def _intersection_ns(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the intersection of two unions of intervals."""
    a, b = _merged(a), _merged(b)
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        total += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


# Kernel families by name, first match wins (`kernel_categories`): the Pallas kernels by their
# `name=` prefix, XLA's library calls, and every other XLA fusion as one family.
CATEGORIES = (
    ("nvfp4 matmul", ("nvfp4_matmul",)),
    ("fp8 matmul", ("fp8_matmul",)),
    ("grouped expert matmul", ("grouped_",)),
    ("gated delta", ("gated_delta",)),
    ("attention", ("paged_decode_attention", "paged_prefill_attention")),
    ("xla gemm", ("gemm", "cublas", "cutlass", "triton_gemm")),
    ("copies and memsets", ("memcpy", "memset", "copy")),
    ("sort", ("sort", "radix", "cub::")),
)


def kernel_categories(counts: dict[str, int], times_ns: dict[str, float]) -> dict[str, dict]:
    """{family: {"kernels", "ms"}} of the kernels named in `counts` / `times_ns` (CATEGORIES; the
    rest is "other xla"): how many launches and how much time each family takes, the figure a
    change that cuts launches moves."""
    out: dict[str, dict] = {}
    for name, n in counts.items():
        low = name.lower()
        family = next((f for f, keys in CATEGORIES if any(k in low for k in keys)), "other xla")
        entry = out.setdefault(family, {"kernels": 0, "ms": 0.0})
        entry["kernels"] += n
        entry["ms"] += times_ns.get(name, 0.0) / 1e6
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["ms"]))


def summarize_planes(planes: Any, top: int = 25) -> dict:
    """{"devices": [...], "host_top": [...]} from ProfileData planes (see the module docstring)."""
    devices, host, marks = [], collections.Counter(), []
    for plane in planes:
        if plane.name.startswith("/device:"):
            intervals, by_name, counts = [], collections.Counter(), collections.Counter()
            kernels, per_line = [], collections.defaultdict(list)  # per_line: stream line -> intervals
            for line in plane.lines:
                if "stream" not in line.name.lower():
                    continue  # kernel events sit on per-stream lines; others are derived views
                for ev in line.events:
                    intervals.append((ev.start_ns, ev.start_ns + ev.duration_ns))
                    kernels.append((ev.start_ns, ev.start_ns + ev.duration_ns, ev.name))
                    per_line[line.name].append((ev.start_ns, ev.start_ns + ev.duration_ns, ev.name))
                    by_name[ev.name] += ev.duration_ns
                    counts[ev.name] += 1
            if not intervals:
                continue
            span = max(e for _, e in intervals) - min(s for s, _ in intervals)
            busy = _union_ns(intervals)
            origin = min(s for s, _ in intervals)
            devices.append({
                "plane": plane.name,
                "span_ms": span / 1e6,
                "busy_ms": busy / 1e6,
                "busy_fraction": busy / span if span else None,
                # kernel time beyond the busy time ran beside other kernels, on another stream
                # or inside one CUDA graph (whose kernels the trace lists on the launching stream)
                "kernel_ms": sum(e - s for s, e in intervals) / 1e6,
                "kernels": len(intervals),
                "categories": kernel_categories(counts, by_name),
                "top": [
                    {"name": name[:160], "ms": ns / 1e6, "count": counts[name], "share": ns / busy,
                     "beside_other_streams_ms": _beside_other_streams(per_line, name) / 1e6}
                    for name, ns in by_name.most_common(top)
                ],
                "streams": {
                    name: {"kernels": len(ev), "busy_ms": _union_ns([(a, b) for a, b, _ in ev]) / 1e6}
                    for name, ev in per_line.items()
                },
                "origin_ns": origin,
                "gaps": idle_gaps(kernels, origin, top),
            })  # fmt: skip
        elif plane.name.startswith("/host:CPU"):
            for line in plane.lines:
                for ev in line.events:
                    host[f"{line.name}: {ev.name}"[:160]] += ev.duration_ns
                    if ev.name.startswith(MARK):
                        marks.append((ev.start_ns, ev.duration_ns, ev.name[len(MARK) :]))
    origin = min((d["origin_ns"] for d in devices), default=min((m[0] for m in marks), default=0))
    return {
        "devices": devices,
        "host_top": [{"name": n, "ms": ns / 1e6} for n, ns in host.most_common(top)],
        "marks": [{"name": n, "start_ms": (t - origin) / 1e6, "ms": d / 1e6} for t, d, n in sorted(marks)],
    }


def _beside_other_streams(per_line: dict[str, list], name: str) -> float:
    """ns in which a kernel called `name` ran while a kernel of another stream line ran too (a
    copy on a second stream that overlaps the compute, or waits beside it)."""
    total = 0.0
    for line, events in per_line.items():
        mine = [(a, b) for a, b, n in events if n == name]
        if not mine:
            continue
        others = [(a, b) for other, ev in per_line.items() if other != line for a, b, _ in ev]
        total += _intersection_ns(mine, others)
    return total


def idle_gaps(
    kernels: list[tuple[float, float, str]], origin: float, top: int = 25, min_ns: float = 1e5
) -> list[dict]:
    """The `top` longest stretches (at least `min_ns`) in which no kernel ran, in time order: where
    each starts (ms after `origin`), how long it is, and the kernels on either side (a gap after a
    kernel that reads host memory, or before the first kernel of a step, says who kept the device
    waiting)."""
    gaps, covered_to, last = [], None, ""
    for start, end, name in sorted(kernels):
        if covered_to is not None and start - covered_to >= min_ns:
            gaps.append({"start_ms": (covered_to - origin) / 1e6, "ms": (start - covered_to) / 1e6,
                         "after": last[:80], "before": name[:80]})  # fmt: skip
        if covered_to is None or end >= covered_to:
            covered_to, last = end, name
    return sorted(sorted(gaps, key=lambda g: -g["ms"])[:top], key=lambda g: g["start_ms"])


def profile_device(
    fn: Callable[[], Any], *, repeats: int = 1, log_dir: str | None = None, top: int = 25
) -> dict:
    """Trace `repeats` calls of fn (each waited for) and summarise them (`summarize_planes`)."""
    from jax.profiler import ProfileData

    log_dir = log_dir or tempfile.mkdtemp(prefix="infernix-profile-")
    jax.profiler.start_trace(log_dir)
    try:
        for _ in range(repeats):
            jax.block_until_ready(fn())
    finally:
        jax.profiler.stop_trace()
    paths = sorted(
        glob.glob(os.path.join(log_dir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime
    )
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
            f", {dev['kernel_ms'] - dev['busy_ms']:.2f} ms of kernel time beside other kernels"
        )
        for name, line in dev.get("streams", {}).items():
            out.append(f"  {name[:40]}: {line['kernels']} kernels, busy {line['busy_ms']:.2f} ms")
        families = dev.get("categories", {})
        if families:
            parts = (f"{f} {c['kernels']} x {c['ms']:.2f} ms" for f, c in families.items())
            out.append("  by family: " + ", ".join(parts))
        for k in dev["top"][:lines]:
            beside = k.get("beside_other_streams_ms", 0.0)
            also = f" ({beside:.3f} ms beside another stream)" if beside else ""
            out.append(f"  {k['ms']:9.3f} ms {k['share']:6.1%} x{k['count']:<5d} {k['name'][:100]}{also}")
        if dev.get("gaps"):
            out.append("  longest idle gaps (at ms: length, after -> before):")
            for g in dev["gaps"][:lines]:
                out.append(
                    f"    {g['start_ms']:9.3f}: {g['ms']:7.3f} ms  {g['after'][:40]} -> {g['before'][:40]}"
                )
    for m in summary.get("marks", [])[: 2 * lines]:
        out.append(f"  host {m['name']}: at {m['start_ms']:.3f} ms for {m['ms']:.3f} ms")
    if not summary.get("devices"):
        out.append("no device plane in the trace (CPU run); busiest host events:")
        out += [f"  {h['ms']:9.3f} ms {h['name'][:110]}" for h in summary.get("host_top", [])[:lines]]
    return "\n".join(out)
