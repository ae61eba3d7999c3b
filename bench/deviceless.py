"""The engine's decode program compiled for an H100 or H200 on a machine without a GPU, and its census.

    pip install -e '.[cuda13]'      # once: the CUDA plugin (its compiler runs without a driver or GPU)
    python -m bench.deviceless --target h100 --shapes moe --weights nvfp4 --batch 1 --context 8192
    INFERNIX_NVFP4_GROUPED_DOT=dot_w python -m bench.deviceless --shapes moe     # any switch, by env

Why: most of a decode step's device time at batch 1 goes to launches (the 80B-A3B shape: ~1,000
kernels a step at ~1.5 us for a small fusion, docs/pallas.md), and which fusions XLA forms is
decided by its GPU compiler, not by the CPU's. XLA's GPU compiler runs without a device when it is
given the device's description (a `GpuTargetConfigProto`; the CUDA plugin's topology takes it as
`target_config`), so the launches a step makes can be counted on any machine. The program is the
one the engine dispatches (`engine.runner.decode_program`, `--steps` steps in a loop) on abstract
arguments: the weights are shapes only (`jax.eval_shape` of the benchmark's random model), the
pools and sampling state the runner's own, each given the target device's sharding.

Prints the census of `bench.hlo_census` (launches of the step's loop body by source line) and, with
`--json`, writes it. The dump (`--dump-dir`) keeps XLA's HLO, PTX and the Triton kernels' IR.

Limits: the kernels' code and the fusions are the GPU's (the same XLA passes, the target's
description), but this machine's jaxlib may differ from the GPU machine's (0.10.2 here, 0.11.2
there), so a count can move by a few launches between them; times are not predicted (a GPU
measures those: `bench.decode --profile`). The project's code chooses its GPU kernels by
`jax.default_backend()`, which this tool reports as "gpu" while it traces.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import sys
import tempfile
import time
from pathlib import Path

from bench import hlo_census

TARGETS = {"h100": "h100_sxm.txtpb", "h200": "h200.txtpb"}
CONFIG_DIR = Path(__file__).parent / "target_configs"


def prepare_environment(dump_dir: str | None) -> None:
    """Environment for a deviceless CUDA compile; before jax is imported. The plugin's start-up
    check of the CUDA libraries' versions needs a driver, so it is skipped; XLA dumps the decode
    program's optimized HLO into dump_dir."""
    os.environ.setdefault("JAX_PLATFORMS", "cpu,cuda")
    os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] = "1"
    if dump_dir:
        flags = f"--xla_dump_to={dump_dir} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*decode_program.*"
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()


def target_device(target: str):
    """The compile-only device of `target` (a key of TARGETS or a GpuTargetConfigProto text file)."""
    from jax.experimental import topologies

    if not Path(target).is_file() and target not in TARGETS:
        raise SystemExit(
            f"--target: one of {', '.join(TARGETS)} or a GpuTargetConfigProto text file; got {target!r}"
        )
    path = Path(target) if Path(target).is_file() else CONFIG_DIR / TARGETS[target]
    topology = topologies.get_topology_desc(
        platform="cuda", topology_name="", target_config=path.read_text(), topology="1x1x1"
    )
    return topology.devices[0]


def decode_call(
    shape: str, weights: str, batch: int, context: int, steps: int, device, top_logprobs: bool = False,
    sampled: bool = False,
):  # fmt: skip
    """(jitted decode program, args, keyword args) of the engine's decode dispatch for `batch` rows
    at `context`, every argument abstract with `device`'s sharding (weights never materialise)."""
    import jax
    import numpy as np

    from bench.engine_setup import bench_config, build_model
    from infernix_jax.engine.memory_plan import plan_blocks
    from infernix_jax.engine.runner import Runner, decode_program, decode_width
    from infernix_jax.engine.sampling import ANY_PLAN, GREEDY_PLAN

    made = {}

    def model():
        made["cfg"], params = build_model(shape, weights=weights)
        return params

    params = jax.eval_shape(model)
    cfg = made["cfg"]
    config = bench_config(
        batch=batch, context=context, steps=steps, kv_dtype="bf16", prefill_chunk=256, prefix_cache=False,
        warmup=False,
    )  # fmt: skip
    blocks = plan_blocks(cfg, config, params.final_norm.dtype, params)  # the engine's own sizing
    # the runner's own pools and sampling state (small, real: they become shapes below)
    runner = Runner(cfg, params, config, blocks, config.max_concurrency + 1)
    decode = runner.empty_decode(batch, steps)
    sharding = jax.sharding.SingleDeviceSharding(device)

    def spec(a):
        return jax.ShapeDtypeStruct(np.shape(a), a.dtype, sharding=sharding)

    args = tuple(
        jax.tree.map(spec, tree) for tree in (params, runner.kv_pool, runner.state_pool, runner.slot_sampling)
    ) + tuple(
        spec(a) for a in (decode.tokens, decode.positions, decode.block_table, decode.slots, decode.max_steps)
    )
    program = jax.jit(
        decode_program.__wrapped__,
        static_argnames=("cfg", "steps", "num_top", "plan"),
        donate_argnames=("kv_pool", "state_pool", "slot_sampling", "out_buffer"),
    )
    # greedy rows without logprobs, as bench.decode's requests: the plan a GPU engine dispatches
    # them with, and no top alternatives (top_logprobs: K of them; sampled: ANY_PLAN's searches)
    num_top = runner.num_top if top_logprobs else 0
    out_buffer = spec(np.zeros((batch, decode_width(steps, num_top)), np.int32))
    return program, args, {"cfg": cfg, "steps": steps, "num_top": num_top,
                           "plan": ANY_PLAN if sampled else GREEDY_PLAN, "out_buffer": out_buffer}  # fmt: skip


def body_command_buffers(thunks: str) -> dict:
    """From XLA's `*.thunk_sequence_after_thunk_passes.txt` of a decode program: the step loop's
    body's command buffers (CUDA graphs launched one after another each step) and conditionals
    (each a host wait on the device: XLA:GPU reads a branch's predicate back to the host)."""
    lines = thunks.splitlines()
    start = next((i for i, line in enumerate(lines) if line.strip() == "body:"), None)
    if start is None:
        return {"command_buffers": 0, "conditionals": 0}
    body = []
    for line in lines[start + 1 :]:
        if line and not line[0].isspace():  # back at the program's top level
            break
        body.append(line)
    return {
        "command_buffers": sum(line.startswith("    ") and not line.startswith("     ") and "kCommandBuffer" in line
                               for line in body),
        "conditionals": sum("kConditional" in line for line in body),
    }  # fmt: skip


def loop_body_names(hlo: str) -> set[str]:
    """From XLA's optimized HLO text: the names of the instructions in every while loop's body
    (nested loops' bodies too): the values a step computes (`bench.hlo_census`'s parse)."""
    module = hlo_census.parse(hlo)
    return {
        ins.name
        for name, how in hlo_census.step_computations(module).items()
        if how.startswith("loop body")
        for ins in module.computations[name]
    }


def loop_output_buffers(assignment: str, body: set[str] = frozenset()) -> int:
    """From XLA's `*-buffer-assignment.txt`: the program's output allocations (not a donated
    parameter's) that hold a loop-carried value (a phi) or a value the loop body computes (`body`,
    from `loop_body_names`: XLA puts a step's small temporaries in the output's allocation when
    their live ranges allow). Each makes the loop body's graph point at a buffer that is new at
    every dispatch, so XLA re-records the graph each time."""
    found, allocation, in_output = set(), None, False
    for line in assignment.splitlines():
        if line.startswith("allocation "):
            allocation = line.split(":")[0]
            in_output = ("maybe-live-out" in line or "output shape" in line) and "parameter" not in line
        elif in_output and line.lstrip().startswith("value:"):
            name = re.match(r"\s*value: <\d+ ([^ {]+)", line)
            if "(phi)" in line or (name and name.group(1) in body):
                found.add(allocation)
    return len(found)


def host_waits(dump: str, program_file: str) -> dict:
    """What in the compiled decode program keeps the host from running ahead of the device
    (docs/engine.md): `body_command_buffers` and `loop_output_buffers` of its dump files."""
    stem = program_file.split(".sm_")[0]
    with open(program_file) as f:
        body = loop_body_names(f.read())
    out = {}
    for pattern, read in (("*.thunk_sequence_after_thunk_passes.txt", body_command_buffers),
                          ("*-buffer-assignment.txt", lambda text: {"loop_output_buffers":
                                                                    loop_output_buffers(text, body)})):  # fmt: skip
        found = sorted(glob.glob(stem + pattern))
        if found:
            with open(found[-1]) as f:
                out.update(read(f.read()))
    return out


def compile_decode(
    shape: str, weights: str, batch: int, context: int, steps: int, device, as_gpu: bool = True,
    top_logprobs: bool = False, sampled: bool = False,
):  # fmt: skip
    """Lower and compile the decode program for `device`; as_gpu: the project's code traces as on a
    GPU (its kernels, not the CPU's XLA references); top_logprobs: the program of a batch whose rows
    ask for top alternatives; sampled: of a batch with sampled rows (ANY_PLAN). Returns the
    compiled program."""
    import jax

    real_backend = jax.default_backend
    if as_gpu:
        jax.default_backend = lambda: "gpu"
    try:
        program, args, kwargs = decode_call(shape, weights, batch, context, steps, device, top_logprobs, sampled)
        return program.lower(*args, **kwargs).compile()
    finally:
        jax.default_backend = real_backend


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--target", default="h100", help=f"{', '.join(TARGETS)} or a GpuTargetConfigProto text file"
    )
    parser.add_argument("--shapes", default="moe", help="bench.engine_setup.SHAPES keys, comma-separated")
    parser.add_argument("--weights", default="nvfp4")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=8, help="decode steps per dispatch")
    parser.add_argument("--top", type=int, default=30, help="sites shown for each computation")
    parser.add_argument("--top-logprobs", action="store_true",
                        help="the program of rows asking for top alternatives (a top-k over the vocabulary)")
    parser.add_argument("--sampled", action="store_true",
                        help="the program of a batch with sampled rows (ANY_PLAN: top-k / top-p threshold searches)")
    parser.add_argument("--dump-dir", default=None, help="keep XLA's dump here (default: a temporary folder)")
    parser.add_argument("--json", default=None, help="write the census (one entry a shape) here")
    args = parser.parse_args(argv)
    if "jax" in sys.modules:
        raise SystemExit(
            "run as a program (python -m bench.deviceless): jax must start with XLA's dump flags"
        )
    dump = args.dump_dir or tempfile.mkdtemp(prefix="deviceless-")
    prepare_environment(dump)
    import jax

    device = target_device(args.target)
    results, seen = [], set()
    for shape in args.shapes.split(","):
        start = time.perf_counter()
        compile_decode(shape, args.weights, args.batch, args.context, args.steps, device,
                       top_logprobs=args.top_logprobs, sampled=args.sampled)  # fmt: skip
        seconds = time.perf_counter() - start
        files = sorted(set(glob.glob(os.path.join(dump, "*decode_program*after_optimizations.txt"))) - seen)
        if not files:
            raise SystemExit(f"XLA wrote no optimized decode program under {dump}")
        seen.update(files)
        print(f"{shape} {args.weights} batch {args.batch} ctx {args.context} on {args.target} "
              f"(jax {jax.__version__}): compiled in {seconds:.0f} s, dump {files[-1]}")  # fmt: skip
        rows = hlo_census.main([files[-1], "--top", str(args.top)])
        waits = host_waits(dump, files[-1])
        print(f"step loop: {waits.get('command_buffers', '?')} command buffer(s), "
              f"{waits.get('conditionals', '?')} conditional(s) (host waits), "
              f"{waits.get('loop_output_buffers', '?')} output buffer(s) written in the loop "
              "(graph re-recorded every dispatch)")  # fmt: skip
        results.append({"shape": shape, "weights": args.weights, "batch": args.batch, "context": args.context,
                        "target": args.target, "jax": jax.__version__, "census": rows,
                        "host_waits": waits})  # fmt: skip
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return results


if __name__ == "__main__":
    main()
