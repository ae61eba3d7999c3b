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
    async_decode: bool = True  # dispatch the next decode before reading the last one back (core.py)
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
    # warm-up also compiles the scoring programs (score requests: /v1/decide, option logprobs); with
    # False an engine that only generates starts sooner and refuses score requests with a clear error
    scoring: bool = True
    # how a batch with constrained rows decodes (docs/structured_output.md): "callback", the
    # multi-step decode program with masks, each step's from a host callback after the sample
    # before (engine/mask_feed.py); "fused", one masked forward+sample program per sampled token,
    # the tokens a grammar forces fed in the same dispatch; "split", a forward and a masked sample
    # per token, the mask computed while the forward runs; "check", the free multi-step program
    # with each constrained row's tokens checked against its grammar afterwards, the first refused
    # one replaced by a masked sample (split's tokens; chosen against split step by step from the
    # seconds per token each took and how often the model's free choice was allowed,
    # engine/constrained_way.py; rows with top-k/top-p/min-p sampling or top logprobs split).
    # Check is the default: on an H100 it ran 2.5-3.8x split's speed where the demo model kept to
    # its grammar, and a model that leaves its grammar never pays for a check dispatch (split at
    # batch 1 took 7.3 ms a token against fused's 9.3 on the H200; docs/structured_output.md)
    constrained_decode: str = "check"
    # the largest decode batch the check way serves (larger ones split): its copies of a batch's
    # state slots are reserved at start (engine/memory_plan.py), a 27B-shape slot is ~147 MiB, and
    # a large batch spreads split's per-token launches over many rows
    check_max_batch: int = 8
    # with asynchronous decode, the next check dispatch is enqueued before the last is read only
    # while a constrained row keeps a whole dispatch's tokens with at least this chance (the keep
    # share measured lately, to the power of the dispatch's steps): the dispatch behind a refusal
    # runs the refused rows on dropped tokens, at batch 1 a whole dispatch of device time, against
    # the host's time between dispatches that following saves (~20 ms of a 27B's ~170 ms dispatch
    # on an H100; docs/structured_output.md)
    check_ahead_min_keep: float = 0.9
    # whether the programs dispatched once per constrained token (split and fused) keep XLA's
    # command buffers (CUDA graphs) on a GPU; False compiles them without, the multi-step programs
    # keep theirs (infernix_jax/jit.py). On the H200 False was slower: 27B split at 60% of free
    # decode against 85% (docs/structured_output.md)
    one_step_command_buffers: bool = True
    # whether the multi-step decode program is compiled with its step loop inside one CUDA graph
    # (XLA's WHILE / CONDITIONAL commands, infernix_jax/jit.py `with_loop_graphs`): one graph launch
    # per dispatch instead of one per step, so the host could run ahead of the device; on an H100
    # it did not change the 80B-A3B decode rate, so it is off (docs/engine.md)
    decode_loop_graphs: bool = False
    # how the multi-step decode program picks its sampling branches (engine/sampling.py
    # SamplingPlan): "static", chosen on the host from the rows' settings (one program per plan and
    # bucket: every row greedy, or any); "dynamic", on the device (lax.cond: one program, but XLA's
    # GPU runtime waits for the device at every cond of every step); "auto": static on accelerators,
    # dynamic on the CPU (whose runtime does not wait, and where compiles cost the most)
    sampling_plans: str = "auto"
    progress: bool = True  # show the warm-up progress bar
    # prefix cache (docs/prefix_cache.md)
    prefix_cache: bool = True  # reuse KV blocks and recurrent-state snapshots of earlier prompts
    prefix_cache_snapshots: int | str = "auto"  # GPU snapshot slots; "auto": 2 per concurrent request (>= 4)
    prefix_cache_host_mem: int | str = "4GiB"  # host-RAM tier for evicted blocks and snapshots (0: none)
    prefix_cache_file: str | None = None  # saved on shutdown (and every save_mins), loaded at start
    prefix_cache_save_mins: float = 0.0  # also save the file every this many minutes (0: only at shutdown)
    prefix_cache_snapshot_blocks: int = 16  # snapshot a long prompt every this many blocks (0: off)
    snapshots_per_chunk: int = 4  # most snapshots one prefill row takes per chunk (a static program shape)
    spec: str = "none"  # speculative decoding drafter: "none", "ngram", "mtp" or "mtp+ngram"
    draft_tokens: int = 3  # MTP draft chain length (tokens verified per step: up to this + 1)
    ngram_draft_tokens: int = 5  # most tokens the n-gram (prompt lookup) drafter proposes
    ngram_min_match: int = 2  # shortest suffix the n-gram drafter may match (it tries up to 8 first)
    spec_tree_width: int = 1  # candidate branches per verify window, as one tree (1: a linear window)
    spec_tree_nodes: int = 0  # most draft nodes of a tree window (0: what the branches need, <= 15)
    # n-gram memory (Engram-style tables; docs/ngram_memory.md)
    ngram_volume: str | None = None  # the table volume of a model with an n-gram memory
    ngram_cache_mem: int | str = "1GiB"  # host cache of hot table rows
    # experts beyond device memory (docs/experts.md); gpu_expert_budget None: every expert resident, no slots
    gpu_expert_budget: int | str | None = None  # device bytes for routed experts ("16GiB", "all", "auto")
    host_expert_budget: int | str | None = "all"  # host RAM for experts without a slot; then: the artifact
    expert_artifact: str | None = None  # converted artifact the disk tier reads experts from
    expert_profile: str | None = None  # routing profile for the placement (infernix_jax.experts.profile)
    # how a missed expert reaches the step: "callback" (a host callback per layer that misses; any
    # tier), "program" (copied from pinned host memory inside the program; every expert in RAM), or
    # "auto": "program" on a GPU when every expert fits in RAM (4-9x the callbacks' tok/s on the
    # H200, docs/experts.md), else "callback"
    expert_host_reads: str = "auto"
    # with expert_host_reads "program": how the program copies a layer's missed experts out of
    # pinned host memory: "loop" (one copy per expert in a loop), "buckets" (unrolled copies in
    # static-size branches), "dma" (one callback per layer that reads the ids back and enqueues the
    # copies; 73.5 against 67.2 tok/s at batch 1, 144 against 106 at batch 4 on the H200,
    # docs/experts.md), "mapped" (one callback per layer launching a gather that reads the rows
    # from mapped host memory, no read-back: 87.7 against 73.8 tok/s at batch 1, 138 against 140
    # at batch 4 in the same H200 run; model/host_copy.py) or "auto": mapped when the device can
    # address the pinned rows, else dma (experts.offload.resolve_host_copy)
    expert_host_copy: str = "auto"
    # copies a proposed slot swap must save, on average over recent proposals, before swaps that
    # evict an expert are made (experts.cache.ExpertCache.payback): 1.0 pays for the swap's own copy;
    # 0 swaps on the routing scores alone (under random routing that halved the 80B shape's batch-1
    # rate on the H200, docs/experts.md)
    expert_swap_payback: float = 1.0
    # with expert_host_reads "program": each MoE layer of a decode step guesses the next layer's
    # experts (its router applied to this layer's input) and copies the guessed misses ahead on a
    # second GPU stream, so the copies overlap this layer's compute (model.mlp.prefetching_experts;
    # docs/experts.md, "Prefetching the next layer's misses"). Off: 20-22% slower on an H200 and
    # an H100 (a third of the guesses unused; with XLA's command buffers on, the copy stayed on the
    # program's one stream); on a GPU it needs the mapped or dma copy
    expert_prefetch: bool = False
    # blocks of the prefetch's gather ("mapped" copy): few, so it runs beside the layer's kernels
    # (a gather of 1024 blocks fills every SM until its rows have crossed PCIe); 32 is a quarter of
    # an H100's / H200's 132 SMs at one block each, and reads at the pinned copy's rate there
    expert_prefetch_blocks: int = 32  # model.host_copy.PREFETCH_GATHER_BLOCKS (tests keep them equal)
    # experts the prefetch guesses per token, the router's likeliest first (0: all its top-k): fewer
    # copies wasted on wrong guesses, fewer misses caught
    expert_prefetch_guesses: int = 0
    # with expert_host_reads "callback": the share of each layer's missed experts the host's CPU
    # computes (those with the fewest tokens; the fetch callback returns their outputs, not their
    # weights, while it stages the rest), or "auto": balanced by a cost model measured at start
    # (CPU seconds per expert against staging + copy; 0 where the device is the CPU, and with
    # "program" host reads). experts.host_compute, docs/experts.md
    expert_cpu_share: float | str = "auto"

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
        if self.sampling_plans not in ("auto", "static", "dynamic"):
            errors.append(f"sampling_plans must be auto, static or dynamic, got {self.sampling_plans!r}")
        if self.decode_steps_per_dispatch < 1:
            errors.append(f"decode_steps_per_dispatch must be >= 1, got {self.decode_steps_per_dispatch}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            errors.append(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if not (self.kv_capacity == "auto" or (isinstance(self.kv_capacity, int) and self.kv_capacity > 0)):
            errors.append(f"kv_capacity must be 'auto' or a positive block count, got {self.kv_capacity!r}")
        if not (
            self.prefix_cache_snapshots == "auto"
            or (isinstance(self.prefix_cache_snapshots, int) and self.prefix_cache_snapshots >= 0)
        ):
            errors.append(
                f"prefix_cache_snapshots must be 'auto' or >= 0, got {self.prefix_cache_snapshots!r}"
            )
        if self.prefix_cache_save_mins < 0:
            errors.append(f"prefix_cache_save_mins must be >= 0, got {self.prefix_cache_save_mins}")
        if self.prefix_cache_snapshot_blocks < 0:
            errors.append(
                f"prefix_cache_snapshot_blocks must be >= 0, got {self.prefix_cache_snapshot_blocks}"
            )
        if self.snapshots_per_chunk < 1:
            errors.append(f"snapshots_per_chunk must be >= 1, got {self.snapshots_per_chunk}")
        if self.spec not in ("none", "ngram", "mtp", "mtp+ngram"):
            errors.append(f"spec must be none, ngram, mtp or mtp+ngram, got {self.spec!r}")
        if self.spec != "none" and not 1 <= self.spec_window - 1 <= 15:
            errors.append(
                f"draft tokens must be in [1, 15] (verify windows <= 16), got {self.spec_window - 1}"
            )
        if self.spec_tree_width < 1:
            errors.append(f"spec_tree_width must be >= 1, got {self.spec_tree_width}")
        if not 0 <= self.spec_tree_nodes <= 15:
            errors.append(
                f"spec_tree_nodes must be in [0, 15] (verify windows <= 16), got {self.spec_tree_nodes}"
            )
        if self.constrained_decode not in ("callback", "check", "fused", "split"):
            errors.append(
                f"constrained_decode must be callback, check, fused or split, got {self.constrained_decode!r}"
            )
        if self.check_max_batch < 1:
            errors.append(f"check_max_batch must be >= 1, got {self.check_max_batch}")
        if not 0.0 <= self.check_ahead_min_keep <= 1.0:
            errors.append(f"check_ahead_min_keep must be in [0, 1], got {self.check_ahead_min_keep}")
        if self.ngram_min_match < 1:
            errors.append(f"ngram_min_match must be >= 1, got {self.ngram_min_match}")
        errors += _expert_budget_errors(self.gpu_expert_budget, self.host_expert_budget)
        if self.expert_host_reads not in ("auto", "callback", "program"):
            errors.append(
                f"expert_host_reads must be auto, callback or program, got {self.expert_host_reads!r}"
            )
        if self.expert_cpu_share != "auto" and not (
            isinstance(self.expert_cpu_share, (int, float)) and 0 <= self.expert_cpu_share <= 1
        ):
            errors.append(
                f"expert_cpu_share must be auto or a number in [0, 1], got {self.expert_cpu_share!r}"
            )
        if self.expert_prefetch_guesses < 0:
            errors.append(f"expert_prefetch_guesses must be >= 0, got {self.expert_prefetch_guesses}")
        if self.expert_prefetch_blocks < 1:
            errors.append(f"expert_prefetch_blocks must be >= 1, got {self.expert_prefetch_blocks}")
        if not self.expert_swap_payback >= 0:
            errors.append(f"expert_swap_payback must be >= 0, got {self.expert_swap_payback!r}")
        if self.expert_host_copy not in ("auto", "loop", "buckets", "dma", "mapped"):
            errors.append(
                f"expert_host_copy must be auto, loop, buckets, dma or mapped, got {self.expert_host_copy!r}"
            )
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
    def check_buckets(self) -> tuple[int, ...]:
        """Decode batch sizes the check way serves (none unless constrained_decode is "check")."""
        if self.constrained_decode != "check":
            return ()
        return tuple(b for b in self.decode_buckets if b <= self.check_max_batch)

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
    def num_snapshot_slots(self) -> int:
        """GPU state slots reserved for prefix-cache snapshots."""
        if not self.prefix_cache:
            return 0
        if self.prefix_cache_snapshots == "auto":
            return max(4, 2 * self.max_concurrency)
        return int(self.prefix_cache_snapshots)

    @property
    def prefix_cache_host_bytes(self) -> int:
        from infernix_jax.cache.capacity import parse_bytes

        value = self.prefix_cache_host_mem
        if value in (0, "0"):
            return 0
        return parse_bytes(value)

    @property
    def spec_window(self) -> int:
        """Tokens of a verify window (pending token + most drafts); 1 without speculation."""
        drafts = {"none": 0, "ngram": self.ngram_draft_tokens, "mtp": self.draft_tokens}.get(
            self.spec, max(self.draft_tokens, self.ngram_draft_tokens)
        )
        if self.spec_tree and self.spec != "none":  # draft nodes of a tree window
            if self.spec_tree_nodes:
                return self.spec_tree_nodes + 1
            width, ngram, mtp = self.spec_tree_width, self.ngram_draft_tokens, self.draft_tokens
            branches = {"ngram": width * ngram, "mtp": mtp + width - 1}
            nodes = branches.get(self.spec, width * ngram + mtp + width - 1)
            return min(nodes, 15) + 1
        return drafts + 1

    @property
    def spec_tree(self) -> bool:
        """Verify windows are trees of candidate branches (tree verification)."""
        return self.spec_tree_width > 1

    @property
    def spec_uses_mtp(self) -> bool:
        return self.spec in ("mtp", "mtp+ngram")

    @property
    def max_blocks_per_sequence(self) -> int:
        return -(-self.max_context // BLOCK_SIZE)

    def replace(self, **changes) -> EngineConfig:
        return dataclasses.replace(self, **changes)


def _expert_budget_errors(gpu: int | str | None, host: int | str | None) -> list[str]:
    """Readable errors for budgets that are neither a size ("16GiB", bytes) nor a keyword."""
    errors = []
    for name, value, words in (
        ("gpu_expert_budget", gpu, ("all", "auto")),
        ("host_expert_budget", host, ("all",)),
    ):
        if value is None or value in words or value in (0, "0"):
            continue
        from infernix_jax.cache.capacity import parse_bytes  # only when a size is given: it pulls in JAX

        try:
            parse_bytes(value)
        except ValueError as e:
            errors.append(f"{name}: {e}; or one of {', '.join(words)}")
    return errors
