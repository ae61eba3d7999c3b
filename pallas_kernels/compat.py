"""One place for the Pallas API differences between the jax versions we run on.

The CPU machines and CI run jax 0.10.x; the GPU machines run jax 0.11.x. The Pallas Triton API
moved over the releases before these (see docs/pallas.md for the record):

* masked loads and stores: ``pl.load`` / ``pl.store`` (which took an index argument) moved to
  ``jax.experimental.pallas.triton.load`` / ``store``, which take a ref (or a ``ref.at[...]``
  view) and ``mask=`` / ``other=``;
* compiler parameters: ``dict(triton=dict(num_warps=...))``, then ``plgpu.TritonCompilerParams``,
  now ``plgpu.CompilerParams(num_warps=, num_stages=)``;
* ``pl.dot`` moved to ``plgpu.dot`` (deprecated in ``pl`` since 0.10.2). Kernels here call
  ``jax.lax.dot_general`` instead, which lowers on every version and in interpret mode.

Kernels import these names from here and never from the moving locations, so a future move is a
change to this one file.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.experimental import pallas as pl

try:  # jax >= 0.4.31: the Triton-specific names live in their own module.
    from jax.experimental.pallas import triton as _plgpu
except ImportError:  # pragma: no cover - very old jax
    _plgpu = None


def _all_indices(ref: Any) -> tuple[slice, ...]:
    return tuple(slice(None) for _ in ref.shape)


def load(ref: Any, *, mask: jax.Array | None = None, other: Any = None) -> jax.Array:
    """Read a whole ref (or ``ref.at[...]`` view); where ``mask`` is False the value is ``other``.

    A masked load is how kernels here read ragged edges: the out-of-bounds part of a tile is
    never touched on the GPU, and interpret mode pads the array before slicing it.
    """
    if _plgpu is not None and hasattr(_plgpu, "load"):
        return _plgpu.load(ref, mask=mask, other=other)
    return pl.load(ref, _all_indices(ref), mask=mask, other=other)  # pragma: no cover - old jax


def store(ref: Any, value: jax.Array, *, mask: jax.Array | None = None) -> None:
    """Write ``value`` to a whole ref (or view), only where ``mask`` is True."""
    if _plgpu is not None and hasattr(_plgpu, "store"):
        _plgpu.store(ref, value, mask=mask)
        return
    pl.store(ref, _all_indices(ref), value, mask=mask)  # pragma: no cover - old jax


def triton_compiler_params(num_warps: int | None = None, num_stages: int | None = None) -> Any:
    """Compiler parameters for the Triton backend, in the form this jax version accepts."""
    if _plgpu is not None and hasattr(_plgpu, "CompilerParams"):
        return _plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    if _plgpu is not None and hasattr(_plgpu, "TritonCompilerParams"):  # pragma: no cover
        return _plgpu.TritonCompilerParams(num_warps=num_warps, num_stages=num_stages)
    return {"triton": {"num_warps": num_warps, "num_stages": num_stages}}  # pragma: no cover


def on_gpu() -> bool:
    """True when the default backend is an NVIDIA or AMD GPU (where the Triton kernels run)."""
    return jax.default_backend() in ("gpu", "cuda", "rocm")


def sm_count(default: int = 132) -> int:
    """Streaming multiprocessors of the first device (a streamed kernel's grid is sized by them);
    `default` (the H200's 132) where the device does not say, as on the CPU."""
    count = getattr(jax.devices()[0], "core_count", None)
    return int(count) if on_gpu() and count else default


def kernel_choice(mode: str) -> tuple[bool, bool]:
    """(run the Pallas kernel, through the interpreter) for a dispatch mode: "kernel" compiled,
    "interpret" through the Pallas interpreter (CPU tests of a kernel path), "auto" compiled on a
    GPU and not elsewhere; any other mode names the plain-JAX path ("xla", "reference")."""
    if mode == "interpret":
        return True, True
    if mode == "kernel":
        return True, False
    if mode == "auto":
        return on_gpu(), False
    return False, False


def pow2_at_least(n: int, floor: int = 1) -> int:
    """The smallest power of two >= max(n, floor); Triton tiles must have power-of-two sizes."""
    n = max(int(n), int(floor))
    return 1 << (n - 1).bit_length()


cdiv = pl.cdiv
ds = pl.ds
when = pl.when  # a block run only where a traced scalar condition holds
program_id = pl.program_id
pallas_call = pl.pallas_call


def lower_for_cuda(fn: Any, *args: Any) -> str:
    """Lower a jitted function for CUDA on any machine and return the StableHLO text.

    This runs the Pallas Triton lowering (every kernel op must have a Triton rule, every tile a
    power-of-two size) without a GPU, so CPU tests catch kernels that would fail to compile.
    `args` may be `jax.ShapeDtypeStruct`s.
    """
    return fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
