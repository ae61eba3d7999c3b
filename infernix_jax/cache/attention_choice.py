"""Which implementation runs attention over the cache: a Pallas kernel or XLA.

`PagedKV.attend` and the Gated DeltaNet layers ask while tracing:

* `use_decode_kernel(t)`: one-token queries (decode) through the paged decode attention kernel
  (pallas_kernels/paged_attention.py: flash decoding over the pool's own blocks, no gather);
* `use_prefill_kernel(t)`: chunks of at least `PREFILL_KERNEL_MIN_TOKENS` tokens (prefill)
  through the paged prefill flash attention kernel (pallas_kernels/flash_prefill.py: causal,
  over the pool's blocks, no [H, T, context] score tensor). On the H200 it ran a 4096-token chunk
  at 32K context at 73% of the bf16 matmul rate, 2.5x XLA's path, and a 32K prompt in 4096-token
  chunks 4.6x faster (bench/results/flash-prefill-nvidia-h200.json). Shorter multi-token queries
  (linear speculative verify windows, small chunks) stay on XLA: with few queries per program the
  kernel walks the whole context in one loop with no split over it.
* `use_recurrent_kernel(t, dk, dv)`: the Gated DeltaNet (linear attention) layers' per-token
  recurrence over windows of up to 16 tokens (decode) through the gated delta kernel
  (pallas_kernels/gated_delta.py; its conv form: conv, gates and recurrence in one launch), in
  place on the state pool's slots (`SlottedGDNState`). On an H100 it made the NVFP4 decode at
  batch 1 4.5% faster on the 27B shape and 19% on the 80B-A3B one (docs/pallas.md).

Anything else is the XLA path: gather the row's blocks into a contiguous view, then a masked
softmax. All give the same result within float rounding (tests/pallas_kernels compare each kernel
with `PagedKV.attend` on pages written by `PagedKV.write`).

Each choice comes from an environment variable read at import, `INFERNIX_DECODE_ATTENTION`,
`INFERNIX_PREFILL_ATTENTION` and `INFERNIX_GDN_DECODE`, or the context managers
`decode_attention_mode` / `prefill_attention_mode` / `recurrent_update_mode`: "auto" (the kernel
on a GPU, XLA elsewhere), "kernel", "xla", or "interpret" (the kernel through the Pallas
interpreter: CPU tests of that path); "auto" by default. They are read when a program is traced,
so set them before an engine compiles its programs.
"""

from __future__ import annotations

import contextlib

from infernix_jax.switches import env_mode, switched

MODES = ("auto", "kernel", "xla", "interpret")
DEFAULT_MODE = "auto"
PREFILL_KERNEL_MIN_TOKENS = 64  # query tokens per row from which prefill runs the flash kernel


_modes = {
    "decode": env_mode("INFERNIX_DECODE_ATTENTION", DEFAULT_MODE, MODES),
    "prefill": env_mode("INFERNIX_PREFILL_ATTENTION", DEFAULT_MODE, MODES),
    "recurrent": env_mode("INFERNIX_GDN_DECODE", DEFAULT_MODE, MODES),
}


def _mode(kind: str, mode: str) -> contextlib.AbstractContextManager[None]:
    return switched(_modes, kind, mode, MODES, f"{kind} attention mode")


def decode_attention_mode(mode: str) -> contextlib.AbstractContextManager[None]:
    """Choose the decode (one-token) attention implementation for programs traced inside this block."""
    return _mode("decode", mode)


def prefill_attention_mode(mode: str) -> contextlib.AbstractContextManager[None]:
    """Choose the prefill (chunk) attention implementation for programs traced inside this block."""
    return _mode("prefill", mode)


def recurrent_update_mode(mode: str) -> contextlib.AbstractContextManager[None]:
    """Choose the Gated DeltaNet recurrence implementation for programs traced inside this block."""
    return _mode("recurrent", mode)


def current_modes() -> dict[str, str]:
    """The switches as they stand now (their environment variables or an enclosing block): what a
    benchmark record names as measured."""
    return dict(_modes)


def _kernel_choice(kind: str) -> tuple[bool, bool]:
    from pallas_kernels import compat  # the cache package imports Pallas only when asked

    return compat.kernel_choice(_modes[kind])


def use_decode_kernel(tokens_per_row: int) -> tuple[bool, bool]:
    """(run the Pallas decode kernel, through the interpreter) for `tokens_per_row` query tokens."""
    if tokens_per_row != 1:
        return False, False
    return _kernel_choice("decode")


def use_prefill_kernel(tokens_per_row: int, head_dim: int) -> tuple[bool, bool]:
    """(run the Pallas prefill flash kernel, through the interpreter) for a chunk of
    `tokens_per_row` query tokens; the kernel's tiles need a power-of-two head_dim >= 16."""
    if tokens_per_row < PREFILL_KERNEL_MIN_TOKENS or head_dim < 16 or head_dim & (head_dim - 1):
        return False, False
    return _kernel_choice("prefill")


def use_recurrent_kernel(tokens_per_row: int, k_head_dim: int, v_head_dim: int) -> tuple[bool, bool]:
    """(run the gated delta kernel, through the interpreter) for a window of `tokens_per_row`
    tokens of a linear-attention layer; its tiles need power-of-two head sizes >= 16."""
    from pallas_kernels import gated_delta

    if not gated_delta.supports(k_head_dim, v_head_dim, tokens_per_row):
        return False, False
    return _kernel_choice("recurrent")
