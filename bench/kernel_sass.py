"""The machine code (SASS) of a compiled NVFP4 decode kernel, with the instruction mix of its loops.

    python -m bench.kernel_sass --variant gemv_ws --n 17408 --k 5120 --out-dir /tmp/sass   # GPU
    python -m bench.kernel_sass --variant gemv_h2_ws --block-n 16 --block-k 1024 --out-dir /tmp/sass

Why a kernel stops short of HBM bandwidth is read in its inner loop: how many instructions it
issues per loaded word, of which kinds (integer, float16, conversions, loads, shared-memory
round trips). XLA's dump directory does not hold the PTX of Pallas kernels, so this compiles one
configuration with jax, serializes the executable (`LoadedExecutable.serialize`), carves the ELF
images (cubins) out of the bytes and disassembles them with `cuobjdump -sass` from the CUDA
toolkit (`--cuobjdump`, else /usr/local/cuda/bin or PATH). It writes the kernel's SASS and a JSON
report: the opcode counts of the whole function and of every loop (a backward branch and the
instructions it jumps over), innermost first. Nothing here is a speed figure: it says where the
instructions go, for docs/pallas.md.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import shutil
import struct
import subprocess
import tempfile
from pathlib import Path

ELF_MAGIC = b"\x7fELF"
_INSTRUCTION = re.compile(
    r"/\*(?P<addr>[0-9a-f]{4,})\*/\s+(?:(?P<pred>@!?U?P[T0-9]+)\s+)?(?P<op>[A-Z][A-Z0-9_]*)(?P<mods>[.A-Z0-9_]*)(?P<rest>[^;]*);"
)
_LABEL = re.compile(r"^\s*(?P<label>\.L_x_\d+):")
_TARGET = re.compile(r"`?\(?(?P<label>\.L_x_\d+)\)?|(?P<addr>0x[0-9a-f]+)")


def carve_elfs(blob: bytes) -> list[bytes]:
    """Every 64-bit little-endian ELF image inside `blob`, cut to its size (the section header
    table ends it: e_shoff + e_shnum * e_shentsize). Headers that do not fit the blob are skipped."""
    out, at = [], blob.find(ELF_MAGIC)
    while at >= 0:
        if at + 0x40 <= len(blob) and blob[at + 4] == 2 and blob[at + 5] == 1:  # ELFCLASS64, little endian
            (shoff,) = struct.unpack_from("<Q", blob, at + 0x28)
            shentsize, shnum = struct.unpack_from("<HH", blob, at + 0x3A)
            size = shoff + shentsize * shnum
            if 0x40 <= size <= len(blob) - at:
                out.append(blob[at : at + size])
        at = blob.find(ELF_MAGIC, at + 1)
    return out


def split_functions(sass: str) -> dict[str, str]:
    """cuobjdump -sass text -> {function name: its listing}."""
    parts = re.split(r"\n\s*Function : ", "\n" + sass)
    return {p.split("\n", 1)[0].strip(): p for p in parts[1:]}


def instructions(listing: str) -> list[dict]:
    """The instructions of one function in address order: address, opcode (no modifiers),
    modifiers, predicate, operands, and the branch target address for branches (None if none)."""
    labels, pending, out = {}, [], []
    for line in listing.splitlines():
        m = _LABEL.match(line)
        if m:
            pending.append(m.group("label"))
            continue
        m = _INSTRUCTION.search(line)
        if not m:
            continue
        addr = int(m.group("addr"), 16)
        for label in pending:
            labels[label] = addr
        pending = []
        out.append({"addr": addr, "op": m.group("op"), "mods": m.group("mods"), "pred": m.group("pred"),
                    "rest": m.group("rest").strip()})  # fmt: skip
    for ins in out:
        ins["target"] = None
        if ins["op"] in ("BRA", "JMP", "BRX"):
            t = _TARGET.search(ins["rest"])
            if t and t.group("label"):
                ins["target"] = labels.get(t.group("label"))
            elif t and t.group("addr"):
                ins["target"] = int(t.group("addr"), 16)
    return out


def loops(ins: list[dict]) -> list[dict]:
    """Each backward branch as a loop: its first and last address and the opcode counts of the
    instructions between (both ends included), innermost (fewest instructions) first."""
    found = []
    for i, b in enumerate(ins):
        if b["target"] is None or b["target"] > b["addr"]:
            continue
        body = [x for x in ins[: i + 1] if x["addr"] >= b["target"]]
        found.append({"start": b["target"], "end": b["addr"], "instructions": len(body),
                      "ops": dict(collections.Counter(x["op"] for x in body).most_common())})  # fmt: skip
    return sorted(found, key=lambda lp: lp["instructions"])


def find_cuobjdump(given: str | None = None) -> str | None:
    for cand in (given, "/usr/local/cuda/bin/cuobjdump", shutil.which("cuobjdump")):
        if cand and os.path.exists(cand):
            return cand
    return None


def kernel_sass(blob: bytes, name_part: str, cuobjdump: str) -> dict[str, str]:
    """{function: SASS} of the functions whose name contains `name_part`, from every cubin in the
    serialized executable `blob`."""
    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, elf in enumerate(carve_elfs(blob)):
            path = Path(tmp) / f"image{i}.cubin"
            path.write_bytes(elf)
            # a carved image cuobjdump cannot read (not every ELF in the bytes is a cubin) yields nothing
            text = subprocess.run(
                [cuobjdump, "-sass", str(path)], check=False, capture_output=True, text=True
            ).stdout
            found.update({f: s for f, s in split_functions(text).items() if name_part in f})
    return found


def add_kernel_arguments(parser: argparse.ArgumentParser) -> None:
    """The options naming one NVFP4 decode kernel configuration (`kernel_inputs` reads them)."""
    parser.add_argument("--variant", default="gemv_ws")
    parser.add_argument("--n", type=int, default=17408)
    parser.add_argument("--k", type=int, default=5120)
    parser.add_argument("--rows", type=int, default=1, help="activation rows (grouped: routed rows, one an expert)")
    parser.add_argument("--block-n", type=int, default=32)
    parser.add_argument("--block-k", type=int, default=512)
    parser.add_argument("--warps", type=int, default=8)
    parser.add_argument("--stages", type=int, default=3, help="software pipeline stages (the dot formulations)")
    parser.add_argument("--programs", type=int, default=None, help="streamed grid (default two per SM)")
    parser.add_argument("--scale-spread", default="reshape", help="word gemvs: reshape or gather (MatmulConfig)")
    parser.add_argument("--experts", type=int, default=0,
                        help="the grouped kernel over NVFP4 stacks of this many experts (0: the dense kernel)")  # fmt: skip


def kernel_name(args) -> str:
    """The name of the configuration's Pallas kernel (its CUDA function names contain it)."""
    return f"grouped_nvfp4_matmul_{args.variant}" if getattr(args, "experts", 0) else f"nvfp4_matmul_{args.variant}"


def kernel_inputs(args):
    """The NVFP4 decode kernel of `args` as a jitted function and its inputs: random weights of
    its shape and `args.rows` bf16 rows (`args.programs`, where given, sizes a streamed grid).
    With `args.experts`, the grouped kernel (`moe_matmul.grouped_matmul`) over stacks of that many
    experts with `args.rows` routed rows, one on each of as many distinct random experts (a decode
    step's pairs: ten rows are one token's top-10)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pallas_kernels.moe_matmul import grouped_matmul
    from pallas_kernels.nvfp4_matmul import nvfp4_matmul

    rng = np.random.default_rng(0)
    lead = (args.experts,) if getattr(args, "experts", 0) else ()
    packed = jnp.asarray(rng.integers(0, 256, (*lead, args.n, args.k // 2), dtype=np.uint8))
    scales = jnp.asarray(rng.uniform(0.5, 2, (*lead, args.n, args.k // 16)).astype(np.float32)).astype(
        jnp.float8_e4m3fn
    )
    x = jnp.asarray(rng.standard_normal((args.rows, args.k)), jnp.bfloat16)
    tiles = {"variant": args.variant, "block_n": args.block_n, "block_k": args.block_k, "num_warps": args.warps}
    if lead:
        if args.rows > args.experts:
            raise SystemExit(f"--rows {args.rows} routed rows need at least as many --experts")
        sizes = np.zeros(args.experts, np.int32)
        sizes[rng.choice(args.experts, args.rows, replace=False)] = 1
        tiles["num_stages"] = getattr(args, "stages", 3)
        fn = jax.jit(lambda x, p, s, t, g: grouped_matmul(x, (p, s, t), g, fmt="nvfp4", **tiles))
        return fn, (x, packed, scales, jnp.ones(lead, jnp.float32), jnp.asarray(sizes))
    tiles["scale_spread"] = getattr(args, "scale_spread", "reshape")
    if getattr(args, "programs", None):
        tiles["programs"] = args.programs
    fn = jax.jit(lambda x, p, s, t: nvfp4_matmul(x, p, s, t, **tiles))
    return fn, (x, packed, scales, jnp.float32(1.0))


def serialized_executable(args) -> bytes:
    """Compile the NVFP4 decode kernel of `args` (`kernel_inputs`) and return the executable's
    serialized bytes."""
    fn, inputs = kernel_inputs(args)
    compiled = fn.lower(*inputs).compile()
    exe = compiled.runtime_executable()
    if hasattr(exe, "serialize"):  # jax 0.10: LoadedExecutable.serialize; else the client's
        return bytes(exe.serialize())
    return bytes(exe.client.serialize_executable(exe))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_kernel_arguments(parser)
    parser.add_argument("--cuobjdump", default=None)
    parser.add_argument("--out-dir", required=True)
    args = parser.parse_args(argv)
    tool = find_cuobjdump(args.cuobjdump)
    if tool is None:
        raise SystemExit("cuobjdump not found: pass --cuobjdump (it comes with the CUDA toolkit)")
    blob = serialized_executable(args)
    functions = kernel_sass(blob, kernel_name(args), tool)
    if not functions:
        raise SystemExit(f"no {kernel_name(args)} function in the {len(carve_elfs(blob))} cubins found")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    report = {"config": vars(args), "functions": {}}
    for name, listing in functions.items():
        ins = instructions(listing)
        (out / f"{args.variant}.sass").write_text(listing)
        report["functions"][name] = {
            "instructions": len(ins),
            "ops": dict(collections.Counter(x["op"] for x in ins).most_common()),
            "loops": loops(ins),
        }
        inner = report["functions"][name]["loops"][:3]
        print(f"{name}: {len(ins)} instructions; loops (innermost first): "
              + "; ".join(f"{lp['instructions']} ({', '.join(f'{k} {v}' for k, v in list(lp['ops'].items())[:8])})"
                          for lp in inner), flush=True)  # fmt: skip
    (out / f"{args.variant}.json").write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
