"""python -m infernix_jax.generate: stream a continuation of a prompt to stdout.

    python -m infernix_jax.generate --prompt "def fibonacci(n):"
    python -m infernix_jax.generate --model DIR --chat --prompt "Write a haiku about JAX" --max-tokens 200

Without --model the bundled demo model is used.
"""

from __future__ import annotations

import argparse
import sys

from infernix_jax.loaded_model import load


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m infernix_jax.generate", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="Hugging Face-layout model directory (default: the bundled demo model)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text")
    source.add_argument("--prompt-ids", help="prompt as comma-separated token ids (for models without a tokenizer)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt as a user message with the chat template")
    p.add_argument("--no-think", action="store_true", help="with --chat: pass enable_thinking=False to the template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--max-context", type=int, default=None, help="cache capacity in tokens")
    p.add_argument("--ngram-volume", default=None, metavar="PATH",
                   help="table volume of a model with an n-gram memory (docs/ngram_memory.md); generates "
                        "through the engine and prints the text at the end")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    model = load(args.model, max_context=args.max_context)
    prompt = [int(t) for t in args.prompt_ids.split(",")] if args.prompt_ids else args.prompt
    if args.chat:
        kwargs = {"enable_thinking": False} if args.no_think else {}
        prompt = model.apply_chat_template([{"role": "user", "content": prompt}], **kwargs)

    def emit(piece: str) -> None:
        sys.stdout.write(piece)
        sys.stdout.flush()

    if args.ngram_volume or model.config.ngram_memory is not None:
        result = _generate_with_memory(model, prompt, args)
        emit(result.text)
    else:
        result = model.generate(prompt, max_new_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, seed=args.seed, stream=emit)
    if model.tokenizer is None:  # no text to stream: print the ids
        sys.stdout.write(" ".join(str(t) for t in result.token_ids))
    sys.stdout.write("\n")
    print(f"[{len(result.token_ids)} tokens, finish_reason={result.finish_reason}]", file=sys.stderr)
    return 0


def _generate_with_memory(model, prompt, args):
    """A model with an n-gram memory runs through the engine, which feeds the memory's rows."""
    from infernix_jax.engine.llm import LLM
    from infernix_jax.engine.protocol import SamplingParams

    llm = LLM(model=model, ngram_volume=args.ngram_volume, compilation_cache_dir=None, progress=False,
              max_concurrency=1, decode_batch_sizes=(1,), prefill_batch_sizes=(1,))
    sampling = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                              top_k=args.top_k, seed=args.seed)
    return llm.generate([prompt], sampling)[0]


if __name__ == "__main__":
    raise SystemExit(main())
