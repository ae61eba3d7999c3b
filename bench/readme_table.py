"""python -m bench.readme_table: the README's performance table, generated from bench/results/*.json.

Every row carries its ceiling and the fraction of it, as the records do.
"""

from __future__ import annotations

import sys
from pathlib import Path

from bench.record import RESULTS_DIR, read_records

FILES = ("ceilings-nvidia-h200.json", "decode-nvidia-h200.json", "kernels-nvidia-h200.json",
         "mtp-acceptance-cpu.json")


def table(results_dir: Path = RESULTS_DIR, kernel_rows: int = 4) -> str:
    lines = ["| measured | machine | figure | ceiling | fraction | commit |", "|---|---|---|---|---|---|"]
    for name in FILES:
        path = results_dir / name
        if not path.exists():
            continue
        records = read_records(path)
        if name.startswith("kernels"):  # the largest matrices only; the file has every shape
            records = [r for r in records if "gate_up" in r["name"]][:kernel_rows]
        for r in records:
            ceiling = f"{r['ceiling']:.4g} {r['ceiling_unit']}" if r.get("ceiling") else "-"
            fraction = f"{r['fraction']:.1%}" if r.get("fraction") is not None else "-"
            lines.append(f"| {r['name']} | {r['machine']} | {r['figure']:.4g} {r['unit']} | {ceiling} | "
                         f"{fraction} | {str(r['commit'])[:8]} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(table() + "\n")
