"""Benchmark records: one JSON object per measured point, written to files under bench/results/.

Every record states its figure next to the ceiling the same machine reached in the same run, so
that a table built from these files always shows how far from the hardware a figure is. The
README's performance tables are generated from these files.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import subprocess
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"

REQUIRED_FIELDS = ("name", "machine", "commit", "figure", "unit", "ceiling", "ceiling_unit", "fraction")


@dataclass
class BenchRecord:
    """One measured point."""

    name: str  # what was measured, shape, format and batch in words: "decode 27b bf16 batch1 ctx8k"
    machine: str  # the accelerator's name ("NVIDIA H200"), or the CPU's on a CPU run
    commit: str  # git commit of the code measured ("-dirty" when the tree had changes)
    figure: float  # the measured value
    unit: str  # its unit: "tok/s", "GB/s", "TFLOP/s", "s"
    ceiling: float | None  # what the machine allows for this work, measured in the same run
    ceiling_unit: str | None  # the ceiling's unit
    fraction: float | None  # figure / ceiling (overhead comparisons: reference figure / figure)
    details: dict[str, Any] = field(default_factory=dict)  # free-form: sizes, repeats, versions
    time: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S%z"))  # when measured


def make_record(
    name: str,
    figure: float,
    unit: str,
    ceiling: float | None,
    ceiling_unit: str | None,
    *,
    machine: str | None = None,
    commit: str | None = None,
    fraction: float | None = None,
    details: dict[str, Any] | None = None,
) -> BenchRecord:
    """A record whose fraction is figure / ceiling unless given (overheads pass their own); the
    run's XLA_FLAGS, when set, go into its details (they can change any figure)."""
    if fraction is None and ceiling:
        fraction = figure / ceiling
    details = dict(details or {})
    if os.environ.get("XLA_FLAGS"):
        details.setdefault("xla_flags", os.environ["XLA_FLAGS"])
    return BenchRecord(
        name=name,
        machine=machine if machine is not None else machine_name(),
        commit=commit if commit is not None else git_commit(),
        figure=float(figure),
        unit=unit,
        ceiling=None if ceiling is None else float(ceiling),
        ceiling_unit=ceiling_unit,
        fraction=None if fraction is None else float(fraction),
        details=details,
    )


def context_label(tokens: int) -> str:
    """ "ctx8k" for whole thousands of 1024 tokens and up, else "ctx300" (for record names)."""
    return f"ctx{tokens // 1024}k" if tokens >= 1024 else f"ctx{tokens}"


def machine_slug(machine: str) -> str:
    """The machine's name as it appears in result file names ("NVIDIA H200" -> "nvidia-h200")."""
    return re.sub(r"[^a-z0-9]+", "-", machine.lower()).strip("-")


def machine_name() -> str:
    """The first accelerator's name as JAX reports it, or the CPU's name on a CPU-only run."""
    import jax

    device = jax.devices()[0]
    if device.platform == "cpu":
        return f"cpu {platform.machine()} {platform.processor() or platform.node()}".strip()
    return device.device_kind


def git_commit(repo: Path | None = None) -> str:
    """HEAD of the repository holding bench/ ("-dirty" if tracked files changed; "unknown" outside git).

    INFERNIX_COMMIT overrides it, for machines that receive a copy of the tree without .git.
    """
    if os.environ.get("INFERNIX_COMMIT"):
        return os.environ["INFERNIX_COMMIT"]
    cwd = repo or Path(__file__).resolve().parent.parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, check=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=cwd,
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def validate_record(record: dict[str, Any]) -> None:
    """Raise ValueError naming every field that is missing or of the wrong kind."""
    problems = [f"missing {name!r}" for name in REQUIRED_FIELDS if name not in record]
    for name in ("name", "machine", "commit", "unit"):
        if name in record and not (isinstance(record[name], str) and record[name]):
            problems.append(f"{name!r} must be a non-empty string, got {record[name]!r}")
    figure = record.get("figure")
    if "figure" in record and not (isinstance(figure, (int, float)) and math.isfinite(figure)):
        problems.append(f"'figure' must be a finite number, got {figure!r}")
    ceiling = record.get("ceiling")
    if ceiling is not None and not (isinstance(ceiling, (int, float)) and ceiling > 0):
        problems.append(f"'ceiling' must be a positive number or null, got {ceiling!r}")
    if ceiling is not None and not record.get("ceiling_unit"):
        problems.append("'ceiling_unit' must name the ceiling's unit")
    fraction = record.get("fraction")
    if fraction is not None and not (isinstance(fraction, (int, float)) and math.isfinite(fraction)):
        problems.append(f"'fraction' must be a finite number or null, got {fraction!r}")
    if "details" in record and not isinstance(record["details"], dict):
        problems.append("'details' must be an object")
    if problems:
        raise ValueError(f"bad benchmark record {record.get('name')!r}: " + "; ".join(problems))


def write_records(records: Iterable[BenchRecord], path: str | Path) -> Path:
    """Write records as a JSON list; a bare file name goes under bench/results/. Returns the path."""
    path = Path(path)
    if not path.is_absolute() and path.parent == Path("."):
        path = RESULTS_DIR / path
    rows = [asdict(r) if isinstance(r, BenchRecord) else dict(r) for r in records]
    for row in rows:
        validate_record(row)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rows, indent=2) + "\n")
    return path


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """Read and validate a file written by write_records."""
    rows = json.loads(Path(path).read_text())
    if not isinstance(rows, list):
        raise TypeError(f"{path}: expected a JSON list of records")
    for row in rows:
        validate_record(row)
    return rows
