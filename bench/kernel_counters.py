"""Hardware counters of one NVFP4 decode kernel configuration, read by Nsight Compute (`ncu`).

    python -m bench.kernel_counters --variant gemv_ws --n 17408 --k 5120 --out-dir /tmp/ncu   # GPU + ncu
    python -m bench.kernel_counters --variant gemv_ws --n 5120 --k 17408 --out-dir /tmp/ncu --tag down
    python -m bench.kernel_counters --experts 512 --rows 10 --n 1024 --k 2048 --variant dot_w --block-n 64 \
        --block-k 256 --warps 4 --out-dir /tmp/ncu --tag gate-up-1    # the grouped kernel, one token

Timing variants that leave a stage out (bench.kernel_bounds) says *that* a kernel stops short of
HBM bandwidth; the counters say *why*: DRAM throughput, issue-slot use, occupancy, and the warp
stall reasons (waiting on memory, on a long-latency conversion, on the scoreboard of a load that
was asked for too late). This runs itself under `ncu` (child mode: compile the configuration,
`--warm` calls, then the profiled call), profiles the one launch of `nvfp4_matmul_<variant>`
(`grouped_nvfp4_matmul_<variant>` with --experts) after the warm ones with the full section set, and exports from the report:

    <tag>.ncu-rep          the report (open it in Nsight Compute's GUI)
    <tag>-details.csv      every section's metrics
    <tag>-source.csv       per-SASS-instruction samples (stall reasons by instruction)
    <tag>-raw.csv          every raw metric
    <tag>.json             the headline metrics and the stall reasons, largest first

ncu needs a machine whose runtime lets it read the counters (the Firecracker H100s did; gVisor
did not). Clocks are left alone (`--clock-control none`). Nothing here is a speed figure.
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from bench.kernel_sass import add_kernel_arguments, kernel_inputs, kernel_name

# Raw metrics kept in the JSON summary, by name prefix (the rest stays in the raw CSV).
HEADLINE_PREFIXES = (
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "dram__bytes_read.sum.per_second",
    "gpu__time_duration.sum",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
    "smsp__issue_active.avg.pct_of_peak_sustained_active",
    "smsp__inst_executed.sum",
    "launch__registers_per_thread",
    "launch__occupancy_limit_registers",
    "launch__grid_size",
    "launch__block_size",
    "lts__t_sector_hit_rate.pct",
    "l1tex__t_sector_hit_rate.pct",
)
STALL_PREFIX = "smsp__average_warp_latency_issue_stalled_"  # cycles a warp spends per issue, by reason
STALL_PREFIX_ALT = "smsp__average_warps_issue_stalled_"


def find_ncu(given: str | None = None) -> str | None:
    for cand in (given, shutil.which("ncu"), "/usr/local/cuda/bin/ncu"):
        if cand and os.path.exists(cand):
            return cand
    return None


def ncu_command(ncu: str, report: Path, args, child_argv: list[str]) -> list[str]:
    """The ncu command line that profiles the first launch of the configuration's kernel after its
    warm calls (by name: XLA's own fusions around it are not profiled)."""
    return [
        ncu, "--clock-control", "none", "--target-processes", "all",
        "--kernel-name", f"regex:{kernel_name(args)}", "--launch-skip", str(args.warm),
        "--launch-count", "1", "--set", "full", "--import-source", "yes",
        "--export", str(report), "--force-overwrite",
        sys.executable, "-m", "bench.kernel_counters", "--child", *child_argv,
    ]  # fmt: skip


def parse_raw_csv(text: str) -> dict[str, str]:
    """ncu's `--page raw --csv` of one profiled kernel -> {metric: "value unit"}: the first row
    names the metrics, the second gives their units, the third the kernel's values."""
    rows = [r for r in csv.reader(io.StringIO(text)) if r]
    header = next((i for i, r in enumerate(rows) if "Kernel Name" in r or "ID" in r), None)
    if header is None or len(rows) < header + 3:
        return {}
    names, units, values = rows[header], rows[header + 1], rows[header + 2]
    return {n: (f"{v} {u}".strip()) for n, u, v in zip(names, units, values, strict=False)}


def summarize(raw: dict[str, str]) -> dict:
    """The headline metrics and the stall reasons (largest first) of a parsed raw page."""
    headline = {k: v for k, v in raw.items() if k.startswith(HEADLINE_PREFIXES)}
    stalls = {}
    for key, value in raw.items():
        for prefix in (STALL_PREFIX, STALL_PREFIX_ALT):
            if key.startswith(prefix) and key.endswith(".ratio"):
                reason = key[len(prefix) :].removesuffix(".ratio")
                try:
                    stalls[reason] = float(value.split()[0].replace(",", ""))
                except (ValueError, IndexError):
                    pass
    return {"headline": headline, "stalls": dict(sorted(stalls.items(), key=lambda kv: -kv[1]))}


def run_child(args) -> None:
    """Compile the configuration and run it `warm` + 1 times (the profiled launch is the last)."""
    import jax

    fn, inputs = kernel_inputs(args)
    for _ in range(args.warm + 1):
        jax.block_until_ready(fn(*inputs))


def export(ncu: str, report: Path, page: str, extra: list[str]) -> str:
    out = subprocess.run(
        [ncu, "--import", str(report), "--page", page, "--csv", *extra], capture_output=True, text=True, check=False
    )
    return out.stdout if out.returncode == 0 else f"# ncu --page {page} failed: {out.stderr.strip()[:2000]}\n"


def main(argv: list[str] | None = None) -> dict | None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_kernel_arguments(parser)
    parser.add_argument("--warm", type=int, default=3, help="calls before the profiled one")
    parser.add_argument("--tag", default=None, help="file name stem (default the variant)")
    parser.add_argument("--ncu", default=None)
    parser.add_argument("--out-dir", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        run_child(args)
        return None
    if args.out_dir is None:
        parser.error("--out-dir is required")
    ncu = find_ncu(args.ncu)
    if ncu is None:
        raise SystemExit("ncu not found: pass --ncu (Nsight Compute comes with the CUDA toolkit)")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tag = args.tag or args.variant
    report = out / f"{tag}.ncu-rep"
    child = _drop_option(argv if argv is not None else sys.argv[1:], ("--out-dir", "--ncu", "--tag"))
    run = subprocess.run(ncu_command(ncu, report, args, child), capture_output=True, text=True, check=False)
    (out / f"{tag}-ncu.log").write_text(run.stdout[-20000:] + "\n" + run.stderr[-20000:])
    if run.returncode != 0 or not report.exists():
        raise SystemExit(f"ncu failed (rc {run.returncode}); see {out / f'{tag}-ncu.log'}")
    (out / f"{tag}-details.csv").write_text(export(ncu, report, "details", []))
    (out / f"{tag}-source.csv").write_text(export(ncu, report, "source", ["--print-source", "sass"]))
    raw_text = export(ncu, report, "raw", [])
    (out / f"{tag}-raw.csv").write_text(raw_text)
    config = {k: v for k, v in vars(args).items() if k not in ("child", "ncu")}
    summary = {"config": config, **summarize(parse_raw_csv(raw_text))}
    (out / f"{tag}.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary, indent=1), flush=True)
    return summary


def _drop_option(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """argv without the options `names` (as "--x v" or "--x=v")."""
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in names:
            skip = True
            continue
        if a.split("=", 1)[0] in names:
            continue
        kept.append(a)
    return kept


if __name__ == "__main__":
    main()
