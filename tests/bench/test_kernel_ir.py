"""bench.kernel_ir: the Triton module is cut out of Pallas' debug printing without its source
locations, and a compiled listing reads as layout conversions, barriers and loops (the parts that
run without the triton package)."""

import pytest

from bench import kernel_ir
from tests.bench.test_kernel_sass import LISTING

DEBUG_OUTPUT = """
The kernel jaxpr for pallas_call nvfp4_matmul_gemv_ws at x.py:1:
{ lambda ; a. let in () }
The Triton module for pallas_call nvfp4_matmul_gemv_ws at x.py:1:
module @nvfp4_matmul_gemv_ws {
  tt.func public @k(%arg0: !tt.ptr<f16> {tt.divisibility = 32 : i32} [unknown]) {
    %c21_i32 = arith.constant 21 : i32 "mul:"(#loc333)
    %0 = tt.get_program_id x : i32 at #loc12
    tt.return loc(unknown)
  }
}
#loc12 = loc("x.py":3:4)
"""

TTGIR = """
    %5 = ttg.convert_layout %4 : tensor<32x32xf8E4M3FN, #blocked2> -> tensor<32x32xf8E4M3FN, #ttg.slice<{dim = 2, parent = #blocked3}>> loc(#loc1)
    %9 = ttg.convert_layout %8 : tensor<1x32xi1, #blocked> -> tensor<1x32xi1, #blocked2> loc(#loc2)
"""


def test_the_module_is_cut_out_of_the_debug_output_without_locations():
    module = kernel_ir.triton_module(DEBUG_OUTPUT)
    assert module.startswith("module @nvfp4_matmul_gemv_ws {") and module.endswith("}\n")
    assert "#loc" not in module and "[unknown]" not in module and "loc(" not in module
    assert "%c21_i32 = arith.constant 21 : i32\n" in module
    assert "%0 = tt.get_program_id x : i32\n" in module
    with pytest.raises(ValueError, match="no Triton module"):
        kernel_ir.triton_module("The kernel jaxpr only")


def test_a_compiled_listing_reads_as_conversions_barriers_and_loops():
    result = kernel_ir.report(TTGIR, "bar.sync 0;\n...\nbar.sync 0;\n", LISTING)
    assert result["converts"] == [
        "tensor<32x32xf8E4M3FN, #blocked2> -> tensor<32x32xf8E4M3FN, #ttg.slice<{dim = 2, parent = #blocked3}>>",
        "tensor<1x32xi1, #blocked> -> tensor<1x32xi1, #blocked2>",
    ]
    assert result["bar_sync"] == 2
    assert [loop["instructions"] for loop in result["loops"]] == [3, 6]  # innermost first
    assert result["loops"][0]["ops"] == {"LOP3": 1, "HFMA2": 1, "BRA": 1}


def test_the_dense_and_grouped_kernels_lower_to_a_module_a_parser_can_read():
    """Pallas' own printing, cut and cleaned: what `triton.compile` is given (no triton needed here)."""
    import argparse

    common = {"rows": 2, "n": 64, "k": 256, "block_n": 32, "block_k": 128, "warps": 4, "programs": 4}
    dense = argparse.Namespace(variant="gemv_ws", experts=0, scale_spread="reshape", **common)
    grouped = argparse.Namespace(variant="dot_w", experts=4, scale_spread="reshape", **common)
    for args, name in ((dense, "nvfp4_matmul_gemv_ws"), (grouped, "grouped_nvfp4_matmul_dot_w")):
        module = kernel_ir.lowered_module(args)
        assert module.startswith(f"module @{name}") and module.endswith("}\n")
        assert "tt.func" in module and "#loc" not in module and "loc(" not in module
