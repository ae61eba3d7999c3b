"""The server command line: `python -m infernix_jax.serve --model DIR [--host H] [--port P] ...`.

It loads the tokenizer, builds the engine through `build_engine(args)` (the one seam between the
command line and the engine package), wraps both in the API app and runs it on Hypercorn until
Ctrl+C or SIGTERM, then shuts down cleanly.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from collections.abc import Sequence

from infernix_jax.api.config import ServerConfig

log = logging.getLogger("infernix_jax.serve")


def _cpu_share(text: str) -> float | str:
    """`--expert-cpu-share`: "auto" or a number in [0, 1]."""
    if text == "auto":
        return text
    try:
        share = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or a number in [0, 1], got {text!r}") from None
    if not 0.0 <= share <= 1.0:
        raise argparse.ArgumentTypeError(f"expected auto or a number in [0, 1], got {text!r}")
    return share


def _steps(text: str) -> int:
    """--decode-steps: a whole number of steps, at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m infernix_jax.serve",
        description="Serve a Qwen hybrid model over the OpenAI and Anthropic HTTP APIs.",
    )
    model = parser.add_argument_group("model")
    model.add_argument(
        "--model", default=None, help="model folder (HF checkpoint); default: the bundled demo model"
    )
    model.add_argument("--tokenizer", default=None, help="tokenizer folder, when not the model folder")
    model.add_argument(
        "--served-model-name",
        default=None,
        help="model id clients send and /v1/models lists (default: the folder name)",
    )

    engine = parser.add_argument_group("engine")
    engine.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="requests decoded together at most (default: the engine's, 8)",
    )
    engine.add_argument(
        "--max-context", type=int, default=None, help="context length in tokens (default: the model's)"
    )
    engine.add_argument(
        "--kv-dtype",
        default="auto",
        choices=["auto", "bf16", "int8", "fp8"],
        help="storage format of the KV cache (default: %(default)s)",
    )
    engine.add_argument(
        "--prefill-chunk",
        type=int,
        default=None,
        help="most prompt tokens fed in one step (default: the engine's, 4096)",
    )
    engine.add_argument(
        "--decode-steps",
        type=_steps,
        default=None,
        help="decode steps the device runs per dispatch (default: the engine's, 8); more spread the "
        "host's launch cost over more tokens where steps are short (a small-active MoE at batch 1: "
        "16 gave 496 against 392 tok/s on an H100), at the price of tokens streamed in larger bursts",
    )

    prefix = parser.add_argument_group("prefix cache")
    prefix.add_argument(
        "--no-prefix-cache",
        dest="prefix_cache",
        action="store_false",
        help="do not reuse the KV blocks and recurrent state of earlier prompts",
    )
    prefix.add_argument(
        "--prefix-cache-file",
        default=None,
        metavar="PATH",
        help="keep the prefix cache across restarts: loaded at start, saved on shutdown",
    )
    prefix.add_argument(
        "--prefix-cache-save-mins",
        type=float,
        default=0.0,
        metavar="N",
        help="also save the prefix cache file every N minutes (default: only on shutdown)",
    )
    prefix.add_argument(
        "--prefix-cache-host-mem",
        default=None,
        metavar="SIZE",
        help="host RAM for prefix-cache entries evicted from the GPU, e.g. 8GiB, 0 for none (default: 4GiB)",
    )
    prefix.add_argument(
        "--prefix-cache-snapshot-blocks",
        type=int,
        default=None,
        metavar="N",
        help="snapshot long prompts every N 64-token blocks, 0 for none (default: 16)",
    )

    spec = parser.add_argument_group("speculative decoding")
    spec.add_argument(
        "--spec",
        default="none",
        choices=["none", "ngram", "mtp", "mtp+ngram"],
        help="drafter: n-gram prompt lookup, the checkpoint's MTP head, or n-gram with MTP as fallback "
        "(default: %(default)s)",
    )
    spec.add_argument(
        "--draft-tokens", type=int, default=None, help="MTP draft chain length (default: the engine's, 3)"
    )
    spec.add_argument(
        "--ngram-draft-tokens",
        type=int,
        default=None,
        help="most tokens the n-gram drafter proposes (default: the engine's, 5)",
    )
    spec.add_argument(
        "--ngram-min-match",
        type=int,
        default=None,
        help="shortest context suffix the n-gram drafter may match (default: the engine's, 2)",
    )
    spec.add_argument(
        "--spec-tree-width",
        type=int,
        default=None,
        help="verify a tree of up to N candidate branches per step (several n-gram matches, MTP top-N "
        "first tokens); 1 for one linear draft (default: the engine's, 1)",
    )
    spec.add_argument(
        "--spec-tree-nodes",
        type=int,
        default=None,
        help="most draft nodes of a tree (<= 15; default: what the branches need)",
    )

    ngram = parser.add_argument_group("n-gram memory (docs/ngram_memory.md)")
    ngram.add_argument(
        "--ngram-volume",
        default=None,
        metavar="PATH",
        help="table volume of a model with an n-gram memory (written by python -m conversion.ngram_volume)",
    )
    ngram.add_argument(
        "--ngram-cache-mem", default=None, help="host cache of hot table rows, e.g. 8GiB (default: the engine's, 1GiB)"
    )

    experts = parser.add_argument_group("experts beyond GPU memory (docs/experts.md)")
    experts.add_argument(
        "--gpu-expert-budget",
        default=None,
        metavar="SIZE",
        help="device memory for routed experts, e.g. 16GiB, or auto (what the other weights and KV for "
        "--max-concurrency sequences of --max-context leave); the rest live in host RAM or on disk "
        "(default: every expert on the GPU)",
    )
    experts.add_argument(
        "--host-expert-budget",
        default=None,
        metavar="SIZE",
        help="host RAM for experts without a GPU slot, e.g. 48GiB; beyond it they are read from "
        "--expert-artifact (default: all of them)",
    )
    experts.add_argument(
        "--expert-artifact",
        default=None,
        metavar="DIR",
        help="converted artifact the disk tier reads experts from",
    )
    experts.add_argument(
        "--expert-profile",
        default=None,
        metavar="PATH",
        help="routing profile for the placement at start (python -m infernix_jax.experts.profile)",
    )
    experts.add_argument(
        "--expert-host-reads",
        default=None,
        choices=("auto", "callback", "program"),
        help="how a missed expert reaches the GPU: a host callback per layer that misses (any tier), "
        "a copy from pinned host memory inside the program (every expert in RAM), or auto (default: "
        "program on a GPU when every expert fits in RAM, else callback)",
    )
    experts.add_argument(
        "--expert-host-copy",
        default=None,
        choices=("auto", "loop", "buckets", "dma", "mapped"),
        help="with program host reads, how a layer's missed experts are copied from pinned host memory: "
        "one copy per expert in a loop, unrolled copies in static-size branches, one callback per "
        "layer enqueueing the copies (dma), or a gather kernel reading mapped host memory without "
        "waiting (mapped) (default: auto, mapped when the GPU can address pinned host memory, else dma; "
        "docs/experts.md)",
    )
    experts.add_argument(
        "--expert-prefetch",
        action="store_true",
        default=None,
        help="with program host reads: copy each decode step's guessed misses of the next MoE layer "
        "while this layer computes, on a second GPU stream (docs/experts.md)",
    )
    experts.add_argument(
        "--expert-prefetch-blocks",
        type=int,
        default=None,
        metavar="N",
        help="with --expert-prefetch and the mapped copy: blocks of the prefetch's gather kernel, few so "
        "that it runs beside the layer's own kernels (default: 32)",
    )
    experts.add_argument(
        "--expert-prefetch-guesses",
        type=int,
        default=None,
        metavar="N",
        help="with --expert-prefetch: experts guessed per token, the router's likeliest first "
        "(default: 0, all of its top-k)",
    )
    experts.add_argument(
        "--expert-cpu-share",
        type=_cpu_share,
        default=None,
        metavar="auto|SHARE",
        help="with callback host reads: the share (0 to 1) of each layer's missed experts computed on "
        "the CPU while the rest cross PCIe, or auto (default): balanced by a cost model measured at "
        "start (docs/experts.md)",
    )
    experts.add_argument(
        "--expert-swap-payback",
        type=float,
        default=None,
        metavar="COPIES",
        help="copies a proposed GPU slot swap must save, on average over recent proposals, before the "
        "cache swaps experts (default: 1.0, the swap's own copy; 0: swap on routing scores alone)",
    )

    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    server.add_argument("--port", type=int, default=8000, help="port to listen on (default: %(default)s)")
    server.add_argument(
        "--api-key", default=None, help="require this key (Authorization: Bearer KEY or x-api-key: KEY)"
    )
    server.add_argument(
        "--max-waiting",
        type=int,
        default=0,
        help="answer 503 + Retry-After when this many requests already wait (0: no limit)",
    )
    server.add_argument(
        "--accept-any-model",
        action="store_true",
        help="answer requests naming any model (clients with fixed model names)",
    )
    server.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])

    structured = parser.add_argument_group("structured output (docs/structured_output.md)")
    structured.add_argument(
        "--constrained-decode",
        default=None,
        choices=["split", "check", "fused", "callback"],
        help="how a batch with constrained requests decodes (default: the engine's, check): check "
        "samples free and checks after, chosen step by step against split (a forward and a masked "
        "sample per token) by measured speed and how often the model keeps to its grammar",
    )

    tools = parser.add_argument_group("tools and reasoning")
    tools.add_argument(
        "--tool-call-parser",
        default="auto",
        choices=["auto", "hermes", "qwen3_coder"],
        help="tool-call format (default: auto, read from the chat template)",
    )
    tools.add_argument(
        "--tolerant-tool-calls",
        action="store_true",
        help="recover tool calls from broken output (missing tags, truncated JSON)",
    )
    tools.add_argument(
        "--reasoning-budget",
        type=int,
        default=None,
        help="default thinking budget in tokens (unlimited when unset)",
    )
    tools.add_argument(
        "--reasoning-loop", action="store_true", help="wrap up thinking that keeps repeating itself"
    )
    tools.add_argument(
        "--reasoning-wrap-up",
        default=None,
        help="text inserted to close thinking that ran out of budget or looped",
    )
    return parser


def server_config(args: argparse.Namespace) -> ServerConfig:
    from pathlib import Path

    return ServerConfig(
        served_model_name=args.served_model_name or Path(args.model).resolve().name,
        api_key=args.api_key,
        tool_call_parser=args.tool_call_parser,
        tolerant_tool_calls=args.tolerant_tool_calls,
        reasoning_budget=args.reasoning_budget,
        reasoning_loop=args.reasoning_loop,
        **({"reasoning_wrap_up": args.reasoning_wrap_up} if args.reasoning_wrap_up else {}),
        max_waiting=args.max_waiting,
        accept_any_model=args.accept_any_model,
    )


def build_engine(args: argparse.Namespace):
    """The real engine for `args`. The one place the command line reaches into infernix_jax.engine."""
    from infernix_jax.engine import create_engine  # imported here: it pulls in JAX and the model

    speculative = {}
    if getattr(args, "spec", "none") != "none":
        speculative = {
            "spec": args.spec,
            "draft_tokens": args.draft_tokens,
            "ngram_draft_tokens": args.ngram_draft_tokens,
            "ngram_min_match": args.ngram_min_match,
            "spec_tree_width": getattr(args, "spec_tree_width", None),
            "spec_tree_nodes": getattr(args, "spec_tree_nodes", None),
        }
    prefix = {}
    if not getattr(args, "prefix_cache", True):
        prefix["prefix_cache"] = False
    for name in ("prefix_cache_file", "prefix_cache_save_mins", "prefix_cache_host_mem", "prefix_cache_snapshot_blocks"):
        value = getattr(args, name, None)
        if value is not None and not (name == "prefix_cache_save_mins" and value == 0):
            prefix[name] = value
    given = {  # flags passed only when set: otherwise the engine's defaults hold
        name: getattr(args, name)
        for name in ("ngram_volume", "ngram_cache_mem", "constrained_decode")
        if getattr(args, name, None) is not None
    }
    if getattr(args, "decode_steps", None) is not None:
        given["decode_steps_per_dispatch"] = args.decode_steps
    experts = {
        name: getattr(args, name)
        for name in (
            "gpu_expert_budget",
            "host_expert_budget",
            "expert_artifact",
            "expert_profile",
            "expert_host_reads",
            "expert_host_copy",
            "expert_swap_payback",
            "expert_prefetch",
            "expert_prefetch_blocks",
            "expert_prefetch_guesses",
            "expert_cpu_share",
        )
        if getattr(args, name, None) is not None
    }
    return create_engine(
        args.model,
        max_concurrency=args.max_concurrency,
        max_context=args.max_context,
        kv_dtype=args.kv_dtype,
        prefill_chunk=args.prefill_chunk,
        **speculative,
        **prefix,
        **given,
        **experts,
    )


def load_tokenizer(args: argparse.Namespace):
    from infernix_jax.chat.tokenizer import Tokenizer

    return Tokenizer.from_dir(args.tokenizer or args.model)


async def serve_app(app, host: str, port: int, shutdown: asyncio.Event) -> None:
    """Run `app` on Hypercorn until `shutdown` is set."""
    from hypercorn.asyncio import serve
    from hypercorn.config import Config

    config = Config()
    config.bind = [f"{host}:{port}"]
    config.accesslog = None
    config.graceful_timeout = 3.0
    config.keep_alive_timeout = 75.0
    await serve(app, config, shutdown_trigger=shutdown.wait)


def log_engine_memory(engine) -> None:
    """Log where memory went: the engine's own description when it has one, else its KV pool size."""
    describe = getattr(engine, "describe", None)
    if callable(describe):
        for line in str(describe()).splitlines():
            log.info("%s", line)
        return
    stats = engine.stats()
    log.info(
        "engine: context %d tokens, KV pool %d blocks (%d in use)",
        engine.max_context,
        stats.kv_blocks_total,
        stats.kv_blocks_used,
    )


async def _main_async(args: argparse.Namespace) -> None:
    from infernix_jax.api.app import create_app

    tokenizer = load_tokenizer(args)
    engine = build_engine(args)
    log_engine_memory(engine)
    app = create_app(engine, tokenizer, server_config(args))
    shutdown = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        try:
            loop.add_signal_handler(sig, shutdown.set)
        except NotImplementedError:  # platforms without loop signal handlers
            signal.signal(sig, lambda *_: loop.call_soon_threadsafe(shutdown.set))
    log.info(
        "ready: http://%s:%d (model %s)",
        args.host,
        args.port,
        app.extensions["infernix"].config.served_model_name,
    )
    await serve_app(app, args.host, args.port, shutdown)
    close = getattr(engine, "close", None)
    if close is not None:
        result = close()
        if asyncio.iscoroutine(result):
            await result
    log.info("stopped")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.model is None:
        from infernix_jax.loaded_model import demo_model_dir

        args.model = str(demo_model_dir())
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    asyncio.run(_main_async(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
