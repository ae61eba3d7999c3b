"""Small values a jitted program hands to host code without the device waiting for the host.

`io_callback` copies its operands to the host and synchronises XLA's stream before its Python
function runs: the thread that launches the program's kernels stops until the device has caught
up, at every call. The forward's expert routing report (one a step, `mlp.report_expert_routing`)
cost the offloaded Qwen3-Next-80B shape a third of its batch-1 decode rate on the H200 that way
(docs/experts.md, "The grouped kernel, the routing report and asynchronous decode").

`send_to_host(value, receiver)` instead runs one `buffer_callback` that enqueues a copy of `value`
into pinned host memory on XLA's stream and records an event behind it; nothing waits. The
callback declares no side effect: it returns a receipt (a float32 zero) that the caller folds into
its result, which is what keeps XLA from removing it. A callback with a side effect would mark the
whole program effectful, and jit runs effectful programs through its Python path at every call,
never its C++ fast path: on the H200 that cost the offloaded Qwen3-Next-80B shape about 13 ms of
host time a decode dispatch (docs/experts.md, "Why the steps alternate"). The
receiver gets the numpy copy later, in the order the sends ran, from `deliver()`: the engine calls
it between steps (`ExpertOffload.rebalance`), and code about to read what the receivers keep calls
`deliver(wait=True)`. On the CPU the program runs on the host, so the callback hands the value over
at once.

The pinned buffers and events are pooled per (CUDA context, size) and reused; they live as long as
the process (a few per distinct value size).
"""

from __future__ import annotations

import collections
import ctypes
import dataclasses
import functools
import threading
from collections.abc import Callable

import jax
import numpy as np

from infernix_jax.model.host_copy import _cuda, _device_pointer

Receiver = Callable[[np.ndarray], None]

# Past this many sends not yet delivered, the sending callback waits and delivers them all (nobody
# is calling deliver: a loop of programs without an engine step between them).
MAX_PENDING = 1024


@dataclasses.dataclass(frozen=True)
class _Pending:
    context: int
    event: int
    buffer: int  # pinned host address the copy lands at
    shape: tuple[int, ...]
    dtype: np.dtype
    receiver: Receiver


_lock = threading.Lock()  # the queue and the pools
_delivering = threading.Lock()  # one deliverer at a time, so receivers run in send order
_pending: collections.deque[_Pending] = collections.deque()
_free_buffers: dict[tuple[int, int], list[int]] = collections.defaultdict(list)  # (context, bytes)
_free_events: dict[int, list[int]] = collections.defaultdict(list)  # context -> events


def send_to_host(value: jax.Array, receiver: Receiver) -> jax.Array:
    """Inside a jitted function: hand `value`'s contents, as a numpy array, to `receiver` once the
    device has computed it, without stopping the device or the launching thread (see the module
    docstring). `receiver` is static: part of the traced program, like an io_callback's function.

    Returns the receipt, float32 [] zero: the send happens only if the program's result depends on
    it (add it to something the program returns: `x + receipt.astype(x.dtype)`)."""
    from jax.experimental.buffer_callback import buffer_callback

    receipt = jax.ShapeDtypeStruct((), np.float32)
    return buffer_callback(functools.partial(_send, receiver), receipt)(value)


def _send(receiver: Receiver, ctx, receipt, value) -> None:
    from jax.experimental.buffer_callback import ExecutionStage

    if ctx.stage != ExecutionStage.EXECUTE:
        return
    if value.__dlpack_device__()[0] == 1:  # kDLCPU: the value is in host memory now
        np.asarray(receipt)[()] = 0
        receiver(np.array(np.asarray(value)))
        return
    _send_from_gpu(ctx.stream, value, receiver)
    cuda = _cuda()
    with cuda.context_of(ctx.stream):
        cuda.check("cuMemsetD8Async", _device_pointer(receipt), 0, np.dtype(np.float32).itemsize, ctx.stream)
    if pending() > MAX_PENDING:
        deliver(wait=True)


def _send_from_gpu(stream: int, value, receiver: Receiver) -> None:
    """Enqueue the copy of `value` (device memory) to a pinned buffer, then an event, on `stream`."""
    shape, dtype = tuple(value.shape), np.dtype(value.dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    cuda = _cuda()
    with cuda.context_of(stream) as context:
        with _lock:
            buffers, events = _free_buffers[(context, nbytes)], _free_events[context]
            buffer = buffers.pop() if buffers else None
            event = events.pop() if events else None
        if buffer is None:
            buffer = cuda.alloc_host(max(nbytes, 1))
        if event is None:
            event = cuda.new_event()
        if nbytes:
            cuda.check("cuMemcpyDtoHAsync_v2", buffer, _device_pointer(value), nbytes, stream)
        cuda.check("cuEventRecord", event, stream)
    with _lock:
        _pending.append(_Pending(context, event, buffer, shape, dtype, receiver))


def pending() -> int:
    """Sends not delivered yet."""
    with _lock:
        return len(_pending)


def deliver(wait: bool = False) -> int:
    """Hand every sent value whose copy has arrived to its receiver, oldest first, stopping at the
    first one still on its way; with `wait`, wait for each instead. Returns how many were handed.
    A receiver's exception propagates; its value is dropped and the later ones stay queued."""
    handed = 0
    with _delivering:
        while True:
            with _lock:
                item = _pending[0] if _pending else None
            if item is None or not _cuda().event_done(item.context, item.event, wait):
                return handed
            value = np.empty(item.shape, item.dtype)
            if value.nbytes:
                ctypes.memmove(value.ctypes.data, item.buffer, value.nbytes)
            with _lock:
                _pending.popleft()
                _free_buffers[(item.context, value.nbytes)].append(item.buffer)
                _free_events[item.context].append(item.event)
            handed += 1
            item.receiver(value)
