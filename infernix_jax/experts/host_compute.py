"""Part of a step's missed experts computed on the host's CPU, and the cost model that sets the part.

A missed expert reaches a step (with callback host reads) in one of two ways: its packed bytes
are staged by the callback and cross PCIe for the device to compute, or the CPU computes the
few rows routed to it from its copy in host RAM (or read from the artifact) and only the outputs
cross. The device picks which (`model.mlp._split_missed`: a share of each layer's misses, those
with the fewest tokens); the callback runs the CPU's experts on a worker thread while it stages
the others.

The CPU unpacks the experts with the device's `dequantize` (NVFP4 / FP8 / ... alike) in the
activations' dtype and runs the same SwiGLU, on jax's CPU backend, batched per expert (each
expert unpacked once for all its rows, where the device's decode path gathers weights per pair):
a CPU-computed pair differs from the device's only by float rounding.

`HostComputeCost` is measured at start: seconds for the CPU to compute one expert for one token
(decode), to stage one expert's packed bytes, and to copy them to the device the way callback
results travel. `best_share` balances the CPU's work, which runs beside the staging of the rest,
against the staging plus copies it saves.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from infernix_jax.experts.layout import ExpertLayout, Leaves
from infernix_jax.weights.quant import dequantize

log = logging.getLogger("infernix_jax.experts")


@dataclass(frozen=True)
class HostComputeCost:
    """Seconds per missed expert (decode: one token routed to it), as measured at start."""

    cpu_seconds: float  # the CPU computes it from its packed bytes (unpacking included)
    stage_seconds: float  # the callback stacks its packed bytes into its result
    copy_seconds: float  # its packed bytes cross to the device as a callback result does

    def layer_seconds(self, on_cpu: float, missed: float) -> float:
        """Host-side time of a layer that misses `missed` experts and computes `on_cpu` of them:
        the CPU's work runs beside the staging of the others; their copies follow."""
        crossing = missed - on_cpu
        return max(on_cpu * self.cpu_seconds, crossing * self.stage_seconds) + crossing * self.copy_seconds

    def best_share(self) -> float:
        """The share of a layer's misses to compute on the CPU for the least time (0 when the
        CPU is no faster than copying; ties go to copying). The time is linear in the misses
        on either side of the point where the CPU's work equals the staging, so the best share
        is 0, 1 or that point, whatever the number of misses."""
        even = self.stage_seconds / (self.cpu_seconds + self.stage_seconds) if self.cpu_seconds else 1.0
        return min((0.0, even, 1.0), key=lambda share: (self.layer_seconds(share, 1.0), share))

    def describe(self) -> str:
        return (
            f"an expert costs {self.cpu_seconds * 1e3:.3f} ms on the CPU against "
            f"{self.stage_seconds * 1e3:.3f} ms staging + {self.copy_seconds * 1e3:.3f} ms copy"
        )


def _bucket(n: int) -> int:
    """The next power of two >= n (>= 1): few compiled shapes for the CPU function."""
    return 1 << max(0, (n - 1).bit_length())


class HostExpertCompute:
    """Runs missed experts on jax's CPU backend for the rows routed to them."""

    def __init__(self, layout: ExpertLayout):
        self.layout = layout
        self.cpu = host_cpu_device()
        if self.cpu is None:
            raise ValueError(
                "computing experts on the host needs jax's CPU backend (JAX_PLATFORMS leaves it out)"
            )
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="expert-cpu")
        treedef = layout.treedef

        def rows_through_experts(leaves, x):
            """leaves: C experts' stacked leaves; x [C, R, D], each expert's rows -> [C, R, D]."""
            gate, up, down = (dequantize(w, x.dtype) for w in jax.tree.unflatten(treedef, leaves))
            h = jax.nn.silu(jnp.einsum("crd,cid->cri", x, gate)) * jnp.einsum("crd,cid->cri", x, up)
            return jnp.einsum("cri,cdi->crd", h, down)

        self._rows_through_experts = jax.jit(rows_through_experts)

    def submit(self, fn, *args) -> Future:
        """`fn(*args)` on the CPU's worker thread (one: the CPU backend spreads a call over the cores)."""
        return self._pool.submit(fn, *args)

    def outputs(
        self, experts: list[Leaves], expert_ids: list[int], x: np.ndarray, ids: np.ndarray, valid: np.ndarray
    ) -> np.ndarray:
        """Per-pair outputs [N, k, D] (x's dtype) of the pairs of valid rows routed to `expert_ids`
        (their leaves in `experts`), zeros for every other pair."""
        out = np.zeros((*ids.shape, x.shape[-1]), x.dtype)
        if not expert_ids:
            return out
        local_of = np.full(self.layout.num_experts, -1, np.int64)
        local_of[expert_ids] = np.arange(len(expert_ids))
        local = np.where(valid[:, None] != 0, local_of[ids], -1)
        rows, slots = np.nonzero(local >= 0)
        if not len(rows):
            return out
        pair_expert = local[rows, slots]
        order = np.argsort(pair_expert, kind="stable")
        per_expert = np.bincount(pair_expert, minlength=len(expert_ids))
        rank = np.arange(len(rows)) - np.repeat(np.cumsum(per_expert) - per_expert, per_expert)
        c, r = _bucket(len(expert_ids)), _bucket(int(per_expert.max()))  # few compiled shapes
        x_rows = np.zeros((c, r, x.shape[-1]), x.dtype)
        x_rows[pair_expert[order], rank] = x[rows[order]]
        stacked = [np.zeros((c, *s), d) for s, d in zip(self.layout.leaf_shapes, self.layout.leaf_dtypes)]
        for dst, *leaves in zip(stacked, *experts):
            dst[: len(leaves)] = np.stack(leaves)
        put = lambda a: jax.device_put(a, self.cpu)
        result = np.asarray(self._rows_through_experts([put(a) for a in stacked], put(x_rows)))
        out[rows[order], slots[order]] = result[pair_expert[order], rank]
        return out

    def measure(self, sample: Leaves, hidden_size: int, dtype, repeats: int = 5) -> HostComputeCost:
        """The cost model on this machine, with one expert's leaves and the model's hidden size and
        activation dtype."""
        x = np.ones((1, hidden_size), jnp.dtype(dtype))
        ids = np.zeros((1, 1), np.int32)
        valid = np.ones(1, np.int32)

        def cpu():
            self.outputs([sample], [0], x, ids, valid)

        width = 8
        staged = [
            np.empty((width, *s), dt) for s, dt in zip(self.layout.leaf_shapes, self.layout.leaf_dtypes)
        ]

        def stage():
            for dst, leaf in zip(staged, sample):
                np.stack([leaf] * width, out=dst)

        device = jax.devices()[0]

        def copy():
            jax.block_until_ready([jax.device_put(a, device) for a in staged])

        return HostComputeCost(
            cpu_seconds=_best_of(cpu, repeats),
            stage_seconds=_best_of(stage, repeats) / width,
            copy_seconds=_best_of(copy, repeats) / width,
        )

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _best_of(fn, repeats: int) -> float:
    """The fastest of `repeats` timed runs after one untimed (compiles, warms caches)."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def host_cpu_device() -> jax.Device | None:
    """jax's first CPU device, or None where the CPU backend is not loaded."""
    try:
        return jax.devices("cpu")[0]
    except RuntimeError:
        return None
