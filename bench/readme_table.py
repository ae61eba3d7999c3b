"""python -m bench.readme_table: the README's performance table, generated from bench/results/*.json.

Every row carries its ceiling and the fraction of it, as the records do. The files named in `FILES`
come first, in that order; any other result file follows in name order, so a new benchmark shows
up without an edit here. A file gains records run after run (each names its commit); the table
shows the newest record of each benchmark on each machine, where its last measurement stands in
the file, and bench/results keeps the history.
"""

from __future__ import annotations

import sys
from pathlib import Path

from bench.record import RESULTS_DIR, read_records

FILES = ("ceilings-nvidia-h200.json", "decode-nvidia-h200.json", "kernels-nvidia-h200.json",
         "attention-kernels-nvidia-h200.json", "moe-kernels-nvidia-h200.json", "speculative-nvidia-h200.json", "structured-nvidia-h200.json", "mtp-acceptance-cpu.json",
         "prefix-replay-cpu-default.json", "prefix-replay-cpu.json")  # fmt: skip

# Records of experiments, not of the engine as it is: a change tried and reverted, a run with the
# routing report switched off to price it (docs/experts.md), decode under settings the engine does
# not use (docs/engine.md). Kept in bench/results, left out here.
EXPERIMENT_FILES = ("experts-deferred-routing", "experts-no-routing-report", "decode-host-experiments")


def result_files(results_dir: Path = RESULTS_DIR) -> list[Path]:
    """The result files of the table: those in `FILES` that exist, then the others by name."""
    known = [results_dir / name for name in FILES if (results_dir / name).exists()]
    others = sorted(p for p in results_dir.glob("*.json") if p.name not in FILES)
    return known + others


def newest(records: list[dict]) -> list[dict]:
    """The last record of each (name, machine) in file order (records are appended as they are
    measured), each where that last one stands. An A/B run's baseline records (an older commit
    timed beside the new one: `details["baseline"]`) are history, not the engine as it is: left out."""
    seen: set[tuple[str, str]] = set()
    kept = []
    for r in reversed([r for r in records if not (r.get("details") or {}).get("baseline")]):
        if (r["name"], r["machine"]) not in seen:
            seen.add((r["name"], r["machine"]))
            kept.append(r)
    return kept[::-1]


def table(results_dir: Path = RESULTS_DIR, kernel_rows: int = 4) -> str:
    lines = ["| measured | machine | figure | ceiling | fraction | commit |", "|---|---|---|---|---|---|"]
    for path in result_files(results_dir):
        try:
            records = newest(read_records(path))
        except (ValueError, KeyError, TypeError) as exc:  # not a records file: leave it out, say so
            sys.stderr.write(f"readme_table: skipping {path.name}: {exc}\n")
            continue
        if path.name.startswith("kernels-prefill"):  # the largest matrix at M = 4096, kernel and XLA
            records = [r for r in records if "gate_up" in r["name"] and " m4096" in r["name"]]
        elif path.name.startswith("xla-quant"):  # the largest matrices, kernel against XLA's dot
            records = [r for r in records if ("34816x5120" in r["name"] or r["name"].startswith("moe experts"))
                       and r["name"].rsplit(" ", 1)[-1] in ("kernel", "xla_dot", "xla_pairs", "weights.quant", "reference")]  # fmt: skip
        elif path.name.startswith("kernels"):  # the largest matrices only; the file has every shape
            records = [r for r in records if "gate_up" in r["name"]][:kernel_rows]
        elif path.name.startswith("kernel-bounds"):  # the 27B gate_up probes (the file has down too)
            records = [r for r in records if "34816x5120" in r["name"]]
        elif path.name.startswith("attention-kernels"):  # bf16 KV at 32K; the file has every format
            records = [r for r in records if " bf16 " in r["name"] and r["name"].endswith("ctx32k")]
        elif path.name.startswith("moe-kernels"):  # gate_up, uniform routing, batch 1 and 8
            records = [r for r in records if "gate_up" in r["name"] and r["name"].endswith("uniform")
                       and (" batch1 " in r["name"] or " batch8 " in r["name"])]  # fmt: skip
        elif path.name.startswith("gated-delta"):  # each form at its default tiles; the sweep stays in the file
            records = [r for r in records if " bv" not in r["name"]]
        elif path.name.startswith(EXPERIMENT_FILES):
            records = []
        elif path.name.startswith("mapped-gather"):  # the gather variant the engine launches
            records = [r for r in records if " w16 u1 ld 1024 blocks " in r["name"]]
        for r in records:
            ceiling = f"{r['ceiling']:.4g} {r['ceiling_unit']}" if r.get("ceiling") else "-"
            fraction = f"{r['fraction']:.1%}" if r.get("fraction") is not None else "-"
            lines.append(
                f"| {r['name']} | {r['machine']} | {r['figure']:.4g} {r['unit']} | {ceiling} | "
                f"{fraction} | {str(r['commit'])[:8]} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(table() + "\n")
