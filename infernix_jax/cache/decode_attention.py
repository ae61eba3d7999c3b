"""Which implementation runs one-token (decode) attention over the paged KV pool.

`PagedKV.attend` asks `use_decode_kernel(t)` while tracing: the Pallas paged decode attention
kernel (pallas_kernels/paged_attention.py, flash decoding over the pool's own blocks, no gather)
or the XLA path (gather the row's blocks into a contiguous view, then a masked softmax). Both give
the same result within float rounding (tests/pallas_kernels/test_paged_attention.py compares the
kernel with `PagedKV.attend` on pages written by `PagedKV.write`).

The choice comes from `INFERNIX_DECODE_ATTENTION` (read at import) or `decode_attention_mode`:
"auto" (the kernel on a GPU, XLA elsewhere), "kernel", "xla", or "interpret" (the kernel through
the Pallas interpreter: CPU tests of this path). It is read when a program is traced, so set it
before an engine compiles its programs.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

MODES = ("auto", "kernel", "xla", "interpret")
DEFAULT_MODE = "auto"

_mode = os.environ.get("INFERNIX_DECODE_ATTENTION", DEFAULT_MODE)
if _mode not in MODES:
    raise ValueError(f"INFERNIX_DECODE_ATTENTION must be one of {', '.join(MODES)}; got {_mode!r}")


@contextlib.contextmanager
def decode_attention_mode(mode: str) -> Iterator[None]:
    """Choose the decode attention implementation for programs traced inside this block."""
    global _mode
    if mode not in MODES:
        raise ValueError(f"decode attention mode must be one of {', '.join(MODES)}; got {mode!r}")
    previous, _mode = _mode, mode
    try:
        yield
    finally:
        _mode = previous


def use_decode_kernel(tokens_per_row: int) -> tuple[bool, bool]:
    """(run the Pallas kernel, through the interpreter) for a query of `tokens_per_row` tokens."""
    if tokens_per_row != 1 or _mode == "xla":
        return False, False
    if _mode == "interpret":
        return True, True
    if _mode == "kernel":
        return True, False
    from pallas_kernels import compat

    return compat.on_gpu(), False
