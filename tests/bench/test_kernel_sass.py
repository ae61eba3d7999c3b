"""bench.kernel_sass: cubins are carved out of serialized bytes and a SASS listing is read into
instructions and loops (the parts that run without a GPU)."""

import struct

from bench import kernel_sass

LISTING = """
	code for sm_90a
		Function : nvfp4_matmul_gemv_ws
	.headerflags	@"EF_CUDA_SM90"
        /*0000*/                   LDC R1, c[0x0][0x28] ;                       /* 0x00000a00ff017b82 */
        /*0010*/                   S2R R0, SR_TID.X ;                           /* 0x0000000000007919 */
.L_x_1:
        /*0020*/                   LDG.E.128 R4, desc[UR4][R2.64] ;             /* 0x000000040204798e */
.L_x_0:
        /*0030*/                   LOP3.LUT R8, R4, 0xe000e00, RZ, 0xc0, !PT ;  /* 0x0e000e0004087812 */
        /*0040*/                   HFMA2 R9, R8, R10, R9 ;                      /* 0x0000000a08097231 */
        /*0050*/               @P0 BRA `(.L_x_0) ;                              /* 0x0000000000000947 */
        /*0060*/                   F2F.F32.F16 R11, R9 ;                        /* 0x0000000900087304 */
        /*0070*/              @!P1 BRA `(.L_x_1) ;                              /* 0x0000000000000947 */
        /*0080*/                   EXIT ;                                       /* 0x000000000000794d */
		Function : other_kernel
        /*0000*/                   EXIT ;
"""


def _elf(size_body: int) -> bytes:
    """A minimal ELF64 LE header whose section table (2 entries of 64 bytes) ends the image."""
    shoff = 0x40 + size_body
    header = bytearray(0x40)
    header[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", header, 0x28, shoff)
    struct.pack_into("<HH", header, 0x3A, 64, 2)
    return bytes(header) + b"\x00" * size_body + b"\x11" * 128


def test_cubins_are_cut_out_of_serialized_bytes_at_their_own_size():
    a, b = _elf(10), _elf(300)
    blob = b"proto" + a + b"between" + b + b"\x7fELF-truncated"
    assert kernel_sass.carve_elfs(blob) == [a, b]


def test_a_listing_reads_as_functions_instructions_and_loops_innermost_first():
    functions = kernel_sass.split_functions(LISTING)
    assert set(functions) == {"nvfp4_matmul_gemv_ws", "other_kernel"}
    ins = kernel_sass.instructions(functions["nvfp4_matmul_gemv_ws"])
    assert [i["op"] for i in ins] == ["LDC", "S2R", "LDG", "LOP3", "HFMA2", "BRA", "F2F", "BRA", "EXIT"]
    assert ins[2]["mods"] == ".E.128" and ins[5]["pred"] == "@P0" and ins[7]["pred"] == "@!P1"
    assert ins[5]["target"] == 0x30 and ins[7]["target"] == 0x20
    inner, outer = kernel_sass.loops(ins)
    assert (inner["start"], inner["end"], inner["instructions"]) == (0x30, 0x50, 3)
    assert inner["ops"] == {"LOP3": 1, "HFMA2": 1, "BRA": 1}
    assert (outer["start"], outer["instructions"]) == (0x20, 6) and outer["ops"]["BRA"] == 2
