"""Values a program sends to the host without the device waiting: on the CPU they arrive at once;
on a GPU (a driver that works in host memory) each send enqueues one copy and one event and waits
for nothing, and `deliver` hands the values over in send order once their copies have landed."""

from __future__ import annotations

import collections
import contextlib
import ctypes
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from infernix_jax.model import host_report
from tests.cuda_fakes import HostBackedBuffer


@pytest.fixture(autouse=True)
def fresh_queue(monkeypatch):
    """Each test gets its own queue and pools (the module keeps them per process)."""
    monkeypatch.setattr(host_report, "_pending", collections.deque())
    monkeypatch.setattr(host_report, "_free_buffers", collections.defaultdict(list))
    monkeypatch.setattr(host_report, "_free_events", collections.defaultdict(list))


def test_on_the_cpu_each_step_of_a_loop_reaches_its_receiver_in_order():
    got = []

    @jax.jit
    def run(x):
        def step(i, x):
            receipt = host_report.send_to_host(x * i, got.append)
            return x + 1 + receipt.astype(x.dtype)

        return jax.lax.fori_loop(0, 3, step, x)

    out = run(jnp.arange(4, dtype=jnp.int32))
    np.testing.assert_array_equal(np.asarray(out), np.arange(4) + 3)
    assert [g.tolist() for g in got] == [[0, 0, 0, 0], [1, 2, 3, 4], [4, 6, 8, 10]]
    assert host_report.pending() == 0 and host_report.deliver(wait=True) == 0


def test_a_send_whose_receipt_the_result_uses_keeps_the_program_free_of_effects():
    """jit runs a program with effects through its Python path at every call; a send declares none
    (its receipt, folded into the result, is what keeps it), and one whose receipt goes unused is
    dropped by the compiler."""
    got = []

    def kept(x):
        return x + host_report.send_to_host(x, got.append).astype(x.dtype)

    def dropped(x):
        host_report.send_to_host(x, got.append)
        return x + 1

    x = jnp.arange(3, dtype=jnp.int32)
    assert not jax.make_jaxpr(kept)(x).effects
    np.testing.assert_array_equal(np.asarray(jax.jit(kept)(x)), np.arange(3))
    assert len(got) == 1
    np.testing.assert_array_equal(np.asarray(jax.jit(dropped)(x)), np.arange(3) + 1)
    assert len(got) == 1, "an unused receipt loses its send"


class _FakeDriver:
    """The driver calls of `host_report` in host memory: copies run at once, events finish when
    the test says so; every call is logged."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.done: set[int] = set()
        self.buffers: list[np.ndarray] = []  # "pinned" allocations, kept alive here
        self._events = itertools.count(100)

    def check(self, name: str, *args) -> None:
        self.calls.append(name)
        if name == "cuMemcpyDtoHAsync_v2":
            dst, src, size, _stream = args
            ctypes.memmove(dst, src, size)

    @contextlib.contextmanager
    def context_of(self, stream: int):
        yield 7

    def alloc_host(self, nbytes: int) -> int:
        self.calls.append("alloc_host")
        self.buffers.append(np.zeros(nbytes, np.uint8))
        return self.buffers[-1].ctypes.data

    def new_event(self) -> int:
        self.calls.append("new_event")
        return next(self._events)

    def event_done(self, context: int, event: int, wait: bool) -> bool:
        assert context == 7
        if wait:
            self.calls.append("wait")
            self.done.add(event)
        return event in self.done


def test_on_a_gpu_a_send_waits_for_nothing_and_values_arrive_in_order(monkeypatch):
    driver = _FakeDriver()
    monkeypatch.setattr(host_report, "_cuda", lambda: driver)
    got = []
    first, second = np.arange(6, dtype=np.int32).reshape(2, 3), np.full((2, 3), 9, np.int32)
    host_report._send_from_gpu(3, HostBackedBuffer(first), lambda v: got.append(("a", v)))
    host_report._send_from_gpu(3, HostBackedBuffer(second), lambda v: got.append(("b", v)))
    assert driver.calls == ["alloc_host", "new_event", "cuMemcpyDtoHAsync_v2", "cuEventRecord"] * 2
    assert host_report.pending() == 2 and host_report.deliver() == 0 and not got, "nothing has landed"

    driver.done.add(101)  # the second copy's event only: the first still holds the queue
    assert host_report.deliver() == 0 and not got
    driver.done.add(100)
    assert host_report.deliver() == 2
    assert [name for name, _ in got] == ["a", "b"]
    np.testing.assert_array_equal(got[0][1], first)
    np.testing.assert_array_equal(got[1][1], second)
    assert got[0][1].dtype == np.int32 and got[0][1].shape == (2, 3)

    driver.calls.clear()  # a third send of the same size reuses a buffer and an event
    host_report._send_from_gpu(3, HostBackedBuffer(first + 1), lambda v: got.append(("c", v)))
    assert driver.calls == ["cuMemcpyDtoHAsync_v2", "cuEventRecord"]
    assert host_report.deliver(wait=True) == 1 and driver.calls[-1] == "wait"
    np.testing.assert_array_equal(got[-1][1], first + 1)


def test_a_failing_receiver_drops_only_its_value(monkeypatch):
    driver = _FakeDriver()
    monkeypatch.setattr(host_report, "_cuda", lambda: driver)
    got = []

    def broken(value):
        raise RuntimeError("receiver broke")

    host_report._send_from_gpu(0, HostBackedBuffer(np.zeros(2, np.float32)), broken)
    host_report._send_from_gpu(0, HostBackedBuffer(np.ones(2, np.float32)), got.append)
    with pytest.raises(RuntimeError, match="receiver broke"):
        host_report.deliver(wait=True)
    assert host_report.pending() == 1 and not got
    assert host_report.deliver(wait=True) == 1
    np.testing.assert_array_equal(got[0], np.ones(2, np.float32))
