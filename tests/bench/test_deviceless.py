"""bench.deviceless builds the engine's decode dispatch from shapes alone (the GPU compile itself
needs the CUDA plugin, which CI does not install: on a CPU the same call compiles for the CPU)."""

from __future__ import annotations

import os

import jax

from bench import deviceless
from infernix_jax.engine.runner import decode_width
from infernix_jax.engine.sampling import ANY_PLAN, GREEDY_PLAN


def test_the_decode_dispatch_is_built_from_shapes_and_compiles_for_the_given_device():
    device = jax.devices("cpu")[0]
    program, args, static = deviceless.decode_call(
        "tiny", "nvfp4", batch=2, context=100, steps=3, device=device
    )
    leaves = jax.tree.leaves(args)
    assert leaves and all(isinstance(leaf, jax.ShapeDtypeStruct) for leaf in leaves)  # nothing materialised
    assert all(leaf.sharding.device_set == {device} for leaf in leaves)
    assert static["steps"] == 3 and args[4].shape == (2,)  # the rows' first tokens
    text = program.lower(*args, **static).compile().as_text()
    assert "while" in text  # the dispatch's steps run in one loop on the device
    # greedy rows without logprobs, as the engine dispatches them on a GPU: no top-k, no searches;
    # the flags give the programs of rows that ask for top alternatives or sample
    assert static["num_top"] == 0 and static["plan"] == GREEDY_PLAN
    assert static["out_buffer"].shape == (2, decode_width(3, 0))
    _, _, other = deviceless.decode_call(
        "tiny", "nvfp4", batch=2, context=100, steps=3, device=device, top_logprobs=True, sampled=True
    )
    assert other["num_top"] > 0 and other["plan"] == ANY_PLAN
    assert other["out_buffer"].shape == (2, decode_width(3, other["num_top"]))


def test_the_environment_asks_for_the_cuda_plugin_without_its_driver_checks_and_dumps_the_program(
    monkeypatch,
):
    for name in ("JAX_PLATFORMS", "JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "XLA_FLAGS"):
        monkeypatch.delenv(name, raising=False)
    deviceless.prepare_environment("/tmp/dump-here")
    assert os.environ["JAX_PLATFORMS"] == "cpu,cuda"
    assert os.environ["JAX_SKIP_CUDA_CONSTRAINTS_CHECK"] == "1"
    assert "--xla_dump_to=/tmp/dump-here" in os.environ["XLA_FLAGS"]
    assert set(deviceless.TARGETS.values()) <= {p.name for p in deviceless.CONFIG_DIR.iterdir()}


# Excerpts in the layout of XLA's dumps of a GPU decode program (jax 0.11): the step loop's body
# as two command buffers around a conditional, and the buffers its loop values live in.
THUNKS_WITH_A_BRANCH = """\
000: kCommandBuffer [source       | next=014 (1) ] 
    001: kCopy         [source       | sink        ] kCopy
014: kWhile         [prev=000 (1) | next=1063 (1)]   
condition:
    015: kCustomKernel [source | sink] loop_compare_fusion grid: [1, 1, 1]
  body:
    000: kCommandBuffer [source        | next=1025 (1)] 
        016: kCustomKernel [source       | sink        ] input_reduce_fusion grid: [1, 1, 1]
    1025: kConditional   [prev=000 (1)  | next=000 (1) ]       
      false_branch:
        No thunks.      true_branch:
        000: kCommandBuffer [source | sink] 
            825: kCustomKernel [source        | next=826 (1) ] input_reduce_fusion_65 grid: [367, 1, 1]
    000: kCommandBuffer [prev=1025 (1) | sink         ] 
        1026: kCustomKernel [source        | next=1030 (4) ] input_reduce_fusion_286 grid: [1, 1, 1]
1063: kCustomKernel  [prev=014 (1) | sink         ] input_scatter_fusion_34 grid: [1, 1, 1]
"""

ASSIGNMENT = """\
allocation 0: size 622329856, parameter 0, shape |bf16[151936,2048]| at ShapeIndex {}:
 value: <1 params_embed.1 @0> (size=622329856,offset=0): bf16[151936,2048]{1,0}
allocation 146: size 8519680, parameter 957, shape |bf16[130,64,2,256]| at ShapeIndex {}, maybe-live-out:
 value: <17767 arg_tuple.6{1} (phi) @0> (size=8519680,offset=0): bf16[130,64,2,256]{3,2,1,0}
allocation 756: size 640, maybe-live-out:
 value: <16497 loop_dynamic_update_slice_fusion.32 @0> (size=640,offset=0): s32[8,1,20]{2,1,0}
 value: <17823 arg_tuple.6{57} (phi) @0> (size=640,offset=0): s32[8,1,20]{2,1,0}
 value: <19878 while.41{57} (phi) @0> (size=640,offset=0): s32[8,1,20]{2,1,0}
allocation 757: size 1356, maybe-live-out:
 value: <20001 concatenate.3 @0> (size=1356,offset=0): s32[1,339]{1,0}
allocation 2533: size 5304344, preallocated-temp:
 value: <17900 arg_tuple.6{58} (phi) @0> (size=640,offset=0): f32[8,1,20]{2,1,0}
"""


def test_the_step_loops_host_waits_are_read_from_xlas_dumps():
    """A conditional in the loop body (the host waits on the device every step) and an output
    buffer written by the loop (its graph re-recorded every dispatch) are what the engine avoids
    (docs/engine.md); bench.deviceless reports both without a GPU."""
    assert deviceless.body_command_buffers(THUNKS_WITH_A_BRANCH) == {"command_buffers": 2, "conditionals": 1}
    one_graph = "\n".join(
        line for line in THUNKS_WITH_A_BRANCH.splitlines()[:8] if "kConditional" not in line
    )
    assert deviceless.body_command_buffers(one_graph) == {"command_buffers": 1, "conditionals": 0}
    # the donated pool (a parameter) and the temporaries hold loop values too: only 756 counts
    assert deviceless.loop_output_buffers(ASSIGNMENT) == 1
    assert deviceless.loop_output_buffers(ASSIGNMENT.replace("(phi)", "")) == 0
    # a step's temporary that XLA placed in the packed output's allocation (757) counts too
    body = deviceless.loop_body_names(HLO)
    assert body == {"arg_tuple.6", "loop_compare_fusion", "tuple.9", "region_inner_fusion"}
    shared = ASSIGNMENT.replace(
        " value: <20001 concatenate.3",
        " value: <1504 loop_compare_fusion @0> (size=1,offset=0): pred[]\n value: <20001 concatenate.3",
    )
    assert deviceless.loop_output_buffers(ASSIGNMENT.replace("(phi)", ""), body) == 1  # 756's arg_tuple.6
    assert deviceless.loop_output_buffers(shared, body) == 2
    assert deviceless.loop_output_buffers(shared.replace("(phi)", "")) == 0


HLO = """\
%fused_computation.1 (param_0: s32[]) -> pred[] {
  %param_0 = s32[] parameter(0)
  ROOT %compare.1 = pred[] compare(%param_0, %param_0), direction=LT
}

%region_body (arg_tuple.6: (s32[], s32[1,339])) -> (s32[], s32[1,339]) {
  %arg_tuple.6 = (s32[], s32[1,339]) parameter(0)
  %loop_compare_fusion = pred[] fusion(%arg_tuple.6), kind=kLoop, calls=%fused_computation.1
  %region_inner_fusion = s32[] fusion(%arg_tuple.6), kind=kLoop, calls=%fused_computation.1
  ROOT %tuple.9 = (s32[], s32[1,339]) tuple(%region_inner_fusion, %arg_tuple.6)
}

ENTRY %main.321 (p: s32[1,339]) -> s32[1,339] {
  %p = s32[1,339] parameter(0)
  %while.41 = (s32[], s32[1,339]) while(%p), condition=%cond, body=%region_body
  ROOT %concatenate.3 = s32[1,339] concatenate(%p), dimensions={1}
}
"""
