"""Experts as one byte row each in pinned host memory: rows round-trip to the exact leaves, and
the in-program copy brings the asked experts' bytes to the device."""

from __future__ import annotations

import contextlib
import ctypes

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infernix_jax.experts.offload import expert_rows, promote_layers_from_host_program
from infernix_jax.model import host_copy
from infernix_jax.model.mlp import copy_host_rows, copy_missed_rows, expert_row_bytes, expert_rows_to_leaves
from tests.cuda_fakes import HostBackedBuffer

PINNED = jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host")


def nvfp4_like_stacks(experts: int, rng) -> list[np.ndarray]:
    """An NVFP4 projection's leaves: packed bytes, e4m3 block scales, a float32 scale per expert."""
    packed = rng.integers(0, 256, (experts, 6, 8), dtype=np.uint8)
    scales = rng.integers(0, 0x7E, (experts, 6, 1), dtype=np.uint8).view(jnp.float8_e4m3fn)
    return [packed, scales, rng.random(experts, dtype=np.float32)]


def test_rows_cut_back_into_the_same_leaves_bit_for_bit():
    stacks = nvfp4_like_stacks(5, np.random.default_rng(0))
    rows = expert_rows([[s[e] for s in stacks] for e in range(5)])
    expert_bytes = sum(s[0].nbytes for s in stacks)
    assert rows.dtype == np.uint8 and rows.shape == (5, expert_row_bytes(expert_bytes))
    assert rows.shape[1] % 16 == 0 and not rows[:, expert_bytes:].any()  # 16-byte rows, zero padding
    back = expert_rows_to_leaves(jnp.asarray(rows), [jnp.asarray(s) for s in stacks])
    for got, want in zip(back, stacks):
        assert got.dtype == want.dtype and got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8), want.view(np.uint8))
    with pytest.raises(ValueError, match="bytes"):
        expert_rows_to_leaves(jnp.asarray(rows[:, 1:]), [jnp.asarray(s) for s in stacks])


def test_the_program_copies_the_counted_experts_from_pinned_host_memory():
    rows = np.random.default_rng(1).integers(0, 256, (9, 40), dtype=np.uint8)
    host = jax.device_put(rows, PINNED)
    missed = jnp.asarray([7, 2, 5, -1], jnp.int32)
    counted = jax.jit(copy_host_rows)(host, missed, jnp.int32(3))
    assert counted.sharding.memory_kind == "device"
    np.testing.assert_array_equal(np.asarray(counted), np.concatenate([rows[[7, 2, 5]], np.zeros((1, 40))]))
    every = jax.jit(copy_host_rows)(host, missed)  # no count: every row, -1 reads expert 0
    np.testing.assert_array_equal(np.asarray(every), rows[[7, 2, 5, 0]])


@pytest.mark.parametrize("method", ["loop", "dma", "mapped"])
def test_promotion_writes_host_experts_into_the_listed_slots_of_the_listed_layers_only(method):
    """One program promotes the swaps of every layer (a row of ids each; -1 rows leave a layer as
    it is), copying the way the layer's forward does (`SlottedExperts.host_copy`)."""
    rng = np.random.default_rng(2)
    layers = [nvfp4_like_stacks(6, rng), nvfp4_like_stacks(6, rng)]
    hosts = [jax.device_put(expert_rows([[s[e] for s in stacks] for e in range(6)]), PINNED) for stacks in layers]
    refs = {
        "loop": lambda host: None,
        "dma": lambda host: jnp.int32(host_copy.register_host_rows(host)),
        "mapped": lambda host: jnp.asarray(host_copy.host_rows_address(host)),
    }[method]
    slots = tuple(tuple(jnp.asarray(s[:3]) for s in stacks) for stacks in layers)  # experts 0, 1, 2
    ids = jnp.asarray([[2, -1, 0] + [-1] * 5, [-1] * 8], jnp.int32)
    experts = jnp.asarray([[5, 3, 4] + [-1] * 5, [-1] * 8], jnp.int32)
    new = promote_layers_from_host_program(slots, ids, tuple(hosts), experts, tuple(map(refs, hosts)), method=method)
    for got, want in zip(new[0], layers[0]):  # slot 0 <- expert 4, slot 1 kept, slot 2 <- expert 5
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8), want[[4, 1, 5]].view(np.uint8))
    for got, want in zip(new[1], layers[1]):  # the second layer listed nothing: as it was
        np.testing.assert_array_equal(np.asarray(got).view(np.uint8), want[:3].view(np.uint8))


@pytest.mark.parametrize("method", host_copy.HOST_COPIES)
def test_every_host_copy_brings_the_asked_rows_and_zeros_after(method):
    """Each way of copying missed experts (`host_copy.HOST_COPIES`): for random ids and every
    count from 0 to the most rows, the first `count` rows are the source rows' bytes and the
    rest are zeros, on the device. Ids come ascending (as the model gives them: consecutive ones
    make one "dma" copy) and shuffled."""
    rng = np.random.default_rng(3)
    experts, row_bytes, m = 23, 72, 9
    rows = rng.integers(0, 256, (experts, row_bytes), dtype=np.uint8)
    host = jax.device_put(rows, PINNED)
    refs = {
        "dma": lambda: jnp.int32(host_copy.register_host_rows(host)),
        "mapped": lambda: host_copy.host_rows_address(host),
    }
    rows_ref = refs.get(method, lambda: None)()
    copy = jax.jit(lambda h, e, c, i: copy_missed_rows(method, h, e, c, i))
    for count in range(m + 1):
        for ordered in (True, False):
            chosen = rng.choice(experts, count, replace=False)
            chosen = np.sort(chosen) if ordered else chosen
            ids = np.full(m, -1, np.int32)
            ids[:count] = chosen
            got = copy(host, jnp.asarray(ids), jnp.int32(count), rows_ref)
            assert got.sharding.memory_kind == "device" and got.shape == (m, row_bytes)
            want = np.zeros((m, row_bytes), np.uint8)
            want[:count] = rows[chosen]
            np.testing.assert_array_equal(np.asarray(got), want, err_msg=f"{method}, count {count}")


def test_dma_copies_refuse_rows_that_are_gone_or_ids_out_of_range():
    rows = jax.device_put(np.zeros((4, 8), np.uint8), PINNED)
    rows_id = host_copy.register_host_rows(rows)
    copy = jax.jit(lambda i, e, c: host_copy.copy_rows_by_dma(i, e, c, 8))
    with pytest.raises(Exception, match="out of range"):
        jax.block_until_ready(copy(jnp.int32(rows_id), jnp.asarray([1, 4], jnp.int32), jnp.int32(2)))
    with pytest.raises(Exception, match="no host rows"):
        jax.block_until_ready(copy(jnp.int32(10**6), jnp.asarray([1, 2], jnp.int32), jnp.int32(2)))
    with pytest.raises(ValueError, match="u8"):
        host_copy.register_host_rows(jnp.zeros((4, 2), jnp.float32))


class _FakeDriver:
    """Does what the CUDA driver calls of `host_copy._cuda_dma_rows` would, in host memory; logs them."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def check(self, name: str, *args) -> None:
        self.calls.append(name)
        if name in ("cuMemcpyDtoHAsync_v2", "cuMemcpyHtoDAsync_v2"):
            dst, src, size, _stream = args
            ctypes.memmove(dst, src, size)
        elif name == "cuMemsetD8Async":
            dst, value, size, _stream = args
            ctypes.memset(dst, value, size)

    @contextlib.contextmanager
    def context_of(self, stream: int):
        yield


def test_the_gpu_dma_path_reads_the_ids_once_and_copies_each_run_of_ids(monkeypatch):
    """The CUDA side of "dma" (`_cuda_dma_rows`) with a driver that works in host memory: one
    read-back and one synchronisation, one copy per run of consecutive ids, the rest zeroed."""
    driver = _FakeDriver()
    monkeypatch.setattr(host_copy, "_cuda", lambda: driver)
    rows = np.random.default_rng(4).integers(0, 256, (12, 16), dtype=np.uint8)
    host = jax.device_put(rows, PINNED)
    rows_id = host_copy.register_host_rows(host)
    chosen = [2, 3, 4, 7, 9, 10]  # three runs
    header = np.asarray([rows_id, len(chosen), *chosen, -1, -1], np.int32)
    out = np.full((8, 16), 0xAB, np.uint8)
    host_copy._cuda_dma_rows(0, HostBackedBuffer(out), HostBackedBuffer(header))
    want = np.zeros_like(out)
    want[: len(chosen)] = rows[chosen]
    np.testing.assert_array_equal(out, want)
    assert driver.calls == [
        "cuMemcpyDtoHAsync_v2",
        "cuStreamSynchronize",
        *["cuMemcpyHtoDAsync_v2"] * 3,
        "cuMemsetD8Async",
    ]


def test_mapped_copies_refuse_ids_out_of_range_and_rows_that_are_not_bytes():
    rows = jax.device_put(np.zeros((4, 8), np.uint8), PINNED)
    address = host_copy.host_rows_address(rows)
    assert address.dtype == np.int32 and address.shape == (2,)
    copy = jax.jit(lambda a, e, c: host_copy.copy_rows_mapped(a, e, c, 8, 4))
    with pytest.raises(Exception, match="out of range"):
        jax.block_until_ready(copy(address, jnp.asarray([1, 4], jnp.int32), jnp.int32(2)))
    with pytest.raises(ValueError, match="u8"):
        host_copy.host_rows_address(jnp.zeros((4, 2), jnp.float32))


class _LaunchLog:
    """Records what `host_copy._cuda_mapped_rows` asks of the CUDA driver."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def check(self, name: str, *args) -> None:
        self.calls.append((name, *args))

    def function(self, stream: int, name: str) -> str:
        return name

    @contextlib.contextmanager
    def context_of(self, stream: int):
        yield


@pytest.mark.parametrize(
    ("rows", "row_bytes", "width"), [(8, 1_769_472, 16), (3, 72, 8), (10, 1_769_476, 4), (2, 9, 1)]
)
def test_the_gpu_mapped_path_launches_one_gather_and_waits_for_nothing(monkeypatch, rows, row_bytes, width):
    """The CUDA side of "mapped": one kernel launch on XLA's stream, one block row per output row,
    loads as wide as the row width allows; no read-back and no synchronisation (the point of the
    way: the host keeps launching the program while the rows cross PCIe)."""
    log = _LaunchLog()
    monkeypatch.setattr(host_copy, "_cuda", lambda: log)
    out = HostBackedBuffer(np.zeros((rows, row_bytes), np.uint8))
    header = HostBackedBuffer(np.zeros(3 + rows, np.int32))
    host_copy._cuda_mapped_rows(7, out, header)
    assert [c[0] for c in log.calls] == ["cuLaunchKernel"]
    _, fn, blocks_x, blocks_y, _, threads, _, _, _, stream, _, _ = log.calls[0]
    assert fn == f"gather_rows_w{width}" and blocks_y == rows and stream == 7
    assert threads == host_copy.GATHER_THREADS and 1 <= blocks_x * rows <= max(host_copy.GATHER_BLOCKS, rows)
    assert f".entry gather_rows_w{width}(" in host_copy.GATHER_PTX


@pytest.mark.parametrize(("rows", "blocks"), [(8, 32), (10, 32), (40, 32), (1, 8)])
def test_a_background_gather_launches_few_blocks_with_loads_in_flight(monkeypatch, rows, blocks):
    """The prefetch's gather (`copy_rows_mapped(blocks=...)`) shares the GPU with the layer's own
    kernels: it launches at most `blocks` blocks (one a row at least), each thread keeping
    `BACKGROUND_GATHER_UNROLL` loads in flight, from a kernel the module loads with the others."""
    log = _LaunchLog()
    monkeypatch.setattr(host_copy, "_cuda", lambda: log)
    out = HostBackedBuffer(np.zeros((rows, 1_769_488), np.uint8))
    header = HostBackedBuffer(np.zeros(3 + rows, np.int32))
    host_copy._cuda_mapped_rows(7, out, header, blocks)
    _, fn, blocks_x, blocks_y, *_ = log.calls[0]
    unroll = host_copy.BACKGROUND_GATHER_UNROLL
    assert fn == f"gather_rows_w16_u{unroll}_ld" and fn in host_copy.GATHER_NAMES
    assert blocks_y == rows and blocks_x * rows <= max(blocks, rows)
    assert f".entry {fn}(" in host_copy.GATHER_PTX


def test_a_background_gather_brings_the_same_rows():
    """On the CPU the callback copies in memory whatever the blocks: the bytes are the asked rows."""
    rows = jnp.asarray(np.random.default_rng(0).integers(0, 255, (6, 64), dtype=np.uint8))
    address = jnp.asarray(host_copy.host_rows_address(rows))
    ids = jnp.asarray([4, 1, 0, 0], jnp.int32)
    got = jax.jit(lambda a, i, c: host_copy.copy_rows_mapped(a, i, c, 64, 6, blocks=2))(
        address, ids, jnp.int32(2)
    )
    want = np.zeros((4, 64), np.uint8)
    want[:2] = np.asarray(rows)[[4, 1]]
    np.testing.assert_array_equal(np.asarray(got), want)
    with pytest.raises(ValueError, match="at least one block"):
        host_copy.copy_rows_mapped(address, ids, jnp.int32(2), 64, 6, blocks=0)


def test_auto_host_copy_is_mapped_where_the_device_addresses_the_rows_else_dma(monkeypatch, caplog):
    from infernix_jax.experts import offload

    rows = jax.device_put(np.zeros((4, 16), np.uint8), PINNED)
    assert offload.resolve_host_copy("auto", rows) == "mapped"
    assert offload.resolve_host_copy("dma", rows) == "dma"

    def refuse(rows):
        raise RuntimeError("the GPU cannot address these pinned host rows")

    monkeypatch.setattr(offload, "host_rows_address", refuse)
    assert offload.resolve_host_copy("auto", rows) == "dma"
    assert "copying with dma instead" in caplog.text
