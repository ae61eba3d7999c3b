"""The Triton IR, GPU IR, PTX and SASS of an NVFP4 decode kernel configuration, made without a GPU.

    pip install triton        # once, in any environment: the Triton compiler (ptxas and cuobjdump come with it)
    python -m bench.kernel_ir --variant gemv_ws --n 17408 --k 5120 --out-dir /tmp/ir
    python -m bench.kernel_ir --variant gemv_h2w_ws --out-dir /tmp/ir --triton-python /path/to/venv/bin/python
    python -m bench.kernel_ir --experts 512 --rows 10 --n 512 --k 2048 --variant dot_w --block-n 64 \
        --block-k 256 --warps 4 --out-dir /tmp/ir      # the grouped kernel (80B-A3B gate, one token)

Why: on the GPU, `bench.kernel_counters` showed where the streamed gemv's cycles go (a shared-
memory round trip and two barriers in every K step, for a layout conversion of the block scales).
Such conversions are decided by Triton's layout passes, which run inside XLA on the GPU machine.
This tool runs the same passes here: it lowers the kernel with jax (Pallas prints the Triton
module it hands to XLA), strips the source locations, and compiles the module with the `triton`
package for sm_90 (`GPUTarget("cuda", 90, 32)`). It writes <variant>.ttir / .ttgir / .ptx /
.cubin / .sass and prints, per configuration:

    converts   `ttg.convert_layout` ops in the GPU IR (each is a register shuffle or a trip
               through shared memory), with their source and target layouts
    bar.sync   barriers in the PTX (a conversion through shared memory costs two)
    loops      SASS instructions in each loop (innermost first) and the opcodes of the largest

The triton package need not match the version inside XLA (its layout heuristics move slowly, and
on 2026-12-06 its verdicts matched the H100's SASS: the same conversion, the same barriers, loop
bodies within 15% in size); treat small differences as noise, the conversions as facts to check.
`--triton-python` compiles with another interpreter's triton (for example a separate venv), so
the project's environment needs no triton.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import re
import subprocess
import sys
from pathlib import Path

from bench.kernel_sass import add_kernel_arguments, instructions, loops, split_functions

# The Triton compile step, run by the interpreter that has `triton` (this one or --triton-python).
COMPILE = r"""
import json, os, sys
import triton
from triton.backends.compiler import GPUTarget
src, warps, stages = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
stem = src[: -len(".ttir")]
open(stem + ".ttgir", "w").write(k.asm["ttgir"])
open(stem + ".ptx", "w").write(k.asm["ptx"])
open(stem + ".cubin", "wb").write(k.asm["cubin"])
bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
print(json.dumps({"cuobjdump": os.path.join(bin_dir, "cuobjdump"), "triton": triton.__version__}))
"""

_MODULE_START = "module @"
_LOCATION_PATTERNS = (
    re.compile(r"\s+at #loc\d+"),  # pretty-printed locations after an op
    re.compile(r" \[unknown\]"),
    re.compile(r" loc\([^)]*\)"),
    re.compile(r' "[^"]*"\(#loc\d+\)'),  # named locations
    re.compile(r" \(#loc\d+\)"),
)


def triton_module(debug_output: str) -> str:
    """The Triton module text Pallas prints with debug=True, without source locations (a parser
    outside jax does not know jax's location attributes)."""
    start = debug_output.find("The Triton module for pallas_call")
    if start < 0:
        raise ValueError("no Triton module in the lowering output (was the kernel lowered with debug=True?)")
    body = debug_output[debug_output.index(_MODULE_START, start) :]
    for pattern in _LOCATION_PATTERNS:
        body = pattern.sub("", body)
    lines = [line for line in body.split("\n") if line.strip() and not line.startswith("#loc")]
    end = max(i for i, line in enumerate(lines) if line == "}")  # the module's closing brace
    return "\n".join(lines[: end + 1]) + "\n"


def lowered_module(args) -> str:
    """Lower the configuration for CUDA with Pallas' debug printing on; return the Triton module.
    With `args.experts`, the grouped kernel (`moe_matmul.grouped_matmul`) over NVFP4 stacks of that
    many experts, `args.rows` routed rows; else the dense `nvfp4_matmul`."""
    import jax
    import jax.numpy as jnp

    from pallas_kernels import compat
    from pallas_kernels.moe_matmul import grouped_matmul
    from pallas_kernels.nvfp4_matmul import nvfp4_matmul

    lead = (args.experts,) if args.experts else ()
    x = jax.ShapeDtypeStruct((args.rows, args.k), jnp.bfloat16)
    packed = jax.ShapeDtypeStruct((*lead, args.n, args.k // 2), jnp.uint8)
    scales = jax.ShapeDtypeStruct((*lead, args.n, args.k // 16), jnp.float8_e4m3fn)
    tensor_scale = jax.ShapeDtypeStruct(lead, jnp.float32)
    tiles = {"variant": args.variant, "block_n": args.block_n, "block_k": args.block_k, "num_warps": args.warps}
    if args.experts:
        sizes = jax.ShapeDtypeStruct((args.experts,), jnp.int32)
        fn = jax.jit(lambda x, p, s, t, g: grouped_matmul(x, (p, s, t), g, fmt="nvfp4", **tiles))
        shapes = (x, packed, scales, tensor_scale, sizes)
    else:
        tiles.update(scale_spread=args.scale_spread, programs=args.programs or 264)
        fn, shapes = jax.jit(functools.partial(nvfp4_matmul, **tiles)), (x, packed, scales, tensor_scale)
    real = compat.pallas_call
    compat.pallas_call = functools.partial(real, debug=True)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            compat.lower_for_cuda(fn, *shapes)
    finally:
        compat.pallas_call = real
    return triton_module(out.getvalue())


def conversions(ttgir: str) -> list[str]:
    """'source -> target' of every layout conversion in a GPU IR listing."""
    found = re.findall(r"ttg\.convert_layout %\S+ : (tensor<[^>]*>>?) -> (tensor<[^>]*>>?)", ttgir)
    return [f"{a} -> {b}" for a, b in found]


def report(ttgir: str, ptx: str, sass: str) -> dict:
    """Conversions, barriers and loop sizes of one compiled configuration."""
    functions = split_functions(sass)
    loop_rows = []
    for listing in functions.values():
        for loop in loops(instructions(listing)):
            loop_rows.append({"instructions": loop["instructions"], "ops": dict(list(loop["ops"].items())[:14])})
    return {
        "converts": conversions(ttgir),
        "bar_sync": ptx.count("bar.sync"),
        "loops": loop_rows,
    }


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_kernel_arguments(parser)
    parser.add_argument("--triton-python", default=sys.executable,
                        help="interpreter whose `triton` package compiles the module (default: this one)")  # fmt: skip
    parser.add_argument("--out-dir", required=True)
    args = parser.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    ttir = out / f"{args.variant}.ttir"
    ttir.write_text(lowered_module(args))
    run = subprocess.run(
        [args.triton_python, "-c", COMPILE, str(ttir), str(args.warps), str(args.stages)],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    if run.returncode != 0:
        hint = "pip install triton" if "No module named 'triton'" in run.stderr else run.stderr.strip()[-2000:]
        raise SystemExit(f"the Triton compile failed: {hint}")
    tools = json.loads(run.stdout.strip().splitlines()[-1])
    cubin = out / f"{args.variant}.cubin"
    sass = subprocess.run([tools["cuobjdump"], "-sass", str(cubin)], capture_output=True, text=True, check=False).stdout
    (out / f"{args.variant}.sass").write_text(sass)
    result = {"config": vars(args), "triton": tools["triton"],
              **report((out / f"{args.variant}.ttgir").read_text(), (out / f"{args.variant}.ptx").read_text(), sass)}  # fmt: skip
    (out / f"{args.variant}.json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"{args.variant} {args.n}x{args.k} bn{args.block_n} bk{args.block_k} w{args.warps} (triton {tools['triton']}): "
          f"{len(result['converts'])} layout conversions, {result['bar_sync']} bar.sync")  # fmt: skip
    for c in result["converts"]:
        print("  convert", c)
    for loop in result["loops"]:
        print(f"  loop of {loop['instructions']} SASS instructions: {loop['ops']}")
    return result


if __name__ == "__main__":
    main()
