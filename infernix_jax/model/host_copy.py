"""Ways for a jitted program to copy a dynamic set of rows out of `pinned_host` memory.

A MoE layer with `--expert-host-reads program` copies its missed experts (ids and count known only
on the device) from a u8 [E, expert_bytes] array in pinned host memory (`SlottedExperts.host_stacks`).
`HOST_COPIES` names the ways (`SlottedExperts.host_copy`, `EngineConfig.expert_host_copy`):

- "loop": a `fori_loop` over the missed rows, one host-to-device copy each (`mlp.copy_host_rows`).
  On the GPU every copy whose offset comes from device data makes XLA read that offset back and
  wait for the stream (its DynamicSliceThunk), and so does every loop iteration's condition: the
  copies run one at a time with the pipeline drained in between (~20 GB/s for 1.77 MB rows on the
  H200, against ~52 GB/s for one large copy).
- "buckets": `lax.switch` on the count picks a static size (`mlp.fetch_buckets`: 0, 1, 2, 3, 4,
  6, 8, ...), whose branch makes that many independent copies, unrolled (`copy_rows_in_buckets`):
  no loop condition per row and no loop-carried buffer, at most 1.5x the rows asked for.
- "dma": one `buffer_callback` per layer (`copy_rows_by_dma`). On the GPU it reads the ids back
  once (one stream synchronisation per layer instead of one per row) and enqueues one
  `cuMemcpyHtoDAsync` per run of consecutive ids on XLA's stream, back to back, so the copies
  run at the DMA engine's rate. On the CPU it copies with `memmove`. The rows are found through
  `register_host_rows` (an id carried as data), not passed to the program.
- "mapped": one `buffer_callback` per layer (`copy_rows_mapped`) that reads nothing back. On the
  GPU it launches a small gather kernel (PTX below, loaded through the CUDA driver) on XLA's
  stream; the kernel reads the count and the ids from device memory and the rows themselves
  straight from the pinned host memory, which the device can address (CUDA maps pinned
  allocations into its unified address space). No synchronisation at all: the host keeps
  launching the rest of the program while the rows cross PCIe. The rows' device address is
  carried as data (`host_rows_address`), so engines of one shape share programs. On the CPU it
  copies with `memmove` from the same address. The callback is `command_buffer_compatible`
  (`MAPPED_IN_COMMAND_BUFFERS`): its only work on the GPU is one kernel launch whose arguments are
  device addresses, so XLA may record it into the CUDA graphs it runs a program's thunks as, and
  the layer does not split them. A callback that is not compatible ends one graph and starts
  another, and the thunks between are launched one by one from the host (measured: docs/experts.md,
  "Where a dispatch's time goes").

Every way leaves the rows past the count zero, so all give the same bytes.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import functools
import itertools
import weakref
from collections.abc import Sequence
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np

HOST_COPIES = ("loop", "buckets", "dma", "mapped")

# id -> a u8 [E, row_bytes] array in pinned host memory, for "dma" (`register_host_rows`)
HOST_ROWS: weakref.WeakValueDictionary[int, jax.Array] = weakref.WeakValueDictionary()
_next_rows_id = itertools.count(1)


def register_host_rows(rows: jax.Array) -> int:
    """Make `rows` (u8 [E, row_bytes], pinned host memory) reachable from `copy_rows_by_dma`;
    returns the id to pass it. Held weakly: the caller keeps the rows alive while programs use
    them (SlottedExperts holds them as `host_stacks`)."""
    if rows.ndim != 2 or rows.dtype != jnp.uint8:
        raise ValueError(f"host rows must be u8 [E, row_bytes], got {rows.dtype} {rows.shape}")
    rows_id = next(_next_rows_id)
    HOST_ROWS[rows_id] = rows
    return rows_id


def device_row(host_rows: jax.Array, expert: jax.Array) -> jax.Array:
    """One row [1, row_bytes] copied from pinned host memory to device memory."""
    return jax.device_put(jax.lax.dynamic_slice_in_dim(host_rows, expert, 1), jax.memory.Space.Device)


def copy_rows_in_buckets(
    host_rows: jax.Array, experts: jax.Array, count: jax.Array, buckets: Sequence[int]
) -> jax.Array:
    """Rows [M, row_bytes] on the device: the first `count` of `experts` (i32 [M]) copied from
    `host_rows`, zeros after. `lax.switch` on `count` runs the branch of the smallest bucket that
    holds it; a branch of size m makes m independent row copies (unrolled: nothing orders them
    but their own data) and pads with zeros. `buckets` must be ascending and end at M."""
    m_max = experts.shape[0]
    if buckets[-1] != m_max:
        raise ValueError(f"buckets {tuple(buckets)} must end at the row count {m_max}")
    experts = jnp.maximum(experts, 0)
    row_bytes = host_rows.shape[1]

    def branch(m: int):
        def run(host_rows, experts, count):
            live = (jnp.arange(m) < count)[:, None]  # a larger bucket's extra rows read as zeros
            rows = [device_row(host_rows, experts[i]) for i in range(m)]
            got = jnp.where(live, jnp.concatenate(rows), 0) if m else jnp.zeros((0, row_bytes), jnp.uint8)
            return jnp.pad(got, [(0, m_max - m), (0, 0)])

        return run

    index = jnp.searchsorted(jnp.asarray(buckets, jnp.int32), count.astype(jnp.int32), side="left")
    return jax.lax.switch(index, [branch(m) for m in buckets], host_rows, experts, count)


def copy_rows_by_dma(rows_id: jax.Array, experts: jax.Array, count: jax.Array, row_bytes: int) -> jax.Array:
    """Rows [M, row_bytes] on the device: the first `count` of `experts` (i32 [M]) copied from the
    host rows registered as `rows_id` (i32 []), zeros after, by one buffer callback that issues
    the copies itself (the module docstring). `row_bytes` must be the registered rows' width."""
    from jax.experimental.buffer_callback import buffer_callback

    header = jnp.concatenate(
        [jnp.reshape(rows_id, (1,)).astype(jnp.int32), jnp.reshape(count, (1,)).astype(jnp.int32),
         experts.astype(jnp.int32)]
    )  # fmt: skip
    out = jax.ShapeDtypeStruct((experts.shape[0], row_bytes), jnp.uint8)
    return buffer_callback(_dma_rows, out)(header)


def _runs(experts: np.ndarray) -> list[tuple[int, int, int]]:
    """(first output row, first expert, length) of each run of consecutive ids in `experts`: one
    copy per run (missed ids come ascending, so a prefill that misses a whole layer makes few)."""
    runs: list[tuple[int, int, int]] = []
    for i, e in enumerate(int(x) for x in experts):
        if runs and runs[-1][1] + runs[-1][2] == e:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((i, e, 1))
    return runs


def _lookup_rows(rows_id: int, experts: np.ndarray, out_shape: tuple[int, int]) -> jax.Array:
    """The registered host rows, checked against what the program asks of them (`experts`: the
    ids to copy into an output of `out_shape`)."""
    rows_out, row_bytes = out_shape
    if not 0 <= experts.size <= rows_out:
        raise ValueError(f"{experts.size} rows asked for an output of {rows_out}")
    rows = HOST_ROWS.get(rows_id)
    if rows is None:
        raise RuntimeError(f"no host rows {rows_id} (their engine was closed)")
    if rows.shape[1] != row_bytes:
        raise ValueError(
            f"host rows {rows_id} hold {rows.shape[1]} bytes a row; the program expects {row_bytes}"
        )
    if experts.size and (experts.min() < 0 or experts.max() >= rows.shape[0]):
        raise ValueError(f"expert ids {experts.tolist()} out of range for {rows.shape[0]} host rows")
    return rows


def _dma_rows(ctx, out, header) -> None:
    """buffer_callback body of `copy_rows_by_dma`: the copies, on the device's stream or in memory."""
    from jax.experimental.buffer_callback import ExecutionStage

    if ctx.stage != ExecutionStage.EXECUTE:  # nothing to prepare
        return
    if out.__dlpack_device__()[0] == 1:  # kDLCPU: every buffer is host memory
        head = np.asarray(header)
        count, row_bytes = int(head[1]), out.shape[1]
        experts = head[2 : 2 + count]
        rows = _lookup_rows(int(head[0]), experts, out.shape)
        dst = np.asarray(out)
        base = rows.unsafe_buffer_pointer()
        for at, first, n in _runs(experts):
            ctypes.memmove(dst.ctypes.data + at * row_bytes, base + first * row_bytes, n * row_bytes)
        dst[count:] = 0
        return
    _cuda_dma_rows(ctx.stream, out, header)


def _cuda_dma_rows(stream: int, out, header) -> None:
    """GPU side: read the header back (one synchronisation), then enqueue the host-to-device copies
    and the zeroing of the rest on `stream`; nothing waits for them here."""
    cuda = _cuda()
    with cuda.context_of(stream):
        head = np.empty(header.shape, np.int32)
        cuda.check("cuMemcpyDtoHAsync_v2", head.ctypes.data, _device_pointer(header), head.nbytes, stream)
        cuda.check("cuStreamSynchronize", stream)
        count, row_bytes = int(head[1]), out.shape[1]
        experts = head[2 : 2 + count]
        rows = _lookup_rows(int(head[0]), experts, out.shape)
        base, dst = rows.unsafe_buffer_pointer(), _device_pointer(out)
        for at, first, n in _runs(experts):
            cuda.check(
                "cuMemcpyHtoDAsync_v2", dst + at * row_bytes, base + first * row_bytes, n * row_bytes, stream
            )
        rest = (out.shape[0] - count) * row_bytes
        if rest:
            cuda.check("cuMemsetD8Async", dst + count * row_bytes, 0, rest, stream)


def _device_pointer(buffer) -> int:
    return int(buffer.__cuda_array_interface__["data"][0])


# "mapped": bytes a gather kernel moves per load (the largest that divides the row width), threads
# per block, and blocks per launch spread over the rows (enough loads in flight to fill PCIe).
GATHER_WIDTHS = (16, 8, 4, 2, 1)
# "mapped": let XLA record the gather's launch into its CUDA graphs (read when a program is traced)
MAPPED_IN_COMMAND_BUFFERS = True
GATHER_THREADS = 256
GATHER_BLOCKS = 1024
# A gather meant to run beside the layer's kernels (expert prefetch on a second stream) launches
# `blocks` blocks only, so that it leaves most SMs free; each thread then keeps this many loads in
# flight, to keep enough bytes crossing PCIe from few blocks (`copy_rows_mapped(blocks=...)`).
BACKGROUND_GATHER_UNROLL = 4
# Blocks of the expert prefetch's gather (`--expert-prefetch-blocks`'s default): a quarter of an
# H100's / H200's 132 SMs at one block each, which read at the pinned copy's rate there.
PREFETCH_GATHER_BLOCKS = 32
CU_POINTER_ATTRIBUTE_DEVICE_POINTER = 3
CU_EVENT_DISABLE_TIMING = 2
CUDA_ERROR_NOT_READY = 600


def host_rows_address(rows: jax.Array) -> np.ndarray:
    """i32 [2] (low word, high word): the address at which the device reads `rows` (u8 [E,
    row_bytes] in pinned host memory), for "mapped". On a GPU, the CUDA device pointer of the
    pinned allocation (in CUDA's unified address space, the host address itself); on the CPU, the
    buffer's address. The caller keeps `rows` alive while programs use the address (SlottedExperts
    holds them as `host_stacks`). Raises RuntimeError when the device cannot address the memory."""
    if rows.ndim != 2 or rows.dtype != jnp.uint8:
        raise ValueError(f"host rows must be u8 [E, row_bytes], got {rows.dtype} {rows.shape}")
    address = rows.unsafe_buffer_pointer()
    device = next(iter(rows.devices()))
    if device.platform == "gpu":
        cuda, value = _cuda(), ctypes.c_uint64()
        with cuda.some_context(getattr(device, "local_hardware_id", None) or 0):
            try:
                cuda.check(
                    "cuPointerGetAttribute", ctypes.byref(value), CU_POINTER_ATTRIBUTE_DEVICE_POINTER, address
                )
            except RuntimeError as e:
                raise RuntimeError(
                    'the GPU cannot address these pinned host rows, so host copy "mapped" cannot read '
                    "them; use --expert-host-copy dma"
                ) from e
            # load the gathers now, not inside a graph capture (where loading may be refused)
            cuda.load_current(GATHER_PTX, GATHER_NAMES)
        address = value.value
    return np.asarray([address & 0xFFFFFFFF, address >> 32], np.uint32).view(np.int32)


def copy_rows_mapped(
    address: jax.Array,
    experts: jax.Array,
    count: jax.Array,
    row_bytes: int,
    num_rows: int,
    blocks: int = GATHER_BLOCKS,
) -> jax.Array:
    """Rows [M, row_bytes] on the device: the first `count` of `experts` (i32 [M], each below
    `num_rows`) read from the host rows at `address` (i32 [2], `host_rows_address`), zeros after,
    by one buffer callback that launches the gather and waits for nothing (the module docstring).
    `blocks`: at most this many blocks (at least one a row); below `GATHER_BLOCKS` the gather keeps
    `BACKGROUND_GATHER_UNROLL` loads in flight a thread (a copy that shares the GPU with compute)."""
    from jax.experimental.buffer_callback import buffer_callback

    header = jnp.concatenate(
        [jnp.reshape(address, (2,)).astype(jnp.int32), jnp.reshape(count, (1,)).astype(jnp.int32),
         experts.astype(jnp.int32)]
    )  # fmt: skip
    out = jax.ShapeDtypeStruct((experts.shape[0], row_bytes), jnp.uint8)
    if blocks < 1:
        raise ValueError(f"a gather needs at least one block, got {blocks}")
    gather = functools.partial(_mapped_rows, num_rows, blocks)
    return buffer_callback(gather, out, command_buffer_compatible=MAPPED_IN_COMMAND_BUFFERS)(header)


def _mapped_rows(num_rows: int, blocks: int, ctx, out, header) -> None:
    """buffer_callback body of `copy_rows_mapped`: the gather launched on the device's stream, or
    the copies in memory."""
    from jax.experimental.buffer_callback import ExecutionStage

    if ctx.stage != ExecutionStage.EXECUTE:
        return
    if out.__dlpack_device__()[0] != 1:  # not kDLCPU
        _cuda_mapped_rows(ctx.stream, out, header, blocks)
        return
    head = np.asarray(header)
    low, high = (int(w) for w in head[:2].view(np.uint32))
    count, (rows_out, row_bytes) = int(head[2]), out.shape
    experts = head[3 : 3 + count]
    if not 0 <= count <= rows_out:
        raise ValueError(f"{count} rows asked for an output of {rows_out}")
    if count and (experts.min() < 0 or experts.max() >= num_rows):
        raise ValueError(f"expert ids {experts.tolist()} out of range for {num_rows} host rows")
    base, dst = low | high << 32, np.asarray(out)
    for at, first, n in _runs(experts):
        ctypes.memmove(dst.ctypes.data + at * row_bytes, base + first * row_bytes, n * row_bytes)
    dst[count:] = 0


def gather_width(row_bytes: int) -> int:
    """Bytes the gather moves per load for rows of `row_bytes`: the largest of `GATHER_WIDTHS`
    that divides it (padded expert rows take 16)."""
    return next(w for w in GATHER_WIDTHS if row_bytes % w == 0)


def gather_unroll(blocks: int) -> int:
    """Loads in flight per thread of a gather launched with at most `blocks` blocks."""
    return 1 if blocks >= GATHER_BLOCKS else BACKGROUND_GATHER_UNROLL


def gather_launch(rows_out: int, row_bytes: int, max_blocks: int = GATHER_BLOCKS) -> tuple[str, int, int]:
    """(kernel name, words a row, blocks per row) of the gather for an output [rows_out, row_bytes]
    launched with at most `max_blocks` blocks (one a row at least)."""
    width = gather_width(row_bytes)
    words = row_bytes // width
    unroll = gather_unroll(max_blocks)
    blocks = max(1, min(-(-words // (GATHER_THREADS * unroll)), max_blocks // max(rows_out, 1)))
    return gather_kernel_name(width, unroll), words, blocks


def _cuda_mapped_rows(stream: int, out, header, max_blocks: int = GATHER_BLOCKS) -> None:
    """GPU side of "mapped": launch the gather on `stream`; nothing is read back or waited for."""
    rows_out, row_bytes = out.shape
    if rows_out == 0 or row_bytes == 0:
        return
    name, words, blocks = gather_launch(rows_out, row_bytes, max_blocks)
    cuda = _cuda()
    with cuda.context_of(stream):
        fn = cuda.function(stream, name)
        args = [
            ctypes.c_uint64(_device_pointer(header)),
            ctypes.c_uint64(_device_pointer(out)),
            ctypes.c_uint64(words),
        ]
        params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(a) for a in args])
        cuda.check("cuLaunchKernel", fn, blocks, rows_out, 1, GATHER_THREADS, 1, 1, 0, stream, params, None)


def gather_kernel_name(width: int, unroll: int = 1, load: str = "ld") -> str:
    """Entry name of the gather with loads of `width` bytes, `unroll` loads in flight per thread
    and the PTX load instruction `load` (the defaults are the kernels `copy_rows_mapped` runs)."""
    tag = "" if (unroll, load) == (1, "ld") else f"_u{unroll}_{load.replace('.', '_')}"
    return f"gather_rows_w{width}{tag}"


def gather_entry(width: int, unroll: int = 1, load: str = "ld") -> str:
    """PTX of the gather kernel `gather_kernel_name(...)(header, dst, words)`: block (x, y) copies a
    stripe of output row y. header is i32 [2 + 1 + M] in device memory: the source rows' address
    (two words), the count, the ids. Output row y < count gets source row ids[y] (`words` loads of
    `width` bytes; the default `ld` reads through the generic address space, so from mapped host
    memory); the other rows get zeros. Each thread keeps `unroll` loads in flight, one grid stride
    apart (every load instruction of a warp stays coalesced)."""
    kind = {
        16: (".v4.u32", 4, "r"),
        8: (".v2.u32", 2, "r"),
        4: (".u32", 1, "r"),
        2: (".u16", 1, "h"),
        1: (".u8", 1, "h"),
    }
    suffix, lanes, reg = kind[width]
    bits = 32 if reg == "r" else 16
    vals = [[f"%{reg}v{j * lanes + i}" for i in range(lanes)] for j in range(unroll)]
    group = ["{" + ", ".join(v) + "}" if lanes > 1 else v[0] for v in vals]
    body = []
    for j in range(unroll):  # the loads: index rd12 + j * stride
        body += [
            f"mad.lo.u64 %ri{j}, %rd13, {j}, %rd12;",
            f"setp.lt.u64 %pw{j}, %ri{j}, %rd3;",
            f"and.pred %pl{j}, %pw{j}, %p1;",
            *[f"mov.b{bits} {v}, 0;" for v in vals[j]],
            f"mad.lo.u64 %ra{j}, %ri{j}, {width}, %rd9;",
            f"@%pl{j} {load}{suffix} {group[j]}, [%ra{j}];",
        ]
    for j in range(unroll):  # then the stores
        body += [
            f"mad.lo.u64 %ra{j}, %ri{j}, {width}, %rd11;",
            f"@%pw{j} st.global{suffix} [%ra{j}], {group[j]};",
        ]
    body = "\n    ".join(body)
    return f"""
.visible .entry {gather_kernel_name(width, unroll, load)}(.param .u64 p_header, .param .u64 p_dst, .param .u64 p_words)
{{
    .reg .pred %p<3>;
    .reg .pred %pw<{unroll}>;
    .reg .pred %pl<{unroll}>;
    .reg .b32 %r<10>;
    .reg .b64 %rd<17>;
    .reg .b64 %ri<{unroll}>;
    .reg .b64 %ra<{unroll}>;
    .reg .b{bits} %{reg}v<{lanes * unroll}>;
    ld.param.u64 %rd1, [p_header];
    ld.param.u64 %rd2, [p_dst];
    ld.param.u64 %rd3, [p_words];
    cvta.to.global.u64 %rd1, %rd1;
    cvta.to.global.u64 %rd2, %rd2;
    ld.global.u64 %rd4, [%rd1];
    ld.global.u32 %r1, [%rd1+8];
    mov.u32 %r2, %ctaid.y;
    setp.lt.s32 %p1, %r2, %r1;
    mul.wide.u32 %rd5, %r2, 4;
    add.u64 %rd6, %rd1, %rd5;
    mov.u32 %r3, 0;
    @%p1 ld.global.u32 %r3, [%rd6+12];
    mul.lo.u64 %rd7, %rd3, {width};
    cvt.u64.u32 %rd8, %r3;
    mad.lo.u64 %rd9, %rd8, %rd7, %rd4;
    cvt.u64.u32 %rd10, %r2;
    mad.lo.u64 %rd11, %rd10, %rd7, %rd2;
    mov.u32 %r4, %ctaid.x;
    mov.u32 %r5, %ntid.x;
    mov.u32 %r6, %tid.x;
    mov.u32 %r7, %nctaid.x;
    mad.lo.u32 %r8, %r4, %r5, %r6;
    mul.lo.u32 %r9, %r7, %r5;
    cvt.u64.u32 %rd12, %r8;
    cvt.u64.u32 %rd13, %r9;
    mul.lo.u64 %rd14, %rd13, {unroll};
LOOP:
    setp.ge.u64 %p2, %rd12, %rd3;
    @%p2 bra DONE;
    {body}
    add.u64 %rd12, %rd12, %rd14;
    bra LOOP;
DONE:
    ret;
}}
"""


def gather_ptx(entries) -> str:
    """One PTX module of gather kernels, one per (width, unroll, load) of `entries`."""
    return ".version 7.0\n.target sm_80\n.address_size 64\n" + "".join(gather_entry(*e) for e in entries)


# the kernels `copy_rows_mapped` launches: one load in flight a thread, and the background form
_GATHER_ENTRIES = [(w, u) for u in (1, BACKGROUND_GATHER_UNROLL) for w in GATHER_WIDTHS]
GATHER_PTX = gather_ptx(_GATHER_ENTRIES)
GATHER_NAMES = [gather_kernel_name(w, u) for w, u in _GATHER_ENTRIES]


class _CudaDriver:
    """The few CUDA driver calls "dma" and "mapped" make (libcuda, always beside a GPU driver; no
    extra package)."""

    _ARGS: ClassVar[dict[str, tuple]] = {
        "cuMemcpyDtoHAsync_v2": (ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p),
        "cuMemcpyHtoDAsync_v2": (ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p),
        "cuMemsetD8Async": (ctypes.c_uint64, ctypes.c_ubyte, ctypes.c_size_t, ctypes.c_void_p),
        "cuStreamSynchronize": (ctypes.c_void_p,),
        "cuStreamGetCtx": (ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)),
        "cuCtxPushCurrent_v2": (ctypes.c_void_p,),
        "cuCtxPopCurrent_v2": (ctypes.POINTER(ctypes.c_void_p),),
        "cuGetErrorName": (ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)),
        "cuPointerGetAttribute": (ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64),
        "cuCtxGetCurrent": (ctypes.POINTER(ctypes.c_void_p),),
        "cuDeviceGet": (ctypes.POINTER(ctypes.c_int), ctypes.c_int),
        "cuDevicePrimaryCtxRetain": (ctypes.POINTER(ctypes.c_void_p), ctypes.c_int),
        "cuDevicePrimaryCtxRelease_v2": (ctypes.c_int,),
        "cuModuleLoadData": (ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p),
        "cuModuleGetFunction": (ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p),
        "cuLaunchKernel": (
            ctypes.c_void_p,
            *[ctypes.c_uint] * 7,
            ctypes.c_void_p,
            *[ctypes.POINTER(ctypes.c_void_p)] * 2,
        ),
        "cuMemAllocHost_v2": (ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t),
        "cuEventCreate": (ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint),
        "cuEventRecord": (ctypes.c_void_p, ctypes.c_void_p),
        "cuEventQuery": (ctypes.c_void_p,),
        "cuEventSynchronize": (ctypes.c_void_p,),
    }

    def __init__(self) -> None:
        path = ctypes.util.find_library("cuda") or "libcuda.so.1"
        self.lib = ctypes.CDLL(path)
        self._modules: dict[tuple[int, str], ctypes.c_void_p] = {}  # (context, PTX) -> module
        self._functions: dict[tuple[int, str, str], ctypes.c_void_p] = {}  # (context, PTX, name)
        for name, args in self._ARGS.items():
            fn = getattr(self.lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int

    def check(self, name: str, *args) -> None:
        """Call `name`; raise with the driver's error name when it fails."""
        status = getattr(self.lib, name)(*args)
        if status:
            text = ctypes.c_char_p()
            self.lib.cuGetErrorName(status, ctypes.byref(text))
            raise RuntimeError(f"{name} failed: {(text.value or b'?').decode()} ({status})")

    @contextlib.contextmanager
    def context_of(self, stream: int):
        """Make `stream`'s context current on this thread for the block, and yield it (XLA's thread
        need not keep one current between its own calls, nor the one of this stream)."""
        ctx = ctypes.c_void_p()
        self.check("cuStreamGetCtx", stream, ctypes.byref(ctx))
        with self.pushed(ctx.value):
            yield ctx.value

    @contextlib.contextmanager
    def pushed(self, context: int):
        """Make `context` current on this thread for the block."""
        self.check("cuCtxPushCurrent_v2", ctypes.c_void_p(context))
        try:
            yield
        finally:
            popped = ctypes.c_void_p()
            self.check("cuCtxPopCurrent_v2", ctypes.byref(popped))

    def alloc_host(self, nbytes: int) -> int:
        """Address of `nbytes` of new pinned host memory (call with a context current)."""
        address = ctypes.c_void_p()
        self.check("cuMemAllocHost_v2", ctypes.byref(address), nbytes)
        return address.value

    def new_event(self) -> int:
        """A new event without timing (call with a context current)."""
        event = ctypes.c_void_p()
        self.check("cuEventCreate", ctypes.byref(event), CU_EVENT_DISABLE_TIMING)
        return event.value

    def event_done(self, context: int, event: int, wait: bool) -> bool:
        """Whether the work before `event` has finished; with `wait`, wait for it first."""
        with self.pushed(context):
            if wait:
                self.check("cuEventSynchronize", ctypes.c_void_p(event))
                return True
            status = self.lib.cuEventQuery(ctypes.c_void_p(event))
            if status == CUDA_ERROR_NOT_READY:
                return False
            if status:
                self.check("cuEventQuery", ctypes.c_void_p(event))  # raises with the error's name
            return True

    @contextlib.contextmanager
    def some_context(self, device: int):
        """A current context for calls outside XLA's callbacks: the thread's own, else `device`'s
        primary context (the one XLA runs in)."""
        ctx = ctypes.c_void_p()
        self.check("cuCtxGetCurrent", ctypes.byref(ctx))
        if ctx.value:
            yield
            return
        dev = ctypes.c_int()
        self.check("cuDeviceGet", ctypes.byref(dev), device)
        self.check("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
        try:
            self.check("cuCtxPushCurrent_v2", ctx)
            try:
                yield
            finally:
                self.check("cuCtxPopCurrent_v2", ctypes.byref(ctx))
        finally:
            self.check("cuDevicePrimaryCtxRelease_v2", dev)

    def function(self, stream: int, name: str, ptx: str = GATHER_PTX) -> ctypes.c_void_p:
        """Kernel `name` of the PTX module `ptx`, loaded once per context (call with the context
        current)."""
        ctx = ctypes.c_void_p()
        self.check("cuStreamGetCtx", stream, ctypes.byref(ctx))
        return self._function(ctx.value, ptx, name)

    def load_current(self, ptx: str, names: Sequence[str]) -> None:
        """Load the kernels `names` of the PTX module `ptx` into the current context now, so that
        a later `function` call (perhaps while XLA captures a CUDA graph) finds them loaded."""
        ctx = ctypes.c_void_p()
        self.check("cuCtxGetCurrent", ctypes.byref(ctx))
        for name in names:
            self._function(ctx.value, ptx, name)

    def _module(self, context: int, ptx: str) -> ctypes.c_void_p:
        module = self._modules.get((context, ptx))
        if module is None:
            module = ctypes.c_void_p()
            self.check("cuModuleLoadData", ctypes.byref(module), ptx.encode() + b"\0")
            self._modules[(context, ptx)] = module
        return module

    def _function(self, context: int, ptx: str, name: str) -> ctypes.c_void_p:
        key = (context, ptx, name)
        if key not in self._functions:
            fn = ctypes.c_void_p()
            self.check("cuModuleGetFunction", ctypes.byref(fn), self._module(context, ptx), name.encode())
            self._functions[key] = fn
        return self._functions[key]


@functools.cache
def _cuda() -> _CudaDriver:
    return _CudaDriver()
