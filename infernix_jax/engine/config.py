"""`EngineConfig`: the serving engine's options (they mirror the server's command-line flags).

Kept apart from `ModelConfig`: the model config is static for jit and describes the network; this
one describes how the engine uses memory and schedules requests.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

BLOCK_SIZE = 64  # tokens per KV block (the paged pool's granularity)


@dataclass(frozen=True)
class EngineConfig:
    """How many requests, how much context and which buckets the engine compiles."""

    max_concurrency: int = 8  # requests advanced at once (state slots; the largest decode batch)
    max_context: int = 8192  # longest sequence (prompt + generated tokens) a request may reach
    kv_dtype: str = "bf16"  # KV pool storage: "bf16" (the model dtype on the CPU), "int8" or "fp8"
    kv_capacity: int | str = "auto"  # KV blocks in the pool, or "auto": what memory allows (see plan)
    prefill_chunk: int = 4096  # most prompt tokens fed in one step (the largest prefill bucket)
    gpu_memory_utilization: float = 0.9  # share of device memory the weights + pools may take ("auto")
    decode_steps_per_dispatch: int = 8  # decode steps run on the device per host round trip
    prefill_buckets: tuple[int, ...] = (16, 64, 256, 1024, 4096)  # chunk lengths (capped at prefill_chunk)
    prefill_batch_sizes: tuple[int, ...] = (
        1,
        2,
        4,
    )  # rows of a prefill program (rows x chunk <= prefill_chunk)
    decode_batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)  # capped at max_concurrency
    prefill_shape_override: tuple[tuple[int, int], ...] | None = None  # explicit (rows, chunk) programs
    max_top_logprobs: int = 20  # alternatives the programs compute (a request may ask for fewer)
    max_logit_bias: int = 64  # logit_bias entries per request (static width of the sampling arrays)
    max_stop_ids: int = 16  # stop token ids per request, EOS included
    compilation_cache_dir: str | None = "~/.cache/infernix_jax/xla"  # JAX persistent cache; None: off
    warmup: bool = True  # compile every bucket at start (with a progress bar)
    structured_output: bool = True  # warm-up also compiles the one-step masked decode programs
    progress: bool = True  # show the warm-up progress bar

    def __post_init__(self) -> None:
        errors = []
        if self.max_concurrency < 1:
            errors.append(f"max_concurrency must be >= 1, got {self.max_concurrency}")
        if self.max_context < 1:
            errors.append(f"max_context must be >= 1, got {self.max_context}")
        if self.kv_dtype not in ("bf16", "int8", "fp8"):
            errors.append(f"kv_dtype must be bf16, int8 or fp8, got {self.kv_dtype!r}")
        if self.prefill_chunk < min(self.prefill_buckets):
            errors.append(
                f"prefill_chunk {self.prefill_chunk} is below the smallest bucket {min(self.prefill_buckets)}"
            )
        if self.decode_steps_per_dispatch < 1:
            errors.append(f"decode_steps_per_dispatch must be >= 1, got {self.decode_steps_per_dispatch}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            errors.append(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not (self.kv_capacity == "auto" or (isinstance(self.kv_capacity, int) and self.kv_capacity > 0)):
            errors.append(f"kv_capacity must be 'auto' or a positive block count, got {self.kv_capacity!r}")
        if errors:
            raise ValueError("; ".join(errors))

    @property
    def chunk_buckets(self) -> tuple[int, ...]:
        """Prefill chunk lengths in use: the configured buckets up to prefill_chunk, and prefill_chunk."""
        kept = {b for b in self.prefill_buckets if b <= self.prefill_chunk} | {self.prefill_chunk}
        return tuple(sorted(kept))

    @property
    def decode_buckets(self) -> tuple[int, ...]:
        """Decode batch sizes in use: those below max_concurrency, and one that holds all of them."""
        kept = [b for b in sorted(self.decode_batch_sizes) if b < self.max_concurrency]
        bigger = [b for b in sorted(self.decode_batch_sizes) if b >= self.max_concurrency]
        return tuple(kept + [bigger[0] if bigger else self.max_concurrency])

    @property
    def prefill_shapes(self) -> tuple[tuple[int, int], ...]:
        """(rows, chunk length) of every prefill program: rows x chunk stays within prefill_chunk."""
        if self.prefill_shape_override:
            return tuple(sorted(self.prefill_shape_override, key=lambda s: (s[1], s[0])))
        rows = sorted(b for b in self.prefill_batch_sizes if b <= self.max_concurrency) or [1]
        return tuple(
            (r, t) for t in self.chunk_buckets for r in rows if r == 1 or r * t <= self.prefill_chunk
        )

    @property
    def max_blocks_per_sequence(self) -> int:
        return -(-self.max_context // BLOCK_SIZE)

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)
