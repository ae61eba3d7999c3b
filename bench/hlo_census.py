"""Which source lines a compiled program's kernels come from: a census of XLA's optimized HLO.

    XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*decode_program.*" \\
        python -m bench.decode --shapes moe --weights nvfp4 --batches 1 --contexts 8192
    python -m bench.hlo_census DIR/module_*.jit_decode_program.*after_optimizations.txt --top 40

A profile names kernels by XLA's fusion names ("loop_add_fusion.123"), which say little about
the Python that made them. The optimized HLO keeps, for every instruction, the stack of the trace
(`stack_frame_id` into the module's StackFrames table). This tool counts the instructions that
launch work on the device (fusions, custom calls such as Pallas / Triton kernels, copies, sorts,
...) in every computation that runs as a program step (the entry, loop bodies and conditions,
conditional branches, called computations) and groups them by the innermost frame in the
project's own files, with the chain of project frames above it. The counts are per execution of
each computation: the decode step's loop body is what runs once a token.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import re

# opcodes that launch nothing of their own on a GPU (aliases, tuples, control flow that is counted
# through its bodies, parameters and constants)
NO_LAUNCH = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while", "conditional", "call",
    "after-all", "partition-id", "replica-id", "opt-barrier", "add-dependency", "iota",
}  # fmt: skip
PROJECT_PARTS = ("/infernix_jax/", "/pallas_kernels/", "/bench/", "/tests/")
CHAIN_DEPTH = 4  # callers shown above a site

_HEADER = re.compile(r"^(?:ENTRY )?%([\w.\-]+) \(.*\{$")
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%([\w.\-]+) = (.*)$")
_OPCODE = re.compile(r"(?<![\w.\-%])([a-z][a-z0-9\-]*)\(")
_TABLE_ROW = re.compile(r"^(\d+) (.*)$")
_FIELD = re.compile(r"(\w+)=(\d+)")


@dataclasses.dataclass
class Instruction:
    name: str
    opcode: str
    text: str  # everything after "=": shape, opcode, operands, attributes

    def attribute(self, key: str) -> str | None:
        found = re.search(rf"\b{key}=([^,\s}}]+)", self.text)
        return found.group(1) if found else None

    def callees(self, key: str) -> list[str]:
        found = re.search(rf"\b{key}=\{{([^}}]*)\}}", self.text)
        if found:
            return [c.strip().lstrip("%") for c in found.group(1).split(",") if c.strip()]
        single = self.attribute(key)
        return [single.lstrip("%")] if single else []


@dataclasses.dataclass
class Module:
    computations: dict[str, list[Instruction]]
    entry: str
    frames: dict[int, tuple[str, str, int, int]]  # frame id -> (file, function, line, parent id or 0)

    def stack(self, frame_id: int | None) -> list[tuple[str, str, int]]:
        """(file, function, line) from the innermost frame outwards."""
        out, seen = [], set()
        while frame_id and frame_id in self.frames and frame_id not in seen:
            seen.add(frame_id)
            file, function, line, parent = self.frames[frame_id]
            out.append((file, function, line))
            frame_id = parent
        return out


def _tables(lines: list[str]) -> dict[str, dict[int, str]]:
    tables, current = {}, None
    for line in lines:
        if line in ("FileNames", "FunctionNames", "FileLocations", "StackFrames"):
            current = tables.setdefault(line, {})
            continue
        row = _TABLE_ROW.match(line) if current is not None else None
        if row:
            current[int(row.group(1))] = row.group(2)
        elif current is not None and line.strip():
            current = None
    return tables


def _frames(tables: dict[str, dict[int, str]]) -> dict[int, tuple[str, str, int, int]]:
    files = {i: v.strip('"') for i, v in tables.get("FileNames", {}).items()}
    functions = {i: v.strip('"') for i, v in tables.get("FunctionNames", {}).items()}
    locations = {
        i: {k: int(n) for k, n in _FIELD.findall(v)} for i, v in tables.get("FileLocations", {}).items()
    }
    raw = {i: {k: int(n) for k, n in _FIELD.findall(v)} for i, v in tables.get("StackFrames", {}).items()}
    # Some XLA versions print a frame's parent one past its id (frame 1, the outermost, shows
    # parent 1; a callee of frame 3 shows 4): a frame that names itself as parent gives it away.
    shifted = any(f.get("parent_frame_id") == i for i, f in raw.items())
    frames = {}
    for i, f in raw.items():
        loc = locations.get(f.get("file_location_id", 0), {})
        parent = f.get("parent_frame_id", 0) - (1 if shifted else 0)
        frames[i] = (
            files.get(loc.get("file_name_id", 0), "?"),
            functions.get(loc.get("function_name_id", 0), "?"),
            loc.get("line", 0),
            parent if 0 < parent < i else 0,
        )
    return frames


def parse(text: str) -> Module:
    """The computations, entry and stack frames of one HLO text dump."""
    lines = text.splitlines()
    computations: dict[str, list[Instruction]] = {}
    entry, current = "", None
    for line in lines:
        header = _HEADER.match(line)
        if header:
            current = computations.setdefault(header.group(1), [])
            if line.startswith("ENTRY "):
                entry = header.group(1)
            continue
        if line == "}":
            current = None
            continue
        found = _INSTRUCTION.match(line) if current is not None else None
        if found:
            opcode = _OPCODE.search(found.group(2))
            current.append(Instruction(found.group(1), opcode.group(1) if opcode else "?", found.group(2)))
    if not entry:
        raise ValueError("no ENTRY computation: not an HLO text dump")
    return Module(computations, entry, _frames(_tables(lines)))


def step_computations(module: Module) -> dict[str, str]:
    """Computations that run as program steps (not fused bodies or reducers) -> how they are reached."""
    reached = {module.entry: "entry"}
    todo = [module.entry]
    while todo:
        name = todo.pop()
        for ins in module.computations.get(name, []):
            for key, how in (("body", "loop body"), ("condition", "loop condition"),
                             ("branch_computations", "branch"), ("true_computation", "branch"),
                             ("false_computation", "branch")):  # fmt: skip
                for callee in ins.callees(key):
                    if callee in module.computations and callee not in reached:
                        reached[callee] = f"{how} of {name}"
                        todo.append(callee)
            if ins.opcode == "call":
                for callee in ins.callees("to_apply"):
                    if callee in module.computations and callee not in reached:
                        reached[callee] = f"called from {name}"
                        todo.append(callee)
    return reached


def _site(module: Module, ins: Instruction) -> tuple[str, str]:
    """(innermost project frame "file:line function", the chain of project functions above it)."""
    frame = ins.attribute("stack_frame_id")
    stack = module.stack(int(frame)) if frame and frame.isdigit() else []
    own = [f for f in stack if any(part in f[0] for part in PROJECT_PARTS)]
    if not own:
        op_name = re.search(r'op_name="([^"]*)"', ins.text)
        return (op_name.group(1).split("/")[-1] if op_name else "(no metadata)"), ""
    file, function, line = own[0]
    short = file
    for part in PROJECT_PARTS:
        short = short.split(part)[-1]
    return f"{short}:{line} {function}", " < ".join(f[1] for f in own[1 : 1 + CHAIN_DEPTH])


def launch_kind(ins: Instruction) -> str:
    if ins.opcode == "custom-call":
        target = ins.attribute("custom_call_target") or "?"
        name = re.search(r'"name":\s*"([^"]+)"|name=\\?"?([\w.\-]+)', ins.text)
        return f"custom-call {target.strip(chr(34))}" + (f" {name.group(1) or name.group(2)}" if name else "")
    if ins.opcode == "fusion":
        return f"fusion {ins.attribute('kind') or ''}".strip()
    return ins.opcode


def census(module: Module) -> list[dict]:
    """One row per step computation: its launches, grouped by source site."""
    rows = []
    for name, how in step_computations(module).items():
        launches = [ins for ins in module.computations[name] if ins.opcode not in NO_LAUNCH]
        sites: dict[str, dict] = {}
        for ins in launches:
            site, chain = _site(module, ins)
            row = sites.setdefault(
                site, {"site": site, "chain": chain, "launches": 0, "kinds": collections.Counter()}
            )
            row["launches"] += 1
            row["kinds"][launch_kind(ins)] += 1
        ordered = sorted(sites.values(), key=lambda r: -r["launches"])
        for row in ordered:
            row["kinds"] = dict(row["kinds"].most_common())
        rows.append({"computation": name, "reached": how, "launches": len(launches), "sites": ordered})
    return sorted(rows, key=lambda r: -r["launches"])


def time_by_site(module: Module, kernels: list[dict]) -> list[dict]:
    """A profile's kernels (`bench.profile_summary`'s "top": name, ms, count) summed by source site.

    XLA names a fusion's kernel after the instruction with '.' made '_' ("input_reduce_fusion.25"
    runs as "input_reduce_fusion_25"); kernels of custom calls (Pallas, cuBLAS) and names not in
    the module keep their own name, without the "__N" suffix of repeated launches."""
    sites_of = {}
    for name in step_computations(module):
        for ins in module.computations[name]:
            if ins.opcode not in NO_LAUNCH:
                sites_of[ins.name.replace(".", "_")] = _site(module, ins)
    rows: dict[str, dict] = {}
    for kernel in kernels:
        base = re.sub(r"__\d+$", "", kernel["name"])
        site, chain = sites_of.get(base, (f"kernel {base}", ""))
        row = rows.setdefault(site, {"site": site, "chain": chain, "ms": 0.0, "count": 0, "kernels": 0})
        row["ms"] += kernel["ms"]
        row["count"] += kernel["count"]
        row["kernels"] += 1
    return sorted(rows.values(), key=lambda r: -r["ms"])


def profile_kernels(path: str, record_name: str | None) -> list[dict]:
    """The "top" kernels of one record's device profile in a bench JSON file (the first record
    with a profile, or the one named)."""
    with open(path) as f:
        records = json.load(f)
    for record in records:
        profile = record.get("details", {}).get("profile")
        if profile and profile.get("devices") and record_name in (None, record["name"]):
            return profile["devices"][0]["top"]
    raise ValueError(
        f"no record with a device profile{' named ' + repr(record_name) if record_name else ''} in {path}"
    )


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("dump", help="an *after_optimizations.txt file of XLA's dump")
    parser.add_argument("--top", type=int, default=30, help="sites shown for each computation")
    parser.add_argument(
        "--min-launches", type=int, default=2, help="computations with fewer launches are left out"
    )
    parser.add_argument("--json", default=None, help="also write the full census here")
    parser.add_argument("--profile", default=None,
                        help="a bench JSON whose record has a device profile (bench.decode --profile): "
                             "its kernels' time summed by source site")  # fmt: skip
    parser.add_argument("--record", default=None, help="with --profile: the record's name (else the first)")
    args = parser.parse_args(argv)
    with open(args.dump) as f:
        module = parse(f.read())
    rows = census(module)
    for row in rows:
        if row["launches"] < args.min_launches:
            continue
        print(f"\n{row['computation']} ({row['reached']}): {row['launches']} launches")
        for site in row["sites"][: args.top]:
            kinds = ", ".join(f"{n} {k}" for k, n in site["kinds"].items())
            chain = f"  [< {site['chain']}]" if site["chain"] else ""
            print(f"  {site['launches']:5d}  {site['site']}{chain}  ({kinds})")
    if args.profile:
        timed = time_by_site(module, profile_kernels(args.profile, args.record))
        total = sum(r["ms"] for r in timed) or 1.0
        print(f"\nprofiled kernel time by site ({args.profile}):")
        for row in timed[: args.top]:
            chain = f"  [< {row['chain']}]" if row["chain"] else ""
            print(
                f"  {row['ms']:9.3f} ms {row['ms'] / total:6.1%}  {row['count']:6d} launches  {row['site']}{chain}"
            )
        rows.append({"profile": args.profile, "time_by_site": timed})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
