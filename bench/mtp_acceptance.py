"""MTP acceptance of the bundled demo model under greedy speculative decoding.

    python -m bench.mtp_acceptance                 # demo model, 3 draft tokens
    python -m bench.mtp_acceptance --model DIR --draft-tokens 4

Greedy speculative decoding accepts a draft token exactly when it equals the target's own greedy
token, so the acceptance can be read off the target's greedy path without a verify pass: the target
generates a greedy continuation of several held-out snippets; at every position i of that path the
MTP head drafts a chain of k tokens (step 1 reads the committed token x_{i+1} and the target's hidden
h_i; step j > 1 reads its own previous draft and hidden state, at position i + j - 1, over an MTP KV
cache holding the committed positions and the earlier drafts of the chain) and the chain's accepted
length is its number of leading drafts equal to the path. Tokens per verification step = accepted + 1
(the bonus token), the figure vLLM reports as mean acceptance length; its ceiling is k + 1.
"""

from __future__ import annotations

import argparse
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

from bench.record import machine_name, make_record, write_records
from infernix_jax.cache.sequence import init_cache
from infernix_jax.demo.data import heldout_token_ids
from infernix_jax.loaded_model import Model, load
from infernix_jax.model.forward import forward, mtp_forward


@partial(jax.jit, static_argnums=(2,))
def _trunk_and_mtp(params, tokens, cfg):
    """Target forward over the path, then the MTP head over every committed position."""
    t = tokens.shape[1]
    cache = init_cache(cfg, 1, t, params.final_norm.dtype, with_mtp=True)
    positions = jnp.arange(t)[None]
    _, hidden, cache = forward(params, tokens, positions, cache, cfg)
    logits, mtp_hidden, cache = mtp_forward(params, tokens[:, 1:], hidden[:, :-1], positions[:, :-1], cache, cfg)
    return jnp.argmax(logits[0], -1), mtp_hidden, cache


@partial(jax.jit, static_argnums=(4,))
def _mtp_step(params, token, hidden, position, cfg, cache):
    logits, hidden, cache = mtp_forward(params, token, hidden, position, cache, cfg)
    return jnp.argmax(logits[0, 0]), hidden, cache


def chain_acceptance(model: Model, path: np.ndarray, start: int, draft_tokens: int) -> list[int]:
    """Accepted draft counts for every position i >= start of a greedy path (tokens [L])."""
    params, cfg = model.params, model.config
    first, mtp_hidden, cache = _trunk_and_mtp(params, jnp.asarray(path)[None], cfg)
    first = np.asarray(first)
    accepted = []
    for i in range(start, len(path) - draft_tokens - 1):
        # step 1 at position i drafts x_{i+2}; it was computed by the full pass
        drafts = [int(first[i])]
        token, hidden, step_cache = jnp.asarray([[drafts[0]]]), mtp_hidden[:, i : i + 1], cache
        for j in range(1, draft_tokens):
            nxt, hidden, step_cache = _mtp_step(params, token, hidden, jnp.asarray([[i + j]]), cfg, step_cache)
            drafts.append(int(nxt))
            token = jnp.asarray([[drafts[-1]]])
        n = 0
        while n < draft_tokens and drafts[n] == int(path[i + 2 + n]):
            n += 1
        accepted.append(n)
    return accepted


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.mtp_acceptance", description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model directory (default: the bundled demo model)")
    p.add_argument("--draft-tokens", type=int, default=3)
    p.add_argument("--snippets", type=int, default=6, help="held-out snippets used as prompts")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=160)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    model = load(args.model, max_context=args.prompt_tokens + args.new_tokens + 8)
    if model.params.mtp is None:
        raise SystemExit("this model has no MTP head")
    ids = heldout_token_ids(None) if args.model is None else None
    if ids is None:
        raise SystemExit("--model needs held-out token ids: only the demo model is supported for now")
    stride = len(ids) // args.snippets
    counts: list[int] = []
    for s in range(args.snippets):
        prompt = ids[s * stride : s * stride + args.prompt_tokens].tolist()
        greedy = model.generate(prompt, max_new_tokens=args.new_tokens, ignore_eos=True).token_ids
        path = np.asarray(prompt + greedy, np.int32)
        counts += chain_acceptance(model, path, start=len(prompt) - 1, draft_tokens=args.draft_tokens)
    counts_arr = np.asarray(counts)
    per_step = float(counts_arr.mean() + 1)
    rates = [float((counts_arr > j).mean()) for j in range(args.draft_tokens)]
    name = f"mtp acceptance {'demo' if args.model is None else args.model} greedy {args.draft_tokens} draft tokens"
    record = make_record(
        name, per_step, "tokens/step", args.draft_tokens + 1, "tokens/step",
        machine=machine_name(),
        details={"positions": len(counts), "mean_accepted_drafts": float(counts_arr.mean()),
                 "accept_rate_by_depth": rates, "snippets": args.snippets, "prompt_tokens": args.prompt_tokens,
                 "new_tokens": args.new_tokens},
    )
    out = write_records([record], args.out or f"mtp-acceptance-{machine_name().split()[0].lower()}.json")
    print(f"{name}: {per_step:.3f} tokens/step over {len(counts)} positions "
          f"(accept rate by depth {', '.join(f'{r:.2f}' for r in rates)}) -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
